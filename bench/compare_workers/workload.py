"""What every side of bench/compare.py trains, and how a worker says it committed a step.

Two models, built identically (seed first, one thread) in every worker of every system: the
demo's GPT (flashrecovery/demo/model.py, ~1.2 M parameters) and an MLP of four 1024 x 1024
linear layers (~4.2 M parameters; bench/rto.py --state-mb widens it). Batches depend only on
(step, rank, world size), so a restarted or replacing worker draws what the one it replaces
would have drawn.

Each committed step is one JSON line appended to ``<out>/progress.jsonl`` (wall time, rank,
pid, step): bench/compare.py measures every system from these same lines, never from a
system's own bookkeeping.
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from flashrecovery.demo.data import BLOCK_SIZE, batch_for, vocabulary
from flashrecovery.demo.model import GPTConfig, TinyGPT, lm_loss

MODELS = ("gpt", "mlp")
MLP_WIDTH = 1024
MLP_LAYERS = 4
MLP_BATCH = 32
LEARNING_RATE = 1e-3
PROGRESS = "progress.jsonl"


@dataclass
class Workload:
    """A model, its optimizer and the loss of one rank's batch at one step."""

    model: nn.Module
    optimizer: torch.optim.Optimizer
    loss: Callable[[nn.Module, int, int, int], torch.Tensor]  # (forward, step, rank, world)


def _gpt_loss(forward: nn.Module, step: int, rank: int, world: int) -> torch.Tensor:
    x, y = batch_for(step, rank, world)
    return lm_loss(forward(x), y)


def _mlp_loss(width: int) -> Callable[[nn.Module, int, int, int], torch.Tensor]:
    def loss(forward: nn.Module, step: int, rank: int, world: int) -> torch.Tensor:
        generator = torch.Generator().manual_seed((world * 1_000_003 + step) * 1_000 + rank)
        x = torch.randn(MLP_BATCH, width, generator=generator)
        return F.mse_loss(forward(x), x.roll(1, dims=1).tanh())

    return loss


def _mlp(width: int) -> nn.Module:
    layers: list[nn.Module] = []
    for i in range(MLP_LAYERS):
        layers.append(nn.Linear(width, width))
        if i < MLP_LAYERS - 1:
            layers.append(nn.ReLU())
    return nn.Sequential(*layers)


def mlp_width(state_mb: float) -> int:
    """The MLP's width whose parameters and AdamW moments (three float32 copies) come nearest
    ``state_mb`` megabytes: what a replacement receives from its donors."""
    per_layer = state_mb * 1e6 / (3 * 4 * MLP_LAYERS)  # width**2 + width floats a layer
    return max(1, round((-1 + (1 + 4 * per_layer) ** 0.5) / 2))


def build(name: str, seed: int = 0, width: int = MLP_WIDTH) -> Workload:
    """``width``: the MLP's (bench/rto.py --state-mb sizes the state with it)."""
    if name not in MODELS:
        raise ValueError(f"model {name!r}: expected one of {', '.join(MODELS)}")
    torch.set_num_threads(1)
    torch.manual_seed(seed)
    if name == "gpt":
        model: nn.Module = TinyGPT(GPTConfig(vocab_size=len(vocabulary()), block_size=BLOCK_SIZE))
        loss: Callable[[nn.Module, int, int, int], torch.Tensor] = _gpt_loss
    else:
        model, loss = _mlp(width), _mlp_loss(width)
    return Workload(model, torch.optim.AdamW(model.parameters(), lr=LEARNING_RATE), loss)


class Progress:
    """Appends one line per committed step; one write per line (O_APPEND), so lines of the
    processes sharing the file never interleave."""

    def __init__(self, out: Path) -> None:
        out.mkdir(parents=True, exist_ok=True)
        self._fd = os.open(out / PROGRESS, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)

    def committed(self, rank: int, step: int) -> None:
        line = {"t": time.time(), "rank": rank, "pid": os.getpid(), "step": step}
        os.write(self._fd, (json.dumps(line) + "\n").encode())
