"""Test-only fault injection: a process fails for real at one place of the protocol, so tests
(and `flashrecovery chaos`) exercise the true failure paths.

Two ways to ask for one. ``FLASHRECOVERY_FAULT=<point>@<step>`` is given to one launched
process only (its replacements never inherit it). ``FLASHRECOVERY_FAULT_PLAN=<rank>:<point>@<step>
[,…]`` is given to every process of the job, spares included: each entry fires once in the job,
in whichever process holds the rank when it reaches the point at the step (the first to claim
it on the store), so a replacement can be hit too, and one rank can fail at several steps.

Points, with the step they are checked at: ``before_reduce`` and ``after_reduce`` SIGKILL the
process there, at the step being committed (after the gradients are reduced but before the vote
completes is the delicate case); ``finish`` SIGKILLs it in ``finish()`` once ``step`` is
committed (the last step: lost after the job's work is done); ``exit`` SIGKILLs it at the very
end of ``finish()``, its ``RankFinished`` handed over (a crash in the interpreter's teardown
after training); ``raise`` raises instead of dying; ``hang`` SIGSTOPs the process so only the
detectors can find it; ``stall`` blocks the training thread forever before the step's commit
while the process (and its heartbeats) live on, so only the stall detector can find it. During a
recovery, at the member's committed step: ``regroup`` SIGKILLs a member as it starts to join a
new generation, ``group_build`` as it starts to build the generation's group (its ring
neighbours wait for it while theirs form), and ``donor_send`` kills a donor in the middle of
sending its state (after the first message). ``checkpoint_load`` SIGKILLs a member as it starts
loading the checkpoint a fallback names, at that checkpoint's step.
"""

from __future__ import annotations

import os
import signal
import threading
from collections.abc import Callable
from dataclasses import dataclass

POINTS = (
    "before_reduce",
    "after_reduce",
    "finish",
    "exit",
    "raise",
    "hang",
    "stall",
    "regroup",
    "group_build",
    "donor_send",
    "checkpoint_load",
)
_CHECKED_AT = {"raise": "before_reduce", "hang": "before_reduce", "stall": "before_reduce"}


class InjectedFault(RuntimeError):
    """The ``raise`` fault: an ordinary exception escaping the training loop."""


@dataclass(frozen=True)
class Fault:
    point: str
    step: int

    @classmethod
    def parse(cls, spec: str) -> Fault:
        point, sep, step = spec.partition("@")
        if not sep or point not in POINTS or not step.isdigit():
            raise ValueError(
                f"fault {spec!r}: expected <point>@<step>, point one of " + ", ".join(POINTS)
            )
        return cls(point, int(step))

    def due(self, where: str, step: int) -> bool:
        """Whether this fault acts at ``where`` (a place of the protocol) at ``step``."""
        return step == self.step and _CHECKED_AT.get(self.point, self.point) == where

    def check(self, where: str, step: int) -> None:
        """Fail here if this is the fault's place."""
        if self.due(where, step):
            self.fire()

    def fire(self) -> None:
        if self.point == "raise":
            raise InjectedFault(f"injected fault at step {self.step}")
        if self.point == "hang":
            os.kill(os.getpid(), signal.SIGSTOP)
        elif self.point == "stall":
            threading.Event().wait()  # never set: stuck in user code until SIGKILLed
        else:
            os.kill(os.getpid(), signal.SIGKILL)


@dataclass(frozen=True)
class FaultPlan:
    """The job's planned faults, each fired at most once (see the module docstring)."""

    entries: tuple[tuple[int, Fault], ...]

    @classmethod
    def parse(cls, spec: str) -> FaultPlan:
        entries = []
        for item in filter(None, spec.split(",")):
            rank, sep, fault = item.partition(":")
            if not sep or not rank.isdigit():
                raise ValueError(f"planned fault {item!r}: expected <rank>:<point>@<step>")
            entries.append((int(rank), Fault.parse(fault)))
        return cls(tuple(entries))

    def spec(self) -> str:
        return ",".join(f"{rank}:{f.point}@{f.step}" for rank, f in self.entries)

    def check(self, where: str, rank: int, step: int, claim: Callable[[int], bool]) -> None:
        """Fire the first entry due here that ``claim(index)`` wins (it is true once per
        entry in the whole job)."""
        for index, (planned_rank, fault) in enumerate(self.entries):
            if planned_rank == rank and fault.due(where, step) and claim(index):
                fault.fire()
                return
