"""What the rewrite verbs announce, for the layers above them to act on.

`unfuse` and `fuse` publish `after_rewrite(model)` once every module is swapped. The core does not know who listens:
the diffusers integration (`surgery.integration.interop`) subscribes when `import surgery` loads it, and keeps
diffusers' plans, block-name lists and checkpoint hooks in step with the model's modules. A subscriber that raises
fails the verb, after the swap (the model is rewritten; the subscriber's own state is what went wrong).
"""

from __future__ import annotations

from typing import Callable

import torch.nn as nn

_after_rewrite: list[Callable[[nn.Module], None]] = []


def subscribe_after_rewrite(callback: Callable[[nn.Module], None]) -> Callable[[nn.Module], None]:
    """Call `callback(model)` after every `unfuse` and `fuse`, in the order subscribed; subscribing twice is once."""
    if callback not in _after_rewrite:
        _after_rewrite.append(callback)
    return callback


def unsubscribe_after_rewrite(callback: Callable[[nn.Module], None]) -> None:
    if callback in _after_rewrite:
        _after_rewrite.remove(callback)


def after_rewrite(model: nn.Module) -> None:
    """Published by `unfuse` and `fuse` once every module is swapped."""
    for callback in tuple(_after_rewrite):
        callback(model)
