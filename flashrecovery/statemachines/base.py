"""What every machine shares: declared as data for `transitions`, stamped, strict.

The engine's machines stamp each transition with the log position, timestamp and type of the
record that caused it; the hook's session machine moves on what its own process does, with no
record behind it. An illegal trigger raises IllegalTransition (never ignored) so that whoever
drives the machine reports it.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any, ClassVar, Generic, TypeVar, cast

from transitions import Machine

from flashrecovery.errors import IllegalTransition


class Trigger(StrEnum):
    """Every move a machine can make. One vocabulary for all machines: a record that moves
    several machines (a failure isolates the rank, the job and the incident) names one move."""

    RUN = "run"
    JOIN = "join"
    READY = "ready"
    SUSPECT = "suspect"
    CLEAR = "clear"
    FAIL = "fail"
    ISOLATE = "isolate"
    REPLACE = "replace"
    REJOIN = "rejoin"
    PAUSE = "pause"
    REGROUP = "regroup"
    BEGIN_RESTORE = "begin_restore"
    END_RESTORE = "end_restore"
    RESUME = "resume"
    CLOSE = "close"
    FINISH = "finish"
    FALL_BACK = "fall_back"
    COMPLETE = "complete"
    # The hook's session machine (statemachines/session.py)
    STANDBY = "standby"
    ASSIGN = "assign"
    FORM = "form"
    BEGIN_STEP = "begin_step"
    VOTE = "vote"
    COMMIT = "commit"
    DISCARD = "discard"  # the vote found the step non-finite: no member applies it


def arc(trigger: Trigger, source: StrEnum | Sequence[StrEnum], dest: StrEnum) -> dict[str, Any]:
    """One transition as `transitions` takes it, from enum members (plain strings inside)."""
    sources = str(source) if isinstance(source, StrEnum) else [str(s) for s in source]
    return {"trigger": str(trigger), "source": sources, "dest": str(dest)}


@dataclass(frozen=True)
class Stamp:
    """Why a machine moved: which record, where in the log, when."""

    position: int
    ts: float
    cause: str


@dataclass(frozen=True)
class Step:
    trigger: Trigger
    source: StrEnum
    dest: StrEnum
    stamp: Stamp | None  # None: a machine of the hook, whose moves no record causes


S = TypeVar("S", bound=StrEnum)  # a machine's states
Moves = dict[tuple[str, str], StrEnum]  # (state, trigger) -> next state
_COMPILED: dict[str, Moves] = {}


def compiled(machine: type[StateMachine[Any]]) -> Moves:
    """The declaration of a machine class, built and checked by `transitions` once, as a table
    (state, trigger) -> next state (a member of STATES). Instances only look moves up: a world
    of 100,000 ranks must not build 100,000 `transitions` machines (about a millisecond each).
    A StrEnum member hashes and compares as its value, so the table is keyed by either."""
    key = f"{machine.__module__}.{machine.__qualname__}"
    if key in _COMPILED:
        return _COMPILED[key]
    built = Machine(
        model=None,
        states=[str(state) for state in machine.STATES],
        transitions=machine.TRANSITIONS,
        initial=str(machine.INITIAL),
        auto_transitions=False,
        ignore_invalid_triggers=False,
    )
    _COMPILED[key] = {
        (source, trigger): machine.STATES(str(transition.dest))
        for trigger, event in built.events.items()
        for source, transitions in event.transitions.items()
        for transition in transitions
    }
    return _COMPILED[key]


@dataclass
class StateMachine(Generic[S]):
    """Base of every machine: the engine's rank, job and incident machines and the hook's
    session machine. Subclasses declare STATES, TRANSITIONS (dicts as `transitions` takes them)
    and INITIAL; the declaration is the diagram. The state is always a member of STATES.
    ``census``, when given, counts the machines of a population by state (kept as they move).
    HISTORY bounds the moves kept (None: all, as the engine's machines need for their stamps)."""

    name: str
    history: list[Step] = field(default_factory=list)
    census: Counter[S] | None = field(default=None, repr=False, compare=False)
    state: S = field(init=False)

    STATES: ClassVar[type[StrEnum]]
    TRANSITIONS: ClassVar[list[dict[str, Any]]]
    INITIAL: ClassVar[StrEnum]
    HISTORY: ClassVar[int | None] = None

    def __post_init__(self) -> None:
        self._moves = compiled(type(self))
        self.state = cast(S, self.INITIAL)
        if self.census is not None:
            self.census[self.state] += 1

    def fire(self, trigger: Trigger, stamp: Stamp | None = None, *, counted: bool = True) -> None:
        """Apply a trigger; raise IllegalTransition when the current state does not allow it.
        ``counted=False``: the census already counts this move (made for a whole population
        at once, see EngineState.sweep_pause)."""
        source = self.state
        dest = self._moves.get((source, trigger))
        if dest is None:
            where = "" if stamp is None else f" (record {stamp.cause} at position {stamp.position})"
            raise IllegalTransition(
                f"{self.name}: '{trigger}' is not allowed in state '{source}'{where}",
                machine=self.name,
                trigger=trigger,
                state=source,
                stamp=stamp,
            )
        self.state = cast(S, dest)
        if self.census is not None and counted:
            self.census[source] -= 1
            self.census[self.state] += 1
        if self.HISTORY is not None and len(self.history) >= self.HISTORY:
            del self.history[0]
        self.history.append(Step(trigger, source, dest, stamp))

    def can(self, trigger: Trigger) -> bool:
        return (self.state, trigger) in self._moves

    def entered(self, state: S) -> Stamp | None:
        """When the machine last entered ``state`` (None if never)."""
        for step in reversed(self.history):
            if step.dest == state:
                return step.stamp
        return None
