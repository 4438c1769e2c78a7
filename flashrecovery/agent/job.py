"""The agent of one node of a job: it starts its node's processes, heartbeats for the node,
carries out the decisions that name its node and ends with the job's status (docs/protocol.md,
docs/multinode.md). A single node's agent hosts the store and runs the engine. Across nodes no
agent is needed to the end: each hosts a store (the generation's may move to it, meeting.py),
runs a standby engine that takes over by the lease in the log, and watches the others'
agents (presence.py), so the job survives the loss of any one node, node 0 included."""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from types import FrameType
from typing import Any

import structlog

import flashrecovery
from flashrecovery import heap, logs
from flashrecovery.agent import rendezvous
from flashrecovery.agent.actions import SPAWNS_PER_S, Actions, SpawnBudget
from flashrecovery.agent.config import AgentConfig, SpareRefill, StartMethod
from flashrecovery.agent.forkserver import ForkServer
from flashrecovery.agent.link_probe import LinkProbe, ring_peers
from flashrecovery.agent.links import ProcessLinks
from flashrecovery.agent.meeting import EndWatch, Meeting
from flashrecovery.agent.nodedir import NodeDir
from flashrecovery.agent.presence import Presence
from flashrecovery.agent.relay import BeatRelay
from flashrecovery.agent.store import JobStore
from flashrecovery.agent.supervisor import Child, Supervisor, meeting_env
from flashrecovery.connectors import open_log
from flashrecovery.connectors.base import Entry
from flashrecovery.connectors.chain import seal
from flashrecovery.connectors.follow import StreamCursor, append_through_outage
from flashrecovery.connectors.signing import Keyring
from flashrecovery.engine.loop import EngineLoop
from flashrecovery.errors import ConfigError, LogError
from flashrecovery.observe.exporter import MetricsServer
from flashrecovery.records import (
    AgentExited,
    Decision,
    Envelope,
    JobFinished,
    JobOutcome,
    JobStarted,
    NodeHeartbeat,
    NodeJoined,
    RankExited,
    Stream,
)
from flashrecovery.trainer_hooks import exit_note, final_state, probe
from flashrecovery.trainer_hooks.decisions import PROCESS_DECISIONS
from flashrecovery.trainer_hooks.env import (
    CHECKPOINT_DIR,
    CHECKPOINT_EVERY,
    GROUP_REBUILD,
    NODE_STORE,
    NONFINITE_POLICY,
    VERIFY_EVERY,
)
from flashrecovery.trainer_hooks.heartbeat import HeartbeatThread

log = structlog.get_logger("flashrecovery.agent")
FOLLOW_TIMEOUT_S = 0.1  # how often the agent looks at its children between decisions
# How long its engine's follow waits for records before it runs the time-based detectors
# anyway (they also run after every batch of records): theirs are seconds-long windows, and
# waking 20 times a second to find nothing cost the agent CPU the ranks share.
ENGINE_POLL_S = 0.2
NODES_DONE_WAIT_S = 10.0  # node 0 keeps the store this long for the others to see the end
STUCK_AFTER_S = 120.0  # a rank has had no live process this long: nothing will recover it
LOG_OUTAGE_S = 60.0  # how long a record is retried while the log is away
LINK_DRAIN_S = 5.0  # longest wait for a process's handed-over records to reach the log
LEASE_TTL_S = 3.0  # a multi-node job's engines: how long a lease lasts without renewal
STORE_AWAY_S = 60.0  # the meeting store unreachable this long with no plan moving it: give up


def _base_env() -> dict[str, str]:
    """What every process the agent starts (and its fork server) has in its environment."""
    quieted = {logs.TORCH_LOG_LEVEL} if os.environ.get(logs.QUIETED_C10D) else set()
    inherited = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith("FLASHRECOVERY_") and k not in {"RANK", "LOCAL_RANK", *quieted}
    }
    # The ranks must speak the agent's protocol: import the agent's flashrecovery first.
    package_root = str(Path(flashrecovery.__file__).resolve().parent.parent)
    python_path = os.pathsep.join(filter(None, [package_root, os.environ.get("PYTHONPATH")]))
    return {**inherited, "PYTHONPATH": python_path, "OMP_NUM_THREADS": "1"}


class Interrupted(BaseException):
    """SIGTERM (or SIGINT) reached the agent: tear the job down."""

    def __init__(self, signum: int) -> None:
        super().__init__(signum)
        self.signum = signum


@dataclass(frozen=True)
class Outcome:
    status: JobOutcome
    exit_code: int
    detail: str = ""


class Agent:
    """``Agent(config).run()`` runs the job (or its node's part of it) to its end and returns
    the exit code. Child PIDs are in the log (RankJoined, SpareReady, SpareActivated,
    ReplacementSpawned records)."""

    def __init__(self, config: AgentConfig) -> None:
        self.config = config.resolved()  # ConfigError before anything starts
        assert self.config.log_url is not None
        self.job_id: str = self.config.job_id or ""  # a joining node learns it at rendezvous
        self.log_url: str = self.config.log_url
        self.node: int | None = self.config.node_rank  # None ("auto") until rendezvous
        self._log = open_log(self.log_url)
        self._stop = threading.Event()
        self._generation = 0  # the newest generation a decision named
        self.metrics: MetricsServer | None = None  # serving before the first rank starts
        self._engine: EngineLoop | None = None
        self._links: ProcessLinks | None = None  # the node's processes' records, once running
        self._exit_notes: Path | None = None  # where its processes leave their last error
        self._advised: set[str] = set()
        self._presence: Presence | None = None  # a multi-node job's watch of the other agents
        self._probe: LinkProbe | None = None  # ... and its probes of their links
        self._keys: Keyring | None = None  # the job's writer keys, once its secret is known

    def run(self) -> int:
        config = self.config
        try:  # first: a port in use ends the job before anything starts
            self.metrics = self._serve_metrics()
        except OSError as exc:
            print(f"flashrecovery run: error: metrics port: {exc}", file=sys.stderr)
            self._log.close()
            return 2
        # Its imports (seconds) overlap the rendezvous and the engine's start.
        forks = ForkServer(_base_env()) if config.start_method is StartMethod.FORKSERVER else None
        try:
            member = rendezvous.join(config, self._start_job)
        except ConfigError as exc:
            if forks is not None:
                forks.close()
            if self.metrics is not None:
                self.metrics.stop()
            self._log.close()
            print(f"flashrecovery run: error: {exc}", file=sys.stderr)
            return 2
        self.job_id, self.node = member.job_id, member.node
        keys = self._sign(member.own)
        engine = None
        if config.multinode and not config.external_engine:
            # every node's engine stands by; the lease in the log says which one decides (the
            # control plane's first, when there is one)
            engine = EngineLoop(
                self.log_url,
                self.job_id,
                poll_s=ENGINE_POLL_S,
                lease_ttl_s=LEASE_TTL_S,
                node=member.node,
                claim_after_s=LEASE_TTL_S if config.control_plane else 0.0,
                keys=keys,
            ).start()
        elif config.hosts_store and not config.external_engine:
            engine = EngineLoop(self.log_url, self.job_id, poll_s=ENGINE_POLL_S, keys=keys).start()
        self._engine = engine
        if config.multinode:
            self._presence = Presence(member.node, os.getpid(), member.own.host, self._agent_exited)
            self._probe = LinkProbe(member.own.host)
        meeting = Meeting(member.own, member.meeting)
        # The processes talk to their agent, not to the log: their beats in one record, their
        # other records in batches, the decisions relayed. Only the agent writes, so a rank
        # stopped (SIGSTOP) in the middle of a write cannot hold the embedded log's lock and
        # silence the whole job.
        node_dir = NodeDir()
        relay = BeatRelay(node_dir.path)
        self._links = ProcessLinks(node_dir.path, self._log, LOG_OUTAGE_S)
        self._exit_notes = node_dir.path
        if forks is not None and not forks.ready():
            log.warning("no fork server: each process starts a new interpreter", why=forks.refusal)
            forks.close()
            forks = None
        supervisor = Supervisor(
            config.command,
            {**self._child_env(member, meeting, relay), "TMPDIR": str(node_dir.tmp)},
            self._on_exit,
            config.output_dir,
            nproc_per_node=config.nproc,
            spare_ids=member.next_spare_id,
            forks=forks,
            finished=self._links.finished,
            watches=node_dir.path,
        )
        actions = Actions(
            supervisor,
            member.own.keys,
            lambda: meeting.endpoint,
            self._report,
            self.job_id,
            member.spares,
            SpawnBudget(len(member.ranks) + member.spares, SPAWNS_PER_S),
            refill_at_once=config.spare_refill is SpareRefill.IMMEDIATE,
            node=member.node,
            say=lambda line: print(line, file=sys.stderr, flush=True),
        )
        heartbeat = self._node_heartbeat(member, relay)
        previous = _handle_signals()
        outcome = Outcome(JobOutcome.FAILED, 1, "interrupted")
        try:
            for rank in member.ranks:
                supervisor.spawn_rank(rank)
            for _ in range(member.spares):
                supervisor.spawn_spare()
            heap.settle()  # while the ranks start: the engine's later pauses stay short
            outcome = self._supervise(member, meeting, supervisor, actions, engine)
        except Interrupted as exc:
            outcome = Outcome(
                JobOutcome.FAILED, 128 + exc.signum, f"interrupted by signal {exc.signum}"
            )
        finally:
            _ignore_signals(previous)  # a second Ctrl-C must not cut the teardown short
            try:
                supervisor.teardown()  # first: no child may outlive an unreachable log
            finally:
                if forks is not None:
                    forks.close()
                heartbeat.stop()
                relay.close()
                self._links.close(LINK_DRAIN_S)
                node_dir.close()
                if self._presence is not None:
                    self._presence.close()
                if self._probe is not None:
                    self._probe.close()
                # Whoever hosts the meeting store ends the job (node 0's, unless it was lost):
                # the others read the end from it, then it seals the log.
                # A node given up on never does, though it may think it hosts the meeting:
                # the plan that moved it away may not have reached it.
                if meeting.here and self.node not in actions.lost_nodes:
                    wait_for_agents(member.own, self._other_agents(actions), outcome.status)
                    self._finish_report(outcome)
                if engine is not None:
                    engine.stop()
                if self.metrics is not None:
                    self.metrics.stop()
                _restore_signals(previous)
                self._log.close()
        if outcome.status is not JobOutcome.COMPLETED:
            print(f"flashrecovery: job {self.job_id} failed: {outcome.detail}", file=sys.stderr)
        return outcome.exit_code

    def _start_job(self, own: JobStore) -> None:
        config = self.config
        self._sign(own)
        self._report(
            JobStarted(
                job_id=self.job_id,
                generation=0,
                source="agent",
                world_size=config.nproc * config.nnodes,
                spares=config.spares,
                heartbeat_interval_s=config.heartbeat_interval_s,
                stall_floor_s=config.stall_floor_s,
                straggler_policy=config.straggler_policy,
                straggler_ratio=config.straggler_ratio,
                straggler_steps=config.straggler_steps,
                nonfinite_policy=config.nonfinite_policy,
                verify_every=config.verify_every,
                log_hold_s=self._log.write_hold_s,
                max_replacements=config.max_replacements,
                max_incidents=config.max_incidents,
                nodes=config.nnodes,
                node_wait_s=config.node_wait_s,
                shards=config.shards,
                store=own.endpoint if config.multinode else None,
            )
        )

    def _other_agents(self, actions: Actions) -> int:
        """How many other agents read the end from this one's store: every joined node not
        lost (a multi-node job's engine knows them), else as the rendezvous counted them."""
        if self.config.multinode and self._engine is not None:
            nodes = list(self._engine.state.nodes.values())
            return sum(1 for view in nodes if not view.lost and view.node != self.node)
        return 0

    def _agent_exited(self, node: int, pid: int) -> None:
        """The presence watch saw another node's agent go (on its thread)."""
        assert self.node is not None
        with contextlib.suppress(LogError):
            self._report(
                AgentExited(
                    job_id=self.job_id,
                    generation=self._generation,
                    source=f"agent:{self.node}",
                    node=node,
                    pid=pid,
                    observer=self.node,
                )
            )

    def _watch_peers(self) -> None:
        """Watch every other node's agent the engine has seen join, and probe the links to the
        next few of them in ring order (of the nodes not given up)."""
        if self._presence is None or self._engine is None or self.node is None:
            return
        live = [view for view in list(self._engine.state.nodes.values()) if not view.lost]
        for view in live:
            if view.presence is not None:
                self._presence.watch(view.node, view.pid, view.presence)
        if self._probe is not None:
            probes = {view.node: view.probe for view in live if view.probe is not None}
            peers = ring_peers(self.node, [n for n in probes if n != self.node])
            self._probe.probe({node: probes[node] for node in peers})

    def _node_heartbeat(self, member: rendezvous.Membership, relay: BeatRelay) -> HeartbeatThread:
        """Say the node joined, then beat for it every interval from a thread of its own,
        carrying its processes' beats of the interval."""
        host, pid = socket.gethostname(), os.getpid()
        envelope: dict[str, Any] = {
            "job_id": self.job_id,
            "generation": 0,
            "source": f"agent:{member.node}",
        }
        multinode = self.config.multinode
        self._report(
            NodeJoined(
                **envelope,
                node=member.node,
                pid=pid,
                host=host,
                ranks=len(member.ranks),
                spares=member.spares,
                store=member.own.endpoint if multinode else None,
                presence=self._presence.endpoint if self._presence is not None else None,
                probe=self._probe.endpoint if self._probe is not None else None,
            )
        )
        thread = HeartbeatThread(
            self._log,
            self.config.heartbeat_interval_s,
            lambda: NodeHeartbeat(
                **envelope,
                node=member.node,
                pid=pid,
                beats=relay.take(),
                links=self._probe.take() if self._probe is not None else [],
            ),
        )
        thread.start()
        return thread

    def _finish_report(self, outcome: Outcome) -> None:
        """Append JobFinished, sealing the log's hash chains, if the log can take it; the exit
        code says the outcome anyway."""
        try:
            self._report(
                JobFinished(
                    job_id=self.job_id,
                    generation=self._generation,
                    source="agent",
                    status=outcome.status,
                    exit_code=outcome.exit_code,
                    detail=outcome.detail,
                    **seal(self._log, self.job_id),
                )
            )
            seal_hash = self._log.chain_head(self.job_id, Stream.EVENTS, "agent")
            print(
                f"flashrecovery: job {self.job_id} sealed, seal hash {seal_hash}", file=sys.stderr
            )
        except LogError as exc:
            log.error("could not record the end of the job", error=str(exc))

    def _serve_metrics(self) -> MetricsServer | None:
        port = self.config.metrics_port
        if port is None:
            return None
        reader = None if self.config.external_engine else self._engine_position
        server = MetricsServer(self.log_url, self.job_id, port, reader_position=reader).start()
        print(f"flashrecovery: metrics on {server.url}", file=sys.stderr, flush=True)
        return server

    def _engine_position(self) -> int:
        return self._engine.next_position if self._engine is not None else 0

    def stop(self) -> None:
        """Ask a running job to end (from another thread): it fails and is torn down."""
        self._stop.set()

    def _supervise(
        self,
        member: rendezvous.Membership,
        meeting: Meeting,
        supervisor: Supervisor,
        actions: Actions,
        engine: EngineLoop | None,
    ) -> Outcome:
        # While the log is briefly away the cursor returns nothing: the children train on.
        decisions = StreamCursor(self._log, Stream.DECISIONS, self.job_id, stop=self._stop)
        # A single node holds every rank; across nodes, training is over once every member
        # passed the last generation's `done` barrier (docs/protocol.md) on the meeting store.
        end = EndWatch(meeting, lambda: self._generation) if self.config.multinode else None
        down_since: float | None = None
        try:
            while True:
                for entry in decisions.poll(FOLLOW_TIMEOUT_S):
                    if isinstance(entry.record, Decision) and self._believed(entry):
                        reason = self._decided(entry.record, meeting, supervisor, actions)
                        if reason is not None:
                            return Outcome(JobOutcome.FAILED, 1, reason)
                actions.tick()
                self._watch_peers()
                if supervisor.all_finished() and (end is None or end.passed.is_set()):
                    return self._completed(meeting)
                if end is not None and end.away_s() > STORE_AWAY_S:
                    return Outcome(
                        JobOutcome.FAILED,
                        1,
                        f"the job's store at {meeting.endpoint} is unreachable, its host is lost "
                        f"(for {end.away_s():.1f}s, and no plan moved it)",
                    )
                if self._stop.is_set():
                    return Outcome(JobOutcome.FAILED, 1, "stopped")
                if engine is not None and engine.error is not None:
                    return Outcome(JobOutcome.FAILED, 1, f"engine stopped: {engine.error!r}")
                if not supervisor.rank_down():
                    down_since = None
                elif down_since is None:
                    down_since = time.monotonic()
                elif time.monotonic() - down_since > STUCK_AFTER_S:
                    why = f"a rank stayed down for {STUCK_AFTER_S:.0f}s"
                    return Outcome(JobOutcome.FAILED, 1, why)
        finally:
            if end is not None:
                end.close()

    def _sign(self, own: JobStore) -> Keyring:
        """The job's keys, from its secret: what this agent writes is signed from now on."""
        if self._keys is None:
            self._keys = Keyring(own.prefix)
            self._log.sign_with(self._keys)
            if self.metrics is not None:
                self.metrics.believe(self._keys)
        return self._keys

    def _believed(self, entry: Entry) -> bool:
        """A decision signed by an engine of the job; one that is not is logged and never
        carried out (docs/protocol.md "Who may write")."""
        assert self._keys is not None and entry.record is not None
        forgery = self._keys.forgery(entry.raw, entry.record)
        if forgery is not None:
            log.warning("decision not believed", position=entry.position, reason=forgery)
        return forgery is None

    def _decided(
        self, decision: Decision, meeting: Meeting, supervisor: Supervisor, actions: Actions
    ) -> str | None:
        """Take one decision in (relay it to the processes, carry it out); why the job must
        end, if it must."""
        self._generation = max(self._generation, decision.generation)
        if meeting.follow(decision):
            supervisor.meet_at(meeting.endpoint)  # where its new processes meet
        if self._links is not None and isinstance(decision, PROCESS_DECISIONS):
            self._links.relay(decision)
        return actions.apply(decision)

    def _completed(self, meeting: Meeting) -> Outcome:
        """Training is over everywhere: the node's last records go out before the seal, and
        the agent hosting the meeting store is told this one has seen the end."""
        if self._links is not None:
            self._links.flush(LINK_DRAIN_S)
        if self.config.multinode and not meeting.here:
            try:
                meeting.keys().add(rendezvous.AGENTS_DONE_KEY, 1)
            except (RuntimeError, ConfigError):  # its host was lost at the very end
                log.warning("the meeting store is gone: the end is not confirmed to it")
        return Outcome(JobOutcome.COMPLETED, 0)

    def _child_env(
        self, member: rendezvous.Membership, meeting: Meeting, relay: BeatRelay
    ) -> dict[str, str]:
        return {
            **_base_env(),
            **member.own.environment(),  # gloo on this node's interface, the job's secret
            **meeting_env(meeting.endpoint),  # the store its generation meets on
            NODE_STORE: member.own.endpoint,  # where its spares wait for a rank
            "WORLD_SIZE": str(self.config.nproc * self.config.nnodes),
            "LOCAL_WORLD_SIZE": str(self.config.nproc),
            "GROUP_RANK": str(self.node),
            "FLASHRECOVERY_JOB_ID": self.job_id,
            "FLASHRECOVERY_LOG": self.log_url,
            "FLASHRECOVERY_HEARTBEAT_INTERVAL": str(self.config.heartbeat_interval_s),
            "FLASHRECOVERY_SHARDS": str(self.config.shards),
            GROUP_REBUILD: self.config.group_rebuild,
            NONFINITE_POLICY: self.config.nonfinite_policy,
            VERIFY_EVERY: str(self.config.verify_every),
            **({probe.ENV: self.config.fault_plan.spec()} if self.config.fault_plan.faults else {}),
            **(
                {final_state.ENV: str(self.config.final_state_dir.resolve())}
                if self.config.final_state_dir
                else {}
            ),
            **(
                {
                    CHECKPOINT_DIR: str(self.config.checkpoint_dir.resolve()),
                    CHECKPOINT_EVERY: str(self.config.checkpoint_every),
                }
                if self.config.checkpoint_dir
                else {}
            ),
            "FLASHRECOVERY_NODE": str(self.node),
            "FLASHRECOVERY_AGENT_SOCKET": relay.path,
            **({exit_note.ENV: str(self._exit_notes)} if self._exit_notes is not None else {}),
            **({"FLASHRECOVERY_AGENT_LINK": self._links.path} if self._links is not None else {}),
        }

    def _on_exit(self, child: Child, code: int) -> None:
        """A waiter thread saw a child end: report it at once, after what it handed over."""
        exit_code, signal_number = (code, None) if code >= 0 else (None, -code)
        note = exit_note.take(self._exit_notes, child.pid) if self._exit_notes else None
        fix = exit_note.advice(note.error, spare=child.rank is None) if note else None
        if note is not None and fix is not None and fix not in self._advised:
            self._advised.add(fix)  # once: every spare meets it alike
            print(f"flashrecovery: {note.error}: {fix}", file=sys.stderr, flush=True)
        if self._links is not None:
            self._links.drain(child.pid, LINK_DRAIN_S)
            if code != 0 and self._links.finished(child.pid):
                log.warning(
                    "a rank's process failed after it finished training: the job goes on to "
                    "its end",
                    rank=child.rank,
                    pid=child.pid,
                    exit_code=exit_code,
                    signal=signal_number,
                )
        self._report(
            RankExited(
                job_id=self.job_id,
                generation=child.generation,
                source=f"agent:{self.node or 0}",  # the one writer the engine believes of it
                rank=child.rank,
                spare_id=child.spare_id,
                pid=child.pid,
                exit_code=exit_code,
                signal=signal_number,
                error=note.error if note else None,
                fatal=bool(note and note.fatal),
                node=self.node or 0,
            )
        )

    def _report(self, record: Envelope) -> None:
        """What the agent tells is part of the protocol (an exit, an activation): ride out a
        log outage rather than lose it."""
        append_through_outage(self._log, Stream.EVENTS, record, LOG_OUTAGE_S)


def wait_for_agents(store: JobStore, expected: int, status: JobOutcome) -> None:
    """The meeting store's host keeps it up until ``expected`` other agents have seen the job
    complete (bounded): they read the end from it."""
    if status is not JobOutcome.COMPLETED:
        return
    keys = store.keys
    deadline = time.monotonic() + NODES_DONE_WAIT_S
    while int(keys.add(rendezvous.AGENTS_DONE_KEY, 0)) < expected:
        if time.monotonic() > deadline:
            log.warning("agents did not confirm the end of the job", expected=expected)
            return
        time.sleep(FOLLOW_TIMEOUT_S)


_Handler = signal.Handlers | int | None | object


def _raise_interrupted(signum: int, frame: FrameType | None) -> None:
    raise Interrupted(signum)


def _handle_signals() -> dict[int, _Handler]:
    """Turn SIGTERM/SIGINT into Interrupted so the job is torn down (main thread only)."""
    if threading.current_thread() is not threading.main_thread():
        return {}
    return {sig: signal.signal(sig, _raise_interrupted) for sig in (signal.SIGTERM, signal.SIGINT)}


def _ignore_signals(previous: dict[int, _Handler]) -> None:
    for sig in previous:
        signal.signal(sig, signal.SIG_IGN)


def _restore_signals(previous: dict[int, _Handler]) -> None:
    for sig, handler in previous.items():
        signal.signal(sig, handler)  # type: ignore[arg-type]
