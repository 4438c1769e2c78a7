"""DDP's one-time bucket rebuild, done when the model is registered.

After its first backward, DDP regroups its gradient buckets in the order the gradients became
ready and broadcasts rank 0's order to everyone, once. A replacement would do that on its second
step, long after the survivors did: a broadcast nobody else joins. So every process rebuilds at
registration (the members of generation 0 together over the stable group, a replacement alone
while its group is still local), from one backward of its own that needs no batch.

That backward makes each parameter's gradient ready in reverse registration order, the order a
real backward produces them in (the last layer first) and the order DDP's constructor assumes.
The order matters: DDP all-reduces its buckets strictly in bucket order, so a first bucket that
holds the first layer (ready last) would hold every bucket back until the backward ends, and no
communication would overlap the backward (docs/hook.md, "What the hook costs per step").
"""

from __future__ import annotations

import torch
from torch.nn.parallel import DistributedDataParallel


def settle_buckets(model: torch.nn.Module) -> None:
    if isinstance(model, DistributedDataParallel) and not model._has_rebuilt_buckets:
        if model.find_unused_parameters or model.static_graph:
            # DDP's own bookkeeping differs for these: its join hook's way, parameter order.
            model.reducer._push_all_rebuilt_params()
        else:
            _backward_in_reverse_order(model)
        model._has_rebuilt_buckets = bool(model.reducer._rebuild_buckets())
        model.zero_grad(set_to_none=True)


def _backward_in_reverse_order(model: DistributedDataParallel) -> None:
    """One backward through DDP's reducer whose gradients become ready last parameter first:
    autograd runs the ready node created last first, so the branch made for the last parameter
    finishes first. Its gradients are zeros (all-reduced with the peers', if any)."""
    params = [p for p in model.module.parameters() if p.requires_grad]
    model.reducer.prepare_for_forward()
    model.reducer.prepare_for_backward([])
    torch.autograd.backward([(p * 0).sum() for p in params])
