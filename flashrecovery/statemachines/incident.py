"""One machine per failure, a workflow instance whose stamps give the RTO breakdown."""

from __future__ import annotations

from typing import Any, ClassVar

from flashrecovery.statemachines.base import StateMachine

PHASES = ["detected", "isolated", "replacement_ready", "regrouped", "restored", "resumed"]


class IncidentMachine(StateMachine):
    STATES: ClassVar[list[str]] = [*PHASES, "closed", "fallback"]
    INITIAL: ClassVar[str] = "detected"
    TRANSITIONS: ClassVar[list[dict[str, Any]]] = [
        {"trigger": "isolate", "source": "detected", "dest": "isolated"},
        {"trigger": "replacement_ready", "source": "isolated", "dest": "replacement_ready"},
        {"trigger": "regrouped", "source": "replacement_ready", "dest": "regrouped"},
        {"trigger": "restored", "source": "regrouped", "dest": "restored"},
        {"trigger": "resumed", "source": "restored", "dest": "resumed"},
        {"trigger": "close", "source": "resumed", "dest": "closed"},
        {"trigger": "fall_back", "source": PHASES[:-1], "dest": "fallback"},
    ]
