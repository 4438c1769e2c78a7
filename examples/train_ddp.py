"""An ordinary torch DDP training script (a DataLoader with a DistributedSampler over epochs,
the script's own optimizer step) made to survive rank failures: the lines marked ``# hook``
are all flashrecovery adds (docs/hook.md).

    flashrecovery run --nproc-per-node 3 --spares 1 examples/train_ddp.py --epochs 3
"""

from __future__ import annotations

import argparse
import os
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

import flashrecovery


def dataset() -> TensorDataset:
    generator = torch.Generator().manual_seed(1234)
    x = torch.randn(240, 8, generator=generator)
    return TensorDataset(x, x.sum(dim=1, keepdim=True).sin())


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--out", type=Path, default=None, help="each rank's final parameters")
    parser.add_argument("--step-time", type=float, default=0.0, help="simulated compute, s")
    args = parser.parse_args()

    torch.set_num_threads(1)
    session = flashrecovery.init_process_group()  # hook: replaces dist.init_process_group()
    rank = dist.get_rank()
    torch.manual_seed(0)
    model = DDP(
        torch.nn.Sequential(
            torch.nn.Linear(8, 32), torch.nn.ReLU(), torch.nn.Dropout(0.1), torch.nn.Linear(32, 1)
        )
    )
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    sampler = DistributedSampler(dataset(), shuffle=True, seed=0)
    loader = DataLoader(sampler.dataset, batch_size=8, sampler=sampler)
    session.register(model, optimizer)  # hook

    for epoch in session.epochs(args.epochs):  # hook: was range(args.epochs)
        sampler.set_epoch(epoch)
        for x, y in session.batches(loader):  # hook: was loader
            optimizer.zero_grad()
            loss = F.mse_loss(model(x), y)
            loss.backward()
            time.sleep(args.step_time)
            if session.commit(loss=loss.item()):  # hook: every rank steps, or none
                optimizer.step()
        if rank == 0:
            print(f"epoch {epoch} loss {loss.item():.4f}", flush=True)

    if args.out is not None:
        params = torch.cat([t.detach().reshape(-1) for t in model.state_dict().values()])
        torch.save({"params": params, "pid": os.getpid()}, args.out / f"rank{rank}.pt")
    session.finish()  # hook: was dist.destroy_process_group()


if __name__ == "__main__":
    main()
