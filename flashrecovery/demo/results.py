"""What each training process leaves in the run dir, so runs can be compared bitwise afterwards.

One JSON file per rank id, written by whichever process holds the rank at the end (a survivor,
or the spare that replaced a killed rank), atomically so a reader never sees half a file.
"""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass, field
from pathlib import Path


@dataclass
class RankResult:
    rank: int
    pid: int
    generation: int
    steps: int
    params_sha256: str
    losses: dict[int, float] = field(default_factory=dict)  # committed step -> local loss
    step_times_s: list[float] = field(default_factory=list)  # wall time of committed steps

    def write(self, run_dir: Path) -> Path:
        run_dir.mkdir(parents=True, exist_ok=True)
        path = result_path(run_dir, self.rank)
        tmp = path.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_text(json.dumps(asdict(self), indent=1))
        tmp.replace(path)
        return path

    @classmethod
    def read(cls, path: Path) -> RankResult:
        data = json.loads(path.read_text())
        data["losses"] = {int(step): loss for step, loss in data["losses"].items()}
        return cls(**data)


def result_path(run_dir: Path, rank: int) -> Path:
    return run_dir / f"rank{rank}.json"


def read_results(run_dir: Path, world_size: int) -> dict[int, RankResult]:
    """The results present for ranks 0..world_size-1 (a missing file is a missing rank)."""
    return {
        rank: RankResult.read(result_path(run_dir, rank))
        for rank in range(world_size)
        if result_path(run_dir, rank).exists()
    }
