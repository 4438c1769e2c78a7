"""DDP's one-time bucket rebuild, done when the model is registered.

After its first backward, DDP regroups its gradient buckets in the order the gradients became
ready and broadcasts rank 0's order to everyone, once. A replacement would do that on its second
step, long after the survivors did: a broadcast nobody else joins. So every process rebuilds at
registration, in parameter order (what DDP's own join hook does): the members of generation 0
together over the stable group, a replacement alone while its group is still local.
"""

from __future__ import annotations

import torch
from torch.nn.parallel import DistributedDataParallel


def settle_buckets(model: torch.nn.Module) -> None:
    if isinstance(model, DistributedDataParallel) and not model._has_rebuilt_buckets:
        model.reducer._push_all_rebuilt_params()
        model._has_rebuilt_buckets = bool(model.reducer._rebuild_buckets())
