"""A training process's session: the hook the training loop calls (docs/hook.md).

It carries out the rank's side of docs/protocol.md: it joins its generation's group, commits
each step for all members or none, and on a failure regroups in the same process and restores
a replacement from a healthy replica. What to do is decided by the engine; the session only
follows those decisions.
"""

from __future__ import annotations

import contextlib
import datetime
import json
import os
import socket
import sys
import threading
import time
import traceback
from collections.abc import Callable, Iterator, Mapping
from typing import Any, Protocol

import torch
import torch.distributed as dist

from flashrecovery.connectors import open_log
from flashrecovery.connectors.follow import append_through_outage
from flashrecovery.errors import ProtocolError, ReplacedError
from flashrecovery.records import (
    CollectiveError,
    Envelope,
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
    Stream,
)
from flashrecovery.trainer_hooks import barrier, final_state, groups, rng, transfer, vote
from flashrecovery.trainer_hooks.decisions import DecisionFollower
from flashrecovery.trainer_hooks.env import LaunchEnv
from flashrecovery.trainer_hooks.gradients import ReducedGradients
from flashrecovery.trainer_hooks.groups import Group
from flashrecovery.trainer_hooks.heartbeat import HeartbeatThread

RECOVERY_TIMEOUT_S = 120.0  # longest wait for the engine's next recovery decision
# An idle spare re-arms its wait this often (each expiry logs a c10d warning, hence long); it
# never outlives its agent: the decisions thread ends an orphan.
SPARE_WAIT = datetime.timedelta(minutes=10)
SHARD = 0  # every rank is a data-parallel replica of the one shard


class Stateful(Protocol):
    def state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(self, state_dict: dict[str, Any]) -> Any: ...


class Session:
    """One process's membership in a flashrecovery job (create it with ``init()``)."""

    def __init__(self, env: LaunchEnv) -> None:
        self._env = env
        self._log = open_log(env.log_url)
        self._store = groups.connect_store(env.master_addr, env.master_port, env.store_prefix)
        self._closer_store = groups.connect_store(
            env.master_addr, env.master_port, env.store_prefix
        )
        self._host = socket.gethostname()
        self._pid = os.getpid()
        self._rank = env.rank
        self._generation = env.generation
        self._committed_step = -1
        self._group: Group | None = None
        self._model: torch.nn.Module | None = None
        self._optimizer: torch.optim.Optimizer | None = None
        self._extras: dict[str, Stateful] = {}
        self._open_step: int | None = None
        self._waiting = False
        self._step_started = 0.0
        self._spare_ready = False  # an idle spare heartbeats once it has said it is ready
        self._rng_at_step: dict[str, Any] = {}
        self._release_lock = threading.Lock()
        # The wait in progress that only a newer generation cuts short, and how to cut it.
        self._release: tuple[int, Callable[[dist.Store], object]] | None = None
        self._follower = DecisionFollower(self._log, env.job_id, self._on_regroup)
        self._heartbeat = HeartbeatThread(self._log, env.heartbeat_interval_s, self._beat)
        self._follower.start()
        self._heartbeat.start()
        try:
            if env.role == "rank" and not env.replacement and self._barrier(0, "members"):
                self._group = groups.build(
                    self._store, 0, self.rank, env.world_size, self._superseded
                )
                self._append(
                    RankJoined, rank=self.rank, pid=self._pid, host=self._host, shard=SHARD
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
        return self._env.role == "spare"

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
        seed first). A spare pays its first-time costs here, then reports ready."""
        self._model, self._optimizer, self._extras = model, optimizer, dict(extras or {})
        if self._env.role == "spare":
            if warmup is not None:
                warmup()
                model.zero_grad(set_to_none=True)
            assert self._env.spare_id is not None
            self._append(SpareReady, spare_id=self._env.spare_id, pid=self._pid, host=self._host)
            self._spare_ready = True

    def steps(self, total: int) -> Iterator[int]:
        """Yield the steps to compute, 0..total-1; after a recovery, the step after the one
        every member has committed. A spare blocks here until it is assigned a rank."""
        if self._model is None:
            raise RuntimeError("call session.register(model, optimizer) before session.steps()")
        if self._rank is None:
            self._await_assignment()
        elif self._group is None:
            self._rejoin(self._generation)  # a fresh replacement, or generation 0 never formed
        while self._committed_step + 1 < total:
            step = self._committed_step + 1
            self._open_step, self._step_started = step, time.perf_counter()
            self._rng_at_step = rng.capture()
            yield step
            if self._open_step is not None:
                raise RuntimeError(f"step {step}: call session.commit() once per step")

    def commit(self, loss: float | None = None) -> bool:
        """Average the gradients over the members and step the optimizer if every member
        commits this step. On a peer failure, recover (regroup, restore) and return False:
        ``steps()`` then yields the step to recompute."""
        step, self._open_step = self._open_step, None
        if step is None:
            raise RuntimeError("session.commit() outside a step of session.steps()")
        assert self._group is not None and self._model is not None and self._optimizer is not None
        self._fault("before_reduce", step)
        params = [p for p in self._model.parameters() if p.requires_grad]
        self._waiting = True  # heartbeats now say: held up by the peers, if anyone
        try:
            reduced = ReducedGradients.reduce(self._group, params)
            self._fault("after_reduce", step)
        except RuntimeError as exc:  # a peer vanished: gloo fails within milliseconds
            self._append(CollectiveError, rank=self.rank, step=step, error=str(exc)[:500])
            verdict = vote.Verdict.ABORTED
        else:
            verdict = self._vote(step)
        finally:
            self._waiting = False
        if verdict is vote.Verdict.COMMITTED:
            reduced.apply(self.world_size)
            self._optimizer.step()
            self._optimizer.zero_grad(set_to_none=True)
            self._committed_step = step
            self._append(
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
            self._fault("finish", self._committed_step)
            try:
                while not self._barrier(self._generation, "done"):
                    self._recover()
            except dist.DistStoreError:
                pass  # a member never came: nothing left to train, report what this rank holds
            self._append(RankFinished, rank=self._rank, step=self._committed_step)
            if self._env.final_state_dir is not None and self._model is not None:
                final_state.FinalState(
                    self._rank,
                    self._pid,
                    self._committed_step,
                    final_state.parameters_sha256(self._model),
                ).write(self._env.final_state_dir)
        self._close()

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
            verdict = vote.cast(self._store, key, self.rank, self.world_size)
            if verdict is None and superseded:
                verdict = vote.close(self._store, key, self.world_size)
            if verdict is None:
                try:
                    verdict = vote.wait(self._store, key, groups.COLLECTIVE_TIMEOUT)
                except dist.DistStoreError:  # nobody made it final in time: settle it here
                    verdict = vote.close(self._store, key, self.world_size)
        return verdict

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
        with self._release_lock:
            if self._release is not None and self._release[0] < generation:
                self._release[1](self._closer_store)

    # ------------------------------------------------------------------ recovery

    def _await_assignment(self) -> None:
        """Block until the agent hands this spare a rank (``spare/{id}``), then join."""
        key = f"spare/{self._env.spare_id}"
        while True:
            try:
                self._store.wait([key], SPARE_WAIT)
                break
            except dist.DistStoreError:
                continue  # still idle; an orphaned spare is ended by the decisions thread
        assignment = json.loads(self._store.get(key))
        self._rank = int(assignment["rank"])
        self._rejoin(int(assignment["generation"]))

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
                self._fault("regroup", self._committed_step)
                if self._barrier(generation, "members"):
                    self._fault("group_build", self._committed_step)
                    self._group = groups.build(
                        self._store, generation, self.rank, self.world_size, self._superseded
                    )
                    self._append(
                        RankRegrouped,
                        rank=self.rank,
                        committed_step=self._committed_step,
                        shard=SHARD,
                        pid=self._pid,
                    )
                    plan = self._follower.wait_resume(generation, RECOVERY_TIMEOUT_S)
                    if isinstance(plan, ResumePlanned):
                        self._restore(plan)
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

    def _restore(self, plan: ResumePlanned) -> None:
        assert self._group is not None
        donor = plan.donors[SHARD]
        if self.rank == donor:
            state = self._state()
            for recipient in plan.recipients:
                transfer.send(
                    self._group,
                    recipient,
                    state,
                    after_header=lambda: self._fault("donor_send", self._committed_step),
                )
        elif self.rank in plan.recipients:
            started = time.perf_counter()
            state, size = transfer.recv(self._group, donor)
            self._load(state)
            self._append(
                StateTransferred,
                rank=self.rank,
                donor=donor,
                bytes=size,
                ms=round((time.perf_counter() - started) * 1000, 3),
            )
        if self._committed_step != plan.resume_step:
            raise ProtocolError(
                f"rank {self.rank} holds step {self._committed_step} after the restore, "
                f"the plan resumes after {plan.resume_step}"
            )

    def _state(self) -> dict[str, Any]:
        assert self._model is not None and self._optimizer is not None
        return {
            "model": self._model.state_dict(),
            "optimizer": self._optimizer.state_dict(),
            "extras": {name: obj.state_dict() for name, obj in self._extras.items()},
            "rng": rng.capture(),
            "committed_step": self._committed_step,
        }

    def _load(self, state: dict[str, Any]) -> None:
        assert self._model is not None and self._optimizer is not None
        self._model.load_state_dict(state["model"])
        self._optimizer.load_state_dict(state["optimizer"])
        for name, obj in self._extras.items():
            obj.load_state_dict(state["extras"][name])
        rng.restore(state["rng"])
        self._committed_step = int(state["committed_step"])

    def _drop_group(self) -> None:
        group, self._group = self._group, None
        if group is not None:
            groups.drop(group)

    # ------------------------------------------------------------------ faults (tests)

    def _fault(self, where: str, step: int) -> None:
        """Fail here if a test planned it (trainer_hooks/faults.py)."""
        if self._env.fault is not None:
            self._env.fault.check(where, step)
        if self._rank is not None:
            self._env.fault_plan.check(
                where, self._rank, step, lambda index: self._store.add(f"fault/{index}", 1) == 1
            )

    # ------------------------------------------------------------------ records

    def _append(self, cls: type[Envelope], **fields: Any) -> None:
        """Every record but a heartbeat is part of the protocol: ride out a log outage."""
        record = cls(**self._envelope(), **fields)
        append_through_outage(self._log, Stream.EVENTS, record, RECOVERY_TIMEOUT_S)

    def _envelope(self) -> dict[str, Any]:
        source = f"rank:{self._rank}" if self._rank is not None else f"spare:{self._env.spare_id}"
        return {"job_id": self._env.job_id, "generation": self._generation, "source": source}

    def _beat(self) -> Heartbeat | SpareHeartbeat | None:
        if self._rank is None:
            if not self._spare_ready or self._env.spare_id is None:
                return None
            return SpareHeartbeat(**self._envelope(), spare_id=self._env.spare_id, pid=self._pid)
        return Heartbeat(
            **self._envelope(),
            rank=self._rank,
            step=self._committed_step,
            pid=self._pid,
            host=self._host,
            waiting=self._waiting,
        )

    def _close(self) -> None:
        self._heartbeat.stop()
        self._follower.stop()
        self._drop_group()
        self._log.close()


def init() -> Session:
    """Join the job `flashrecovery run` started this process for (read from the environment)."""
    return Session(LaunchEnv.from_environ())
