"""A process's membership in the job's generations: who it is (rank, generation), the records it
hands its agent, its generation's groups (the user's stable ones rebuilt underneath, the hook's
own where it needs one), the store waits a newer generation cuts short, and the step vote.

The session (session.py) and the recovery procedure (recovery.py) both act through it; its
machine (statemachines/session.py) says where in its life the process is.
"""

from __future__ import annotations

import contextlib
import datetime
import json
import os
import socket
import threading
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

from flashrecovery.records import Envelope, Heartbeat, SpareHeartbeat, SpareReady
from flashrecovery.statemachines.base import Trigger
from flashrecovery.statemachines.session import UNFORMED, SessionMachine, SessionState
from flashrecovery.trainer_hooks import barrier, groups, inflight, stable_group, vote
from flashrecovery.trainer_hooks.agent_link import AgentLink
from flashrecovery.trainer_hooks.decisions import DecisionFollower
from flashrecovery.trainer_hooks.env import LaunchEnv
from flashrecovery.trainer_hooks.groups import Group

RECOVERY_TIMEOUT_S = 120.0  # longest wait for the engine's next recovery decision
# An idle spare re-arms its wait this often (each expiry logs a c10d warning, hence long); it
# never outlives its agent: the decisions thread ends an orphan.
SPARE_WAIT = datetime.timedelta(minutes=10)


class Membership:
    def __init__(self, env: LaunchEnv, machine: SessionMachine) -> None:
        self.env = env
        self.machine = machine
        # The process talks to its agent, not to the log: the agent writes its records (the
        # last step's, by number, is logged before the next vote) and relays the decisions
        # (agent/links.py); its beats go to the agent's socket.
        self.link = AgentLink(env.agent_link)
        self._endpoint = ""  # the store of the generation it is in (``use_store``)
        self._endpoint_since = env.generation  # the generation whose plan (or launch) named it
        self.use_store(env.launch_store)
        self.host = socket.gethostname()
        self.pid = os.getpid()
        self.rank = env.rank  # None for a spare until it is assigned
        self.generation = env.generation
        # The hook's own gloo group of the formed generation (``form``, ``hook_group``).
        self._group: Group | None = None
        self._connected: set[int] = set()  # the peers its pairs are connected with
        self.mesh: DeviceMesh | None = None  # the user's, for the DTensors of a transfer
        self._release_lock = threading.Lock()
        # The wait in progress that only a newer generation cuts short, and how to cut it.
        self._release: tuple[int, Callable[[dist.Store], object]] | None = None
        # The user's process groups (DDP, FSDP2, DeviceMesh): rebuilt under them per generation.
        self.stable = stable_group.StableGroups(
            "cuda" if torch.cuda.is_available() else "cpu", self.superseded, env.group_rebuild
        )
        self.follower = DecisionFollower(self.link, self._on_regroup)

    def use_store(self, endpoint: str) -> None:
        """Meet on the store at ``endpoint`` from now on: the launch's, or the one a plan moved
        the job to when the node holding the previous one was lost. Three clients: the
        training thread's, the decisions thread's (it releases waits), and gloo's (a peer's
        address is read through it when a pair first connects, groups.py)."""
        if endpoint == self._endpoint:
            return
        prefix = self.env.store_prefix
        self.store = groups.connect_store(endpoint, prefix, groups.STORE_OP_TIMEOUT)
        self._closer_store = groups.connect_store(endpoint, prefix, groups.STORE_OP_TIMEOUT)
        self._pairs_store = groups.connect_store(endpoint, prefix)
        self._endpoint = endpoint

    def generation_store(self) -> dist.Store:
        """A new client of the current generation's store (for a thread of its own)."""
        return groups.connect_store(self._endpoint, self.env.store_prefix)

    def enter(self, generation: int) -> None:
        """Join ``generation``: on the store a plan up to it moved the job to, when that plan
        is newer than what named the store in use (the launch, a spare's assignment)."""
        self.generation = generation
        moved = self.follower.store_for(generation)
        if moved is not None and moved[0] > self._endpoint_since:
            self._endpoint_since = moved[0]
            self.use_store(moved[1])

    def close(self) -> None:
        self.follower.stop()
        self.link.close()
        self.drop_group()

    # ------------------------------------------------------------------ records

    def append(self, cls: type[Envelope], **fields: Any) -> int:
        """Every record but a heartbeat is part of the protocol: hand it to the agent, which
        writes it, riding out a log outage (returns its number among those handed over)."""
        return self.link.hand(cls(**self.envelope(), **fields))

    def envelope(self) -> dict[str, Any]:
        source = f"rank:{self.rank}" if self.rank is not None else f"spare:{self.env.spare_id}"
        return {"job_id": self.env.job_id, "generation": self.generation, "source": source}

    def heartbeat(self, committed_step: int) -> Heartbeat | SpareHeartbeat | None:
        """What the heartbeat thread sends now (None: nothing to say yet)."""
        envelope, state = self.envelope(), self.machine.state
        if self.rank is None:
            if state is not SessionState.READY or self.env.spare_id is None:
                return None  # a spare beats once it has said it is ready
            return SpareHeartbeat(**envelope, spare_id=self.env.spare_id, pid=self.pid)
        if state in UNFORMED:
            # Not in a group yet: an assigned spare building its model (with the user's own
            # parallelism that is after its assignment) or a rank regrouping. It is on its way
            # to the newest generation; a newer plan must not fence it as silent.
            envelope["generation"] = max(self.generation, self.follower.latest_generation)
        return Heartbeat(
            **envelope,
            rank=self.rank,
            step=committed_step,
            pid=self.pid,
            host=self.host,
            waiting=state is SessionState.COMMITTING,
        )

    def claim_fault(self, index: int) -> bool:
        """Whether this process is the job's first to claim planned fault ``index`` (tests)."""
        return self.store.add(f"fault/{index}", 1) == 1

    def shard_of(self, rank: int) -> int:
        """The model shard a rank holds: its coordinate on the mesh's last (shard) dimension."""
        return rank % self.env.shards

    # ------------------------------------------------------------------ a spare

    def report_ready(self) -> None:
        """A spare that paid its first-time costs says so (once): it beats from now on."""
        if self.machine.state is SessionState.SPARE:
            assert self.env.spare_id is not None
            self.append(
                SpareReady,
                spare_id=self.env.spare_id,
                pid=self.pid,
                host=self.host,
                node=self.env.node,
            )
            self.machine.fire(Trigger.READY)

    def await_assignment(self) -> None:
        """Block until its agent hands this spare a rank, a generation and that generation's
        store (``spare/{id}`` on the store of the spare's own node)."""
        key = f"spare/{self.env.spare_id}"
        node_store = groups.connect_store(self.env.node_store, self.env.store_prefix)
        while True:
            try:
                node_store.wait([key], SPARE_WAIT)
                break
            except dist.DistStoreError:
                continue  # still idle; an orphaned spare is ended by the decisions thread
        assignment = json.loads(node_store.get(key))
        self.rank = int(assignment["rank"])
        self.generation = int(assignment["generation"])
        if assignment.get("store"):
            self._endpoint_since = self.generation
            self.use_store(assignment["store"])
        # What the script would have had as a rank; LOCAL_RANK stays the spare's own place
        # on its node (its device), which it had from the start.
        os.environ["RANK"] = str(self.rank)
        self.machine.fire(Trigger.ASSIGN)

    # ------------------------------------------------------------------ generations

    def superseded(self) -> bool:
        """Whether the engine planned a generation newer than the one this rank joins."""
        return self.follower.latest_generation > self.generation

    def _on_regroup(self, generation: int) -> None:
        inflight.poke()  # DDP's collectives of an older generation give up now
        with self._release_lock:
            if self._release is not None and self._release[0] < generation:
                with contextlib.suppress(RuntimeError):  # its store is gone: so is the wait
                    self._release[1](self._closer_store)

    @contextlib.contextmanager
    def releasable(self, release: Callable[[dist.Store], object]) -> Iterator[bool]:
        """Around a store wait of this generation that can only end well if every member
        shows up: ``release`` (run by the decisions thread on its own store client when a
        newer generation is planned) ends it. Yields whether that already happened."""
        with self._release_lock:
            self._release = (self.generation, release)
            superseded = self.superseded()
        try:
            yield superseded
        finally:
            with self._release_lock:
                self._release = None

    def barrier(self, generation: int, which: str) -> bool:
        """Whether every member reached this barrier (else a newer generation superseded it)."""
        key = barrier.name(generation, which)
        with self.releasable(lambda store: barrier.supersede(store, key)) as superseded:
            if superseded:
                barrier.supersede(self.store, key)
            return barrier.wait(
                self.store, key, self.env.world_size, groups.COLLECTIVE_TIMEOUT, self.superseded
            )

    def form(self, generation: int) -> None:
        """Join the generation: the user's stable groups are rebuilt under their handles (they
        connect lazily, waiting for nobody: their pairs connect on the first collective, once
        the engine saw every member regroup). The hook's own group is built and connected with
        the ring neighbours its reduce uses unless the user's groups reduce: then it is made
        only where a restore needs it (``hook_group``)."""
        assert self.rank is not None
        if not self.stable.in_use:
            self.hook_group(groups.ring_neighbours(self.rank, self.env.world_size))
        self.stable.attach(self._pairs_store, generation)
        self.machine.fire(Trigger.FORM)

    def hook_group(self, peers: Iterable[int]) -> Group:
        """The hook's own gloo group of the formed generation, connected with ``peers`` (who
        do the same at once). Made when first needed: with the user's own parallelism only a
        restore needs it, and only on its donors and recipients, while an idle gloo device
        still wakes its event loop 100 times a second (docs/benchmarks.md)."""
        assert self.rank is not None
        peers = set(peers) - self._connected
        if self._group is None:
            self._group = groups.build(
                self.store,
                self.generation,
                self.rank,
                self.env.world_size,
                self.superseded,
                self._pairs_store,
                peers,
            )
        elif peers:
            groups.connect_peers(self._group, self.store, self.generation, peers, self.superseded)
        self._connected |= peers
        return self._group

    @property
    def group(self) -> Group:
        """The hook's own group of the formed generation, when the hook reduces (``form``
        connected it with the ring its reduce uses)."""
        assert self._group is not None
        return self._group

    def drop_group(self) -> None:
        self.stable.detach()
        group, self._group = self._group, None
        self._connected = set()
        if group is not None:
            groups.drop(group)
        inflight.release_finished()

    # ------------------------------------------------------------------ the vote

    def vote(
        self, step: int, previous_record: int, ballot: vote.Ballot = vote.FINITE, attempt: int = 0
    ) -> vote.Verdict:
        """This member's vote on ``step`` and the verdict: committed only once every member
        voted, and only once this member's record of its previous step (``previous_record``,
        by number) is in the log, so the log never shows a member two steps ahead of another
        (docs/protocol.md). Aborted when a newer generation is planned first."""
        key = vote.vote_key(self.generation, step, attempt)
        world = self.env.world_size
        try:
            with self.releasable(lambda store: vote.close(store, key, world)) as superseded:
                if not self.link.wait_logged(previous_record, RECOVERY_TIMEOUT_S, self.superseded):
                    return vote.close(self.store, key, world)  # superseded, or the agent is gone
                verdict = vote.cast(self.store, key, world, ballot)
                if verdict is None and superseded:
                    verdict = vote.close(self.store, key, world)
                if verdict is None:
                    # COLLECTIVE_TIMEOUT at most; a newer plan settles it at once
                    verdict = vote.wait(self.store, key, world, self.superseded)
        except RuntimeError:
            # The store is gone with its host (a lost node, a link cut): the verdict cannot be
            # known here, so the step is not committed on this member. The next generation's
            # plan resumes after the highest step any member committed and restores the others,
            # so members that saw it commit and this one never diverge.
            return vote.Verdict.ABORTED
        return verdict

    def nonfinite_found(self, step: int, attempt: int) -> str:
        """What the members found non-finite in ``step``'s ``attempt``, by their own words
        (after a non-finite verdict)."""
        try:
            return vote.nonfinite_found(self.store, vote.vote_key(self.generation, step, attempt))
        except RuntimeError:
            return "some member (the store is out of reach)"
