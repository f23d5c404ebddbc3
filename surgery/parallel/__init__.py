"""Parallelism over a device mesh, on top of the core: stock torch styles, diffusers' context parallelism.

`agreement` (ranks agree before the first collective), `distributed` (collective counting, CPU rank jobs, the fake
process group), `plans` (which modules a plan covers; shared styles), `transformers_plans` (text encoders' own plans),
`tensor_parallel`, `context_parallel`, `decode` (the VAE's decode split across the ranks) and `pipeline` (a whole
pipeline's components).
"""

from surgery.parallel import agreement  # noqa: F401
from surgery.parallel import distributed  # noqa: F401
from surgery.parallel import transformers_plans  # noqa: F401
from surgery.parallel import plans  # noqa: F401
from surgery.parallel import tensor_parallel  # noqa: F401
from surgery.parallel import context_parallel  # noqa: F401
from surgery.parallel import decode  # noqa: F401
from surgery.parallel import pipeline  # noqa: F401
