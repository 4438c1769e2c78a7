"""A plain PyTorch training loop made failure-proof with the flashrecovery hook.

    flashrecovery run --nproc-per-node 3 --spares 1 examples/train_mlp.py --steps 200

Kill any rank (``kill -9 <pid>``; the pids are in the log) and the job carries on: a hot spare
takes the rank over, receives the model and optimizer from a healthy replica, and every rank
ends with the same parameters a run without the failure would have.
"""

from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F

from flashrecovery.trainer_hooks import init


def batch(step: int, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Data keyed by (step, rank): a recomputed step sees exactly the same batch."""
    generator = torch.Generator().manual_seed(step * 1000 + rank)
    x = torch.randn(32, 16, generator=generator)
    return x, x.sum(dim=1, keepdim=True).sin()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=200)
    args = parser.parse_args()

    torch.set_num_threads(1)
    session = init()  # reads the environment `flashrecovery run` set
    torch.manual_seed(0)  # every rank builds the same model
    model = torch.nn.Sequential(
        torch.nn.Linear(16, 64), torch.nn.ReLU(), torch.nn.Dropout(0.1), torch.nn.Linear(64, 1)
    )
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)

    def warmup() -> None:  # a hot spare runs this once, so it is ready the moment it is needed
        x, y = batch(0, 0)
        F.mse_loss(model(x), y).backward()

    session.register(model, optimizer, warmup=warmup)
    with session:  # reports the rank finished (or failed, at once) on the way out
        for step in session.steps(args.steps):
            x, y = batch(step, session.rank)
            loss = F.mse_loss(model(x), y)
            loss.backward()
            if session.commit(loss=loss.item()) and session.rank == 0 and step % 50 == 0:
                print(f"step {step} loss {loss.item():.4f}", flush=True)


if __name__ == "__main__":
    main()
