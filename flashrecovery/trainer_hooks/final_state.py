"""The final state a rank leaves for a bitwise comparison between runs (`flashrecovery chaos`).

When `flashrecovery run --final-state DIR` started the job, every rank's ``session.finish()``
(or the end of ``with session:``) writes ``DIR/rank<r>.json``: the digest of the registered
model's parameters and the step and process it was reached in. Two runs whose digests are equal
ended with bitwise-equal parameters.
"""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from flashrecovery.trainer_hooks.dtensors import is_dtensor

ENV = "FLASHRECOVERY_FINAL_STATE"


def parameters_sha256(model: torch.nn.Module) -> str:
    """Digest of every parameter's name and bytes in definition order: equal digests mean
    bitwise-equal models."""
    digest = hashlib.sha256()
    for name, param in model.named_parameters():
        # A sharded parameter (FSDP2) is gathered whole: a collective of every rank.
        whole = param.full_tensor() if is_dtensor(param) else param
        digest.update(name.encode())
        digest.update(whole.detach().cpu().contiguous().numpy().tobytes())
    return digest.hexdigest()


@dataclass(frozen=True)
class FinalState:
    rank: int
    pid: int
    committed_step: int
    params_sha256: str

    def write(self, directory: Path) -> None:
        """Atomically (a reader never sees half a file)."""
        directory.mkdir(parents=True, exist_ok=True)
        path = directory / f"rank{self.rank}.json"
        tmp = path.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_text(json.dumps(asdict(self)))
        tmp.replace(path)


def read(directory: Path, world_size: int) -> dict[int, FinalState]:
    """The final states present for ranks 0..world_size-1 (a missing file: a missing rank)."""
    found = {}
    for rank in range(world_size):
        path = directory / f"rank{rank}.json"
        if path.exists():
            found[rank] = FinalState(**json.loads(path.read_text()))
    return found
