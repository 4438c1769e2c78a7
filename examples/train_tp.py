"""Tensor parallel beside FSDP2: the model's feed-forward layers are split over the mesh's "tp"
dimension (``parallelize_module`` with ``ColwiseParallel`` then ``RowwiseParallel``; with
``--sequence-parallel`` the norm and the head too, on parts of the sequence) and sharded with
``fully_shard`` over ("dp_replicate", "dp_shard"): torchtitan's mesh names and layout, on CPU
ranks with gloo. An ordinary script plus the hook's lines (docs/hook.md, "Tensor parallel").

A lost rank is restored from the rank at the same (dp_shard, tp) coordinate in another replica:
``--shards`` is the ranks of one replica, dp_shard x tp. With no replica left of a coordinate
(``--replicas 1``, or every replica of it lost) the job falls back to the latest complete
checkpoint, as FSDP does. With one data-parallel coordinate (``--replicas 1 --dp-shard 1``)
there is nothing to shard over: tensor parallel alone, without FSDP2.

    flashrecovery run --nproc-per-node 4 --shards 2 --spares 1 examples/train_tp.py
    flashrecovery run --nproc-per-node 8 --shards 4 --spares 1 examples/train_tp.py --dp-shard 2
    flashrecovery run --nproc-per-node 4 --shards 2 --spares 1 examples/train_tp.py \
        --sequence-parallel
    flashrecovery run --nproc-per-node 2 --shards 2 --spares 1 --checkpoint-dir ckpt \
        --checkpoint-every 5 examples/train_tp.py --replicas 1 --dp-shard 1
"""

from __future__ import annotations

import argparse
import os
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor, Shard
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    ParallelStyle,
    RowwiseParallel,
    SequenceParallel,
    parallelize_module,
)
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

import flashrecovery

SEQUENCE = 4  # tokens per sample


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--out", type=Path, default=None, help="each rank's final parameters")
    parser.add_argument("--step-time", type=float, default=0.0, help="simulated compute, s")
    parser.add_argument("--replicas", type=int, default=2, help="dp_replicate")
    parser.add_argument("--dp-shard", type=int, default=1)
    parser.add_argument("--tp", type=int, default=2)
    parser.add_argument("--sequence-parallel", action="store_true")
    args = parser.parse_args()

    torch.set_num_threads(1)
    session = flashrecovery.init_process_group()
    shape = (args.replicas, args.dp_shard, args.tp)
    mesh = session.device_mesh(shape, ("dp_replicate", "dp_shard", "tp"))
    torch.manual_seed(0)
    # Per token of a sequence: a norm, a feed-forward, a head.
    model = torch.nn.Sequential(
        torch.nn.LayerNorm(8),
        torch.nn.Linear(8, 32),
        torch.nn.ReLU(),
        torch.nn.Linear(32, 8),
        torch.nn.Linear(8, 1),
    )
    # The feed-forward split over tp: the hidden 32 columns, then the rows that meet them.
    # With sequence parallel the norm and the head run on a part of the sequence each (their
    # parameters replicated, their gradients summed over tp), gathered before the feed-forward
    # and scattered after it.
    if args.sequence_parallel:
        plan: dict[str, ParallelStyle] = {
            "0": SequenceParallel(),
            "1": ColwiseParallel(input_layouts=Shard(1)),
            "3": RowwiseParallel(output_layouts=Shard(1)),
            "4": SequenceParallel(use_local_output=True),
        }
    else:
        plan = {"1": ColwiseParallel(), "3": RowwiseParallel()}
    parallelize_module(model, mesh["tp"], plan)
    dp_size = args.replicas * args.dp_shard
    if dp_size > 1:
        fully_shard(model, mesh=mesh["dp_replicate", "dp_shard"])
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    # Every rank of one data-parallel coordinate (its tp peers) reads the same batches.
    dp_rank = mesh["dp_replicate", "dp_shard"]._flatten().get_local_rank()
    x = torch.randn(240, SEQUENCE, 8, generator=torch.Generator().manual_seed(1234))
    data = TensorDataset(x, x.sum(dim=2, keepdim=True).sin())
    # With sequence parallel each tp rank feeds its part of the sequence (and scores it).
    tp_rank, part = mesh.get_local_rank("tp"), SEQUENCE // args.tp
    tokens = slice(tp_rank * part, (tp_rank + 1) * part) if args.sequence_parallel else slice(None)
    sampler = DistributedSampler(data, num_replicas=dp_size, rank=dp_rank, shuffle=True, seed=0)
    loader = DataLoader(data, batch_size=6, sampler=sampler)
    session.register(model, optimizer)

    for epoch in session.epochs(args.epochs):
        sampler.set_epoch(epoch)
        for inputs, targets in session.batches(loader):
            optimizer.zero_grad()
            loss = F.mse_loss(model(inputs[:, tokens]), targets[:, tokens])
            loss.backward()
            time.sleep(args.step_time)
            if session.commit(loss=loss.item()):
                optimizer.step()

    state = model.state_dict().values()
    full = [(t.full_tensor() if isinstance(t, DTensor) else t).reshape(-1) for t in state]
    if args.out is not None:
        rank = dist.get_rank()
        torch.save({"params": torch.cat(full), "pid": os.getpid()}, args.out / f"rank{rank}.pt")
    session.finish()


if __name__ == "__main__":
    main()
