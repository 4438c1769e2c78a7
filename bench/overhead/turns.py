"""Two jobs taking turns on the machine (`python -m bench.overhead --phases`).

A pair of runs started half a minute apart meets a different machine on a shared host: one
repeat's pair differed from the next by up to 60 points here. So both jobs run at once and take
turns instead: each rank stops at a gate every ``every`` steps, and the conductor lets one job's
ranks through, waits until all of them stand at their next gate, then lets the other job's
through. Two neighbouring phases are a second or two apart, so a busy spell of the host hits
both alike, and a run gives dozens of pairs where separate runs gave a handful.

A gate is a FIFO per rank (the conductor writes a byte to let the rank through) and one FIFO per
job that the ranks report their arrival on (one short line each, written atomically). The job
that waits is not stopped: its threads go on (heartbeats, the agent), and the conductor counts
their CPU so that what the waiting job takes from the running one is stated.
"""

from __future__ import annotations

import contextlib
import os
import select
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

REACHED = "reached"
TURN_TIMEOUT_S = 900.0  # how long a rank waits for its turn at most (the other job's phase)


@dataclass(frozen=True)
class Gates:
    """Where a job's gates are: at step ``first``, then every ``every`` steps."""

    directory: str
    first: int
    every: int

    def args(self) -> list[str]:
        """The rank script's command line for them (``overhead_rank.py --gates``)."""
        return ["--gates", self.directory, str(self.first), str(self.every)]

    def open(self, rank: int) -> Gate:
        return Gate(Path(self.directory), rank, self.first, self.every, TURN_TIMEOUT_S)


def _grant_path(directory: Path, rank: int) -> Path:
    return directory / f"grant{rank}"


class Gate:
    """A rank's end: ``passes(step)`` holds the rank at a gate step until its job's turn."""

    def __init__(self, directory: Path, rank: int, first: int, every: int, timeout: float) -> None:
        self._rank, self._first, self._every, self._timeout = rank, first, every, timeout
        # O_RDWR: opening never waits for the other end (Linux), and the conductor made both
        self._grant = os.open(_grant_path(directory, rank), os.O_RDWR)
        self._report = os.open(directory / REACHED, os.O_WRONLY)

    def passes(self, step: int) -> bool:
        """Whether ``step`` is a gate (then it waited for its turn; its time is not the step's)."""
        if step < self._first or (step - self._first) % self._every:
            return False
        os.write(self._report, f"{step} {self._rank}\n".encode())
        ready, _, _ = select.select([self._grant], [], [], self._timeout)
        if not ready:
            raise TimeoutError(f"rank {self._rank} was not let through gate {step}")
        os.read(self._grant, 1)
        return True


class Turns:
    """The conductor's end for one job of ``world`` ranks (the FIFOs live in ``directory``)."""

    def __init__(self, directory: Path, world: int) -> None:
        directory.mkdir(parents=True, exist_ok=True)
        self.directory, self._world = directory, world
        os.mkfifo(directory / REACHED)
        self._reached = os.open(directory / REACHED, os.O_RDWR | os.O_NONBLOCK)
        self._grants = []
        for rank in range(world):
            os.mkfifo(_grant_path(directory, rank))
            self._grants.append(os.open(_grant_path(directory, rank), os.O_RDWR))
        self._arrived: dict[int, int] = {}  # gate step -> ranks standing at it
        self._partial = b""

    def wait_at(self, step: int, timeout: float, alive: Callable[[], bool]) -> None:
        """Until every rank stands at gate ``step``; raises once ``timeout`` passes or the job
        has ended (``alive()`` is looked at every second)."""
        deadline = time.monotonic() + timeout
        while self._arrived.get(step, 0) < self._world:
            left = deadline - time.monotonic()
            if left <= 0 or not alive():
                raise RuntimeError(
                    f"{self._arrived.get(step, 0)} of {self._world} ranks reached gate {step}"
                    + ("" if left > 0 else f" within {timeout:.0f}s")
                )
            ready, _, _ = select.select([self._reached], [], [], min(left, 1.0))
            if ready:
                *lines, self._partial = (self._partial + os.read(self._reached, 4096)).split(b"\n")
                for line in lines:
                    gate = int(line.split()[0])
                    self._arrived[gate] = self._arrived.get(gate, 0) + 1

    def let_through(self) -> None:
        for grant in self._grants:
            os.write(grant, b"1")

    def close(self) -> None:
        for fd in (self._reached, *self._grants):
            with contextlib.suppress(OSError):
                os.close(fd)
