"""Ranks slower than their peers, scored from the step records the engine gets anyway (docs/
protocol.md, "Stragglers"): pure, a function of the records.

Each rank's ``StepCompleted.compute_s`` is its step's time not spent waiting on its peers'
collectives (trainer_hooks/waits.py). Once every member's record of a step is in, each one's
*slowdown* that step is its compute time over the step's lower median (with two ranks, the
other's: the faster one scores 1). A rank whose median slowdown over its last ``window``
scored steps reaches the job's ``ratio`` is a straggler: a steady slowness, never one slow
step, so a rank that is merely noisy (slow now and then) is never named. It is cleared once
that median falls under halfway between 1 and the ratio. Cost: one sort of a step's times
per step and one of a window per rank and step, whatever else the job holds.
"""

from __future__ import annotations

import statistics
from collections import deque
from dataclasses import dataclass, field

KEEP_STEPS = 2  # steps behind the newest whose times are still awaited (a rank lost drops)


@dataclass(frozen=True)
class Change:
    """A rank named (``found``) or no longer a straggler, with its median slowdown."""

    rank: int
    slowdown: float
    found: bool


@dataclass
class StepScores:
    window: int  # scored steps a rank's median slowdown is taken over
    ratio: float  # a median slowdown at or above this names the rank
    pending: dict[int, dict[int, float]] = field(default_factory=dict)  # step -> rank -> s
    recent: dict[int, deque[float]] = field(default_factory=dict)  # rank -> slowdowns
    named: set[int] = field(default_factory=set)

    def add(self, rank: int, step: int, compute_s: float, members: int) -> list[Change]:
        """A member's compute time of ``step``; what changed once the step's every member
        (``members`` of them) reported."""
        times = self.pending.setdefault(step, {})
        times[rank] = compute_s
        for old in [s for s in self.pending if s < step - KEEP_STEPS]:
            del self.pending[old]
        if len(times) < members:
            return []
        del self.pending[step]
        median = statistics.median_low(times.values())
        if median <= 0 or len(times) < 2:
            return []
        changes = []
        for member, seconds in sorted(times.items()):
            recent = self.recent.setdefault(member, deque(maxlen=self.window))
            recent.append(seconds / median)
            if (change := self._changed(member, recent)) is not None:
                changes.append(change)
        return changes

    def _changed(self, rank: int, recent: deque[float]) -> Change | None:
        if len(recent) < self.window:
            return None
        slowdown = round(statistics.median(recent), 3)
        if rank not in self.named and slowdown >= self.ratio:
            self.named.add(rank)
            return Change(rank, slowdown, found=True)
        if rank in self.named and slowdown < (1 + self.ratio) / 2:
            self.named.discard(rank)
            return Change(rank, slowdown, found=False)
        return None

    def restart(self, ranks: set[int] | None = None) -> None:
        """Score afresh (a new generation: its processes and timings are new); ``ranks``
        replaced are no longer named either."""
        self.pending.clear()
        self.recent.clear()
        self.named -= ranks or set()
