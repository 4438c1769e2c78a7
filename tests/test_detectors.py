"""Time-based detectors: pure functions of (state, now) with exact thresholds, and the loop that
appends their findings once so that time enters the engine only as a record."""

from __future__ import annotations

import pytest
from factories import JOB, feed, make, running_job

from flashrecovery.connectors.memory import MemoryLog
from flashrecovery.engine import detectors
from flashrecovery.engine.loop import EngineLoop
from flashrecovery.engine.state import EngineState
from flashrecovery.records import (
    Envelope,
    Heartbeat,
    HeartbeatMissed,
    IsolateRank,
    NodeMissed,
    RankExited,
    RankFinished,
    RegroupPlanned,
    ReplacementSpawned,
    StallSuspected,
    StepCompleted,
    Stream,
)
from flashrecovery.testing.simworld import SimulatedNodes, SimulatedWorld, drive

SILENT_LIMIT = 3 * 0.5  # JobStarted default missed_heartbeats x the world's interval
EPS = 1e-3


def heartbeats(
    world: SimulatedWorld, ranks: list[int], ts: float, waiting: bool = False
) -> list[Envelope]:
    return [
        *(
            make(
                Heartbeat,
                rank=r,
                pid=world.pids[r],
                step=world.committed,
                ts=ts,
                waiting=waiting,
                generation=world.generation,
            )
            for r in ranks
        ),
        *world.spare_heartbeats(ts),
    ]


def steps(world: SimulatedWorld, ranks: list[int], step: int, ts: float) -> list[Envelope]:
    return [make(StepCompleted, rank=r, step=step, duration_s=world.step_s, ts=ts) for r in ranks]


def apply(state: EngineState, records: list[Envelope]) -> None:
    """Feed records that must apply cleanly (the scenario, not what is under test)."""
    assert feed(state, records, state.position + 1) == []
    assert not state.rejected


@pytest.fixture
def world() -> SimulatedWorld:
    return SimulatedWorld(JOB, world_size=4, spares=1)


def silent_rank_2(world: SimulatedWorld) -> tuple[EngineState, float]:
    """A running job where every rank but 2 heartbeat one second after rank 2 last did."""
    state = running_job(world, steps=3)
    last = state.ranks[2].last_heartbeat_ts
    assert last is not None
    apply(state, heartbeats(world, [0, 1, 3], last + 1.0))
    return state, last


# ------------------------------------------------------------------ silent ranks


def test_a_silent_rank_is_reported_once_past_the_limit_and_not_before(
    world: SimulatedWorld,
) -> None:
    state, last = silent_rank_2(world)

    assert detectors.silent_ranks(state, last + SILENT_LIMIT) == []
    now = last + SILENT_LIMIT + EPS
    found = detectors.silent_ranks(state, now)

    assert [(r.rank, r.last_seen_ts, r.ts, r.generation, r.job_id) for r in found] == [
        (2, last, now, 0, JOB)
    ]
    assert found[0].silent_s == pytest.approx(SILENT_LIMIT + EPS)
    again = detectors.silent_ranks(state, now)  # pure: asking again finds the same
    assert [r.model_dump(exclude={"record_id"}) for r in again] == [
        r.model_dump(exclude={"record_id"}) for r in found
    ]


def test_every_silent_rank_is_reported_in_rank_order(world: SimulatedWorld) -> None:
    state, last = silent_rank_2(world)
    found = detectors.silent_ranks(state, last + 1.0 + SILENT_LIMIT + 1.0)
    assert [r.rank for r in found] == [0, 1, 2, 3]


def test_a_heartbeat_resets_the_silence(world: SimulatedWorld) -> None:
    state, last = silent_rank_2(world)
    apply(state, heartbeats(world, [2], last + SILENT_LIMIT))
    assert detectors.silent_ranks(state, last + SILENT_LIMIT + EPS) == []


def test_a_finished_rank_is_not_watched(world: SimulatedWorld) -> None:
    state, last = silent_rank_2(world)
    apply(state, [make(RankFinished, rank=2, step=world.committed, ts=last + 0.5)])
    assert state.ranks[2].machine.state == "finished"
    assert detectors.silent_ranks(state, last + SILENT_LIMIT + EPS) == []


def test_ranks_in_a_recovery_are_watched_from_the_regroup_on(world: SimulatedWorld) -> None:
    """A survivor that hangs while the job regroups is found like any other (its peers would
    wait for it forever); the silence counts from the regroup decision."""
    state, _ = silent_rank_2(world)
    kill = world.kill(1)
    decisions = feed(state, [kill], state.position + 1)
    assert decisions[0].type == "isolate_rank"
    assert {state.ranks[r].machine.state for r in (0, 2, 3)} == {"paused"}
    assert detectors.silent_ranks(state, kill.ts + SILENT_LIMIT) == []
    found = detectors.silent_ranks(state, kill.ts + SILENT_LIMIT + EPS)
    assert [r.rank for r in found] == [0, 2, 3]  # none of them beat since the regroup
    world.generation = 1  # the survivors beat from the new generation on
    apply(state, heartbeats(world, [0, 3], kill.ts + 1.0))
    assert [r.rank for r in detectors.silent_ranks(state, kill.ts + SILENT_LIMIT + EPS)] == [2]


def test_a_survivor_the_plan_has_not_reached_beats_on_in_its_old_generation(
    world: SimulatedWorld,
) -> None:
    """An engine taking over the lease writes the regroup it decided seconds after its cause
    (the one deciding before was lost first): until the plan reaches them, the survivors beat
    in the generation they are in. Those beats prove them alive (and nothing else): they are
    not given up for a silence that was the engines'."""
    state, _ = silent_rank_2(world)
    kill = world.kill(1)
    feed(state, [kill], state.position + 1)
    assert state.generation == 1 and world.generation == 0
    fenced = state.fenced
    apply(state, heartbeats(world, [0, 2, 3], kill.ts + 2.0))
    assert state.fenced == fenced + 3  # still fenced: their step and wait are not believed
    assert detectors.silent_ranks(state, kill.ts + SILENT_LIMIT + EPS) == []
    found = detectors.silent_ranks(state, kill.ts + 2.0 + SILENT_LIMIT + EPS)
    assert [r.rank for r in found] == [0, 2, 3]  # still watched: silent again, found again


def test_a_fresh_replacement_has_a_start_up_grace() -> None:
    state = running_job(SimulatedWorld(JOB, world_size=2, spares=0), steps=1)
    config = state.config
    assert config is not None
    view = state.ranks[1]
    exited = make(RankExited, rank=1, pid=view.pid, signal=9, ts=view.last_heartbeat_ts)
    assert [d.type for d in feed(state, [exited], state.position + 1)][1] == "spawn_replacement"
    spawned = make(ReplacementSpawned, rank=1, pid=4242, generation=1, ts=exited.ts + 0.1)
    feed(state, [spawned], state.position + 1)
    limit_passed = spawned.ts + SILENT_LIMIT + EPS
    assert 1 not in [r.rank for r in detectors.silent_ranks(state, limit_passed)]
    after_grace = spawned.ts + config.startup_grace_s + EPS
    assert 1 in [r.rank for r in detectors.silent_ranks(state, after_grace)]


def test_nothing_is_watched_before_the_start_or_after_the_end(world: SimulatedWorld) -> None:
    assert detectors.silent_ranks(EngineState(JOB), 1e12) == []
    assert detectors.stalled_ranks(EngineState(JOB), 1e12) == []
    state = running_job(world, steps=2)
    apply(state, world.finish())
    assert state.job.state == "completed"
    assert detectors.silent_ranks(state, world.clock + 100.0) == []


# ------------------------------------------------------------------ stalls


@pytest.mark.parametrize(
    ("step_s", "window"),
    [
        pytest.param(0.2, 5.0, id="floor"),  # 10 x 0.2 s < the 5 s floor
        pytest.param(1.0, 10.0, id="k-x-median"),  # 10 x 1.0 s > the floor
    ],
)
def test_a_rank_behind_its_peers_is_suspected_after_the_window(
    world: SimulatedWorld, step_s: float, window: float
) -> None:
    world.step_s = step_s
    state = running_job(world, steps=3)
    progress = world.clock + step_s
    apply(state, steps(world, [0, 2, 3], 3, progress))  # rank 1 stays at step 2

    assert detectors.stalled_ranks(state, progress + window) == []
    now = progress + window + EPS
    found = detectors.stalled_ranks(state, now)

    assert [(type(r), r.rank, r.last_step, r.ts, r.generation) for r in found] == [
        (StallSuspected, 1, 2, now, 0)
    ]
    behind_since = state.ranks[1].last_step_ts
    assert behind_since is not None
    assert found[0].stalled_s == pytest.approx(now - behind_since)


def test_the_rank_outside_commit_while_its_peers_wait_is_suspected_then_failed(
    world: SimulatedWorld,
) -> None:
    """Synchronous data parallelism: one rank stuck in its own code holds every peer inside
    commit() at the same step; its heartbeats go on, but it is the one not waiting."""
    state = running_job(world, steps=3)
    progress = world.clock
    apply(state, heartbeats(world, [0, 2, 3], progress + 1.0, waiting=True))
    apply(state, heartbeats(world, [1], progress + 1.0))
    window = 5.0  # the floor: 10 x 0.2 s steps is less

    assert detectors.stalled_ranks(state, progress + window) == []
    first = detectors.stalled_ranks(state, progress + window + EPS)
    assert [(r.rank, r.window_s) for r in first] == [(1, window)]
    assert feed(state, first, state.position + 1) == []
    assert state.ranks[1].machine.state == "suspect"
    apply(state, heartbeats(world, [1], progress + window + 1.0))  # alive, still not waiting
    assert state.ranks[1].machine.state == "suspect"

    second = detectors.stalled_ranks(state, progress + 2 * window + EPS)
    decisions = feed(state, second, state.position + 1)
    assert [d.type for d in decisions][:1] == ["isolate_rank"]
    assert decisions[0].model_dump()["rank"] == 1


def test_a_suspect_that_commits_again_is_cleared(world: SimulatedWorld) -> None:
    state = running_job(world, steps=3)
    progress = world.clock
    apply(state, heartbeats(world, [0, 2, 3], progress + 1.0, waiting=True))
    apply(state, heartbeats(world, [1], progress + 1.0))
    assert feed(state, detectors.stalled_ranks(state, progress + 6.0), state.position + 1) == []
    assert state.ranks[1].machine.state == "suspect"
    apply(state, steps(world, [0, 1, 2, 3], 3, progress + 6.5))  # it was only slow
    assert state.ranks[1].machine.state == "healthy"
    assert detectors.stalled_ranks(state, progress + 7.0) == []


def test_no_stall_while_progress_continues(world: SimulatedWorld) -> None:
    state = running_job(world, steps=3)
    progress = world.clock + world.step_s
    apply(state, steps(world, [0, 2, 3], 3, progress))
    apply(state, steps(world, [1], 3, progress + 3.9))  # slow, but the job moves on
    apply(state, steps(world, [0, 2, 3], 4, progress + 4.0))
    assert detectors.stalled_ranks(state, progress + 5.0 + EPS) == []


def test_no_stall_when_nobody_is_behind(world: SimulatedWorld) -> None:
    """Everyone waiting at the same step (slow data, a checkpoint) is not a straggler."""
    state = running_job(world, steps=3)
    assert detectors.stalled_ranks(state, world.clock + 1000.0) == []


def test_no_stall_outside_running(world: SimulatedWorld) -> None:
    state = running_job(world, steps=3)
    progress = world.clock + world.step_s
    apply(state, steps(world, [0, 2, 3], 3, progress))
    feed(state, [world.kill(0)], state.position + 1)
    assert state.job.state == "regrouping"
    assert detectors.stalled_ranks(state, progress + 1000.0) == []


# ------------------------------------------------------------------ the loop


@pytest.mark.parametrize(("spares", "replacement"), [(1, "assign_spare"), (0, "spawn_replacement")])
def test_loop_reports_a_silent_rank_once_and_the_engine_isolates_it(
    spares: int, replacement: str
) -> None:
    world = SimulatedWorld(JOB, world_size=4, spares=spares)
    log, now = MemoryLog(), [0.0]
    engine = EngineLoop(log, JOB, clock=lambda: now[0])
    drive(log, engine, world, world.start())
    drive(log, engine, world, world.train(3))
    last = engine.state.ranks[2].last_heartbeat_ts
    assert last is not None
    drive(log, engine, world, heartbeats(world, [0, 1, 3], last + 1.0))

    now[0] = last + SILENT_LIMIT
    assert engine.detect() == []
    now[0] = last + SILENT_LIMIT + EPS
    found = engine.detect()
    assert [(type(r), getattr(r, "rank", None)) for r in found] == [(HeartbeatMissed, 2)]
    now[0] += 0.5
    assert engine.detect() == []  # still silent, but already reported
    events = [e.record for e in log.read(Stream.EVENTS, JOB)]
    assert [r for r in events if isinstance(r, HeartbeatMissed)] == found

    engine.apply(log.read(Stream.EVENTS, JOB, engine.next_position))
    decisions = [e.record for e in log.read(Stream.DECISIONS, JOB)]
    assert [d.type for d in decisions if d is not None] == [
        "isolate_rank",
        replacement,
        "regroup_planned",
    ]
    isolate, _, regroup = decisions
    assert isinstance(isolate, IsolateRank) and isinstance(regroup, RegroupPlanned)
    assert (isolate.rank, isolate.pid, isolate.generation) == (2, world.pids[2], 0)
    assert "no heartbeat" in isolate.reason
    assert (regroup.generation, regroup.members, regroup.replaced) == (1, [0, 1, 2, 3], [2])

    now[0] += 0.5
    assert engine.detect() == []  # survivors are timed from the regroup on, not before it
    assert len(log.read(Stream.EVENTS, JOB)) == len(events)


def test_when_no_node_is_heard_the_log_is_away_and_silence_is_judged_once_it_is_back() -> None:
    """A broker cut off holds every writer's appends for seconds while the engine's reads
    come back empty: no node is read, and that is the log's silence, not a node's. Once the
    nodes are read again, a node still unheard is found a silence limit later."""
    world = SimulatedNodes(JOB, nodes=2, per_node=2)
    log, now = MemoryLog(), [world.clock]
    engine = EngineLoop(log, JOB, clock=lambda: now[0])

    def beat(*nodes: int) -> None:
        for node in nodes:
            log.append(Stream.EVENTS, world.beat(node))
        engine.step(0)

    def missed() -> list[int]:
        return [
            r.node for e in log.read(Stream.EVENTS, JOB) if isinstance(r := e.record, NodeMissed)
        ]

    for record in world.start():
        log.append(Stream.EVENTS, record)
    beat(0, 1, 2)
    last = now[0]
    now[0] = world.clock = last + 10.0  # ten seconds with no record of any node
    engine.step(0)
    engine.detect()
    assert missed() == []
    world.clock = last + 0.5
    beat(0, 1, 2)  # beats held up by the log arrive late: they say nothing of now
    world.clock = now[0]
    engine.step(0)
    assert missed() == []
    beat(0, 2)  # the log is back; node 1's appends are still held up
    limit = 3 * world.heartbeat_interval_s
    now[0] = world.clock = last + 10.0 + limit - EPS
    beat(0, 2)
    assert missed() == []
    now[0] = world.clock = last + 10.0 + limit + 0.5
    beat(0, 2)
    assert missed() == [1]
