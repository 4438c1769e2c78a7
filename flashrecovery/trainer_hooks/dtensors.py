"""Whether a value is a DTensor, without importing DTensors: ``torch.distributed.tensor`` (with
sympy behind it) costs a rank process about half a second of CPU to import, which every
replacement spawned fresh paid before it could train, whether or not the job shards its model.
A process that never imported it holds no DTensor, so the question is free until FSDP2 (or the
user) imports it."""

from __future__ import annotations

import sys
from typing import TYPE_CHECKING, Any, TypeGuard

if TYPE_CHECKING:
    from torch.distributed.tensor import DTensor


def is_dtensor(value: Any) -> TypeGuard[DTensor]:
    module = sys.modules.get("torch.distributed.tensor")
    return module is not None and isinstance(value, module.DTensor)


def local(value: Any) -> Any:
    """A DTensor's local tensor (the same storage, no collective), anything else as it is."""
    return value.to_local() if is_dtensor(value) else value
