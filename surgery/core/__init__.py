"""The rewrite core: what a fused module is, what it becomes, and the verbs that swap one for the other.

Imports nothing else of surgery. `errors` and `checks` first (what is refused, before anything changes); `slicing`,
the `registry` of families and `walk` (finding their modules); the unfused leaves (`split_projection`, `leaves`);
`rewrite` (`unfuse` / `fuse`); the state-dict `slices`
(`state_dict`); and `build` (a family's model from a config, on meta or seeded).
"""

from surgery.core import errors  # noqa: F401
from surgery.core import checks  # noqa: F401
from surgery.core import slicing  # noqa: F401
from surgery.core import registry  # noqa: F401
from surgery.core import walk  # noqa: F401
from surgery.core import split_projection  # noqa: F401
from surgery.core import leaves  # noqa: F401
from surgery.core import rewrite  # noqa: F401
from surgery.core import state_dict  # noqa: F401
from surgery.core import build  # noqa: F401
