"""HSDP with FSDP2: the model is sharded over the mesh's "shard" dimension and replicated over
its "replicate" dimension (2 x 2 on 4 CPU ranks with gloo). A lost rank is restored from a
replica of its own shard, and only that shard's state moves; when every replica of a shard is
lost, every rank loads the latest complete checkpoint and the job carries on (docs/hook.md).
``--replicas 1`` is pure FSDP (no replica): every lost rank is a checkpoint fallback.

    flashrecovery run --nproc-per-node 4 --shards 2 --spares 2 \
        --checkpoint-dir ckpt --checkpoint-every 5 examples/train_hsdp.py
    flashrecovery run --nproc-per-node 2 --shards 2 --spares 1 \
        --checkpoint-dir ckpt --checkpoint-every 5 examples/train_hsdp.py --replicas 1
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
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

import flashrecovery


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--out", type=Path, default=None, help="each rank's final parameters")
    parser.add_argument("--step-time", type=float, default=0.0, help="simulated compute, s")
    parser.add_argument("--replicas", type=int, default=2, help="1: pure FSDP, no replica")
    args = parser.parse_args()

    torch.set_num_threads(1)
    session = flashrecovery.init_process_group()
    shards = session.world_size // args.replicas
    mesh = (
        session.device_mesh((args.replicas, shards), ("replicate", "shard"))
        if args.replicas > 1
        else session.device_mesh((shards,), ("shard",))
    )
    rank = dist.get_rank()
    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Linear(8, 32), torch.nn.ReLU(), torch.nn.Dropout(0.1), torch.nn.Linear(32, 1)
    )
    for layer in (model[0], model[3]):
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    x = torch.randn(240, 8, generator=torch.Generator().manual_seed(1234))
    data = TensorDataset(x, x.sum(dim=1, keepdim=True).sin())
    sampler = DistributedSampler(data, shuffle=True, seed=0)
    loader = DataLoader(data, batch_size=6, sampler=sampler)
    session.register(model, optimizer)

    for epoch in session.epochs(args.epochs):
        sampler.set_epoch(epoch)
        for inputs, targets in session.batches(loader):
            optimizer.zero_grad()
            loss = F.mse_loss(model(inputs), targets)
            loss.backward()
            time.sleep(args.step_time)
            if session.commit(loss=loss.item()):
                optimizer.step()

    full = [t.full_tensor().reshape(-1) for t in model.state_dict().values()]  # a collective
    if args.out is not None:
        torch.save({"params": torch.cat(full), "pid": os.getpid()}, args.out / f"rank{rank}.pt")
    session.finish()


if __name__ == "__main__":
    main()
