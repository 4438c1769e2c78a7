"""Where a rank is in its data: the epoch and the batch of that epoch its next step takes (and
a stateful loader's own state there).

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
    # A stateful loader's state once those batches were yielded (loader.py); None: the epoch's
    # start, or a loader without one (it is read past the committed batches instead).
    loader: dict[str, Any] | None = None

    def next_epoch(self) -> None:
        self.epoch, self.batch, self.loader = self.epoch + 1, 0, None

    def state_dict(self) -> dict[str, Any]:
        return {"epoch": self.epoch, "batch": self.batch, "loader": self.loader}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.epoch, self.batch = int(state["epoch"]), int(state["batch"])
        self.loader = state.get("loader")  # absent in checkpoints of earlier versions
