"""Gradient averaging for the commit: one flat buffer per dtype, all-reduced, and written back
into ``.grad`` only once the step is committed (an aborted step leaves no trace)."""

from __future__ import annotations

from collections.abc import Callable

import torch

from flashrecovery.trainer_hooks import inflight
from flashrecovery.trainer_hooks.groups import Group


class ReducedGradients:
    """Summed gradients of a step, not yet applied."""

    def __init__(self, params: list[torch.nn.Parameter], buckets: dict[torch.dtype, torch.Tensor]):
        self._params = params
        self._buckets = buckets

    @classmethod
    def reduce(
        cls, group: Group, params: list[torch.nn.Parameter], superseded: Callable[[], bool]
    ) -> ReducedGradients:
        """Sum the members' gradients; ``Superseded`` once a newer generation is planned
        while a member holds the sum up (trainer_hooks/inflight.py)."""
        buckets: dict[torch.dtype, torch.Tensor] = {}
        for dtype in dict.fromkeys(p.dtype for p in params):
            grads = [
                (p.grad if p.grad is not None else torch.zeros_like(p)).reshape(-1)
                for p in params
                if p.dtype == dtype
            ]
            flat = torch.cat(grads)
            inflight.wait(group.allreduce([flat]), group, superseded)
            buckets[dtype] = flat
        return cls(params, buckets)

    @property
    def sums(self) -> list[torch.Tensor]:
        """The summed gradients, one flat tensor per dtype."""
        return list(self._buckets.values())

    def apply(self, world_size: int) -> None:
        """Replace every gradient with the members' average."""
        offsets = dict.fromkeys(self._buckets, 0)
        for p in self._params:
            flat, start = self._buckets[p.dtype], offsets[p.dtype]
            average = flat[start : start + p.numel()].view_as(p).div_(world_size)
            offsets[p.dtype] = start + p.numel()
            if p.grad is None:
                p.grad = average.clone()
            else:
                p.grad.copy_(average)
