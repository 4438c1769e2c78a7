"""Fault injection, for tests and `flashrecovery chaos` only: the one probe the hook calls at
each point of its protocol, so a process fails for real where a test wants it to and the true
failure paths run. Not part of the public API.

The plan comes in through the launch environment: ``FLASHRECOVERY_FAULT_PLAN=<rank>:<kind>@<step>
[,…]`` in the environment of `flashrecovery run`, which hands it to every process of the job,
spares included. Each planned fault fires once in the job, in whichever process holds the rank
when it reaches the fault's point at the step (the first to claim it on the job's store), so a
replacement can be hit too (plan the same fault twice), and one rank can fail at several steps.
Without a plan the probe does nothing.

Kinds, with the point and step they act at: ``before_reduce`` and ``after_reduce`` SIGKILL the
process there, at the step being committed (after the gradients are reduced but before the vote
completes is the delicate case); ``committed`` SIGKILLs it once the step's vote committed,
before it hands the step's record over (the step is the job's: its replacement is restored to
it, and no process records it for that rank); ``finish`` SIGKILLs it in ``finish()`` once
``step`` is committed (the last step: lost after the job's work is done); ``exit`` SIGKILLs it
at the very end of ``finish()``, its ``RankFinished`` handed over (a crash in the interpreter's
teardown after training); ``raise`` raises instead of dying; ``hang`` SIGSTOPs the process so
only the detectors can find it; ``stall`` blocks the training thread forever before the step's
commit while the process (and its heartbeats) live on, so only the stall detector can find it;
``nan`` makes one of the rank's gradients NaN before the commit looks at them
(trainer_hooks/nonfinite.py), a fault of the values that the process lives through (plan it
twice at one step for a step that is non-finite when recomputed too); ``bitflip`` flips one bit
of one of its parameters (a silent corruption of its state, found when the replicas compare
their states: digest.py); ``slow`` makes the rank's next SLOW_STEPS steps take 3x their compute
time (a straggler, found from its compute times against its peers': engine/stragglers.py).
During a recovery, at the member's committed step: ``regroup`` SIGKILLs a member as it starts to
join a new generation, ``group_build`` as it starts to build the generation's group (its ring
neighbours wait for it while theirs form), and ``donor_send`` kills a donor in the middle of
sending its state (after the first message), ``garble`` makes a donor flip one bit of what it
sends on the way (its own state untouched: the recipient's check finds it, transfer.py).
``checkpoint_load`` SIGKILLs a member as it starts loading the checkpoint a fallback names, at
that checkpoint's step.
"""

from __future__ import annotations

import os
import signal
import threading
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from enum import StrEnum

ENV = "FLASHRECOVERY_FAULT_PLAN"
SLOW_STEPS = 12  # how long the ``slow`` fault lasts, in the rank's steps
SLOW_FACTOR = 2.0  # what a slowed step adds, in its own compute times


class Point(StrEnum):
    """A place of the hook's protocol where the probe is called."""

    BEFORE_REDUCE = "before_reduce"
    AFTER_REDUCE = "after_reduce"
    COMMITTED = "committed"
    FINISH = "finish"
    EXIT = "exit"
    REGROUP = "regroup"
    GROUP_BUILD = "group_build"
    DONOR_SEND = "donor_send"
    CHECKPOINT_LOAD = "checkpoint_load"


class Action(StrEnum):
    """What a planned fault does where it acts: a SIGKILL (the fault is named by its point), or
    at the step's start, before the gradients are reduced, one of the others."""

    KILL = "kill"
    RAISE = "raise"
    HANG = "hang"
    STALL = "stall"
    NAN = "nan"  # done by the caller: the probe has no hold on the values
    BITFLIP = "bitflip"  # likewise
    GARBLE = "garble"  # likewise, by a donor as it sends its state
    SLOW = "slow"  # likewise: the rank computes slower for a while (session.py)


class InjectedFault(RuntimeError):
    """The ``raise`` fault: an ordinary exception escaping the training loop."""


@dataclass(frozen=True)
class PlannedFault:
    rank: int
    point: Point
    action: Action
    step: int

    @property
    def kind(self) -> str:
        """Its name in a plan: the point for a kill, else the action."""
        return self.point.value if self.action is Action.KILL else self.action.value

    @classmethod
    def parse(cls, spec: str) -> PlannedFault:
        rank, sep, rest = spec.partition(":")
        kind, at, step = rest.partition("@")
        if not sep or not at or not rank.isdigit() or not step.isdigit() or kind not in _KINDS:
            raise ValueError(
                f"planned fault {spec!r}: expected <rank>:<kind>@<step>, kind one of "
                + ", ".join(_KINDS)
            )
        point, action = _KINDS[kind]
        return cls(int(rank), point, action, int(step))

    def spec(self) -> str:
        return f"{self.rank}:{self.kind}@{self.step}"

    def fire(self) -> None:
        if self.action is Action.RAISE:
            raise InjectedFault(f"injected fault at step {self.step}")
        if self.action is Action.HANG:
            os.kill(os.getpid(), signal.SIGSTOP)
        elif self.action is Action.STALL:
            threading.Event().wait()  # never set: stuck in user code until SIGKILLed
        elif self.action is Action.KILL:
            os.kill(os.getpid(), signal.SIGKILL)


# A kind names where a kill acts, or an action taken at the step's start.
_KINDS: dict[str, tuple[Point, Action]] = {
    **{point.value: (point, Action.KILL) for point in Point},
    **{a.value: (Point.BEFORE_REDUCE, a) for a in Action if a is not Action.KILL},
    Action.GARBLE.value: (Point.DONOR_SEND, Action.GARBLE),
}


@dataclass(frozen=True)
class FaultPlan:
    """The job's planned faults, each fired at most once (see the module docstring)."""

    faults: tuple[PlannedFault, ...] = ()

    @classmethod
    def parse(cls, spec: str) -> FaultPlan:
        return cls(tuple(PlannedFault.parse(item) for item in filter(None, spec.split(","))))

    @classmethod
    def from_environ(cls, environ: Mapping[str, str]) -> FaultPlan:
        return cls.parse(environ.get(ENV, ""))

    def spec(self) -> str:
        return ",".join(fault.spec() for fault in self.faults)


class Probe:
    """What the hook calls at each point: fires the first planned fault due there that
    ``claim(index)`` wins (true once per fault in the whole job)."""

    def __init__(self, plan: FaultPlan, claim: Callable[[int], bool]) -> None:
        self._faults = plan.faults
        self._claim = claim

    def __call__(self, point: Point, rank: int | None, step: int) -> Action | None:
        """The action of the fault fired here, if one was (what it left to the caller)."""
        if not self._faults or rank is None:
            return None  # no plan: production does nothing more than this
        for index, fault in enumerate(self._faults):
            due = (fault.rank, fault.point, fault.step) == (rank, point, step)
            if due and self._claim(index):
                fault.fire()
                return fault.action
        return None
