"""Launch the demo's training job under `flashrecovery run` and own everything it starts.

The demo and the benchmarks drive the agent through its command line, exactly as a user would,
in a session of its own so the whole process tree can be found (psutil) and ended by pid when
the run is over or the caller gives up. Nothing outside that tree is ever signalled. A job of
several nodes runs one agent per loopback "node" (agent/loopback.py), each its own tree.
"""

from __future__ import annotations

import contextlib
import math
import os
import secrets
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from types import TracebackType
from typing import TYPE_CHECKING

import psutil

from flashrecovery.connectors.base import LogConnector
from flashrecovery.connectors.believed import BelievedLog
from flashrecovery.connectors.signing import SECRET, Keyring
from flashrecovery.trainer_hooks import probe  # no torch: only the session imports it

if TYPE_CHECKING:  # the agent package imports torch: only a job of several nodes needs it
    from flashrecovery.agent.loopback import LoopbackNodes
    from flashrecovery.agent.netns import Network

TRAIN_SCRIPT = Path(__file__).resolve().with_name("train.py")  # by path: no torch import here
STOP_GRACE_S = 5.0
# Who reduces the gradients (train.py --parallel): the hook, torch DDP, FSDP2 (over replicas x
# shards, or over all ranks), FSDP2 beside tensor parallel (torchtitan's mesh), tensor parallel
# alone over all ranks, or torch DDP over the replicas of each pipeline stage.
PARALLEL = ("hook", "ddp", "hsdp", "fsdp", "tp-hsdp", "3d", "tp", "pp")
# The layouts with replicas of a sharded state: the mesh of one replica (the mesh's dimensions
# after the first, "dp_replicate"), whose ranks each hold distinct state (run --shards).
REPLICA_MESH = {
    "hsdp": {"dp_shard": 2},
    "tp-hsdp": {"dp_shard": 1, "tp": 2},
    "3d": {"dp_shard": 2, "tp": 2},
    "pp": {"pp": 2},
}
# The layouts with one replica, every rank a shard of it (fsdp: FSDP2 over all ranks; tp: tensor
# parallel over all ranks): a lost rank is restored from the latest checkpoint, saved every
# NO_REPLICA_CHECKPOINT_EVERY steps.
NO_REPLICA = ("fsdp", "tp")
NO_REPLICA_CHECKPOINT_EVERY = 4


def replica_ranks(parallel: str) -> int:
    """The ranks of one replica in a layout of ``REPLICA_MESH``."""
    return math.prod(REPLICA_MESH[parallel].values())


def replica_mesh(parallel: str, nproc: int) -> tuple[tuple[int, ...], tuple[str, ...]]:
    """The shape and dimension names of a layout's mesh over ``nproc`` ranks: the replicas
    first ("dp_replicate"), then one replica's (``REPLICA_MESH``)."""
    replica = REPLICA_MESH[parallel]
    return (nproc // replica_ranks(parallel), *replica.values()), ("dp_replicate", *replica)


def whole_replicas(parallel: str, nproc: int) -> bool:
    """Whether ``nproc`` ranks make 2 or more whole replicas of a layout of ``REPLICA_MESH``."""
    within = replica_ranks(parallel)
    return nproc >= 2 * within and nproc % within == 0


@dataclass(frozen=True)
class JobSpec:
    job_id: str
    log_url: str
    run_dir: Path  # the ranks' result files and the agent's output go here
    nproc: int
    spares: int
    steps: int
    seed: int = 0
    min_step_s: float = 0.0
    agent_args: tuple[str, ...] = ()  # more `flashrecovery run` options (faults, engine…)
    parallel: str = "hook"  # who reduces the gradients: the hook, or torch DDP (train.py)
    script: Path | None = None  # a user's script instead of the demo's model
    script_args: tuple[str, ...] = ()
    nodes: int = 1  # loopback nodes, nproc / nodes ranks each (spares: per node)
    spare_nodes: int = 0
    checkpoint_every: int = 0  # > 0: checkpoints in <run_dir>/checkpoints every this many steps
    fault_plan: str = ""  # tests and chaos only: the job's planned faults (trainer_hooks/probe.py)
    # The job's secret, which its agents (and any engine service) are given: whoever launched
    # the job can check its records' signatures (connectors/signing.py).
    secret: str = field(default_factory=lambda: secrets.token_hex(16), repr=False)

    def command(self) -> list[str]:
        return [
            sys.executable,
            "-m",
            "flashrecovery.cli",
            "run",
            "--nproc-per-node",
            str(self.nproc),
            "--spares",
            str(self.spares),
            "--log",
            self.log_url,
            "--job-id",
            self.job_id,
            *self.run_options(),
            *self.script_command(),
        ]

    def run_options(self) -> list[str]:
        """The `flashrecovery run` options every agent of the job gets."""
        shards = {parallel: ["--shards", str(self.nproc)] for parallel in NO_REPLICA} | {
            parallel: ["--shards", str(replica_ranks(parallel))] for parallel in REPLICA_MESH
        }
        checkpoints = (
            [
                "--checkpoint-dir",
                str(self.run_dir / "checkpoints"),
                "--checkpoint-every",
                str(self.checkpoint_every),
            ]
            if self.checkpoint_every
            else []
        )
        return [*shards.get(self.parallel, []), *checkpoints, *self.agent_args]

    def script_command(self) -> list[str]:
        if self.script is not None:
            return [str(self.script), *self.script_args]
        return [
            str(TRAIN_SCRIPT),
            "--steps",
            str(self.steps),
            "--run-dir",
            str(self.run_dir),
            "--seed",
            str(self.seed),
            "--min-step-s",
            str(self.min_step_s),
            "--parallel",
            self.parallel,
        ]

    def believed(self, log: LogConnector) -> BelievedLog:
        """The job's log as its engine believes it: what its secret did not sign is no record."""
        return BelievedLog(log, Keyring(self.secret))

    def environment(self) -> dict[str, str]:
        """What every agent of the job has in its environment beyond this process's."""
        faults = {probe.ENV: self.fault_plan} if self.fault_plan else {}
        return {SECRET: self.secret, **faults}

    @property
    def agent_output(self) -> Path:
        """Node 0's agent's output."""
        return self.run_dir / ("agent.out" if self.nodes == 1 else "agents/node0.log")

    def loopback_nodes(self, network: Network | None = None) -> LoopbackNodes:
        """The job's nodes on this machine: on loopback, or each in a host of ``network``."""
        from flashrecovery.agent.loopback import LoopbackNodes

        script, *script_args = self.script_command()
        return LoopbackNodes(
            script=Path(script),
            script_args=script_args,
            log_url=self.log_url,
            job_id=self.job_id,
            nnodes=self.nodes,
            nproc=self.nproc // self.nodes,
            spares=self.spares,
            spare_nodes=self.spare_nodes,
            agent_args=self.run_options(),
            output_dir=self.agent_output.parent,
            environment=self.environment(),
            network=network,
        )


class LaunchedJob:
    """A running `flashrecovery run` and its descendants; a context manager that ends them.
    ``network``: its nodes each in a host of it (agent/netns.py)."""

    def __init__(self, spec: JobSpec, network: Network | None = None) -> None:
        self.spec = spec
        spec.run_dir.mkdir(parents=True, exist_ok=True)
        self._nodes: LoopbackNodes | None = None
        if spec.nodes > 1:
            self._nodes = spec.loopback_nodes(network).start()
            self._agents = list(self._nodes.agents.values())
        else:
            with spec.agent_output.open("wb") as out:
                self._agents = [
                    subprocess.Popen(
                        spec.command(),
                        env={**os.environ, **spec.environment()},
                        stdin=subprocess.DEVNULL,
                        stdout=out,
                        stderr=subprocess.STDOUT,
                        start_new_session=True,
                    )
                ]
        self._killed: set[int] = set()  # nodes killed or cut off: their agents' ends are theirs
        self.started = time.time()

    @property
    def pid(self) -> int:
        """Node 0's agent's."""
        return self._agents[0].pid

    def _survivors(self) -> list[subprocess.Popen[bytes]]:
        return [agent for node, agent in enumerate(self._agents) if node not in self._killed]

    def kill_node(self, node: int) -> float | None:
        """SIGKILL a node's agent and its process group (its ranks then exit on their own,
        as on a machine that is lost); the unix time it was sent, or None if no such node."""
        if self._nodes is None or node not in self._nodes.agents:
            return None
        self._killed.add(node)
        sent = time.time()  # before: the agent may date the exit before this thread runs again
        self._nodes.signal_node(node, signal.SIGKILL)
        return sent

    def lose_node(self, node: int) -> None:
        """The node is cut off: the job goes on without it, and its agent's exit (it ends once
        it learns it was given up on) is not the job's."""
        self._killed.add(node)

    def wait_lost(self, timeout: float) -> bool:
        """Wait for the agents of the nodes given up on to end; whether they all did."""
        deadline = time.monotonic() + timeout
        for node in self._killed:
            with contextlib.suppress(subprocess.TimeoutExpired):
                self._agents[node].wait(max(deadline - time.monotonic(), 0.0))
        return all(self._agents[node].poll() is not None for node in self._killed)

    def poll(self) -> int | None:
        """The job's exit code once every agent not killed has ended (the first that failed
        says how), None while one runs."""
        codes = [agent.poll() for agent in self._survivors()]
        if None in codes:
            return None
        return next((code for code in codes if code), 0)

    def wait(self, timeout: float) -> int | None:
        """The job's exit code once it ends, or None if it still runs after ``timeout``."""
        deadline = time.monotonic() + timeout
        for agent in self._survivors():
            with contextlib.suppress(subprocess.TimeoutExpired):
                agent.wait(max(deadline - time.monotonic(), 0.0))
        return self.poll()

    def descendants(self) -> dict[int, psutil.Process]:
        found: dict[int, psutil.Process] = {}
        for agent in self._agents:
            with contextlib.suppress(psutil.NoSuchProcess):
                found.update((p.pid, p) for p in psutil.Process(agent.pid).children(recursive=True))
        return found

    def kill_descendant(self, pid: int, sig: signal.Signals = signal.SIGKILL) -> float | None:
        """Send ``sig`` (SIGKILL unless told) to one process of this job; the unix time it was
        sent, or None if the process is not (or no longer) ours."""
        process = self.descendants().get(pid)
        if process is None:
            return None
        sent = time.time()  # before: the agent may date the exit before this thread runs again
        try:
            process.send_signal(sig)
        except psutil.NoSuchProcess:
            return None
        return sent

    def output_tail(self, lines: int = 20) -> str:
        try:
            text = self.spec.agent_output.read_text(errors="replace")
        except OSError:
            return ""
        return "\n".join(text.splitlines()[-lines:])

    def stop(self) -> int | None:
        """End the agents (SIGTERM, SIGKILL after a grace) and then whatever they left behind."""
        tree = self.descendants()
        for agent in self._agents:
            if agent.poll() is None:
                agent.send_signal(signal.SIGCONT)  # a stopped node, if a test stopped one
                agent.send_signal(signal.SIGTERM)
        for agent in self._agents:
            with contextlib.suppress(subprocess.TimeoutExpired):
                agent.wait(STOP_GRACE_S)
        tree.update(self.descendants())
        for agent in self._agents:
            if agent.poll() is None:
                agent.kill()
                agent.wait(STOP_GRACE_S)
        left = [p for p in tree.values() if p.is_running()]
        for process in left:
            with contextlib.suppress(psutil.NoSuchProcess):
                process.kill()
        psutil.wait_procs(left, timeout=STOP_GRACE_S)
        return self.poll()

    def __enter__(self) -> LaunchedJob:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()
