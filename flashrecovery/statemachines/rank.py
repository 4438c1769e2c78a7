"""One machine per rank id: the life of whatever process currently holds that rank."""

from __future__ import annotations

from enum import StrEnum
from typing import Any, ClassVar

from flashrecovery.statemachines.base import StateMachine, Trigger, arc


class RankState(StrEnum):
    PENDING = "pending"
    JOINING = "joining"
    HEALTHY = "healthy"
    SUSPECT = "suspect"
    FAILED = "failed"
    ISOLATED = "isolated"
    REPLACED = "replaced"
    PAUSED = "paused"
    RESTORING = "restoring"
    FINISHED = "finished"


S = RankState
ALIVE: list[RankState] = [S.JOINING, S.HEALTHY, S.SUSPECT, S.PAUSED, S.RESTORING]


class RankMachine(StateMachine[RankState]):
    STATES: ClassVar[type[StrEnum]] = RankState
    INITIAL: ClassVar[StrEnum] = S.PENDING
    TRANSITIONS: ClassVar[list[dict[str, Any]]] = [
        arc(Trigger.JOIN, S.PENDING, S.JOINING),
        arc(Trigger.READY, S.JOINING, S.HEALTHY),
        arc(Trigger.SUSPECT, S.HEALTHY, S.SUSPECT),
        arc(Trigger.CLEAR, S.SUSPECT, S.HEALTHY),
        arc(Trigger.FAIL, [*ALIVE, S.PENDING], S.FAILED),
        arc(Trigger.ISOLATE, S.FAILED, S.ISOLATED),
        arc(Trigger.REPLACE, S.ISOLATED, S.REPLACED),
        arc(Trigger.REJOIN, S.REPLACED, S.JOINING),
        arc(Trigger.PAUSE, [S.HEALTHY, S.SUSPECT, S.JOINING, S.RESTORING], S.PAUSED),
        arc(Trigger.BEGIN_RESTORE, S.PAUSED, S.RESTORING),
        arc(Trigger.END_RESTORE, S.RESTORING, S.HEALTHY),
        arc(Trigger.FINISH, [S.HEALTHY, S.SUSPECT], S.FINISHED),
    ]
