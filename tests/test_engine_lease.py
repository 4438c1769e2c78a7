"""Two engines on one log: only the lease holder decides; the standby takes over, no duplicate."""

from __future__ import annotations

from typing import Any

from flashrecovery.connectors.base import Entry
from flashrecovery.connectors.memory import MemoryLog
from flashrecovery.engine.lease import LeaseBook
from flashrecovery.engine.loop import EngineLoop
from flashrecovery.errors import LogError
from flashrecovery.records import AgentExited, Decision, EngineLease, Envelope, NodeMissed, Stream
from flashrecovery.replay.replayer import replay_job
from flashrecovery.testing.simworld import SimulatedWorld, scripted_failure

JOB = "leased"
TTL = 1.0  # below the 3 x 0.5 s heartbeat limit, so no detector fires on the jump


def lease(engine: str, ts: float, ttl: float = TTL) -> EngineLease:
    return EngineLease(
        job_id=JOB,
        generation=0,
        source=f"engine:{engine}",
        ts=ts,
        engine_id=engine,
        expires_ts=ts + ttl,
    )


def test_lease_book_grants_in_log_order() -> None:
    book = LeaseBook()
    assert book.observe(lease("a", 10.0, ttl=2))
    assert not book.observe(lease("b", 11.0, ttl=2))  # a holds it until 12
    assert book.observe(lease("a", 11.5, ttl=2))  # renewal
    assert book.holder(12.0) == "a" and book.holder(13.5) is None
    assert book.observe(lease("b", 13.6, ttl=2))  # a's lease ran out: takeover
    assert book.holder(14.0) == "b"


def settle(engines: list[EngineLoop]) -> None:
    """Let each engine read everything there is (no waiting)."""
    for _ in range(3):
        for engine in engines:
            engine.step(0)


def types(decisions: list[Decision]) -> list[str]:
    return [d.type for d in decisions]


def essentials(log: MemoryLog) -> list[tuple[str, dict[str, object]]]:
    drop = {"record_id", "caused_by", "ts", "source", "rto_s", "phases", "chain"}  # time moved on
    return [
        (e.record.type, e.record.model_dump(exclude=drop))
        for e in log.read(Stream.DECISIONS, JOB)
        if e.record
    ]


def append_all(log: MemoryLog, records: list[Envelope]) -> None:
    for record in records:
        log.append(Stream.EVENTS, record)


class FencingLog(MemoryLog):
    """Notes each fence, and how many decisions the read right after it found: what an engine
    that starts deciding learns, once its predecessor can write no more (connectors/kafka.py)."""

    def __init__(self) -> None:
        super().__init__()
        self.calls: list[str] = []

    def fence(self, job_id: str) -> None:
        self.calls.append("fence")

    def read(
        self, stream: Stream, job_id: str, from_position: int = 0, limit: int | None = None
    ) -> list[Entry]:
        entries = super().read(stream, job_id, from_position, limit)
        if stream is Stream.DECISIONS and self.calls[-1:] == ["fence"]:
            self.calls.append(f"then read {len(entries)}")
        return entries


def test_standby_takes_over_mid_incident_without_duplicates() -> None:
    reference = MemoryLog()
    scripted_failure(reference, JOB)

    log = FencingLog()
    world = SimulatedWorld(JOB)

    def clock() -> float:
        return world.clock  # the engines live on the scripted world's time

    active = EngineLoop(log, JOB, clock=clock, lease_ttl_s=TTL, engine_id="active")
    standby = EngineLoop(log, JOB, clock=clock, lease_ttl_s=TTL, engine_id="standby")
    active.step(0)  # claims first
    settle([active, standby])
    assert active.is_leader() and not standby.is_leader()

    append_all(log, [*world.start(), *world.train(3), world.kill(2)])
    settle([active, standby])
    written = [e.record for e in log.read(Stream.DECISIONS, JOB)]
    assert types(written) == ["isolate_rank", "assign_spare", "regroup_planned"]  # type: ignore[arg-type]

    # The active engine dies here (it is never stepped again); the ranks answer the regroup.
    append_all(log, [r for d in written for r in world.react(d)])  # type: ignore[arg-type]
    standby.step(0)
    assert len(log.read(Stream.DECISIONS, JOB)) == 3  # the standby does not act on a live lease
    world.clock += TTL + 0.1
    settle([standby])
    assert standby.is_leader()
    new = [e.record for e in log.read(Stream.DECISIONS, JOB)][3:]
    assert types(new) == ["resume_planned"]  # type: ignore[arg-type]
    append_all(log, [r for d in new for r in world.react(d)])  # type: ignore[arg-type]
    append_all(log, [*world.train(2), *world.finish()])
    settle([standby])

    ids = [e.record.record_id for e in log.read(Stream.DECISIONS, JOB) if e.record]
    assert len(ids) == len(set(ids))
    assert log.calls == ["fence", "then read 0", "fence", "then read 3"]  # each, before deciding
    assert essentials(log) == essentials(reference)
    assert replay_job(log, JOB).ok


class OnceAwayLog(FencingLog):
    """Its events cannot be read once (the broker went away), then they can."""

    def __init__(self) -> None:
        super().__init__()
        self.away = False

    def follow(self, *args: Any, **kwargs: Any) -> list[Entry]:
        if self.away:
            self.away = False
            raise LogError("the broker went away")
        return super().follow(*args, **kwargs)


def test_after_the_log_was_away_the_leader_fences_again_before_it_decides() -> None:
    """Decisions acknowledged as the broker went away were found left open after it came back
    (no reader saw them, the job hung): the leader settles them by fencing again, and reads
    what was decided, before it writes another decision."""
    log = OnceAwayLog()
    world = SimulatedWorld(JOB)
    engine = EngineLoop(log, JOB, clock=lambda: world.clock, lease_ttl_s=TTL, engine_id="e")
    append_all(log, [*world.start(), *world.train(3), world.kill(2)])
    engine.step(0)  # claims the lease
    engine.step(0)  # decides
    written = [e.record for e in log.read(Stream.DECISIONS, JOB)]
    assert types(written) == ["isolate_rank", "assign_spare", "regroup_planned"]  # type: ignore[arg-type]
    append_all(log, [r for d in written for r in world.react(d)])  # type: ignore[arg-type]
    log.away = True
    engine.step(0)  # the read fails
    engine.step(0)  # the next succeeds
    assert log.calls == ["fence", "then read 0", "fence", "then read 3"]


def node_lease(engine: str, node: int, ts: float) -> EngineLease:
    return lease(engine, ts).model_copy(update={"node": node})


def test_a_node_given_up_loses_its_lease_and_is_never_granted_one_again() -> None:
    """Given up by its silence (NodeMissed) or its agent's exit: the lease held there ends at
    once, and whatever that node's engine appends once its link heals is refused."""
    for given_up in (
        NodeMissed(job_id=JOB, generation=0, source="detector", node=1, last_seen_ts=9, silent_s=3),
        AgentExited(job_id=JOB, generation=0, source="agent:0", node=1, pid=7, observer=0),
    ):
        book = LeaseBook()
        assert book.fold(node_lease("on-1", 1, 10.0))
        book.fold(given_up)
        assert book.holder(10.1) is None
        assert not book.fold(node_lease("on-1", 1, 10.2))
        assert book.fold(node_lease("on-0", 0, 10.3))


def test_a_node_given_up_cannot_give_up_the_node_holding_the_lease() -> None:
    """A node cut off sees all its peers go: once it is given up, its word on them is void."""
    book = LeaseBook()
    assert book.fold(node_lease("on-0", 0, 10.0))
    book.fold(AgentExited(job_id=JOB, generation=0, source="agent:0", node=2, pid=8, observer=0))
    book.fold(AgentExited(job_id=JOB, generation=0, source="agent:2", node=0, pid=6, observer=2))
    assert book.holder(10.1) == "on-0"
