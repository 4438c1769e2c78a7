"""One machine per job: running, the phases of a recovery, and how it ends."""

from __future__ import annotations

from typing import Any, ClassVar

from flashrecovery.statemachines.base import StateMachine

RECOVERING = ["isolating", "regrouping", "restoring", "resuming"]


class JobMachine(StateMachine):
    STATES: ClassVar[list[str]] = [
        "starting",
        "running",
        *RECOVERING,
        "fallback",
        "completed",
        "failed",
    ]
    INITIAL: ClassVar[str] = "starting"
    TRANSITIONS: ClassVar[list[dict[str, Any]]] = [
        {"trigger": "run", "source": "starting", "dest": "running"},
        {"trigger": "isolate", "source": ["starting", "running", *RECOVERING], "dest": "isolating"},
        {"trigger": "regroup", "source": "isolating", "dest": "regrouping"},
        {"trigger": "restore", "source": "regrouping", "dest": "restoring"},
        {"trigger": "resume", "source": "restoring", "dest": "resuming"},
        {"trigger": "recovered", "source": "resuming", "dest": "running"},
        {"trigger": "fall_back", "source": RECOVERING, "dest": "fallback"},
        {"trigger": "complete", "source": ["running", "starting"], "dest": "completed"},
        {
            "trigger": "fail",
            "source": ["starting", "running", *RECOVERING, "fallback"],
            "dest": "failed",
        },
    ]
