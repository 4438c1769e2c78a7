"""An ordinary Lightning script (a LightningModule, a DataLoader, Trainer.fit with DDP) made to
survive rank failures: the lines marked ``# hook`` are all flashrecovery changes
(docs/hook.md, "Lightning"). ``--hsdp``: FSDP2 over 2 replicas of each shard instead of DDP,
sharded in ``configure_model`` over the strategy's mesh.

    flashrecovery run --nproc-per-node 3 --spares 1 examples/train_lightning.py --epochs 3
    flashrecovery run --nproc-per-node 4 --shards 2 --spares 1 examples/train_lightning.py \
        --hsdp --batch-size 6
"""

from __future__ import annotations

import argparse
import os
import time
from pathlib import Path

import lightning as L
import torch
import torch.nn.functional as F
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor
from torch.utils.data import DataLoader, TensorDataset

from flashrecovery.integrations.lightning import (  # hook
    FlashRecoveryHSDPStrategy,
    FlashRecoveryStrategy,
)


class Regression(L.LightningModule):
    def __init__(self, step_time: float) -> None:
        super().__init__()
        self.net = torch.nn.Sequential(
            torch.nn.Linear(8, 32), torch.nn.ReLU(), torch.nn.Dropout(0.1), torch.nn.Linear(32, 1)
        )
        self.step_time = step_time
        self.final: torch.Tensor | None = None

    def configure_model(self) -> None:
        strategy = self.trainer.strategy
        if isinstance(strategy, FlashRecoveryHSDPStrategy):
            for layer in (self.net[0], self.net[3]):
                fully_shard(layer, mesh=strategy.device_mesh)
            fully_shard(self.net, mesh=strategy.device_mesh)

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], index: int) -> torch.Tensor:
        x, y = batch
        loss = F.mse_loss(self.net(x), y)
        time.sleep(self.step_time)  # simulated compute
        return loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=1e-2)

    def on_train_end(self) -> None:
        """The whole parameters, on every rank (FSDP2's are gathered: a collective)."""
        values = self.state_dict().values()
        full = [t.full_tensor() if isinstance(t, DTensor) else t for t in values]
        self.final = torch.cat([t.detach().reshape(-1) for t in full])


def dataset() -> TensorDataset:
    generator = torch.Generator().manual_seed(1234)
    x = torch.randn(240, 8, generator=generator)
    return TensorDataset(x, x.sum(dim=1, keepdim=True).sin())


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--devices", type=int, default=int(os.environ.get("LOCAL_WORLD_SIZE", 1)))
    parser.add_argument("--hsdp", action="store_true", help="FSDP2, 2 replicas of each shard")
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--out", type=Path, default=None, help="each rank's final parameters")
    parser.add_argument("--step-time", type=float, default=0.0, help="simulated compute, s")
    args = parser.parse_args()

    torch.set_num_threads(1)
    L.seed_everything(0, verbose=False)
    model = Regression(args.step_time)
    trainer = L.Trainer(
        strategy=FlashRecoveryHSDPStrategy() if args.hsdp else FlashRecoveryStrategy(),  # hook
        accelerator="cpu",
        devices=args.devices,
        max_epochs=args.epochs,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    trainer.fit(model, DataLoader(dataset(), batch_size=args.batch_size, shuffle=True))

    if args.out is not None:
        saved = {"params": model.final, "pid": os.getpid()}
        torch.save(saved, args.out / f"rank{trainer.global_rank}.pt")


if __name__ == "__main__":
    main()
