"""What of a rank's step is NaN or infinite (docs/hook.md, "Non-finite steps").

The commit looks at the loss the script hands it and at the gradients it can see (the reduced
ones: the hook's own sum, or what DDP or FSDP2 left in ``.grad``, a DTensor's local shard); a
member that finds a NaN or an infinity says so with its vote (vote.py), and no member steps.
A gradient is looked at through its sum, a NaN or an infinity anywhere in it makes the sum one:
one pass over the gradients, a few hundred microseconds for a million parameters here (half-
precision ones summed in float32, so a large finite sum does not overflow).
"""

from __future__ import annotations

import math
import sys
from collections.abc import Iterable

import torch

from flashrecovery.trainer_hooks.dtensors import local

_NARROW = {torch.float16, torch.bfloat16}  # summed in float32: a large finite sum stays finite


def looks(step: int, rank: int, world: int, shards: int, reduced: bool) -> bool:
    """Whether a rank looks at its gradients in ``step``. Every rank does where they are its
    own; once DDP or FSDP2 reduced them, every replica of a shard holds them bitwise alike (a
    NaN anywhere before the reduce is in all of them), so the replicas take turns: one look per
    shard and step, each replica once every ``world // shards`` steps."""
    return not reduced or step % (world // shards) == rank // shards


def found(
    loss: float | None, gradients: Iterable[torch.Tensor], what: str = "gradients"
) -> str | None:
    """What is NaN or infinite in a step, in a few words ("loss nan", ``what``), else None."""
    if loss is not None and not math.isfinite(loss):
        return f"loss {loss}"
    if sys.modules.get("torch.distributed.tensor") is not None:  # else none is a DTensor
        gradients = [local(g) for g in gradients]
    sums = [g.sum(dtype=torch.float32 if g.dtype in _NARROW else None) for g in gradients]
    if not sums:
        return None
    if len({(s.dtype, s.device) for s in sums}) > 1:  # stacked per dtype and device
        kinds: dict[tuple[torch.dtype, torch.device], list[torch.Tensor]] = {}
        for total in sums:
            kinds.setdefault((total.dtype, total.device), []).append(total)
        finite = all(bool(torch.stack(group).isfinite().all()) for group in kinds.values())
    else:
        finite = bool(torch.stack(sums).isfinite().all())
    return None if finite else what


def poison(gradients: Iterable[torch.Tensor]) -> None:
    """The ``nan`` fault (probe.py): the first element of the first non-empty gradient is NaN."""
    for gradient in gradients:
        tensor = local(gradient)
        if tensor.numel():
            with torch.no_grad():
                tensor[(0,) * tensor.dim()] = math.nan
            return
