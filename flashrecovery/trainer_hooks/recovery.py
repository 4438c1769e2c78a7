"""The rank's side of a recovery (docs/protocol.md): leave the broken generation, join the one
the engine plans, and carry out its resume plan — the donors of each shard send its state to
that shard's recipients, or every member loads the checkpoint the engine named. A failure on the
way sends the rank on to the generation that supersedes it. What to do is decided by the
engine; this only follows those decisions.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import TYPE_CHECKING

from flashrecovery.errors import ProtocolError, ReplacedError, RestoreMismatch
from flashrecovery.records import (
    CheckpointLoaded,
    CollectiveError,
    FallbackToCheckpoint,
    RankRegrouped,
    RestoreRejected,
    ResumePlanned,
    StateTransferred,
)
from flashrecovery.statemachines.base import Trigger
from flashrecovery.statemachines.session import SessionState
from flashrecovery.trainer_hooks import transfer
from flashrecovery.trainer_hooks.membership import RECOVERY_TIMEOUT_S, Membership
from flashrecovery.trainer_hooks.probe import Action, Point, Probe
from flashrecovery.trainer_hooks.training_state import TrainingState

if TYPE_CHECKING:
    from flashrecovery.trainer_hooks.checkpoint import Checkpointer


class Recovery:
    def __init__(
        self,
        member: Membership,
        state: TrainingState,
        probe: Probe,
        checkpoints: Checkpointer | None,
    ) -> None:
        self._member = member
        self._state = state
        self._probe = probe
        self._checkpoints = checkpoints

    def form_first(self) -> None:
        """Form generation 0, once the user's code shows whether it reduces with its own
        groups (``process_group()``) or the hook's (the training loop starts first); a member
        lost meanwhile sends this rank on to the generation that replaces it."""
        if self._member.machine.state is not SessionState.FORMING:
            return
        try:
            self._member.form(0)
        except RuntimeError as exc:
            self.failed(exc)
            self.recover()

    def failed(self, exc: RuntimeError) -> None:
        """A member failed under this rank's feet (gloo says so within milliseconds)."""
        self._member.append(
            CollectiveError,
            rank=self._member.rank,
            step=self._state.committed_step,
            error=str(exc)[:500],
        )

    def recover(self) -> None:
        """A survivor's path: leave the broken generation and join the one the engine plans."""
        member = self._member
        member.machine.fire(Trigger.REGROUP)
        member.drop_group()
        self.rejoin(member.follower.wait_regroup(member.generation, RECOVERY_TIMEOUT_S).generation)

    def rejoin(self, generation: int) -> None:
        """Build ``generation``'s group, report the committed step, and carry out the resume
        plan; when another failure supersedes the generation, move on to the newer one."""
        member, machine = self._member, self._member.machine
        while True:
            if member.follower.isolated(member.pid):
                raise ReplacedError(f"rank {member.rank} was declared failed and replaced")
            try:
                member.enter(generation)  # a store that cannot be reached: another plan comes
                self._probe(Point.REGROUP, member.rank, self._state.committed_step)
                # No barrier of all members: forming waits for nobody (groups.py), and the
                # engine plans the resume once every member regrouped.
                if not member.superseded():
                    self._probe(Point.GROUP_BUILD, member.rank, self._state.committed_step)
                    member.form(generation)
                    assert member.rank is not None
                    member.append(
                        RankRegrouped,
                        rank=member.rank,
                        committed_step=self._state.committed_step,
                        shard=member.shard_of(member.rank),
                        pid=member.pid,
                    )
                    plan = member.follower.wait_resume(generation, RECOVERY_TIMEOUT_S)
                    if isinstance(plan, ResumePlanned | FallbackToCheckpoint):
                        machine.fire(Trigger.BEGIN_RESTORE)
                        if isinstance(plan, ResumePlanned):
                            self._restore(plan)
                        else:
                            self._load_checkpoint(plan)
                        machine.fire(Trigger.END_RESTORE)
                        return
            except RestoreMismatch:
                pass  # recorded: the engine replaces this recipient (and its plan, the donors)
            except RuntimeError as exc:  # a member failed while this generation formed
                self.failed(exc)
            machine.fire(Trigger.REGROUP)
            member.drop_group()
            generation = member.follower.wait_regroup(generation, RECOVERY_TIMEOUT_S).generation

    def _restore(self, plan: ResumePlanned) -> None:
        """Each shard's donors send its state (DTensor local shards only) to that shard's
        recipients, each donor its stripe of the replicated part; donors of different shards
        send at the same time."""
        member, state = self._member, self._state
        assert member.rank is not None
        rank = member.rank
        shard = member.shard_of(rank)
        donors = plan.donors_of(shard)
        # Every donor and recipient of a shard connect first (groups.py): a recipient waiting
        # for a donor still busy with another recipient must not wait on an unconnected pair.
        recipients = [r for r in plan.recipients if member.shard_of(r) == shard]
        if rank in donors:
            stripe = transfer.Stripe(donors.index(rank), len(donors))
            own = state.own() if stripe.index == 0 else None
            group = member.hook_group(recipients)
            for recipient in recipients:
                transfer.send(
                    group,
                    recipient,
                    state.replicated(),
                    own,
                    stripe,
                    after_header=lambda: (
                        self._probe(Point.DONOR_SEND, rank, state.committed_step) is Action.GARBLE
                    ),
                )
        elif rank in plan.recipients:
            started = time.perf_counter()
            # Its own tensors are overwritten in place: until restored it holds no step.
            state.committed_step = -1
            group = member.hook_group(donors)
            try:
                received = transfer.recv(group, donors, state.replicated(), member.mesh)
            except RestoreMismatch as exc:
                member.append(
                    RestoreRejected,
                    rank=rank,
                    step=plan.resume_step,
                    donors=exc.donors,
                    tensors=exc.tensors,
                    error=str(exc),
                )
                raise
            state.load({**received.replicated, **received.own})
            member.append(
                StateTransferred,
                rank=rank,
                donor=donors[0],
                bytes=sum(received.bytes.values()),
                ms=round((time.perf_counter() - started) * 1000, 3),
                donor_bytes=received.bytes,
            )
        if state.committed_step != plan.resume_step:
            raise ProtocolError(
                f"rank {rank} holds step {state.committed_step} after the restore, "
                f"the plan resumes after {plan.resume_step}"
            )

    def _load_checkpoint(self, plan: FallbackToCheckpoint) -> None:
        """No replica was left of some shard: every member loads its own part of the
        checkpoint the engine named, and the job resumes after its step."""
        member, state, checkpoints = self._member, self._state, self._checkpoints
        if checkpoints is None or plan.path is None or plan.step is None:
            raise ProtocolError("a checkpoint fallback, but this job writes no checkpoints")
        self._probe(Point.CHECKPOINT_LOAD, member.rank, plan.step)
        assert state.optimizer is not None and member.rank is not None
        started = time.perf_counter()
        checkpoints.prepare_load(state.optimizer)
        state.load(checkpoints.load(Path(plan.path), member.rank, state.whole()))
        checkpoints.due_next = False
        if state.committed_step != plan.step:
            raise ProtocolError(
                f"rank {member.rank} loaded step {state.committed_step} from {plan.path}, the "
                f"fallback resumes after {plan.step}"
            )
        member.append(
            CheckpointLoaded,
            rank=member.rank,
            step=plan.step,
            ms=round((time.perf_counter() - started) * 1000, 3),
        )
