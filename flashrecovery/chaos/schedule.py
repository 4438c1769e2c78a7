"""A seeded schedule of faults: which kind lands on which rank at which step.

Pure: the same seed, world and kinds give the same schedule. Faults land at distinct steps
spaced ``gap`` apart, so two faults on one rank never land at the same step, and a recovery
has room to finish before the next fault. In-process faults (raise, stall, and the kills that
land inside a recovery) become the job's fault plan (trainer_hooks/probe.py); the others are
carried out from outside by the chaos command (signals to a rank, the engine or the broker).
"""

from __future__ import annotations

import random
import signal
from dataclasses import dataclass

# kind -> what it does; the first rank named fails at the fault's step.
KINDS: dict[str, str] = {
    "sigkill": "SIGKILL a rank from outside",
    "sigstop": "SIGSTOP a rank from outside (found by its missing heartbeats)",
    "raise": "an exception escapes a rank's training loop",
    "stall": "a rank stuck in its own code, heartbeats going on (found by the stall detector)",
    "donor": "a rank dies, then its donor dies mid-transfer (another replica donates)",
    "replacement": "a rank dies, then its replacement dies before its first commit",
    "regroup": "a rank dies, then a second one dies as the members regroup",
    "group_build": "a rank dies, then a second one dies while the new group forms",
    "engine_kill": "a rank is SIGKILLed, then the deciding engine mid-incident (--external-engine)",
    "broker_restart": "a rank is SIGKILLed, then the Kafka broker restarts mid-incident",
    "spare_kill": "SIGKILL an idle hot spare (it must be retired and replaced, never used)",
    "spare_stop": "SIGSTOP an idle hot spare (found by its missing heartbeats, then replaced)",
}
# Kinds that lose a second member during the recovery: they need a replica left to donate.
TWO_FAILURES = ("donor", "replacement", "regroup", "group_build")
OUTSIDE_SIGNAL = {"sigkill": signal.SIGKILL, "sigstop": signal.SIGSTOP}
MID_INCIDENT = ("engine_kill", "broker_restart")  # a rank SIGKILLed, then this
IDLE_SPARE_SIGNAL = {"spare_kill": signal.SIGKILL, "spare_stop": signal.SIGSTOP}


@dataclass(frozen=True)
class PlannedFault:
    index: int
    kind: str
    step: int  # the step the first failure lands at (every member committed step - 1)
    rank: int  # the rank that fails first
    second: int | None = None  # the member lost during the recovery, for TWO_FAILURES

    @property
    def plan(self) -> list[str]:
        """Its entries of the job's fault plan (``RANK:POINT@STEP``); none for outside kinds."""
        first = f"{self.rank}:before_reduce@{self.step}"
        during = self.step - 1  # the members' committed step while they recover
        return {
            "raise": [f"{self.rank}:raise@{self.step}"],
            "stall": [f"{self.rank}:stall@{self.step}"],
            "donor": [first, f"{self.second}:donor_send@{during}"],
            "replacement": [first, first],
            "regroup": [first, f"{self.second}:regroup@{during}"],
            "group_build": [first, f"{self.second}:group_build@{during}"],
        }.get(self.kind, [])

    @property
    def failed_ranks(self) -> list[int]:
        """The ranks it makes fail, in order (one incident each)."""
        if self.kind in IDLE_SPARE_SIGNAL:
            return []  # a spare holds no rank: no incident, a retirement
        if self.kind == "replacement":
            return [self.rank, self.rank]
        return [self.rank] if self.second is None else [self.rank, self.second]

    def describe(self) -> str:
        if self.kind in IDLE_SPARE_SIGNAL:
            return f"an idle spare at step {self.step}"
        if self.kind in ("donor", "regroup", "group_build"):
            return f"rank {self.rank} at step {self.step}, then rank {self.second}"
        return f"rank {self.rank} at step {self.step}"


def available_kinds(nproc: int, external_engine: bool, broker: bool, spares: int = 0) -> list[str]:
    """The kinds this job can take: two failures in one recovery need three ranks (one
    replica must survive to donate); the spare, engine and broker kinds need those to exist."""
    kinds = ["sigkill", "sigstop", "raise", "stall"]
    if nproc >= 3:
        kinds += TWO_FAILURES
    if spares:
        kinds += list(IDLE_SPARE_SIGNAL)
    if external_engine:
        kinds.append("engine_kill")
    if broker:
        kinds.append("broker_restart")
    return kinds


def draw(
    faults: int, seed: int, nproc: int, kinds: list[str], first_step: int, gap: int
) -> list[PlannedFault]:
    """``faults`` faults at steps first_step, first_step + gap, …; kinds are dealt from a
    shuffled deck (so a short schedule still covers many kinds), ranks at random."""
    rng = random.Random(seed)
    deck: list[str] = []
    out = []
    for index in range(faults):
        if not deck:
            deck = list(kinds)
            rng.shuffle(deck)
        kind = deck.pop()
        rank = rng.randrange(nproc)
        others = [r for r in range(nproc) if r != rank]
        second = None
        if kind == "donor":
            second = min(others)  # the planner's donor: the lowest survivor
        elif kind in ("regroup", "group_build"):
            second = rng.choice(others)
        out.append(PlannedFault(index, kind, first_step + index * gap, rank, second))
    return out
