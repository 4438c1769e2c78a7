"""One machine per training process: the life of the session its script holds, from a hot
spare (or a launched rank) through the steps and the recoveries to the end of the job."""

from __future__ import annotations

from enum import StrEnum
from typing import Any, ClassVar

from flashrecovery.statemachines.base import StateMachine, Trigger, arc


class SessionState(StrEnum):
    LAUNCHED = "launched"  # started; not yet known as a spare or a member
    SPARE = "spare"  # a hot spare paying its first-time costs
    READY = "ready"  # a spare that said it is ready: it beats and waits for a rank
    ASSIGNED = "assigned"  # holds a rank, in no formed generation: it joins the current one
    FORMING = "forming"  # a member of generation 0, formed once its script shows its groups
    TRAINING = "training"  # a member of a formed generation, between steps
    STEPPING = "stepping"  # computing a step
    COMMITTING = "committing"  # reducing and voting on the step (held up by peers, if anyone)
    REGROUPING = "regrouping"  # left a broken generation, on its way to the newest one
    REGROUPED = "regrouped"  # its new generation formed; waiting for the resume plan
    RESTORING = "restoring"  # carrying out the resume plan: state moves, or a checkpoint loads
    FINISHING = "finishing"  # done training: waiting until every member is done
    FINISHED = "finished"


S = SessionState
# In no group of its generation yet: its heartbeats name the newest generation planned, so a
# newer plan does not fence it as silent while it is on its way there.
UNFORMED = (S.LAUNCHED, S.ASSIGNED, S.FORMING, S.REGROUPING)
LEFT = [S.ASSIGNED, S.FORMING, S.COMMITTING, S.FINISHING, S.REGROUPING, S.REGROUPED, S.RESTORING]


class SessionMachine(StateMachine[SessionState]):
    STATES: ClassVar[type[StrEnum]] = SessionState
    INITIAL: ClassVar[StrEnum] = S.LAUNCHED
    HISTORY: ClassVar[int | None] = 64  # a long job makes three moves a step: keep the latest
    TRANSITIONS: ClassVar[list[dict[str, Any]]] = [
        arc(Trigger.STANDBY, S.LAUNCHED, S.SPARE),
        arc(Trigger.READY, S.SPARE, S.READY),
        arc(Trigger.ASSIGN, [S.LAUNCHED, S.READY], S.ASSIGNED),
        arc(Trigger.JOIN, S.LAUNCHED, S.FORMING),
        arc(Trigger.FORM, S.FORMING, S.TRAINING),
        arc(Trigger.BEGIN_STEP, S.TRAINING, S.STEPPING),
        arc(Trigger.VOTE, S.STEPPING, S.COMMITTING),
        arc(Trigger.COMMIT, S.COMMITTING, S.TRAINING),
        arc(Trigger.DISCARD, S.COMMITTING, S.TRAINING),
        arc(Trigger.REGROUP, LEFT, S.REGROUPING),
        arc(Trigger.FORM, S.REGROUPING, S.REGROUPED),
        arc(Trigger.BEGIN_RESTORE, S.REGROUPED, S.RESTORING),
        arc(Trigger.END_RESTORE, S.RESTORING, S.TRAINING),
        arc(Trigger.FINISH, [S.ASSIGNED, S.FORMING, S.TRAINING, S.STEPPING], S.FINISHING),
        arc(Trigger.COMPLETE, S.FINISHING, S.FINISHED),
    ]
