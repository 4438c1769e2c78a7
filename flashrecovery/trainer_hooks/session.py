"""A training process's session: the hook the training loop calls (docs/hook.md).

It carries out the rank's side of docs/protocol.md: it joins its generation, commits each step
for all members or none, and on a failure recovers in the same process (recovery.py). Where the
process is in its life is its machine (statemachines/session.py); its membership in the job's
generations (records, groups, the vote) is membership.py; what it holds of the training is
training_state.py. What to do on a failure is decided by the engine; the session only follows.
"""

from __future__ import annotations

import importlib
import math
import sys
import time
import traceback
from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import TYPE_CHECKING, Any, TypeVar

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from flashrecovery import heap
from flashrecovery.errors import (
    ConfigError,
    LostAfterTraining,
    NonFiniteStepError,
    ScriptError,
    Superseded,
)
from flashrecovery.records import (
    CheckpointSaved,
    CollectiveError,
    HealthReport,
    NonFinitePolicy,
    RankFinished,
    RankJoined,
    StateDigest,
    StepCompleted,
    StepNonFinite,
    StepRetried,
)
from flashrecovery.statemachines.base import Trigger
from flashrecovery.statemachines.session import SessionMachine, SessionState
from flashrecovery.trainer_hooks import (
    ddp,
    digest,
    final_state,
    inflight,
    nonfinite,
    pipeline,
    stable_group,
    vote,
)
from flashrecovery.trainer_hooks.env import LaunchEnv, Role
from flashrecovery.trainer_hooks.gradients import ReducedGradients
from flashrecovery.trainer_hooks.heartbeat import HeartbeatThread
from flashrecovery.trainer_hooks.loader import BatchSource, adopt, adopted
from flashrecovery.trainer_hooks.membership import RECOVERY_TIMEOUT_S, Membership
from flashrecovery.trainer_hooks.probe import SLOW_FACTOR, SLOW_STEPS, Action, Point, Probe
from flashrecovery.trainer_hooks.recovery import Recovery
from flashrecovery.trainer_hooks.training_state import Stateful, TrainingState

if TYPE_CHECKING:
    from torch.distributed.pipelining.schedules import _PipelineSchedule

    from flashrecovery.trainer_hooks.checkpoint import Checkpointer

ABORT_GRACE_BEATS = 3  # heartbeat intervals an aborted vote waits for a plan before its retry
T = TypeVar("T")
R = TypeVar("R")
S = SessionState

__all__ = ["Session", "Stateful", "init", "init_process_group"]


class Session:
    """One process's membership in a flashrecovery job (create it with ``init()``)."""

    def __init__(self, env: LaunchEnv) -> None:
        self._env = env
        self._machine = SessionMachine(f"session:{env.rank if env.rank is not None else 'spare'}")
        self._member = member = Membership(env, self._machine)
        self._state = TrainingState()
        self._step_record = 0  # the number of this rank's last StepCompleted handed over
        self._step_started = 0.0
        self._computing_since = 0.0  # after the step's checkpoint save, if any (waits.py)
        self._compute_s = 0.0  # the step's time not spent waiting on peers, up to its vote
        self._slowed_until = -1  # the ``slow`` fault (probe.py): steps before this are slowed
        # (generation, step, votes on it that ended with no step and no regroup): the step's
        # next vote is a new one, under its own key
        self._revotes = (-1, -1, 0)
        self._batches_ended: int | None = None  # the epoch whose batches() loop ended
        self._checkpoints = None if env.checkpoint_dir is None else self._checkpointer()
        # Test-only faults (trainer_hooks/probe.py): without a plan it does nothing.
        self._probe = Probe(env.fault_plan, member.claim_fault)
        self._recovery = Recovery(member, self._state, self._probe, self._checkpoints)
        self._heartbeat = HeartbeatThread(
            env.agent_socket,
            env.heartbeat_interval_s,
            lambda: member.heartbeat(self._state.committed_step),
        )
        member.follower.start()
        self._heartbeat.start()
        try:
            if env.role is Role.SPARE:
                self._machine.fire(Trigger.STANDBY)
            elif not env.replacement and member.barrier(0, "members"):
                self._machine.fire(Trigger.JOIN)
                member.append(
                    RankJoined,
                    rank=self.rank,
                    pid=member.pid,
                    host=member.host,
                    shard=member.shard_of(self.rank),
                )
            else:  # a replacement, or generation 0 was superseded before it formed
                self._machine.fire(Trigger.ASSIGN)
        except BaseException:
            self._close()  # no thread or connection outlives a session that never started
            raise

    # ------------------------------------------------------------------ properties

    @property
    def rank(self) -> int:
        if self._member.rank is None:
            raise ScriptError(
                "a hot spare has no rank until session.steps() (or session.epochs()) yields: "
                "read session.rank inside the training loop"
            )
        return self._member.rank

    @property
    def world_size(self) -> int:
        return self._env.world_size

    @property
    def shards(self) -> int:
        """The job's model shards (`flashrecovery run --shards`): a mesh's last dimension."""
        return self._env.shards

    @property
    def generation(self) -> int:
        return self._member.generation

    @property
    def is_spare(self) -> bool:
        """Whether this process was started as a hot spare (it keeps that role once assigned)."""
        return self._env.role is Role.SPARE

    @property
    def committed_step(self) -> int:
        return self._state.committed_step

    # ------------------------------------------------------------------ the training loop

    def register(
        self,
        model: torch.nn.Module,
        optimizer: torch.optim.Optimizer,
        extras: Mapping[str, Stateful] | None = None,
        warmup: Callable[[], object] | None = None,
        loader: Iterable[Any] | None = None,
        schedule: _PipelineSchedule | None = None,
    ) -> None:
        """Hand over what defines the training state (build it identically on every rank:
        seed first). A spare not yet assigned pays its first-time costs here, then reports
        ready. A model wrapped in DDP is given its final bucket order now (ddp.py), a pipeline
        ``schedule`` (its stage's module is ``model``) its one-time setup (pipeline.py).
        ``loader``: the training loader, whose own ``for batch in loader`` then yields the
        session's steps (as ``batches(loader)`` would) inside ``epochs()``; a
        ``StatefulDataLoader`` resumes from its own state (loader.py)."""
        if _sharded_elsewhere(model, self._member.mesh):
            raise ScriptError(
                "the model is sharded (FSDP2: its parameters are DTensors) over a mesh the "
                "session did not make, so a replacement could not receive its shards: pass "
                "mesh=session.device_mesh(...) to fully_shard (pure FSDP: `flashrecovery run "
                "--shards N` and session.device_mesh((N,), ('shard',))); docs/hook.md"
            )
        if loader is not None:
            if any(obj is loader for obj in (extras or {}).values()):
                raise ScriptError(
                    "the loader is both in extras and loader=: give it as loader= only (its "
                    "state travels with the data position, taken between batches)"
                )
            adopt(loader, self._epoch_batches)
        self._state.register(model, optimizer, extras)
        ddp.settle_buckets(model)
        if schedule is not None:
            pipeline.settle_schedule(schedule)
        spare = self._member.rank is None
        if spare and warmup is not None:
            warmup()
            model.zero_grad(set_to_none=True)
        heap.settle()  # the long-lived objects exist now: a spare settles before it is needed
        if spare:
            self._member.report_ready()

    def process_group(self) -> dist.ProcessGroup:
        """The world process group for the user's DDP or FSDP2 (torch's default group, so
        ``dist.get_rank()`` and friends work): it stays valid across generations. A hot spare
        waits here until it is given a rank."""
        member = self._member
        if not dist.is_initialized():
            if member.rank is None:
                # What DDP's constructor imports on first use (torch._dynamo, 1-2 s here): a
                # spare pays it before it waits, not after it is needed.
                importlib.import_module("torch._dynamo")
                heap.settle()
                member.report_ready()
                member.await_assignment()
            stable_group.init_process_group(member.stable, member.store, self.rank, self.world_size)
            self._recovery.form_first()
        elif not member.stable.in_use:
            raise ConfigError(
                "torch.distributed is already initialized: let session.process_group() (or "
                "flashrecovery's init_process_group()) create the default group"
            )
        world = dist.group.WORLD
        assert world is not None
        return world

    def device_mesh(self, shape: tuple[int, ...], names: tuple[str, ...]) -> DeviceMesh:
        """A DeviceMesh over the stable groups (for FSDP2 / HSDP, tensor parallel beside them),
        e.g. ``((2, 2), ("replicate", "shard"))`` or ``((2, 1, 2), ("dp_replicate",
        "dp_shard", "tp"))``: valid across generations like ``process_group()``. The first
        dimension holds the replicas (a mesh of one dimension: none); a rank's place within
        its replica, r % --shards, is its coordinate on the others (the mesh is row-major)."""
        within = math.prod(shape[1:]) if len(shape) > 1 else shape[0]
        if within != self._env.shards:
            dims = " x ".join(str(size) for size in (shape[1:] if len(shape) > 1 else shape))
            raise ConfigError(
                f"each replica of the mesh {tuple(shape)} holds {dims} = {within} ranks of "
                f"distinct state, the job was started with --shards {self._env.shards}"
            )
        self.process_group()
        self._member.mesh = init_device_mesh(
            self._member.stable.device, shape, mesh_dim_names=names
        )
        return self._member.mesh

    def use_device_mesh(self, mesh: DeviceMesh) -> None:
        """A mesh a framework built itself over ``process_group()`` (torchtitan's world mesh,
        which it unflattens into its own), in place of ``device_mesh()``: the model's DTensors
        may lie on meshes made from it. Its ranks are the session's, in their order, so a
        replica is still --shards ranks in a row."""
        if mesh.size() != self.world_size or mesh.ndim != 1:
            raise ConfigError(
                f"a mesh of shape {tuple(mesh.shape)} is not the job's world of "
                f"{self.world_size} ranks in a row"
            )
        self._member.mesh = mesh

    def steps(self, total: int) -> Iterator[int]:
        """Yield the steps to compute, 0..total-1; after a recovery, the step after the one
        every member has committed. A spare blocks here until it is assigned a rank."""
        self._join()
        while self._state.committed_step + 1 < total:
            yield self._begin_step()
            self._end_step()
        self._member.stable.training_over()

    def epochs(self, total: int) -> Iterator[int]:
        """Yield the epochs to run, ``0..total-1``, from the one the job is in: a replacement
        receives its state here and resumes its donor's epoch. Use with ``batches()`` or a
        registered loader."""
        self._join()
        position = self._state.position
        while position.epoch < total:
            epoch = position.epoch
            self._batches_ended = None  # batches() may run this epoch (again, after a fallback)
            yield epoch
            if position.epoch == epoch:  # else a fallback took the job back to another
                position.next_epoch()
        self._member.stable.training_over()

    def batches(self, loader: Iterable[T]) -> Iterator[T]:
        """Yield the loader's batches of this epoch as steps, from the data position on: each
        batch until its step is committed, so a step aborted by a failure is recomputed with
        the same batch. A replacement continues after the batches its donor had committed;
        after a checkpoint fallback the loader is iterated again from the checkpoint's batch
        (or, from an earlier epoch, this ends and ``epochs()`` yields that epoch again)."""
        if adopted(loader):
            raise ScriptError(
                "this loader was given to session.register(loader=...): loop over it as it "
                "is (`for batch in loader`), not over session.batches(loader); docs/hook.md"
            )
        return self._epoch_batches(BatchSource(loader))

    def _epoch_batches(self, source: BatchSource) -> Iterator[Any]:
        self._join()
        position = self._state.position
        epoch = position.epoch
        if self._batches_ended == epoch:
            raise ScriptError(
                f"the batches of epoch {epoch} again, which are all committed: "
                "loop over `session.epochs(total)` (not range()) around them, so the epoch "
                "moves on; docs/hook.md"
            )
        while True:
            start = position.batch
            for index, batch in enumerate(source.start(position), start):
                while (position.epoch, position.batch) == (epoch, index):
                    self._begin_step()
                    yield batch
                    self._end_step()
                if (position.epoch, position.batch) != (epoch, index + 1):
                    break  # a fallback moved the data position back
                source.committed(position)
            else:
                self._batches_ended = epoch
                return  # the epoch's last batch is committed
            if position.epoch != epoch:
                return

    def join(self) -> None:
        """Take part in the job's current generation, for a loop that is not the session's
        (an integration's: ``steps()``, ``epochs()`` and ``batches()`` do this themselves): a
        spare waits for its rank here, a replacement receives its state."""
        self._join()

    def run_step(self, compute: Callable[[], R], loss: Callable[[R], float | None]) -> R:
        """One step of a loop that is not the session's: ``compute()`` it (forward and
        backward) and commit; on an abort (recovered by then), compute it again, with the same
        inputs and randomness, until it is committed (or skipped: non-finite twice under
        ``--nonfinite-policy skip``, its gradients dropped). The caller steps its optimizer
        after."""
        while True:
            step = self._begin_step()
            result = compute()
            if self.commit(loss=loss(result)) or self._state.committed_step == step:
                return result

    def _join(self) -> None:
        """Take part in the job's current generation: a spare waits for its rank, a
        replacement receives its state (at most once)."""
        if not self._state.registered:
            raise ScriptError("call session.register(model, optimizer) before training")
        if self._machine.state is S.READY:
            self._member.await_assignment()
        self._recovery.form_first()
        if self._machine.state is S.ASSIGNED:  # a replacement, or generation 0 never formed
            self._machine.fire(Trigger.REGROUP)
            self._recovery.rejoin(self._member.generation)

    def _begin_step(self) -> int:
        """Start a step (its random state kept, so an aborted attempt is recomputed alike);
        the step committed last is checkpointed now if it is due."""
        self._machine.fire(Trigger.BEGIN_STEP)
        self._step_started = time.perf_counter()
        self._state.begin_step()
        if self._checkpoints is not None and self._checkpoints.due_next:
            self._save_checkpoint(self._checkpoints)
        self._member.stable.clock.take()
        self._computing_since = time.perf_counter()
        return self._state.committed_step + 1

    def _end_step(self) -> None:
        if self._machine.state is S.STEPPING:
            step = self._state.committed_step + 1
            raise ScriptError(f"step {step}: call session.commit() once per step")

    def _checkpointer(self) -> Checkpointer:
        # Imported only by a job that writes checkpoints: DCP costs a rank process most of a
        # second of CPU at start (a fresh replacement pays it before it can train).
        from flashrecovery.trainer_hooks.checkpoint import Checkpointer

        env = self._env
        assert env.checkpoint_dir is not None
        return Checkpointer(
            env.checkpoint_dir,
            env.checkpoint_every,
            self._member.generation_store,
            lambda step, path: self._member.append(CheckpointSaved, step=step, path=path),
            lambda generation: self._member.follower.replaced_after(generation),
        )

    def _save_checkpoint(self, checkpoints: Checkpointer) -> None:
        """Save the committed step as a replacement would receive it: the caller's optimizer
        has stepped, and the random state and data position are the next step's, taken once
        it fetched its batch (as in a restore)."""
        checkpoints.due_next = False
        checkpoints.save(
            self._state.committed_step,
            self._member.generation,
            self.rank,
            self.world_size,
            self._state.whole(),
        )

    def commit(self, loss: float | None = None) -> bool:
        """Average the gradients over the members and step the optimizer if every member
        commits this step; with the user's own parallelism (``process_group()``: DDP or FSDP
        reduced the gradients) only vote, and the caller steps its optimizer when this returns
        True. On a peer failure, recover (regroup, restore) and return False: ``steps()`` then
        yields the step to recompute. A step NaN or infinite on any member (``loss``, or the
        gradients) is stepped by none and computed again; non-finite again, the job's
        ``--nonfinite-policy`` fails it or skips the batch (False, and the steps move on)."""
        if self._machine.state is not S.STEPPING:
            raise ScriptError(
                "session.commit() outside a step: commit inside `for step in "
                "session.steps(total)`, or inside `for batch in session.batches(loader)` "
                "(or the loop of a loader given to session.register(loader=...)), under "
                "`for epoch in session.epochs(total)`; docs/hook.md"
            )
        member, state = self._member, self._state
        model, optimizer = state.model, state.optimizer
        assert model is not None and optimizer is not None
        step = state.committed_step + 1
        fault = self._probe(Point.BEFORE_REDUCE, member.rank, step)
        if fault is Action.NAN:
            nonfinite.poison(_gradients(model))
        elif fault is Action.BITFLIP:
            digest.flip_bit(model)
        elif fault is Action.SLOW:
            self._slowed_until = step + SLOW_STEPS
        if step < self._slowed_until:
            time.sleep(SLOW_FACTOR * (time.perf_counter() - self._computing_since))
        self._machine.fire(Trigger.VOTE)  # heartbeats now say: held up by the peers, if anyone
        try:
            reduced = None
            if not member.stable.in_use:
                params = [p for p in model.parameters() if p.requires_grad]
                with member.stable.clock.waiting():
                    reduced = ReducedGradients.reduce(member.group, params, member.superseded)
            self._probe(Point.AFTER_REDUCE, member.rank, step)
            failure = member.stable.error()  # a collective of the user's failed this step
        except (RuntimeError, Superseded) as exc:  # a peer vanished (gloo fails within
            failure = str(exc)  # milliseconds), or one stuck in its own code held the sum up
        found = None
        if failure is not None:
            member.append(CollectiveError, rank=self.rank, step=step, error=failure[:500])
            verdict = vote.Verdict.ABORTED
        else:
            # Each member's own gradients first, so the report names where a NaN came from;
            # then the sums the hook made of them, which a large finite value can overflow.
            found = nonfinite.found(loss, self._gradients_to_look_at(step, fault is Action.NAN))
            if found is None and reduced is not None:
                found = nonfinite.found(None, reduced.sums, "summed gradients")
            ballot = vote.Ballot(
                None if found is None else f"rank {self.rank}: {found}",
                again=state.nonfinite_step == step,
                digest=self._digest(step),
            )
            waited = member.stable.clock.take()
            self._compute_s = max(0.0, time.perf_counter() - self._computing_since - waited)
            verdict = member.vote(step, self._step_record, ballot, self._attempt(step))
        if verdict is vote.Verdict.COMMITTED:
            self._machine.fire(Trigger.COMMIT)
            self._probe(Point.COMMITTED, member.rank, step)
            if reduced is not None:
                reduced.apply(self.world_size)
                optimizer.step()
                optimizer.zero_grad(set_to_none=True)
            self._advance(step, loss)
            return True
        if verdict in (vote.Verdict.NONFINITE, vote.Verdict.NONFINITE_AGAIN):
            self._discard(step, verdict is vote.Verdict.NONFINITE_AGAIN, found, loss)
            return False
        if verdict is vote.Verdict.DIVERGED and ballot.digest is not None:
            # The engine compares every member's and replaces the minority: a recovery.
            shard, _, held = ballot.digest.partition(":")
            member.append(StateDigest, rank=self.rank, step=step, shard=int(shard), digest=held)
        state.abort_step()
        if verdict is vote.Verdict.ABORTED and failure is None and self._vote_again(step):
            return False
        self._recovery.recover()
        return False

    def _vote_again(self, step: int) -> bool:
        """Whether an aborted vote with no failure seen here is voted on again: no newer
        generation was planned within a few heartbeats, the time the engine takes to act on a
        failure its detectors see, so none will be (a vote closed by mistake). Retrying is
        safe either way: a peer that did fail holds the retry's collectives up until its plan
        supersedes them."""
        member = self._member
        waited = ABORT_GRACE_BEATS * self._env.heartbeat_interval_s
        if member.follower.regroup_coming(member.generation, waited):
            return False
        attempt = self._attempt(step) + 1
        self._revotes = (member.generation, step, attempt)
        member.append(StepRetried, rank=self.rank, step=step, attempt=attempt, waited_s=waited)
        self._machine.fire(Trigger.DISCARD)
        return True

    def _gradients_to_look_at(self, step: int, poisoned: bool) -> list[torch.Tensor]:
        """Its own gradients, unless the user's DDP or FSDP2 reduced them and another replica of
        its shard looks this step (nonfinite.looks). A member the ``nan`` fault hit looks: its
        gradients stand for what the reduce would have spread."""
        model, env = self._state.model, self._env
        assert model is not None
        reduced = self._member.stable.in_use
        if not (poisoned or nonfinite.looks(step, self.rank, env.world_size, env.shards, reduced)):
            return []
        return _gradients(model)

    def _digest(self, step: int) -> str | None:
        """``shard:digest`` of this member's state, on a step whose vote compares the replicas'
        (every ``--verify-every`` steps, where a shard has more than one)."""
        env, state = self._env, self._state
        every = env.verify_every
        if not every or env.world_size == env.shards or (step + 1) % every:
            return None
        assert state.model is not None and state.optimizer is not None
        held = digest.state_digest(state.model, state.optimizer)
        return f"{self._member.shard_of(self.rank)}:{held}"

    def _attempt(self, step: int) -> int:
        """How many votes on ``step`` in this generation ended with no step and no regroup
        (non-finite, or aborted with nobody failed)."""
        generation, discarded, attempts = self._revotes
        return attempts if (generation, discarded) == (self._member.generation, step) else 0

    def _advance(self, step: int, loss: float | None, skipped: bool = False) -> None:
        """The step is done on every member (committed, or its batch skipped): say so."""
        state = self._state
        state.committed_step = step
        state.nonfinite_step = None
        if self._checkpoints is not None:
            self._checkpoints.due_next = self._checkpoints.due(step)
        state.position.batch += 1
        self._step_record = self._member.append(
            StepCompleted,
            rank=self.rank,
            step=step,
            duration_s=round(time.perf_counter() - self._step_started, 6),
            compute_s=round(self._compute_s, 6),
            loss=loss,
            skipped=skipped,
        )

    def _discard(self, step: int, again: bool, found: str | None, loss: float | None) -> None:
        """The vote found the step non-finite: no member applies it. Its first time it is
        computed again; the second, the job's policy fails the job or skips the batch."""
        member, state = self._member, self._state
        policy = self._env.nonfinite_policy
        attempt = self._attempt(step)
        self._revotes = (member.generation, step, attempt + 1)
        if found is not None:
            member.append(
                StepNonFinite,
                rank=self.rank,
                step=step,
                found=found,
                attempt=2 if again else 1,
                action=policy.value if again else "recompute",
            )
        self._machine.fire(Trigger.DISCARD)
        if not again:
            state.nonfinite_step = step
            state.abort_step()
            return
        if policy is NonFinitePolicy.FAIL:
            raise NonFiniteStepError(
                f"step {step} was non-finite, and again when computed again "
                f"({member.nonfinite_found(step, attempt)}); --nonfinite-policy fail"
            )
        assert state.optimizer is not None
        state.optimizer.zero_grad(set_to_none=True)  # nothing of the batch is applied
        self._advance(step, loss, skipped=True)

    def finish(self) -> None:
        """Wait until every member is done, then report this rank finished and stop the
        session's threads. A member lost after the last commit is replaced meanwhile like any
        other (this rank may be its donor), so the job still ends with every rank."""
        member, state = self._member, self._state
        if member.rank is not None:
            self._probe(Point.FINISH, member.rank, state.committed_step)
            self._machine.fire(Trigger.FINISH)
            try:
                while not member.barrier(member.generation, "done"):
                    self._recovery.recover()
                    self._machine.fire(Trigger.FINISH)
            except dist.DistStoreError:
                pass  # a member never came: nothing left to train, report what this rank holds
            self._machine.fire(Trigger.COMPLETE)
            if self._checkpoints is not None:
                self._checkpoints.close(RECOVERY_TIMEOUT_S)  # the last one completes first
            member.append(RankFinished, rank=member.rank, step=state.committed_step)
            if self._env.final_state_dir is not None and state.model is not None:
                final_state.FinalState(
                    member.rank,
                    member.pid,
                    state.committed_step,
                    final_state.parameters_sha256(state.model),
                ).write(self._env.final_state_dir)
        self._close()
        if member.rank is not None:
            self._probe(Point.EXIT, member.rank, state.committed_step)

    def __enter__(self) -> Session:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: object
    ) -> None:
        if exc is None:
            self.finish()
            return
        lost = self._member.stable.lost_after_training()
        if lost is not None and not isinstance(exc, ScriptError):
            # What torch raised where a collective's future carried it (DDP's): said as it is.
            self._close()
            raise LostAfterTraining(lost) from exc
        if self._member.rank is not None and not isinstance(exc, ScriptError):
            # Say so at once: the interpreter may take seconds to exit after the traceback,
            # and the peers are stuck until the engine replaces this rank. (A ScriptError
            # is the exit's to tell: it fails the job, where a report would replace the rank.)
            traceback.print_exception(exc)
            sys.stderr.flush()
            self._member.append(
                HealthReport, rank=self._member.rank, ok=False, detail=repr(exc)[:500]
            )
        self._close()

    def _close(self) -> None:
        self._heartbeat.stop()
        self._member.close()
        inflight.abandon_left_behind()


def _gradients(model: torch.nn.Module) -> list[torch.Tensor]:
    return [p.grad for p in model.parameters() if p.grad is not None]


def _sharded_elsewhere(model: torch.nn.Module, mesh: DeviceMesh | None) -> bool:
    """Whether some parameter is a DTensor over another mesh than ``mesh`` (the session's) or
    a part of it (tensor parallel's "tp", FSDP2's data-parallel dimensions), e.g. the default
    one fully_shard makes without ``mesh=``. Never while DTensor was not imported: no
    parameter can be one then."""
    tensor = sys.modules.get("torch.distributed.tensor")
    return tensor is not None and any(
        isinstance(p, tensor.DTensor) and (mesh is None or p.device_mesh._get_root_mesh() != mesh)
        for p in model.parameters()
    )


def init() -> Session:
    """Join the job `flashrecovery run` started this process for (read from the environment)."""
    return Session(LaunchEnv.from_environ())


def init_process_group() -> Session:
    """``init()`` plus the stable default process group, in place of
    ``torch.distributed.init_process_group``: DDP and FSDP2 use it as they would their own. A
    hot spare returns from here once it is given a rank."""
    session = init()
    session.process_group()
    return session
