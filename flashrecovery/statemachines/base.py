"""What every machine shares: declared as data for `transitions`, stamped, strict.

Each transition is stamped with the log position, timestamp and type of the record that caused
it; an illegal trigger raises IllegalTransition (never ignored) so the engine can report it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, ClassVar

from transitions import Machine, MachineError

from flashrecovery import errors


@dataclass(frozen=True)
class Stamp:
    """Why a machine moved: which record, where in the log, when."""

    position: int
    ts: float
    cause: str


@dataclass(frozen=True)
class Step:
    trigger: str
    source: str
    dest: str
    stamp: Stamp


class IllegalTransition(errors.IllegalTransition):
    def __init__(self, machine: str, trigger: str, state: str, stamp: Stamp) -> None:
        super().__init__(
            f"{machine}: '{trigger}' is not allowed in state '{state}' "
            f"(record {stamp.cause} at position {stamp.position})"
        )
        self.machine, self.trigger, self.state, self.stamp = machine, trigger, state, stamp


@dataclass
class StateMachine:
    """Base of the rank, job and incident machines. Subclasses declare STATES, TRANSITIONS
    (dicts as `transitions` takes them) and INITIAL; the declaration is the diagram."""

    name: str
    history: list[Step] = field(default_factory=list)
    state: str = field(init=False)

    STATES: ClassVar[list[str]]
    TRANSITIONS: ClassVar[list[dict[str, Any]]]
    INITIAL: ClassVar[str]

    def __post_init__(self) -> None:
        self._machine = Machine(
            model=self,
            states=self.STATES,
            transitions=self.TRANSITIONS,
            initial=self.INITIAL,
            auto_transitions=False,
            ignore_invalid_triggers=False,
            model_override=False,
        )

    def fire(self, trigger: str, stamp: Stamp) -> None:
        """Apply a trigger; raise IllegalTransition when the current state does not allow it."""
        source = self.state
        try:
            ok = self.trigger(trigger)  # type: ignore[attr-defined]
        except (MachineError, AttributeError):
            ok = False
        if not ok:
            raise IllegalTransition(self.name, trigger, source, stamp)
        self.history.append(Step(trigger, source, self.state, stamp))

    def can(self, trigger: str) -> bool:
        return trigger in self._machine.get_triggers(self.state)

    def entered(self, state: str) -> Stamp | None:
        """When the machine last entered ``state`` (None if never)."""
        for step in reversed(self.history):
            if step.dest == state:
                return step.stamp
        return None
