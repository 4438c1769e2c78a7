"""Training script of the live tests: a small MLP with dropout and AdamW on data keyed by
(step, rank), so a run's final parameters depend only on the seed, never on failures. With
``--parallel ddp`` the model is wrapped once in torch DDP over the session's stable group and
the script steps its own optimizer."""

from __future__ import annotations

import argparse
import gc
import os
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from flashrecovery.trainer_hooks import init


def batch(step: int, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(step * 1000 + rank)
    x = torch.randn(16, 8, generator=generator)
    return x, x.sum(dim=1, keepdim=True).sin()


def hold(gate: Path, limit_s: float = 60.0) -> None:
    """Wait (bounded) for the test to open the gate: it does so once its faults are in place."""
    deadline = time.monotonic() + limit_s
    while not gate.exists():
        if time.monotonic() > deadline:
            raise TimeoutError(f"{gate} did not appear within {limit_s:.0f}s")
        time.sleep(0.05)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--out", type=Path, required=True, help="final parameters go here")
    parser.add_argument("--step-time", type=float, default=0.0, help="simulated compute, s")
    parser.add_argument(
        "--work",
        type=int,
        default=0,
        help="real compute: small matmuls a step (a slowed CPU "
        "slows them, unlike --step-time's sleep); leaves the training's numbers alone",
    )
    parser.add_argument(
        "--raise-at", default=None, metavar="RANK@STEP", help="every process of RANK raises there"
    )
    parser.add_argument(
        "--hold-at",
        type=int,
        default=None,
        metavar="STEP",
        help="before STEP, wait until --hold-file exists (a test's gate; heartbeats go on)",
    )
    parser.add_argument("--hold-file", type=Path, default=None)
    parser.add_argument("--parallel", choices=("hook", "ddp"), default="hook")
    parser.add_argument(
        "--after", type=int, default=0, metavar="N",
        help="with --parallel ddp: N all-reduces 50 ms apart after the training loop, as a "
        "script's own final save or evaluation would run collectives",
    )  # fmt: skip
    args = parser.parse_args()
    raise_rank, _, raise_step = (args.raise_at or "-1@-1").partition("@")

    torch.set_num_threads(1)
    session = init()
    if args.parallel == "ddp":
        session.process_group()  # a hot spare waits here for its rank
    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Linear(8, 32), torch.nn.ReLU(), torch.nn.Dropout(0.1), torch.nn.Linear(32, 1)
    )
    if args.parallel == "ddp":
        model = torch.nn.parallel.DistributedDataParallel(model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)

    def warmup() -> None:
        x, y = batch(0, 0)
        F.mse_loss(model(x), y).backward()

    busy = torch.ones(96, 96)
    session.register(model, optimizer, warmup=warmup)
    with session:
        for step in session.steps(args.steps):
            if step == args.hold_at:
                hold(args.hold_file)
            if (session.rank, step) == (int(raise_rank), int(raise_step)):
                raise ValueError(f"bad batch at step {step}")
            x, y = batch(step, session.rank)
            loss = F.mse_loss(model(x), y)
            loss.backward()
            time.sleep(args.step_time)
            for _ in range(args.work):
                busy.mm(busy)
            if session.commit(loss=loss.item()) and args.parallel == "ddp":
                optimizer.step()
                optimizer.zero_grad(set_to_none=True)
        for _ in range(args.after):
            torch.distributed.all_reduce(torch.ones(4))
            time.sleep(0.05)
        params = torch.cat([t.detach().reshape(-1) for t in model.state_dict().values()])
        saved = {"params": params, "pid": os.getpid(), "frozen": gc.get_freeze_count()}
        torch.save(saved, args.out / f"rank{session.rank}.pt")
    # Skip the interpreter's teardown: torch's takes seconds here, and the suite runs on 2 cores.
    sys.stdout.flush()
    os._exit(0)


if __name__ == "__main__":
    main()
