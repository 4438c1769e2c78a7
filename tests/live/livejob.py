"""Live jobs for the tests: real processes, real SIGKILL, gloo, an sqlite log in tmp_path.

``run_job`` runs the agent in a thread, follows the job's log and SIGKILLs a rank from outside
when the log shows it committed a given step; then it checks that no process of the job is left.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import psutil
import torch

from flashrecovery.agent import Agent, AgentConfig
from flashrecovery.agent.config import RunAs
from flashrecovery.connectors import LogConnector, open_log
from flashrecovery.connectors.follow import StreamCursor
from flashrecovery.connectors.signing import SECRET
from flashrecovery.records import Envelope, NonFinitePolicy, StragglerPolicy, Stream
from flashrecovery.trainer_hooks.digest import DEFAULT_VERIFY_EVERY
from flashrecovery.trainer_hooks.probe import FaultPlan

SCRIPT = Path(__file__).parent.parent / "scripts" / "train_mlp.py"
EXAMPLES = Path(__file__).parent.parent.parent / "examples"
WORLD = 3
STEPS = 30
STEP_TIME_S = 0.02  # simulated compute, so that a kill lands at a known step
HEARTBEAT_S = 1.0  # missed after 3 s: imports hold the GIL for long stretches on 2 busy cores
JOB_TIMEOUT_S = 90.0
OPENED: list[LogConnector] = []  # the logs run_job opened for its callers to read


@dataclass
class JobResult:
    exit_code: int
    log: LogConnector
    job_id: str
    out: Path
    killed: dict[int, int] = field(default_factory=dict)  # rank -> pid killed from outside

    def records(self, stream: Stream = Stream.EVENTS, type: str | None = None) -> list[Any]:
        entries = self.log.read(stream, self.job_id)
        return [e.record for e in entries if type is None or e.record.type == type]

    def decisions(self, type: str) -> list[Any]:
        return self.records(Stream.DECISIONS, type)

    def final(self, rank: int) -> dict[str, Any]:
        """What the rank's last process wrote: its parameters and its pid."""
        saved: dict[str, Any] = torch.load(self.out / f"rank{rank}.pt")
        return saved

    def final_state(self, rank: int) -> dict[str, Any]:
        """What the rank's last process left under --final-state (a job without the harness's
        --out): its parameters' digest and its pid."""
        saved: dict[str, Any] = json.loads((self.out / f"rank{rank}.json").read_text())
        return saved

    def pids(self) -> set[int]:
        """Every process the job's agent started, from the log (the agent's own node records
        name the agent, here the test's process)."""
        return {
            r.pid
            for r in self.records()
            if hasattr(r, "pid") and r.type not in ("heartbeat", "node_joined", "node_heartbeat")
        }


@dataclass
class Processes:
    """What the log has said so far about who holds what."""

    ranks: dict[int, int] = field(default_factory=dict)  # rank -> pid of its current process
    spares: dict[int, int] = field(default_factory=dict)  # spare id -> pid, once ready

    def observe(self, record: Envelope) -> None:
        if record.type in ("rank_joined", "spare_activated", "replacement_spawned"):
            self.ranks[record.rank] = record.pid  # type: ignore[attr-defined]
        if record.type == "spare_ready":
            self.spares[record.spare_id] = record.pid  # type: ignore[attr-defined]


# A step of a scenario: called with each new event and the processes known so far; returns True
# once it has done its part (the next step is then called from the following event on).
Scenario = Callable[[Envelope, Processes], bool]


ENGINE = [sys.executable, "-m", "flashrecovery.cli", "engine", "--lease-ttl", "1.0"]


# The job's secret when its engines are services of their own (they sign with it too).
ENGINE_SECRET = "livejob-engines-share-this-secret"


@contextlib.contextmanager
def engine_services(log_url: str, out: Path) -> Iterator[dict[str, subprocess.Popen[bytes]]]:
    """Two `flashrecovery engine` services, "a" and "b", sharing the job; ended on the way out.
    What each says goes to ``out/engine-<name>.log`` and to the test's captured output (shown
    when it fails)."""
    logs = {name: out / f"engine-{name}.log" for name in ("a", "b")}
    engines = {}
    for name, path in logs.items():
        with path.open("wb") as sink:
            engines[name] = subprocess.Popen(
                [*ENGINE, "--log", log_url, "--job", "live", "--engine-id", name],
                stdout=sink,
                stderr=subprocess.STDOUT,
                env={**os.environ, "FLASHRECOVERY_LOG_LEVEL": "info", SECRET: ENGINE_SECRET},
            )
    try:
        yield engines
    finally:
        for proc in engines.values():
            if proc.poll() is None:
                proc.kill()
            proc.wait(timeout=30)
        for name, path in logs.items():
            print(f"--- engine {name} said:\n{path.read_text(errors='replace')[-4000:]}")


def _alive(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def run_job(
    tmp_path: Path,
    *,
    nproc: int = WORLD,
    spares: int = 0,
    fault_plan: list[str] | None = None,
    kill_at: dict[int, int] | None = None,
    log_url: str | None = None,
    stall_floor_s: float = 5.0,
    external_engine: bool = False,
    step_time_s: float = STEP_TIME_S,
    script: Path = SCRIPT,
    script_args: list[str] | None = None,
    scenario: list[Scenario] | None = None,
    max_replacements: int = 3,
    spare_refill: str = "immediate",
    metrics_port: int | None = None,
    shards: int = 1,
    checkpoint_every: int = 0,  # > 0: checkpoints in tmp_path/checkpoints
    start_method: str = "forkserver",
    group_rebuild: str = "fresh",
    run_as: RunAs = RunAs.SCRIPT,
    nonfinite_policy: NonFinitePolicy = NonFinitePolicy.FAIL,
    verify_every: int = DEFAULT_VERIFY_EVERY,
    straggler_policy: StragglerPolicy = StragglerPolicy.REPORT,
    straggler_steps: int = 20,
    store_secret: str | None = None,  # the job's (else the agent makes one)
    harness: bool = True,  # the script takes --out and --step-time; else --final-state only
    heartbeat_interval_s: float = HEARTBEAT_S,
) -> JobResult:
    """Run the training script on ``nproc`` ranks; ``kill_at`` maps rank -> the step after whose
    commit (as the log shows it) the rank's process is SIGKILLed from outside; ``scenario``
    steps run in order as the events arrive."""
    out = tmp_path / "out"
    out.mkdir(parents=True)
    args = ["--out", str(out), "--step-time", str(step_time_s)] if harness else []
    if script == SCRIPT:  # an example script has its own length (STEPS steps too)
        args += ["--steps", str(STEPS)]
    agent = Agent(
        AgentConfig(
            script=script,
            script_args=[*args, *(script_args or [])],
            nproc=nproc,
            spares=spares,
            log_url=log_url or f"sqlite:///{tmp_path / 'log.db'}",
            job_id="live",
            heartbeat_interval_s=heartbeat_interval_s,
            stall_floor_s=stall_floor_s,
            external_engine=external_engine,
            fault_plan=FaultPlan.parse(",".join(fault_plan or [])),
            output_dir=tmp_path / "output",
            max_replacements=max_replacements,
            spare_refill=spare_refill,
            metrics_port=metrics_port,
            shards=shards,
            checkpoint_dir=tmp_path / "checkpoints" if checkpoint_every else None,
            checkpoint_every=checkpoint_every,
            start_method=start_method,
            group_rebuild=group_rebuild,
            run_as=run_as,
            nonfinite_policy=nonfinite_policy,
            verify_every=verify_every,
            straggler_policy=straggler_policy,
            straggler_steps=straggler_steps,
            store_secret=ENGINE_SECRET if external_engine and not store_secret else store_secret,
            final_state_dir=None if harness else out,
        )
    )
    result: dict[str, int] = {}
    thread = threading.Thread(target=lambda: result.setdefault("code", agent.run()), daemon=True)
    thread.start()
    log = open_log(agent.log_url)
    OPENED.append(log)  # closed after the test (conftest.py): a Kafka client left open
    # reconnects to a cluster a later module stopped, until the process runs out of fds
    pending, known, killed = dict(kill_at or {}), Processes(), {}
    steps = list(scenario or [])
    events = StreamCursor(log, Stream.EVENTS, agent.job_id)  # rides out a broker restart
    deadline = time.monotonic() + JOB_TIMEOUT_S
    while thread.is_alive():
        if time.monotonic() > deadline:
            agent.stop()
        for entry in events.poll(0.2):
            record = entry.record
            assert record is not None, entry.error
            known.observe(record)
            due = pending.get(getattr(record, "rank", -1))
            if record.type == "step_completed" and due is not None and due <= record.step:
                os.kill(known.ranks[record.rank], signal.SIGKILL)
                killed[record.rank] = known.ranks[record.rank]
                del pending[record.rank]
            if steps and steps[0](record, known):
                steps.pop(0)
    thread.join(JOB_TIMEOUT_S)
    job = JobResult(result.get("code", -1), log, agent.job_id, out, killed)
    left = [pid for pid in job.pids() if _alive(pid)]
    assert not left, f"processes of the job still running: {left}"
    return job
