"""A training process's session: the hook the training loop calls (docs/hook.md).

It carries out the rank's side of docs/protocol.md: it joins its generation's group, commits
each step for all members or none, and on a failure regroups in the same process and restores
a replacement from a healthy replica. What to do is decided by the engine; the session only
follows those decisions.
"""

from __future__ import annotations

import contextlib
import datetime
import importlib
import itertools
import json
import os
import socket
import sys
import threading
import time
import traceback
from collections.abc import Callable, Iterable, Iterator, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol, TypeVar

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from flashrecovery import heap
from flashrecovery.errors import ConfigError, ProtocolError, ReplacedError, Superseded
from flashrecovery.records import (
    CheckpointLoaded,
    CheckpointSaved,
    CollectiveError,
    Envelope,
    FallbackToCheckpoint,
    HealthReport,
    Heartbeat,
    RankFinished,
    RankJoined,
    RankRegrouped,
    ResumePlanned,
    SpareHeartbeat,
    SpareReady,
    StateTransferred,
    StepCompleted,
)
from flashrecovery.trainer_hooks import (
    barrier,
    ddp,
    final_state,
    groups,
    inflight,
    rng,
    stable_group,
    transfer,
    vote,
)
from flashrecovery.trainer_hooks.agent_link import AgentLink
from flashrecovery.trainer_hooks.decisions import DecisionFollower
from flashrecovery.trainer_hooks.env import LaunchEnv, Role
from flashrecovery.trainer_hooks.gradients import ReducedGradients
from flashrecovery.trainer_hooks.groups import Group
from flashrecovery.trainer_hooks.heartbeat import HeartbeatThread
from flashrecovery.trainer_hooks.position import DataPosition
from flashrecovery.trainer_hooks.probe import Point, Probe

if TYPE_CHECKING:
    from flashrecovery.trainer_hooks.checkpoint import Checkpointer

RECOVERY_TIMEOUT_S = 120.0  # longest wait for the engine's next recovery decision
# An idle spare re-arms its wait this often (each expiry logs a c10d warning, hence long); it
# never outlives its agent: the decisions thread ends an orphan.
SPARE_WAIT = datetime.timedelta(minutes=10)

T = TypeVar("T")


class Stateful(Protocol):
    def state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(self, state_dict: dict[str, Any]) -> Any: ...


class Session:
    """One process's membership in a flashrecovery job (create it with ``init()``)."""

    def __init__(self, env: LaunchEnv) -> None:
        self._env = env
        # The process talks to its agent, not to the log: the agent writes its records (the
        # last step's, by number, is logged before the next vote) and relays the decisions
        # (agent/links.py); its beats go to the agent's socket.
        self._link = AgentLink(env.agent_link)
        self._step_record = 0
        self._store = groups.connect_store(env.master_addr, env.master_port, env.store_prefix)
        self._closer_store = groups.connect_store(
            env.master_addr, env.master_port, env.store_prefix
        )
        # gloo reads a peer's address through it when a pair first connects (groups.py).
        self._pairs_store = groups.connect_store(env.master_addr, env.master_port, env.store_prefix)
        self._host = socket.gethostname()
        self._pid = os.getpid()
        self._rank = env.rank
        self._generation = env.generation
        self._committed_step = -1
        self._formed: int | None = None  # the generation this rank is a member of, once formed
        self._first_form_due = False  # joined generation 0; it forms once the groups are known
        # The hook's own gloo group of that generation (``_form``, ``_hook_group``).
        self._group: Group | None = None
        self._connected: set[int] = set()  # the peers its pairs are connected with
        self._model: torch.nn.Module | None = None
        self._optimizer: torch.optim.Optimizer | None = None
        self._extras: dict[str, Stateful] = {}
        self._open_step: int | None = None
        self._waiting = False
        self._step_started = 0.0
        self._spare_ready = False  # an idle spare heartbeats once it has said it is ready
        self._rng_at_step: dict[str, Any] = {}
        self._restored_rng: dict[str, Any] | None = None  # the donor's, from the next step on
        self._position = DataPosition()
        self._mesh: DeviceMesh | None = None  # the user's, for the DTensors of a transfer
        self._release_lock = threading.Lock()
        # The wait in progress that only a newer generation cuts short, and how to cut it.
        self._release: tuple[int, Callable[[dist.Store], object]] | None = None
        # The user's process groups (DDP, FSDP2, DeviceMesh): rebuilt under them per generation.
        self._stable = stable_group.StableGroups(
            "cuda" if torch.cuda.is_available() else "cpu", self._superseded, env.group_rebuild
        )
        self._checkpoints = None if env.checkpoint_dir is None else self._checkpointer()
        self._checkpoint_due = False  # the step just committed is saved as the next begins
        # Test-only faults (trainer_hooks/probe.py): without a plan it does nothing.
        self._probe = Probe(env.fault_plan, lambda index: self._store.add(f"fault/{index}", 1) == 1)
        self._follower = DecisionFollower(self._link, self._on_regroup)
        self._heartbeat = HeartbeatThread(env.agent_socket, env.heartbeat_interval_s, self._beat)
        self._follower.start()
        self._heartbeat.start()
        try:
            if env.role is Role.RANK and not env.replacement and self._barrier(0, "members"):
                self._first_form_due = True
                self._append(
                    RankJoined,
                    rank=self.rank,
                    pid=self._pid,
                    host=self._host,
                    shard=self._shard_of(self.rank),
                )
        except BaseException:
            self._close()  # no thread or connection outlives a session that never started
            raise

    # ------------------------------------------------------------------ properties

    @property
    def rank(self) -> int:
        if self._rank is None:
            raise RuntimeError("a hot spare has no rank until session.steps() yields a step")
        return self._rank

    @property
    def world_size(self) -> int:
        return self._env.world_size

    @property
    def generation(self) -> int:
        return self._generation

    @property
    def is_spare(self) -> bool:
        """Whether this process was started as a hot spare (it keeps that role once assigned)."""
        return self._env.role is Role.SPARE

    @property
    def committed_step(self) -> int:
        return self._committed_step

    # ------------------------------------------------------------------ the training loop

    def register(
        self,
        model: torch.nn.Module,
        optimizer: torch.optim.Optimizer,
        extras: Mapping[str, Stateful] | None = None,
        warmup: Callable[[], object] | None = None,
    ) -> None:
        """Hand over what defines the training state (build it identically on every rank:
        seed first). A spare not yet assigned pays its first-time costs here, then reports
        ready. A model wrapped in DDP is given its final bucket order now (ddp.py)."""
        self._model, self._optimizer = model, optimizer
        self._extras = {**(extras or {}), "flashrecovery.data": self._position}
        ddp.settle_buckets(model)
        if self._rank is None and warmup is not None:
            warmup()
            model.zero_grad(set_to_none=True)
        heap.settle()  # the long-lived objects exist now: a spare settles before it is needed
        if self._rank is None:
            self._report_ready()

    def process_group(self) -> dist.ProcessGroup:
        """The world process group for the user's DDP or FSDP2 (torch's default group, so
        ``dist.get_rank()`` and friends work): it stays valid across generations. A hot spare
        waits here until it is given a rank."""
        if not dist.is_initialized():
            if self._rank is None:
                # What DDP's constructor imports on first use (torch._dynamo, 1-2 s here): a
                # spare pays it before it waits, not after it is needed.
                importlib.import_module("torch._dynamo")
                heap.settle()
                self._report_ready()
                self._await_assignment()
            stable_group.init_process_group(self._stable, self._store, self.rank, self.world_size)
            self._form_first()
        elif not self._stable.in_use:
            raise ConfigError(
                "torch.distributed is already initialized: let session.process_group() (or "
                "flashrecovery's init_process_group()) create the default group"
            )
        world = dist.group.WORLD
        assert world is not None
        return world

    def device_mesh(self, shape: tuple[int, ...], names: tuple[str, ...]) -> DeviceMesh:
        """A DeviceMesh over the stable groups (for FSDP2 / HSDP), e.g. ``((2, 2),
        ("replicate", "shard"))``: valid across generations like ``process_group()``."""
        if shape[-1] != self._env.shards:
            raise ConfigError(
                f"the mesh's last (shard) dimension is {shape[-1]}, the job was started with "
                f"--shards {self._env.shards}"
            )
        self.process_group()
        self._mesh = init_device_mesh(self._stable.device, shape, mesh_dim_names=names)
        return self._mesh

    def steps(self, total: int) -> Iterator[int]:
        """Yield the steps to compute, 0..total-1; after a recovery, the step after the one
        every member has committed. A spare blocks here until it is assigned a rank."""
        self._join()
        while self._committed_step + 1 < total:
            yield self._begin_step()
            self._end_step()

    def epochs(self, total: int) -> Iterator[int]:
        """Yield the epochs to run, ``0..total-1``, from the one the job is in: a replacement
        receives its state here and resumes its donor's epoch. Use with ``batches()``."""
        self._join()
        while self._position.epoch < total:
            epoch = self._position.epoch
            yield epoch
            if self._position.epoch == epoch:  # else a fallback took the job back to another
                self._position.next_epoch()

    def batches(self, loader: Iterable[T]) -> Iterator[T]:
        """Yield the loader's batches of this epoch as steps, from the data position on: each
        batch until its step is committed, so a step aborted by a failure is recomputed with
        the same batch. A replacement skips the batches its donor had committed; after a
        checkpoint fallback the loader is iterated again from the checkpoint's batch (or, from
        an earlier epoch, this ends and ``epochs()`` yields that epoch again)."""
        self._join()
        epoch = self._position.epoch
        while True:
            start = self._position.batch
            for index, batch in enumerate(itertools.islice(loader, start, None), start):
                while (self._position.epoch, self._position.batch) == (epoch, index):
                    self._begin_step()
                    yield batch
                    self._end_step()
                if (self._position.epoch, self._position.batch) != (epoch, index + 1):
                    break  # a fallback moved the data position back
            else:
                return  # the epoch's last batch is committed
            if self._position.epoch != epoch:
                return

    def _join(self) -> None:
        """Take part in the job's current generation: a spare waits for its rank, a
        replacement receives its state (at most once)."""
        if self._model is None:
            raise RuntimeError("call session.register(model, optimizer) before training")
        if self._rank is None:
            self._await_assignment()
        self._form_first()
        if self._formed is None:
            self._rejoin(self._generation)  # a replacement, or generation 0 never formed

    def _begin_step(self) -> int:
        """Start a step; its random state is captured so that an aborted attempt is recomputed
        with the same randomness. A restored rank takes its donor's random state here, once it
        has fetched the step's batch itself, as the donor had."""
        if self._restored_rng is not None:
            rng.restore(self._restored_rng)
            self._restored_rng = None
        step = self._committed_step + 1
        self._open_step, self._step_started = step, time.perf_counter()
        self._rng_at_step = rng.capture()
        if self._checkpoint_due:
            self._save_checkpoint()
        return step

    def _checkpointer(self) -> Checkpointer:
        # Imported only by a job that writes checkpoints: DCP costs a rank process most of a
        # second of CPU at start (a fresh replacement pays it before it can train).
        from flashrecovery.trainer_hooks.checkpoint import Checkpointer

        env = self._env
        assert env.checkpoint_dir is not None
        return Checkpointer(
            env.checkpoint_dir,
            env.checkpoint_every,
            lambda: groups.connect_store(env.master_addr, env.master_port, env.store_prefix),
            lambda step, path: self._append(CheckpointSaved, step=step, path=path),
            lambda generation: self._follower.replaced_after(generation),
        )

    def _save_checkpoint(self) -> None:
        """Save the committed step as a replacement would receive it: the caller's optimizer
        has stepped, and the random state and data position are the next step's, taken once
        it fetched its batch (as in ``_restore``)."""
        assert self._checkpoints is not None
        self._checkpoint_due = False
        self._checkpoints.save(
            self._committed_step,
            self._generation,
            self.rank,
            self.world_size,
            self._state(),
        )

    def _end_step(self) -> None:
        if self._open_step is not None:
            raise RuntimeError(f"step {self._open_step}: call session.commit() once per step")

    def commit(self, loss: float | None = None) -> bool:
        """Average the gradients over the members and step the optimizer if every member
        commits this step; with the user's own parallelism (``process_group()``: DDP or FSDP
        reduced the gradients) only vote, and the caller steps its optimizer when this returns
        True. On a peer failure, recover (regroup, restore) and return False: ``steps()`` then
        yields the step to recompute."""
        step, self._open_step = self._open_step, None
        if step is None:
            raise RuntimeError("session.commit() outside a step of session.steps()")
        assert self._formed is not None and self._model is not None and self._optimizer is not None
        self._probe(Point.BEFORE_REDUCE, self._rank, step)
        self._waiting = True  # heartbeats now say: held up by the peers, if anyone
        try:
            reduced = None
            if not self._stable.in_use:
                params = [p for p in self._model.parameters() if p.requires_grad]
                assert self._group is not None  # formed with the hook's own reduce (_form)
                reduced = ReducedGradients.reduce(self._group, params, self._superseded)
            self._probe(Point.AFTER_REDUCE, self._rank, step)
            failure = self._stable.error()  # a collective of the user's failed this step
        except (RuntimeError, Superseded) as exc:  # a peer vanished (gloo fails within
            failure = str(exc)  # milliseconds), or one stuck in its own code held the sum up
        try:
            if failure is not None:
                self._append(CollectiveError, rank=self.rank, step=step, error=failure[:500])
                verdict = vote.Verdict.ABORTED
            else:
                verdict = self._vote(step)
        finally:
            self._waiting = False
        if verdict is vote.Verdict.COMMITTED:
            if reduced is not None:
                reduced.apply(self.world_size)
                self._optimizer.step()
                self._optimizer.zero_grad(set_to_none=True)
            self._committed_step = step
            self._checkpoint_due = self._checkpoints is not None and self._checkpoints.due(step)
            self._position.batch += 1
            self._step_record = self._append(
                StepCompleted,
                rank=self.rank,
                step=step,
                duration_s=round(time.perf_counter() - self._step_started, 6),
                loss=loss,
            )
            return True
        self._optimizer.zero_grad(set_to_none=True)
        rng.restore(self._rng_at_step)  # the step is recomputed with the same randomness
        self._recover()
        return False

    def finish(self) -> None:
        """Wait until every member is done, then report this rank finished and stop the
        session's threads. A member lost after the last commit is replaced meanwhile like any
        other (this rank may be its donor), so the job still ends with every rank."""
        if self._rank is not None:
            self._probe(Point.FINISH, self._rank, self._committed_step)
            try:
                while not self._barrier(self._generation, "done"):
                    self._recover()
            except dist.DistStoreError:
                pass  # a member never came: nothing left to train, report what this rank holds
            if self._checkpoints is not None:
                self._checkpoints.close(RECOVERY_TIMEOUT_S)  # the last one completes first
            self._append(RankFinished, rank=self._rank, step=self._committed_step)
            if self._env.final_state_dir is not None and self._model is not None:
                final_state.FinalState(
                    self._rank,
                    self._pid,
                    self._committed_step,
                    final_state.parameters_sha256(self._model),
                ).write(self._env.final_state_dir)
        self._close()
        if self._rank is not None:
            self._probe(Point.EXIT, self._rank, self._committed_step)

    def __enter__(self) -> Session:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: object
    ) -> None:
        if exc is None:
            self.finish()
            return
        if self._rank is not None:
            # Say so at once: the interpreter may take seconds to exit after the traceback,
            # and the peers are stuck until the engine replaces this rank.
            traceback.print_exception(exc)
            sys.stderr.flush()
            self._append(HealthReport, rank=self._rank, ok=False, detail=repr(exc)[:500])
        self._close()

    # ------------------------------------------------------------------ the vote

    def _vote(self, step: int) -> vote.Verdict:
        key = vote.vote_key(self._generation, step)
        with self._releasable(lambda store: vote.close(store, key, self.world_size)) as superseded:
            if not self._previous_step_logged():
                return vote.close(self._store, key, self.world_size)
            verdict = vote.cast(self._store, key, self.world_size)
            if verdict is None and superseded:
                verdict = vote.close(self._store, key, self.world_size)
            if verdict is None:
                try:
                    verdict = vote.wait(self._store, key)  # COLLECTIVE_TIMEOUT at most
                except dist.DistStoreError:  # nobody made it final in time: settle it here
                    verdict = vote.close(self._store, key, self.world_size)
        return verdict

    def _previous_step_logged(self) -> bool:
        """Whether this rank's record of its previous step is in the log, waiting for it if its
        agent still writes it: a step commits only once every member's previous one is logged,
        so the log never shows a member two steps ahead of another (docs/protocol.md). False
        when a newer generation is planned (or the agent is gone) first: then no vote."""
        return self._link.wait_logged(self._step_record, RECOVERY_TIMEOUT_S, self._superseded)

    @contextlib.contextmanager
    def _releasable(self, release: Callable[[dist.Store], object]) -> Iterator[bool]:
        """Around a store wait of this generation that can only end well if every member
        shows up: ``release`` (run by the decisions thread on its own store client when a
        newer generation is planned) ends it. Yields whether that already happened."""
        with self._release_lock:
            self._release = (self._generation, release)
            superseded = self._superseded()
        try:
            yield superseded
        finally:
            with self._release_lock:
                self._release = None

    def _superseded(self) -> bool:
        """Whether the engine planned a generation newer than the one this rank joins."""
        return self._follower.latest_generation > self._generation

    def _on_regroup(self, generation: int) -> None:
        inflight.poke()  # DDP's collectives of an older generation give up now
        with self._release_lock:
            if self._release is not None and self._release[0] < generation:
                self._release[1](self._closer_store)

    # ------------------------------------------------------------------ recovery

    def _report_ready(self) -> None:
        if not self._spare_ready:
            assert self._env.spare_id is not None
            self._append(
                SpareReady,
                spare_id=self._env.spare_id,
                pid=self._pid,
                host=self._host,
                node=self._env.node,
            )
            self._spare_ready = True

    def _await_assignment(self) -> None:
        """Block until the agent hands this spare a rank and generation (``spare/{id}``)."""
        key = f"spare/{self._env.spare_id}"
        while True:
            try:
                self._store.wait([key], SPARE_WAIT)
                break
            except dist.DistStoreError:
                continue  # still idle; an orphaned spare is ended by the decisions thread
        assignment = json.loads(self._store.get(key))
        self._rank = int(assignment["rank"])
        self._generation = int(assignment["generation"])
        # What the script would have had as a rank (one node: the local rank is the rank).
        os.environ["RANK"] = os.environ["LOCAL_RANK"] = str(self._rank)

    def _recover(self) -> None:
        """A survivor's path: leave the broken generation and join the one the engine plans."""
        self._drop_group()
        self._rejoin(self._follower.wait_regroup(self._generation, RECOVERY_TIMEOUT_S).generation)

    def _rejoin(self, generation: int) -> None:
        """Build ``generation``'s group, report the committed step, and carry out the resume
        plan; when another failure supersedes the generation, move on to the newer one."""
        while True:
            if self._follower.isolated(self._pid):
                raise ReplacedError(f"rank {self.rank} was declared failed and replaced")
            self._generation = generation
            try:
                self._probe(Point.REGROUP, self._rank, self._committed_step)
                # No barrier of all members: forming waits for nobody (groups.py), and the
                # engine plans the resume once every member regrouped.
                if not self._superseded():
                    self._probe(Point.GROUP_BUILD, self._rank, self._committed_step)
                    self._form(generation)
                    self._append(
                        RankRegrouped,
                        rank=self.rank,
                        committed_step=self._committed_step,
                        shard=self._shard_of(self.rank),
                        pid=self._pid,
                    )
                    plan = self._follower.wait_resume(generation, RECOVERY_TIMEOUT_S)
                    if isinstance(plan, ResumePlanned):
                        self._restore(plan)
                        return
                    if isinstance(plan, FallbackToCheckpoint):
                        self._load_checkpoint(plan)
                        return
            except RuntimeError as exc:  # a member failed while this generation formed
                self._append(
                    CollectiveError, rank=self.rank, step=self._committed_step, error=str(exc)[:500]
                )
            self._drop_group()
            generation = self._follower.wait_regroup(generation, RECOVERY_TIMEOUT_S).generation

    def _barrier(self, generation: int, which: str) -> bool:
        """Whether every member reached this barrier (else a newer generation superseded it)."""
        key = barrier.name(generation, which)
        with self._releasable(lambda store: barrier.supersede(store, key)) as superseded:
            if superseded:
                barrier.supersede(self._store, key)
            return barrier.wait(self._store, key, self.world_size, groups.COLLECTIVE_TIMEOUT)

    def _shard_of(self, rank: int) -> int:
        """The model shard a rank holds: its coordinate on the mesh's last (shard) dimension."""
        return rank % self._env.shards

    def _restore(self, plan: ResumePlanned) -> None:
        """Each shard's donors send its state (DTensor local shards only) to that shard's
        recipients, each donor its stripe of the replicated part; donors of different shards
        send at the same time."""
        shard = self._shard_of(self.rank)
        donors = plan.donors_of(shard)
        # Every donor and recipient of a shard connect first (groups.py): a recipient waiting
        # for a donor still busy with another recipient must not wait on an unconnected pair.
        recipients = [r for r in plan.recipients if self._shard_of(r) == shard]
        if self.rank in donors:
            stripe = transfer.Stripe(donors.index(self.rank), len(donors))
            own = self._own() if stripe.index == 0 else None
            group = self._hook_group(recipients)
            for recipient in recipients:
                transfer.send(
                    group,
                    recipient,
                    self._replicated(),
                    own,
                    stripe,
                    after_header=lambda: self._probe(
                        Point.DONOR_SEND, self._rank, self._committed_step
                    ),
                )
        elif self.rank in plan.recipients:
            started = time.perf_counter()
            # Its own tensors are overwritten in place: until restored it holds no step.
            self._committed_step = -1
            group = self._hook_group(donors)
            received = transfer.recv(group, donors, self._replicated(), self._mesh)
            self._load({**received.replicated, **received.own})
            self._append(
                StateTransferred,
                rank=self.rank,
                donor=donors[0],
                bytes=sum(received.bytes.values()),
                ms=round((time.perf_counter() - started) * 1000, 3),
                donor_bytes=received.bytes,
            )
        if self._committed_step != plan.resume_step:
            raise ProtocolError(
                f"rank {self.rank} holds step {self._committed_step} after the restore, "
                f"the plan resumes after {plan.resume_step}"
            )

    def _load_checkpoint(self, plan: FallbackToCheckpoint) -> None:
        """No replica was left of some shard: every member loads its own part of the
        checkpoint the engine named, and the job resumes after its step."""
        if self._checkpoints is None or plan.path is None or plan.step is None:
            raise ProtocolError("a checkpoint fallback, but this job writes no checkpoints")
        self._probe(Point.CHECKPOINT_LOAD, self._rank, plan.step)
        assert self._optimizer is not None
        started = time.perf_counter()
        self._checkpoints.prepare_load(self._optimizer)
        self._load(self._checkpoints.load(Path(plan.path), self.rank, self._state()))
        self._checkpoint_due = False
        if self._committed_step != plan.step:
            raise ProtocolError(
                f"rank {self.rank} loaded step {self._committed_step} from {plan.path}, the "
                f"fallback resumes after {plan.step}"
            )
        self._append(
            CheckpointLoaded,
            rank=self.rank,
            step=plan.step,
            ms=round((time.perf_counter() - started) * 1000, 3),
        )

    def _state(self) -> dict[str, Any]:
        """The whole training state (what a checkpoint holds)."""
        return {**self._replicated(), **self._own()}

    def _replicated(self) -> dict[str, Any]:
        """The state every replica of a shard holds bitwise alike (several donors share it)."""
        assert self._model is not None and self._optimizer is not None
        return {"model": self._model.state_dict(), "optimizer": self._optimizer.state_dict()}

    def _own(self) -> dict[str, Any]:
        """The rest of a donor's state, sent by the lead donor alone."""
        return {
            "extras": {name: obj.state_dict() for name, obj in self._extras.items()},
            "rng": rng.capture(),
            "committed_step": self._committed_step,
        }

    def _load(self, state: dict[str, Any]) -> None:
        """Take on a state. Tensors that landed in place make the loads copy-free."""
        assert self._model is not None and self._optimizer is not None
        self._model.load_state_dict(state["model"])
        self._optimizer.load_state_dict(state["optimizer"])
        for name, obj in self._extras.items():
            obj.load_state_dict(state["extras"][name])
        self._restored_rng = state["rng"]
        self._committed_step = int(state["committed_step"])

    def _form_first(self) -> None:
        """Form generation 0, once the user's code shows whether it reduces with its own
        groups (``process_group()``) or the hook's (the training loop starts first); a member
        lost meanwhile sends this rank on to the generation that replaces it."""
        if not self._first_form_due:
            return
        self._first_form_due = False
        try:
            self._form(0)
        except RuntimeError as exc:
            self._append(
                CollectiveError, rank=self.rank, step=self._committed_step, error=str(exc)[:500]
            )
            self._recover()

    def _form(self, generation: int) -> None:
        """Join the generation: the user's stable groups are rebuilt under their handles (they
        connect lazily, waiting for nobody: their pairs connect on the first collective, once
        the engine saw every member regroup). The hook's own group is built and connected with
        the ring neighbours its reduce uses unless the user's groups reduce: then it is made
        only where a restore needs it (``_hook_group``)."""
        if not self._stable.in_use:
            self._hook_group(groups.ring_neighbours(self.rank, self.world_size))
        self._stable.attach(self._pairs_store, generation)
        self._formed = generation

    def _hook_group(self, peers: Iterable[int]) -> Group:
        """The hook's own gloo group of the formed generation, connected with ``peers`` (who
        do the same at once). Made when first needed: with the user's own parallelism only a
        restore needs it, and only on its donors and recipients, while an idle gloo device
        still wakes its event loop 100 times a second (docs/overhead.md)."""
        peers = set(peers) - self._connected
        if self._group is None:
            self._group = groups.build(
                self._store,
                self._generation,
                self.rank,
                self.world_size,
                self._superseded,
                self._pairs_store,
                peers,
            )
        elif peers:
            groups.connect_peers(
                self._group, self._store, self._generation, peers, self._superseded
            )
        self._connected |= peers
        return self._group

    def _drop_group(self) -> None:
        self._stable.detach()
        group, self._group = self._group, None
        self._formed, self._connected = None, set()
        if group is not None:
            groups.drop(group)
        inflight.release_finished()

    # ------------------------------------------------------------------ records

    def _append(self, cls: type[Envelope], **fields: Any) -> int:
        """Every record but a heartbeat is part of the protocol: hand it to the agent, which
        writes it, riding out a log outage (returns its number among those handed over)."""
        return self._link.hand(cls(**self._envelope(), **fields))

    def _envelope(self) -> dict[str, Any]:
        source = f"rank:{self._rank}" if self._rank is not None else f"spare:{self._env.spare_id}"
        return {"job_id": self._env.job_id, "generation": self._generation, "source": source}

    def _beat(self) -> Heartbeat | SpareHeartbeat | None:
        if self._rank is None:
            if not self._spare_ready or self._env.spare_id is None:
                return None
            return SpareHeartbeat(**self._envelope(), spare_id=self._env.spare_id, pid=self._pid)
        envelope = self._envelope()
        if self._formed is None:
            # Not in a group yet: an assigned spare building its model (with the user's own
            # parallelism that is after its assignment) or a rank regrouping. It is on its way
            # to the newest generation; a newer plan must not fence it as silent.
            envelope["generation"] = max(self._generation, self._follower.latest_generation)
        return Heartbeat(
            **envelope,
            rank=self._rank,
            step=self._committed_step,
            pid=self._pid,
            host=self._host,
            waiting=self._waiting,
        )

    def _close(self) -> None:
        self._heartbeat.stop()
        self._follower.stop()
        self._link.close()
        self._drop_group()


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
