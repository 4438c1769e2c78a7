"""Live multi-node jobs for the tests: loopback "nodes" (one agent process each, its own
process group), real signals to a rank or to a whole node, an sqlite log in tmp_path.

``run_nodes`` follows the job's log and runs the scenario's steps as events arrive (each may
signal a rank, a node, or start a node); it ends when every agent has exited (or at its
deadline), ends whatever is left, and checks that no process of the job is left.
"""

from __future__ import annotations

import os
import signal
import subprocess
import time
from collections.abc import Callable
from pathlib import Path

from livejob import HEARTBEAT_S, SCRIPT, STEP_TIME_S, STEPS, JobResult, Processes, _alive

from flashrecovery.agent.loopback import LoopbackNodes
from flashrecovery.connectors import LogConnector, open_log
from flashrecovery.errors import LogError
from flashrecovery.records import Envelope, SpareReady, StepCompleted, Stream

NODES_TIMEOUT_S = 150.0
CONTROL = -1  # the control plane's exit code in run_nodes' codes

# A step of a scenario: called with each new event, the processes known so far and the nodes;
# returns True once it has done its part.
NodeScenario = Callable[[Envelope, Processes, LoopbackNodes], bool]


def run_nodes(
    tmp_path: Path,
    *,
    nnodes: int = 2,
    nproc: int = 2,
    spares: int = 1,
    spare_nodes: int = 0,
    control_plane: bool = False,
    control_args: list[str] | None = None,
    log_url: str | None = None,
    scenario: list[NodeScenario] | None = None,
    script_args: list[str] | None = None,
) -> tuple[JobResult, dict[int, int | None]]:
    """Run the training script on ``nnodes`` x ``nproc`` ranks; returns the job and each
    agent's exit code (None: it had to be ended), and the control plane's under CONTROL."""
    out = tmp_path / "out"
    out.mkdir()
    args = ["--steps", str(STEPS), "--out", str(out), "--step-time", str(STEP_TIME_S)]
    nodes = LoopbackNodes(
        script=SCRIPT,
        script_args=[*args, *(script_args or [])],
        log_url=log_url or f"sqlite:///{tmp_path / 'log.db'}",
        job_id="nodes",
        nnodes=nnodes,
        nproc=nproc,
        spares=spares,
        spare_nodes=spare_nodes,
        control_plane=control_plane,
        control_args=control_args or [],
        agent_args=["--heartbeat-interval", str(HEARTBEAT_S)],
        output_dir=tmp_path / "output",
    ).start()
    deadline = time.monotonic() + NODES_TIMEOUT_S
    codes: dict[int, int | None] = {}
    try:
        log = _opened(nodes, deadline)
        known, steps, position = Processes(), list(scenario or []), 0
        while time.monotonic() < deadline and any(nodes.wait(n, 0) is None for n in nodes.agents):
            for entry in log.follow(Stream.EVENTS, nodes.job_id, position, 0.2):
                position = entry.position + 1
                record = entry.record
                assert record is not None, entry.error
                known.observe(record)
                if steps and steps[0](record, known, nodes):
                    steps.pop(0)
        codes = {node: nodes.wait(node, 10.0) for node in nodes.agents}
        if nodes.control is not None:
            try:
                codes[CONTROL] = nodes.control.wait(15.0)
            except subprocess.TimeoutExpired:
                codes[CONTROL] = None
    finally:
        nodes.teardown()
        _say_what_agents_said(tmp_path / "output")
    code = codes.get(0)
    job = JobResult(-1 if code is None else code, log, nodes.job_id, out)
    ours = {*job.pids(), *(a.pid for a in nodes.agents.values())}
    if nodes.control is not None:
        ours.add(nodes.control.pid)
    left = [pid for pid in ours if _alive(pid)]
    assert not left, f"processes of the job still running: {left}"
    return job, codes


def _say_what_agents_said(output: Path) -> None:
    """Each agent's and the control plane's own lines (why it ended, if it failed) go to
    the test's output, shown when the test fails."""
    for path in sorted(output.glob("*.log")):
        text = path.read_text(errors="replace").replace("flashrecovery:", "\nflashrecovery:")
        for line in text.splitlines():
            if line.startswith("flashrecovery:"):
                print(f"{path.stem}: {line}")


def _opened(nodes: LoopbackNodes, deadline: float) -> LogConnector:
    """The job's log, once node 0 has created it (read only: the tests create nothing)."""
    while True:
        try:
            return open_log(nodes.log_url, read_only=True)
        except LogError:
            assert nodes.wait(0, 0.2) is None, "node 0 ended before it opened the log"
            assert time.monotonic() < deadline, "node 0 never opened the log"


def when(
    happened: Callable[[Envelope], bool], act: Callable[[Processes, LoopbackNodes], object]
) -> NodeScenario:
    """A scenario step: ``act`` once the first record for which ``happened`` holds arrives."""

    def scenario(record: Envelope, known: Processes, nodes: LoopbackNodes) -> bool:
        if happened(record):
            act(known, nodes)
            return True
        return False

    return scenario


def committed(rank: int, step: int) -> Callable[[Envelope], bool]:
    """``rank`` completed ``step`` or a later one (a step before it may have waited)."""
    return lambda r: isinstance(r, StepCompleted) and r.rank == rank and r.step >= step


def spares_ready(node: int, count: int) -> Callable[[Envelope], bool]:
    """The ``count``-th spare of ``node`` reported ready."""
    seen: set[int] = set()

    def ready(r: Envelope) -> bool:
        if isinstance(r, SpareReady) and r.node == node:
            seen.add(r.spare_id)
        return len(seen) >= count

    return ready


def nothing(known: Processes, nodes: LoopbackNodes) -> None:
    """A scenario step that only waits for its record."""


def of_type(record_type: str) -> Callable[[Envelope], bool]:
    return lambda r: r.type == record_type


def kill_rank(rank: int) -> Callable[[Processes, LoopbackNodes], None]:
    return lambda known, nodes: os.kill(known.ranks[rank], signal.SIGKILL)


def signal_node(node: int, sig: signal.Signals) -> Callable[[Processes, LoopbackNodes], None]:
    return lambda known, nodes: nodes.signal_node(node, sig)


def open_gate(gate: Path) -> Callable[[Processes, LoopbackNodes], None]:
    """Let the ranks held at ``--hold-at`` (the training script's gate) go on."""
    return lambda known, nodes: gate.touch()
