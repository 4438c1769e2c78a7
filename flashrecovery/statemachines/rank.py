"""One machine per rank id: the life of whatever process currently holds that rank."""

from __future__ import annotations

from typing import Any, ClassVar

from flashrecovery.statemachines.base import StateMachine

ALIVE = ["joining", "healthy", "suspect", "paused", "restoring"]


class RankMachine(StateMachine):
    STATES: ClassVar[list[str]] = [
        "pending",
        "joining",
        "healthy",
        "suspect",
        "failed",
        "isolated",
        "replaced",
        "paused",
        "restoring",
        "finished",
    ]
    INITIAL: ClassVar[str] = "pending"
    TRANSITIONS: ClassVar[list[dict[str, Any]]] = [
        {"trigger": "join", "source": "pending", "dest": "joining"},
        {"trigger": "ready", "source": "joining", "dest": "healthy"},
        {"trigger": "suspect", "source": "healthy", "dest": "suspect"},
        {"trigger": "clear", "source": "suspect", "dest": "healthy"},
        {"trigger": "fail", "source": [*ALIVE, "pending"], "dest": "failed"},
        {"trigger": "isolate", "source": "failed", "dest": "isolated"},
        {"trigger": "replace", "source": "isolated", "dest": "replaced"},
        {"trigger": "rejoin", "source": "replaced", "dest": "joining"},
        {
            "trigger": "pause",
            "source": ["healthy", "suspect", "joining", "restoring"],
            "dest": "paused",
        },
        {"trigger": "restore", "source": "paused", "dest": "restoring"},
        {"trigger": "restored", "source": "restoring", "dest": "healthy"},
        {"trigger": "finish", "source": ["healthy", "suspect"], "dest": "finished"},
    ]
