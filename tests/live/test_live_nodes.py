"""Live multi-node jobs on loopback "nodes" (an agent process each): a rank lost on node 1, a
whole node SIGKILLed, an agent SIGSTOPped, a node that joins a running job. Each ends bitwise
equal to a fault-free run, keeps the healthy ranks' processes, replays, and leaves no process."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from livejob import HEARTBEAT_S, STEPS, JobResult, Processes
from nodesjob import (
    CONTROL,
    committed,
    kill_rank,
    nothing,
    of_type,
    open_gate,
    run_nodes,
    signal_node,
    spares_ready,
    when,
)
from scrape import free_port, scrape, value

from flashrecovery.agent.loopback import LoopbackNodes
from flashrecovery.connectors import open_log
from flashrecovery.connectors.base import Entry
from flashrecovery.records import NodeJoined, SpareReady, Stream
from flashrecovery.replay.replayer import replay_job
from flashrecovery.replay.verify import handle_runs

pytestmark = pytest.mark.timeout(300)
WORLD = 4  # 2 nodes x 2 ranks
SCRIPT = Path(__file__).parents[1] / "scripts" / "train_mlp.py"


@pytest.fixture(scope="module")
def nodes_reference(tmp_path_factory: pytest.TempPathFactory) -> torch.Tensor:
    """A fault-free 2 x 2 run: every agent completes, ranks laid out node by node."""
    job, codes = run_nodes(tmp_path_factory.mktemp("nodes-reference"), spares=0)
    assert codes == {0: 0, 1: 0}
    joined = {r.rank: r.pid for r in job.records(type="rank_joined")}
    assert sorted(joined) == list(range(WORLD))
    params: torch.Tensor = job.final(0)["params"]
    return params


def assert_recovered(job: JobResult, reference: torch.Tensor, failed: set[int]) -> None:
    [finished] = job.records(type="job_finished")  # sealed once, by whoever was left
    assert finished.status == "completed", finished
    for rank in range(WORLD):
        assert torch.equal(job.final(rank)["params"], reference), f"rank {rank} diverged"
    joined = {r.rank: r.pid for r in job.records(type="rank_joined")}
    for rank in set(range(WORLD)) - failed:
        assert job.final(rank)["pid"] == joined[rank], f"healthy rank {rank} was restarted"
    for rank in failed:
        assert job.final(rank)["pid"] != joined[rank]
    [closed] = job.decisions("incident_closed")
    assert sorted(closed.failed_ranks or [closed.failed_rank]) == sorted(failed)
    assert closed.rpo_steps == 0
    report = replay_job(job.log, job.job_id)
    assert report.ok, report.divergence and report.divergence.describe()


def test_rank_killed_on_node_1_is_replaced(tmp_path: Path, nodes_reference: torch.Tensor) -> None:
    job, codes = run_nodes(tmp_path, scenario=[when(committed(3, 8), kill_rank(3))])
    assert codes == {0: 0, 1: 0}
    assert_recovered(job, nodes_reference, failed={3})
    # The ranks' and spares' beats reach the log only inside their agent's: one record per
    # node per interval.
    assert job.records(type="heartbeat") == job.records(type="spare_heartbeat") == []
    node_beats = job.records(type="node_heartbeat")
    assert {b.rank for nb in node_beats for b in nb.beats if b.type == "heartbeat"} == {0, 1, 2, 3}
    span = node_beats[-1].ts - node_beats[0].ts
    assert len(node_beats) <= 2 * (span / HEARTBEAT_S + 2)
    [assigned] = job.decisions("assign_spare")
    ready = {s.spare_id: s.node for s in job.records(type="spare_ready")}
    assert assigned.rank == 3 and assigned.node == ready[assigned.spare_id]
    assert job.decisions("isolate_node") == []


def test_node_killed_its_ranks_move_together_to_the_spare_node(
    tmp_path: Path, nodes_reference: torch.Tensor
) -> None:
    job, codes = run_nodes(
        tmp_path,
        spare_nodes=1,
        # The spare node's spares may start after step 8: its loss waits for them.
        scenario=[
            when(spares_ready(2, 2), nothing),
            when(committed(2, 8), signal_node(1, signal.SIGKILL)),
        ],
    )
    assert codes[0] == 0 and codes[2] == 0 and codes[1] == -signal.SIGKILL
    assert_recovered(job, nodes_reference, failed={2, 3})
    # Found by the other agents' watch at once (its connections closed, its port refused),
    # not by three missed heartbeats.
    exited = job.records(type="agent_exited")
    assert exited and {e.node for e in exited} == {1} and job.records(type="node_missed") == []
    [isolated] = job.decisions("isolate_node")
    assert (isolated.node, isolated.ranks) == (1, [2, 3])
    assigned = job.decisions("assign_spare")
    assert sorted(a.rank for a in assigned) == [2, 3]
    assert {a.node for a in assigned} == {2}  # the spare node's two spares, together
    assert len({a.incident_id for a in job.decisions("isolate_rank")}) == 1
    assert job.records(type="heartbeat_missed") == []  # one finding for the node, not per rank


def test_agent_stopped_its_ranks_are_replaced_by_the_other_nodes_spares(
    tmp_path: Path, nodes_reference: torch.Tensor
) -> None:
    """The stopped agent's ranks still run: the ranks hold at step 10 until the node is found
    lost, so the job can't end before. Node 0's one spare takes a rank, the other waits for
    the spare node 0 starts in its place. Woken up, the agent tears its node down and ends."""
    gate = tmp_path / "gate"
    job, codes = run_nodes(
        tmp_path,
        scenario=[
            when(committed(3, 8), signal_node(1, signal.SIGSTOP)),
            when(of_type("node_missed"), open_gate(gate)),
            when(of_type("spare_activated"), signal_node(1, signal.SIGCONT)),
        ],
        script_args=["--hold-at", "10", "--hold-file", str(gate)],
    )
    assert codes[0] == 0 and codes[1] == 1  # woken up, it reads that its node was given up
    said = (tmp_path / "output" / "node1.log").read_text()
    assert "this node was declared lost: node 1 lost: no heartbeat" in said
    assert_recovered(job, nodes_reference, failed={2, 3})
    [isolated] = job.decisions("isolate_node")
    assert isolated.node == 1 and "no heartbeat" in isolated.reason
    assigned = job.decisions("assign_spare")
    assert sorted(a.rank for a in assigned) == [2, 3]
    assert {a.node for a in assigned} == {0}
    [waited] = job.decisions("await_node")
    assert len(waited.ranks) == 1


def test_a_node_joining_later_brings_the_spare_that_takes_over(
    tmp_path: Path, nodes_reference: torch.Tensor
) -> None:
    """A job without spares; a node joins with `--node-rank auto` while the ranks hold at step
    10; once its spares are ready rank 1 is killed, and one of them takes over."""
    gate = tmp_path / "gate"
    spare_of_node_2 = lambda r: isinstance(r, SpareReady) and r.node == 2  # noqa: E731

    def kill_and_go(known: Processes, nodes: LoopbackNodes) -> None:
        kill_rank(1)(known, nodes)
        open_gate(gate)(known, nodes)

    job, codes = run_nodes(
        tmp_path,
        spares=0,
        scenario=[
            when(committed(0, 4), lambda known, nodes: nodes.add_node()),
            when(spare_of_node_2, kill_and_go),
        ],
        script_args=["--hold-at", "10", "--hold-file", str(gate)],
    )
    assert codes == {0: 0, 1: 0, 2: 0}
    assert_recovered(job, nodes_reference, failed={1})
    [assigned] = job.decisions("assign_spare")
    assert (assigned.rank, assigned.node) == (1, 2)
    [node] = [n for n in job.records(type="node_joined") if n.node == 2]
    assert (node.ranks, node.spares) == (0, 2)


def test_the_control_plane_on_its_own_process(
    tmp_path: Path, nodes_reference: torch.Tensor
) -> None:
    """Store and engine in `flashrecovery control-plane`; node 0's agent only starts the job;
    the control plane serves the job's metrics."""
    port, seen = free_port(), []

    def read_metrics(known: Processes, nodes: LoopbackNodes) -> None:
        seen.append(scrape(f"http://127.0.0.1:{port}/metrics"))

    job, codes = run_nodes(
        tmp_path,
        control_plane=True,
        control_args=["--metrics-port", str(port)],
        scenario=[when(committed(1, 8), kill_rank(1)), when(committed(0, 10), read_metrics)],
    )
    assert codes == {0: 0, 1: 0, CONTROL: 0}
    assert_recovered(job, nodes_reference, failed={1})
    [samples] = seen
    assert (value(samples, "flashrecovery_steps_committed_total") or 0) >= 8
    assert value(samples, "flashrecovery_incidents_total", cause="rank_exited") == 1


@pytest.mark.kafka
def test_the_control_plane_apart_with_the_log_on_kafka(
    tmp_path: Path, nodes_reference: torch.Tensor, kafka_log_url: str
) -> None:
    """The log across hosts is Kafka: every node and the control plane reach it."""
    job, codes = run_nodes(
        tmp_path,
        control_plane=True,
        log_url=kafka_log_url,
        scenario=[when(committed(2, 8), kill_rank(2))],
    )
    assert codes == {0: 0, 1: 0, CONTROL: 0}
    assert_recovered(job, nodes_reference, failed={2})


def entries(job: JobResult, record_type: str, stream: Stream = Stream.EVENTS) -> list[Entry]:
    return [e for e in job.log.read(stream, job.job_id) if e.record.type == record_type]


def handle(entry: Entry) -> str:
    """The log handle that wrote a chained entry (its writer token's last part)."""
    assert entry.record.chain is not None
    return entry.record.chain.writer.partition("/")[2]


def test_losing_the_control_plane_mid_incident_a_standby_engine_takes_over(
    tmp_path: Path, nodes_reference: torch.Tensor
) -> None:
    """Rank 1 SIGKILLed and, at once, the control plane deciding for the job: the incident is
    decided by a node's standby engine once the lost lease runs out, and the job completes."""

    def kill_rank_and_control_plane(known: Processes, nodes: LoopbackNodes) -> None:
        assert nodes.control is not None
        kill_rank(1)(known, nodes)
        os.killpg(nodes.control.pid, signal.SIGKILL)

    job, codes = run_nodes(
        tmp_path,
        control_plane=True,
        scenario=[when(committed(1, 8), kill_rank_and_control_plane)],
    )
    assert codes == {0: 0, 1: 0, CONTROL: -signal.SIGKILL}
    assert_recovered(job, nodes_reference, failed={1})
    leases = job.records(type="engine_lease")
    assert leases[0].node is None  # the control plane's engine decided first
    # Engines are told apart by the log handle they write through: a node's closed the incident.
    lease_node = {handle(e): e.record.node for e in entries(job, "engine_lease")}
    [closed] = entries(job, "incident_closed", Stream.DECISIONS)
    assert lease_node[handle(closed)] in (0, 1)


def test_node_0_killed_its_store_and_engine_with_it_the_job_goes_on(
    tmp_path: Path, nodes_reference: torch.Tensor
) -> None:
    """Node 0 hosts the meeting store and the deciding engine: SIGKILLed, its agent's peers
    see it go at once, a standby engine takes the lease, the next generation meets on a
    surviving node's store, the spare node takes node 0's ranks, and the job ends sealed by a
    survivor."""
    job, codes = run_nodes(
        tmp_path,
        spare_nodes=1,
        scenario=[
            when(spares_ready(2, 2), nothing),
            when(committed(2, 8), signal_node(0, signal.SIGKILL)),
        ],
    )
    assert codes == {0: -signal.SIGKILL, 1: 0, 2: 0}
    assert_recovered(job, nodes_reference, failed={0, 1})
    assert {e.node for e in job.records(type="agent_exited")} == {0}
    assert job.records(type="node_missed") == []  # found by its closed links, not by silence
    [plan] = [p for p in job.decisions("regroup_planned") if p.generation == 1]
    stores = {n.node: n.store for n in job.records(type="node_joined")}
    assert plan.store in (stores[1], stores[2]) and plan.store != stores[0]
    assert {a.node for a in job.decisions("assign_spare")} == {2}
    assert {lease.node for lease in job.records(type="engine_lease")} - {0}
    for survivor in (1, 2):  # the store's host lost: one line each, no c10d C++ backtrace
        said = (tmp_path / "output" / f"node{survivor}.log").read_text(errors="replace")
        assert "Exception raised from" not in said and "frame #" not in said, said[-2000:]


def test_node_0_killed_while_an_incident_regroups_on_its_store(
    tmp_path: Path, nodes_reference: torch.Tensor
) -> None:
    """Rank 2 (node 1) SIGKILLed, and once its spare is activated — the incident open, the new
    generation meeting on node 0's store, node 0's engine deciding — node 0 SIGKILLed with its
    store, its engine and its ranks: a standby engine takes the lease, a plan names a surviving
    node's store, node 0's ranks and the rank being replaced all land on spares, and the job
    completes bitwise equal to a fault-free run, sealed by a survivor."""
    job, codes = run_nodes(
        tmp_path,
        spare_nodes=1,
        scenario=[
            when(spares_ready(2, 2), nothing),
            when(committed(2, 8), kill_rank(2)),
            when(of_type("spare_activated"), signal_node(0, signal.SIGKILL)),
        ],
    )
    assert codes == {0: -signal.SIGKILL, 1: 0, 2: 0}
    [finished] = job.records(type="job_finished")
    assert finished.status == "completed" and finished.source == "agent", finished
    for rank in range(WORLD):
        assert torch.equal(job.final(rank)["params"], nodes_reference), f"rank {rank} diverged"
    joined = {r.rank: r.pid for r in job.records(type="rank_joined")}
    assert job.final(3)["pid"] == joined[3]  # the one rank neither lost nor on node 0
    assert all(job.final(rank)["pid"] != joined[rank] for rank in (0, 1, 2))
    assert {e.node for e in job.records(type="agent_exited")} == {0}
    stores = {n.node: n.store for n in job.records(type="node_joined")}
    last = max(job.decisions("regroup_planned"), key=lambda p: p.generation)
    assert last.store in (stores[1], stores[2])
    assert {lease.node for lease in job.records(type="engine_lease")} - {0}
    assert all(c.rpo_steps == 0 for c in job.decisions("incident_closed"))
    report = replay_job(job.log, job.job_id)
    assert report.ok, report.divergence and report.divergence.describe()


def test_records_scale_with_nodes_two_nodes_of_four_ranks(tmp_path: Path) -> None:
    """The ranks talk to their agents, not to the log: one heartbeat record per node per
    interval, and the steps written by the agents in batches, none lost, every rank's in
    order; replay still sees each rank's steps."""
    job, codes = run_nodes(tmp_path, nproc=4, spares=0)
    assert codes == {0: 0, 1: 0}
    world = range(8)
    reference = job.final(0)["params"]
    assert all(torch.equal(job.final(rank)["params"], reference) for rank in world)
    # Heartbeats: O(nodes) records per interval, whatever the ranks per node.
    assert job.records(type="heartbeat") == []
    node_beats = job.records(type="node_heartbeat")
    span = node_beats[-1].ts - node_beats[0].ts
    assert len(node_beats) <= 2 * (span / HEARTBEAT_S + 2)
    # Steps: every rank's, in order, each written through its node's agent (one log handle,
    # one chain token, per node), several ranks' records in one write.
    entries = [
        e for e in job.log.read(Stream.EVENTS, job.job_id) if e.record.type == "step_completed"
    ]
    for rank in world:
        assert [e.record.step for e in entries if e.record.rank == rank] == list(range(STEPS))
    handle = {e.record.rank: e.record.chain.writer.split("/")[1] for e in entries}
    assert len({handle[r] for r in range(4)}) == len({handle[r] for r in range(4, 8)}) == 1
    assert handle[0] != handle[4]
    runs = handle_runs(entries)
    assert len(runs) < len(entries) / 2, f"{len(entries)} step records in {len(runs)} writes"
    assert max(len({e.record.rank for e in run}) for run in runs) >= 3
    finished = job.records(type="rank_finished")
    assert sorted(r.rank for r in finished) == list(world)
    report = replay_job(job.log, job.job_id)
    assert report.ok, report.divergence and report.divergence.describe()


def test_agents_given_no_node_rank_find_theirs(tmp_path: Path) -> None:
    """Two agents started with the same command and no --node-rank: the one that can host the
    store on the endpoint is node 0 and starts the job, the other claims node 1; both finish."""
    endpoint = f"127.0.0.1:{free_port()}"
    env = {**os.environ, "FLASHRECOVERY_STORE_PREFIX": "0123456789abcdef0123"}
    log_url = f"sqlite:///{tmp_path / 'log.db'}"
    command = [
        sys.executable, "-m", "flashrecovery.cli", "run", "--nnodes", "2",
        "--rdzv-endpoint", endpoint, "--nproc-per-node", "1", "--log", log_url,
        "--job-id", "nodes-auto", str(SCRIPT), "--steps", "6", "--out", str(tmp_path),
    ]  # fmt: skip
    agents = [subprocess.Popen(command, env=env, start_new_session=True)]
    try:
        # One agent per host in real use; on this one host the second starts once the first
        # listens (two probing in the same instant is the race docs/multinode.md names).
        listening(endpoint, agents[0])
        agents.append(subprocess.Popen(command, env=env, start_new_session=True))
        codes = [agent.wait(timeout=200) for agent in agents]
    finally:
        for agent in agents:
            if agent.poll() is None:
                os.killpg(agent.pid, signal.SIGKILL)
                agent.wait()
    assert codes == [0, 0]
    with open_log(log_url) as log:
        joined = [
            e.record
            for e in log.read(Stream.EVENTS, "nodes-auto")
            if isinstance(e.record, NodeJoined)
        ]
    assert sorted(r.node for r in joined) == [0, 1]
    assert sorted(p.name for p in tmp_path.glob("rank*.pt")) == ["rank0.pt", "rank1.pt"]


def listening(endpoint: str, agent: subprocess.Popen[bytes], timeout: float = 60.0) -> None:
    """Wait until something accepts connections on ``endpoint`` (the agent's store)."""
    host, port = endpoint.rsplit(":", 1)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and agent.poll() is None:
        try:
            socket.create_connection((host, int(port)), timeout=1).close()
            return
        except OSError:
            time.sleep(0.05)
    raise AssertionError(f"nothing listens on {endpoint} (agent exit code {agent.poll()})")
