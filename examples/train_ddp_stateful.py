"""An ordinary torchrun DDP script whose loader is torchdata's StatefulDataLoader, made to
survive rank failures: the lines marked ``# hook`` are all flashrecovery adds (docs/hook.md).
The loop over the loader stays as it was: the loader given to ``session.register`` yields the
session's steps, and its own state travels with a restored rank, which resumes at the next
batch without reading past the ones before it.

    flashrecovery run --nproc-per-node 3 --spares 1 examples/train_ddp_stateful.py --epochs 3
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
from torch.utils.data import Dataset, DistributedSampler
from torchdata.stateful_dataloader import StatefulDataLoader

import flashrecovery


class Pairs(Dataset[tuple[torch.Tensor, torch.Tensor]]):
    """240 (x, sin(sum x)) pairs; counts the samples this process read."""

    def __init__(self) -> None:
        self.x = torch.randn(240, 8, generator=torch.Generator().manual_seed(1234))
        self.read = 0

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        self.read += 1
        x = self.x[index]
        return x, x.sum(dim=0, keepdim=True).sin()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--workers", type=int, default=0, help="the loader's worker processes")
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
    data = Pairs()
    sampler = DistributedSampler(data, shuffle=True, seed=0)
    loader = StatefulDataLoader(data, batch_size=8, sampler=sampler, num_workers=args.workers)
    session.register(model, optimizer, loader=loader)  # hook

    for epoch in session.epochs(args.epochs):  # hook: was range(args.epochs)
        sampler.set_epoch(epoch)
        for x, y in loader:
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
        saved = {"params": params, "pid": os.getpid(), "read": data.read}
        torch.save(saved, args.out / f"rank{rank}.pt")
    session.finish()  # hook: was dist.destroy_process_group()


if __name__ == "__main__":
    main()
