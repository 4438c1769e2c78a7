"""Several "nodes" on one machine: one `flashrecovery run` agent per node, each a process of
its own in its own process group, meeting at a loopback rendezvous endpoint — or, given a
``Network`` (agent/netns.py), each node in a network namespace of its own with an address of
its own, so that a node can be cut off instead of killed. What the demo, chaos, the live tests
and the bench use to try multi-node jobs without a cluster (docs/multinode.md).
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
from flashrecovery.agent.config import LOOPBACK
from flashrecovery.agent.netns import Network

RDZV_PORT = 29500  # node 0's, in a network of its own

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
    control_plane: bool = False  # the store and engine in a process of their own
    control_args: list[str] = field(default_factory=list)  # more `control-plane` options
    environment: dict[str, str] = field(default_factory=dict)  # more for every agent's
    network: Network | None = None  # node k in its host "n<k>", else all on loopback
    agents: dict[int, subprocess.Popen[bytes]] = field(default_factory=dict)
    control: subprocess.Popen[bytes] | None = None  # the control plane's process
    port: int = field(default_factory=free_port)
    _secret: str = field(default_factory=lambda: secrets.token_hex(16), repr=False)

    @property
    def endpoint(self) -> str:
        if self.network is not None:
            return f"{self.network.hosts['n0'].address}:{RDZV_PORT}"
        return f"{LOOPBACK}:{self.port}"

    @staticmethod
    def host_of(node: int) -> str:
        """The name of node ``node``'s host in the network."""
        return f"n{node}"

    def start(self) -> LoopbackNodes:
        if self.control_plane:
            command = ["control-plane", "--log", self.log_url, "--bind", self.endpoint]
            command += ["--job-id", self.job_id, *self.control_args]
            self.control = self._popen(command, "control-plane")
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
            *("run", "--nnodes", str(self.nnodes), "--node-rank", node_rank),
            *("--rdzv-endpoint", self.endpoint, "--nproc-per-node", str(self.nproc)),
            *("--spares", str(self.spares), "--spare-nodes", str(self.spare_nodes)),
            *("--log", self.log_url),
        ]
        if node == 0:
            command += ["--job-id", self.job_id]
        if self.control_plane:
            command += ["--control-plane"]
        if self.output_dir is not None:
            command += ["--output-dir", str(self.output_dir / f"node{node}")]
        command += [*self.agent_args, str(self.script), *self.script_args]
        self.agents[node] = self._popen(command, f"node{node}", self.host_of(node))

    def _popen(
        self, command: list[str], name: str, host: str | None = None
    ) -> subprocess.Popen[bytes]:
        """A `flashrecovery` command in a process group of its own (in ``host``'s network, if
        there is one), its output in ``output_dir/name.log``."""
        output = None
        if self.output_dir is not None:
            self.output_dir.mkdir(parents=True, exist_ok=True)
            output = open(self.output_dir / f"{name}.log", "wb")  # noqa: SIM115
        package_root = str(Path(flashrecovery.__file__).resolve().parent.parent)
        python_path = os.pathsep.join(filter(None, [package_root, os.environ.get("PYTHONPATH")]))
        env = {
            **os.environ,
            "FLASHRECOVERY_STORE_PREFIX": self._secret,
            **self.environment,  # the job's own secret, if it has one
            "PYTHONPATH": python_path,
        }
        argv = [sys.executable, "-m", "flashrecovery.cli", *command]
        if self.network is not None and host is not None:
            argv = self.network.hosts[host].command(argv)
        try:
            return subprocess.Popen(
                argv,
                env=env,
                stdout=output,
                stderr=subprocess.STDOUT if output else None,
                start_new_session=True,  # a node is its agent's process group
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
        """End every agent still running, then the control plane (a stopped process is
        resumed first, so it can tear its own down)."""
        processes = list(self.agents.values())
        for group in (processes, [self.control] if self.control else []):
            for process in group:
                if process.poll() is None:
                    with contextlib.suppress(ProcessLookupError):
                        os.killpg(process.pid, signal.SIGCONT)
                        process.send_signal(signal.SIGTERM)
            for process in group:
                try:
                    process.wait(TEARDOWN_S)
                except subprocess.TimeoutExpired:
                    with contextlib.suppress(ProcessLookupError):
                        os.killpg(process.pid, signal.SIGKILL)
                    process.wait(TEARDOWN_S)
