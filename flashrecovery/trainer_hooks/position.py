"""Where a rank is in its data: the epoch and the batch of that epoch its next step takes.

It travels with the training state like any ``extras`` object, so a replacement resumes the
donor's epoch at the donor's next batch (``Session.epochs`` and ``Session.batches``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass
class DataPosition:
    epoch: int = 0
    batch: int = 0  # batches of the epoch already committed

    def next_epoch(self) -> None:
        self.epoch, self.batch = self.epoch + 1, 0

    def state_dict(self) -> dict[str, Any]:
        return {"epoch": self.epoch, "batch": self.batch}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.epoch, self.batch = int(state["epoch"]), int(state["batch"])
