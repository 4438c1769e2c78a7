"""Several "nodes" on one machine: one `flashrecovery run` agent per node, each a process of
its own in its own process group, meeting at a loopback rendezvous endpoint. What the demo, the
live tests and the bench use to try multi-node jobs (and whole-node failures: a signal to an
agent's process group) without a cluster (docs/multinode.md).
"""

from __future__ import annotations

import contextlib
import os
import secrets
import signal
import socket
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path

import flashrecovery
from flashrecovery.agent.store import LOOPBACK

TEARDOWN_S = 10.0  # an agent's own teardown takes a few seconds (agent/supervisor.py)


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind((LOOPBACK, 0))
        port: int = probe.getsockname()[1]
        return port


@dataclass
class LoopbackNodes:
    """``start()`` launches nodes 0..nnodes+spare_nodes-1, ``add_node()`` one more with
    ``--node-rank auto``; ``agents`` maps node rank -> its agent's process."""

    script: Path
    script_args: list[str]
    log_url: str
    job_id: str
    nnodes: int = 2
    nproc: int = 2
    spares: int = 0
    spare_nodes: int = 0
    agent_args: list[str] = field(default_factory=list)  # more `run` options, for every agent
    output_dir: Path | None = None  # each agent's output in node{K}.log, its children's beside
    agents: dict[int, subprocess.Popen[bytes]] = field(default_factory=dict)
    port: int = field(default_factory=free_port)
    _secret: str = field(default_factory=lambda: secrets.token_hex(16), repr=False)

    @property
    def endpoint(self) -> str:
        return f"{LOOPBACK}:{self.port}"

    def start(self) -> LoopbackNodes:
        for node in range(self.nnodes + self.spare_nodes):
            self._launch(str(node), node)
        return self

    def add_node(self) -> int:
        """A node joining the running job (it becomes a spare node); returns its index here,
        which is its node rank when nodes join one at a time."""
        node = max(self.agents, default=-1) + 1
        self._launch("auto", node)
        return node

    def _launch(self, node_rank: str, node: int) -> None:
        command = [
            *(sys.executable, "-m", "flashrecovery.cli", "run"),
            *("--nnodes", str(self.nnodes), "--node-rank", node_rank),
            *("--rdzv-endpoint", self.endpoint, "--nproc-per-node", str(self.nproc)),
            *("--spares", str(self.spares), "--spare-nodes", str(self.spare_nodes)),
            *("--log", self.log_url),
        ]
        if node == 0:
            command += ["--job-id", self.job_id]
        output = None
        if self.output_dir is not None:
            self.output_dir.mkdir(parents=True, exist_ok=True)
            command += ["--output-dir", str(self.output_dir / f"node{node}")]
            output = open(self.output_dir / f"node{node}.log", "wb")  # noqa: SIM115
        command += [*self.agent_args, str(self.script), *self.script_args]
        package_root = str(Path(flashrecovery.__file__).resolve().parent.parent)
        python_path = os.pathsep.join(filter(None, [package_root, os.environ.get("PYTHONPATH")]))
        env = {**os.environ, "PYTHONPATH": python_path, "FLASHRECOVERY_STORE_PREFIX": self._secret}
        try:
            self.agents[node] = subprocess.Popen(
                command,
                env=env,
                stdout=output,
                stderr=subprocess.STDOUT if output else None,
                start_new_session=True,  # the node is the agent's process group
            )
        finally:
            if output is not None:
                output.close()

    def signal_node(self, node: int, sig: signal.Signals) -> None:
        """Send ``sig`` to the node's agent and its process group (SIGKILL: the node is lost,
        its ranks notice their agent is gone and exit; SIGSTOP: it is silent)."""
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.agents[node].pid, sig)

    def wait(self, node: int, timeout: float) -> int | None:
        """The agent's exit code, or None if it still runs after ``timeout``."""
        try:
            return self.agents[node].wait(timeout)
        except subprocess.TimeoutExpired:
            return None

    def teardown(self) -> None:
        """End every agent still running (a stopped one is resumed first, so it can tear its
        processes down)."""
        for node in self.agents:
            if self.agents[node].poll() is None:
                self.signal_node(node, signal.SIGCONT)
                with contextlib.suppress(ProcessLookupError):
                    self.agents[node].send_signal(signal.SIGTERM)
        for node, agent in self.agents.items():
            try:
                agent.wait(TEARDOWN_S)
            except subprocess.TimeoutExpired:
                self.signal_node(node, signal.SIGKILL)
                agent.wait(TEARDOWN_S)
