"""bench/compare.py's torchrun side: plain DDP with a checkpoint every K steps, the way most
jobs survive a failure today. torchrun (``--max-restarts``) restarts every worker when one
dies; each reloads the last checkpoint and recomputes the steps since.

    torchrun --standalone --nproc-per-node 2 --max-restarts 100 \
        bench/compare_workers/torchrun_worker.py --model gpt --steps 1000 --out /abs/dir

The group is built on torchrun's store under a prefix of the restart count: with torch 2.15,
workers of a restarted group otherwise meet the previous group's keys and fail to connect to
their gloo peers.
"""

from __future__ import annotations

import argparse
import os
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel
from workload import MODELS, Progress, Workload, build

CHECKPOINT = "checkpoint.pt"
STORE_TIMEOUT = timedelta(seconds=60)


def load(work: Workload, path: Path) -> int:
    """The first step to compute: after the checkpoint's, or 0 without one."""
    if not path.exists():
        return 0
    saved = torch.load(path, weights_only=True)
    work.model.load_state_dict(saved["model"])
    work.optimizer.load_state_dict(saved["optimizer"])
    return int(saved["step"]) + 1


def save(work: Workload, path: Path, step: int) -> None:
    """Written aside then renamed: a kill mid-save leaves the previous checkpoint whole."""
    tmp = path.with_suffix(".tmp")
    state = {"model": work.model.state_dict(), "optimizer": work.optimizer.state_dict()}
    torch.save({**state, "step": step}, tmp)
    tmp.replace(path)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", choices=MODELS, required=True)
    parser.add_argument("--steps", type=int, required=True)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--checkpoint-every", type=int, default=10, help="K steps")
    args = parser.parse_args()
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    restart = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    store = dist.TCPStore(
        os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), timeout=STORE_TIMEOUT
    )
    prefixed = dist.PrefixStore(f"restart-{restart}", store)
    dist.init_process_group("gloo", store=prefixed, rank=rank, world_size=world)
    work = build(args.model)
    checkpoint = args.out / CHECKPOINT
    first = load(work, checkpoint)
    ddp = DistributedDataParallel(work.model)
    progress = Progress(args.out)
    for step in range(first, args.steps):
        work.optimizer.zero_grad(set_to_none=True)
        work.loss(ddp, step, rank, world).backward()
        work.optimizer.step()
        progress.committed(rank, step)
        if rank == 0 and (step + 1) % args.checkpoint_every == 0:
            save(work, checkpoint, step)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
