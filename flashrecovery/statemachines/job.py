"""One machine per job: running, the phases of a recovery, and how it ends."""

from __future__ import annotations

from enum import StrEnum
from typing import Any, ClassVar

from flashrecovery.statemachines.base import StateMachine, Trigger, arc


class JobState(StrEnum):
    STARTING = "starting"
    RUNNING = "running"
    ISOLATING = "isolating"
    REGROUPING = "regrouping"
    RESTORING = "restoring"
    RESUMING = "resuming"
    FALLBACK = "fallback"
    COMPLETED = "completed"
    FAILED = "failed"


S = JobState
RECOVERING: list[JobState] = [S.ISOLATING, S.REGROUPING, S.RESTORING, S.RESUMING]
ENDED = (S.COMPLETED, S.FAILED)


class JobMachine(StateMachine[JobState]):
    STATES: ClassVar[type[StrEnum]] = JobState
    INITIAL: ClassVar[StrEnum] = S.STARTING
    TRANSITIONS: ClassVar[list[dict[str, Any]]] = [
        arc(Trigger.RUN, S.STARTING, S.RUNNING),
        arc(Trigger.ISOLATE, [S.STARTING, S.RUNNING, *RECOVERING], S.ISOLATING),
        arc(Trigger.REGROUP, S.ISOLATING, S.REGROUPING),
        arc(Trigger.BEGIN_RESTORE, S.REGROUPING, S.RESTORING),
        arc(Trigger.END_RESTORE, S.RESTORING, S.RESUMING),
        arc(Trigger.RESUME, S.RESUMING, S.RUNNING),
        arc(Trigger.FALL_BACK, RECOVERING, S.FALLBACK),
        arc(Trigger.COMPLETE, [S.RUNNING, S.STARTING], S.COMPLETED),
        arc(Trigger.FAIL, [S.STARTING, S.RUNNING, *RECOVERING, S.FALLBACK], S.FAILED),
    ]
