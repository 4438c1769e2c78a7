"""One machine per failure, a workflow instance whose stamps give the RTO breakdown."""

from __future__ import annotations

from enum import StrEnum
from typing import Any, ClassVar

from flashrecovery.statemachines.base import StateMachine, Trigger, arc


class IncidentState(StrEnum):
    DETECTED = "detected"
    ISOLATED = "isolated"
    REPLACEMENT_READY = "replacement_ready"
    REGROUPED = "regrouped"
    RESTORED = "restored"
    RESUMED = "resumed"
    CLOSED = "closed"
    FALLBACK = "fallback"
    FAILED = "failed"  # the job failed instead of recovering (a crash loop)


S = IncidentState
PHASES: list[IncidentState] = [
    S.DETECTED,
    S.ISOLATED,
    S.REPLACEMENT_READY,
    S.REGROUPED,
    S.RESTORED,
    S.RESUMED,
]
OPEN = PHASES  # an incident in one of these has not ended


class IncidentMachine(StateMachine[IncidentState]):
    STATES: ClassVar[type[StrEnum]] = IncidentState
    INITIAL: ClassVar[StrEnum] = S.DETECTED
    TRANSITIONS: ClassVar[list[dict[str, Any]]] = [
        arc(Trigger.ISOLATE, S.DETECTED, S.ISOLATED),
        arc(Trigger.REPLACE, S.ISOLATED, S.REPLACEMENT_READY),
        arc(Trigger.REGROUP, S.REPLACEMENT_READY, S.REGROUPED),
        arc(Trigger.END_RESTORE, S.REGROUPED, S.RESTORED),
        arc(Trigger.RESUME, S.RESTORED, S.RESUMED),
        arc(Trigger.CLOSE, S.RESUMED, S.CLOSED),
        arc(Trigger.FALL_BACK, PHASES[:-1], S.FALLBACK),
        arc(Trigger.FAIL, PHASES, S.FAILED),
    ]
