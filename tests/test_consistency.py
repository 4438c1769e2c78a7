"""What replay checks over a whole log whatever the network did (replay/consistency.py): every
decision by an engine granted the lease, no step committed by two generations unless a fallback
rolled back past it, and nothing a node writes once given up believed by the engine. The logs
are real embedded logs written through one handle per writer, as agents and engines do."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from factories import JOB, T0, make

from flashrecovery.connectors import LogConnector, open_log
from flashrecovery.connectors.base import Entry
from flashrecovery.engine.loop import EngineLoop
from flashrecovery.records import (
    AgentExited,
    FallbackToCheckpoint,
    JobFinished,
    JobOutcome,
    NodeMissed,
    StepCompleted,
    Stream,
)
from flashrecovery.replay import consistency
from flashrecovery.replay.replayer import replay_job
from flashrecovery.testing.simworld import SimulatedNodes


@pytest.fixture
def handles(tmp_path: Path) -> Iterator[dict[str, LogConnector]]:
    """One log handle for each node's agent (the spare node is 2) and one for the engine."""
    url = f"sqlite:///{tmp_path / 'log.db'}"
    opened = {name: open_log(url) for name in ("0", "1", "2", "engine")}
    yield opened
    for log in opened.values():
        log.close()


def node_1_given_up(handles: dict[str, LogConnector]) -> tuple[SimulatedNodes, EngineLoop]:
    """Two nodes of one rank and a spare node, running; the engine finds node 1 silent and
    replaces its rank with the spare node's spare (generation 1)."""
    world = SimulatedNodes(JOB, nodes=2, per_node=1)
    for record in world.start():
        node = getattr(record, "node", None)
        rank = getattr(record, "rank", None)
        writer = str(node if node is not None else rank if rank is not None else 0)
        handles[writer].append(Stream.EVENTS, record)
    engine = EngineLoop(handles["engine"], JOB)  # the one decider: no lease
    engine.catch_up()
    missed = NodeMissed(
        job_id=JOB, generation=0, source="detector", node=1, last_seen_ts=T0, silent_s=3.5
    )
    handles["engine"].append(Stream.EVENTS, missed)
    engine.catch_up()
    assert engine.state.node_lost(1) and engine.state.generation == 1
    return world, engine


def test_what_a_node_cut_off_writes_when_its_link_heals_is_fenced(
    handles: dict[str, LogConnector],
) -> None:
    """Its ranks' last steps of the old generation, its agent's heartbeat, and its word that the
    other nodes are gone (it saw every peer vanish): all fenced, none believed."""
    world, engine = node_1_given_up(handles)
    late = [
        StepCompleted(
            job_id=JOB, generation=0, source="rank:1", rank=1, step=0, duration_s=0.1, loss=1.0
        ),
        world.beat(1),
        AgentExited(job_id=JOB, generation=0, source="agent:1", node=0, pid=1, observer=1),
    ]
    handles["1"].append_many(Stream.EVENTS, late)
    engine.catch_up()
    assert not engine.state.node_lost(0)
    report = replay_job(handles["engine"], JOB)
    assert report.believed_from_lost_nodes == [] and report.ok, report.to_json()
    assert report.state.fenced >= len(late)


def test_a_record_from_a_node_given_up_that_the_engine_believes_fails_replay(
    handles: dict[str, LogConnector],
) -> None:
    """A lost node that still wrote the job's end (it thought it hosted the meeting store):
    the engine ends the job on its word, and replay names the record."""
    _, engine = node_1_given_up(handles)
    end = JobFinished(
        job_id=JOB, generation=1, source="agent", status=JobOutcome.FAILED, detail="declared lost"
    )
    handles["1"].append(Stream.EVENTS, end)
    engine.catch_up()
    report = replay_job(handles["engine"], JOB)
    [problem] = report.believed_from_lost_nodes
    assert problem.startswith("job_finished at events position") and "from node 1" in problem
    assert not report.ok and report.divergence is None


def test_a_decision_by_an_engine_never_granted_the_lease_is_named(
    handles: dict[str, LogConnector],
) -> None:
    def engine(handle: str, engine_id: str) -> EngineLoop:
        return EngineLoop(handles[handle], JOB, lease_ttl_s=3.0, engine_id=engine_id, clock=clock)

    clock = lambda: T0  # noqa: E731
    holder, other = engine("engine", "holder"), engine("2", "other")
    holder.claim()
    other.claim()  # before it read the holder's: appended, and refused by the log's order
    holder.catch_up()
    other.catch_up()
    assert holder.is_leader() and not other.is_leader()
    events = handles["engine"].read(Stream.EVENTS, JOB)
    for writer in ("engine", "2", "1"):  # the holder, the refused one, one that never asked
        handles[writer].append(Stream.DECISIONS, make(FallbackToCheckpoint, reason="", shards=[0]))
    decisions = handles["engine"].read(Stream.DECISIONS, JOB)
    [never, refused] = consistency.deciders_without_lease(events, decisions)  # sorted
    assert refused == "other" and never.startswith("an engine that took no lease (log handle")
    # the holder's decisions' chain went on under a new writer id (a decision batch failed):
    # still the holder's handle
    held = decisions[0].record
    assert held is not None and held.chain is not None
    restarted = held.model_copy(update={"chain": held.chain.model_copy(
        update={"writer": f"{held.chain.writer}.1"})})  # fmt: skip
    assert consistency.deciders_without_lease(events, [entry(9, restarted)]) == []


def entry(position: int, record: object) -> Entry:
    return Entry(position, b"", record)  # type: ignore[arg-type]


def step(generation: int, step: int) -> StepCompleted:
    return make(StepCompleted, generation=generation, step=step)  # type: ignore[return-value]


def test_a_step_two_generations_committed_is_named_unless_a_fallback_rolled_back_past_it() -> None:
    events = [entry(i, r) for i, r in enumerate([step(0, 3), step(0, 4), step(1, 4)])]
    assert consistency.steps_committed_twice(events, []) == [
        "step 4 committed in generations 0 and 1"
    ]
    fallback = make(FallbackToCheckpoint, generation=1, step=3, reason="no replica", shards=[0])
    assert consistency.steps_committed_twice(events, [entry(0, fallback)]) == []
