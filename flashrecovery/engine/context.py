"""One decide call: the event being applied, where it sits in the log, and what it decides.

Every decision takes its id, timestamp and generation from the event that caused it, so feeding
the same events again yields byte-identical decisions: that is what replay checks and what lets a
restarted engine recognise what it had already written.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, TypeVar

from flashrecovery.engine.state import EngineState
from flashrecovery.errors import Rejected
from flashrecovery.records import Decision, Envelope, decision_id
from flashrecovery.statemachines.base import Stamp, StateMachine, Trigger

D = TypeVar("D", bound=Decision)


@dataclass
class Context:
    state: EngineState
    position: int
    record: Envelope
    decisions: list[Decision] = field(default_factory=list)

    @property
    def stamp(self) -> Stamp:
        return Stamp(self.position, self.record.ts, self.record.type)

    def fire(self, machine: StateMachine, trigger: Trigger) -> None:
        """A move the engine's own logic makes: if it is illegal, that is an engine fault."""
        machine.fire(trigger, self.stamp)

    def require(self, machine: StateMachine, trigger: Trigger, what: str) -> None:
        """A move the record asks for: if its machine can't make it, the record is rejected."""
        if not machine.can(trigger):
            raise Rejected(f"{what} is {machine.state}, which does not allow '{trigger}'")
        machine.fire(trigger, self.stamp)

    def emit(self, cls: type[D], generation: int | None = None, **fields: Any) -> D:
        decision = cls(
            record_id=decision_id(self.state.job_id, self.position, len(self.decisions)),
            job_id=self.state.job_id,
            generation=self.state.generation if generation is None else generation,
            source="engine",
            ts=self.record.ts,
            caused_by=self.position,
            **fields,
        )
        self.decisions.append(decision)
        return decision
