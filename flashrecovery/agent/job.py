"""The agent of one job: hosts the store, runs the engine, starts the processes, carries out
the decisions and ends the job with its status (docs/protocol.md)."""

from __future__ import annotations

import datetime
import os
import signal
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from types import FrameType

import structlog

import flashrecovery
from flashrecovery.agent.actions import SPAWNS_PER_S, Actions, SpawnBudget
from flashrecovery.agent.config import AgentConfig
from flashrecovery.agent.store import JobStore
from flashrecovery.agent.supervisor import Child, Supervisor
from flashrecovery.chain import seal
from flashrecovery.connectors import open_log
from flashrecovery.connectors.follow import StreamCursor, append_through_outage
from flashrecovery.engine.loop import EngineLoop
from flashrecovery.errors import LogError
from flashrecovery.observe.exporter import MetricsServer
from flashrecovery.records import Decision, Envelope, JobFinished, JobStarted, RankExited, Stream
from flashrecovery.trainer_hooks import final_state

log = structlog.get_logger("flashrecovery.agent")
FOLLOW_TIMEOUT_S = 0.1  # how often the agent looks at its children between decisions
STORE_TIMEOUT = datetime.timedelta(seconds=60)
STUCK_AFTER_S = 120.0  # a rank has had no live process this long: nothing will recover it
LOG_OUTAGE_S = 60.0  # how long a record is retried while the log is away


class Interrupted(BaseException):
    """SIGTERM (or SIGINT) reached the agent: tear the job down."""

    def __init__(self, signum: int) -> None:
        super().__init__(signum)
        self.signum = signum


@dataclass(frozen=True)
class Outcome:
    status: str  # "completed" | "failed"
    exit_code: int
    detail: str = ""


class Agent:
    """``Agent(config).run()`` runs the job to its end and returns the exit code. Child PIDs are
    in the log (RankJoined, SpareReady, SpareActivated, ReplacementSpawned records)."""

    def __init__(self, config: AgentConfig) -> None:
        self.config = config.resolved()  # ConfigError before anything starts
        assert self.config.job_id is not None and self.config.log_url is not None
        self.job_id: str = self.config.job_id
        self.log_url: str = self.config.log_url
        self._log = open_log(self.log_url)
        self._stop = threading.Event()
        self._generation = 0  # the newest generation a decision named
        self.metrics: MetricsServer | None = None  # serving before the first rank starts
        self._engine: EngineLoop | None = None

    def run(self) -> int:
        config = self.config
        try:  # first: a port in use ends the job before anything starts
            self.metrics = self._serve_metrics()
        except OSError as exc:
            print(f"flashrecovery run: error: metrics port: {exc}", file=sys.stderr)
            self._log.close()
            return 2
        store = JobStore.open(STORE_TIMEOUT)
        self._report(
            JobStarted(
                job_id=self.job_id,
                generation=0,
                source="agent",
                world_size=config.nproc,
                spares=config.spares,
                heartbeat_interval_s=config.heartbeat_interval_s,
                stall_floor_s=config.stall_floor_s,
                max_replacements=config.max_replacements,
                max_incidents=config.max_incidents,
                shards=config.shards,
            )
        )
        engine = None if config.external_engine else EngineLoop(self.log_url, self.job_id).start()
        self._engine = engine
        supervisor = Supervisor(
            [sys.executable, str(config.script), *config.script_args],
            self._child_env(store),
            self._on_exit,
            config.output_dir,
        )
        actions = Actions(
            supervisor,
            store.keys,
            self._report,
            self.job_id,
            config.spares,
            SpawnBudget(config.nproc + config.spares, SPAWNS_PER_S),
            refill_at_once=config.spare_refill == "immediate",
        )
        previous = _handle_signals()
        outcome = Outcome("failed", 1, "interrupted")
        try:
            for rank in range(config.nproc):
                supervisor.spawn_rank(rank, fault=config.faults.get(rank))
            for _ in range(config.spares):
                supervisor.spawn_spare()
            outcome = self._supervise(supervisor, actions, engine)
        except Interrupted as exc:
            outcome = Outcome("failed", 128 + exc.signum, f"interrupted by signal {exc.signum}")
        finally:
            _ignore_signals(previous)  # a second Ctrl-C must not cut the teardown short
            try:
                supervisor.teardown()  # first: no child may outlive an unreachable log
            finally:
                self._finish_report(outcome)
                if engine is not None:
                    engine.stop()
                if self.metrics is not None:
                    self.metrics.stop()
                _restore_signals(previous)
                self._log.close()
        if outcome.status != "completed":
            print(f"flashrecovery: job {self.job_id} failed: {outcome.detail}", file=sys.stderr)
        return outcome.exit_code

    def _finish_report(self, outcome: Outcome) -> None:
        """Append JobFinished, sealing the log's hash chains, if the log can take it; the exit
        code says the outcome anyway."""
        try:
            self._report(
                JobFinished(
                    job_id=self.job_id,
                    generation=self._generation,
                    source="agent",
                    status="completed" if outcome.status == "completed" else "failed",
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
        self, supervisor: Supervisor, actions: Actions, engine: EngineLoop | None
    ) -> Outcome:
        # While the log is briefly away the cursor returns nothing: the children train on.
        decisions = StreamCursor(self._log, Stream.DECISIONS, self.job_id, stop=self._stop)
        world = self.config.nproc
        down_since: float | None = None
        while True:
            for entry in decisions.poll(FOLLOW_TIMEOUT_S):
                if isinstance(entry.record, Decision):
                    self._generation = max(self._generation, entry.record.generation)
                    reason = actions.apply(entry.record)
                    if reason is not None:
                        return Outcome("failed", 1, reason)
            actions.tick()
            if supervisor.ranks_done(world):
                return Outcome("completed", 0)
            if self._stop.is_set():
                return Outcome("failed", 1, "stopped")
            if engine is not None and engine.error is not None:
                return Outcome("failed", 1, f"engine stopped: {engine.error!r}")
            if not supervisor.rank_down(world):
                down_since = None
            elif down_since is None:
                down_since = time.monotonic()
            elif time.monotonic() - down_since > STUCK_AFTER_S:
                return Outcome("failed", 1, f"a rank stayed down for {STUCK_AFTER_S:.0f}s")

    def _child_env(self, store: JobStore) -> dict[str, str]:
        inherited = {
            k: v
            for k, v in os.environ.items()
            if not k.startswith("FLASHRECOVERY_") and k not in ("RANK", "LOCAL_RANK")
        }
        # The ranks must speak the agent's protocol: import the agent's flashrecovery first.
        package_root = str(Path(flashrecovery.__file__).resolve().parent.parent)
        python_path = os.pathsep.join(filter(None, [package_root, os.environ.get("PYTHONPATH")]))
        return {
            **inherited,
            **store.environment(),
            "PYTHONPATH": python_path,
            "WORLD_SIZE": str(self.config.nproc),
            "OMP_NUM_THREADS": "1",
            "FLASHRECOVERY_JOB_ID": self.job_id,
            "FLASHRECOVERY_LOG": self.log_url,
            "FLASHRECOVERY_HEARTBEAT_INTERVAL": str(self.config.heartbeat_interval_s),
            "FLASHRECOVERY_SHARDS": str(self.config.shards),
            **(
                {"FLASHRECOVERY_FAULT_PLAN": self.config.fault_plan.spec()}
                if self.config.fault_plan.entries
                else {}
            ),
            **(
                {final_state.ENV: str(self.config.final_state_dir.resolve())}
                if self.config.final_state_dir
                else {}
            ),
        }

    def _on_exit(self, child: Child, code: int) -> None:
        """A waiter thread saw a child end: report it at once."""
        self._report(
            RankExited(
                job_id=self.job_id,
                generation=child.generation,
                source="agent",
                rank=child.rank,
                spare_id=child.spare_id,
                pid=child.pid,
                exit_code=code if code >= 0 else None,
                signal=-code if code < 0 else None,
            )
        )

    def _report(self, record: Envelope) -> None:
        """What the agent tells is part of the protocol (an exit, an activation): ride out a
        log outage rather than lose it."""
        append_through_outage(self._log, Stream.EVENTS, record, LOG_OUTAGE_S)


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
