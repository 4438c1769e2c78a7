"""Who wrote a record (connectors/signing.py): every writer of a job signs with its source's key,
and the engine, the agents, replay and verify believe a record only if it is signed by the
source it claims. A process that can append to the log but holds no key (the forger here opens
the job's log through the project's own `open_log`) gets nothing acted on: what it wrote is
rejected, recorded, replayed exactly and reported."""

from __future__ import annotations

from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from flashrecovery.cli import main
from flashrecovery.connectors import LogConnector, open_log
from flashrecovery.connectors.chain import read_streams
from flashrecovery.connectors.memory import MemoryLog
from flashrecovery.connectors.signing import SECRET, Keyring
from flashrecovery.engine.loop import EngineLoop
from flashrecovery.errors import RecordError
from flashrecovery.observe.exporter import MetricsServer
from flashrecovery.records import (
    EngineLease,
    Envelope,
    HealthReport,
    HeartbeatMissed,
    IsolateRank,
    RankExited,
    RecordRejected,
    StepCompleted,
    Stream,
    decision_id,
    parse_record,
)
from flashrecovery.replay.replayer import replay_job
from flashrecovery.replay.verify import verify
from flashrecovery.testing.simworld import SimulatedWorld, drive

JOB = "signed"
THE_SECRET = "the-jobs-secret-0123456789abcdef"
KEYS = Keyring(THE_SECRET)


def signed(record: Envelope) -> tuple[bytes, Envelope]:
    log = MemoryLog()
    log.sign_with(KEYS)
    log.append(Stream.EVENTS, record)
    [entry] = log.read(Stream.EVENTS, record.job_id)
    assert entry.record is not None
    return entry.raw, entry.record


def report(rank: int = 2, ok: bool = True, source: str = "rank:2") -> HealthReport:
    return HealthReport(job_id=JOB, generation=0, source=source, rank=rank, ok=ok)


def test_a_record_is_believed_only_as_its_source_signed_it() -> None:
    raw, record = signed(report())
    assert KEYS.forgery(raw, record) is None
    assert Keyring("another-secret-0123456789").forgery(raw, record) == (
        "health_report claiming source 'rank:2': wrong signature"
    )
    changed = raw.replace(b'"ok":true', b'"ok":false')
    assert KEYS.forgery(changed, parse_record(changed)) == (
        "health_report claiming source 'rank:2': wrong signature"
    )
    # signed by rank 1's key, then made to claim rank 2: its chain says whose it is
    claims = raw.replace(b'"source":"rank:2"', b'"source":"rank:1"')
    assert "in writer 'rank:2/" in str(KEYS.forgery(claims, parse_record(claims)))
    unsigned = MemoryLog()
    unsigned.append(Stream.EVENTS, report())
    [entry] = unsigned.read(Stream.EVENTS, JOB)
    assert entry.record is not None
    assert (
        KEYS.forgery(entry.raw, entry.record) == "unsigned health_report claiming source 'rank:2'"
    )
    assert "***" in repr(KEYS) and THE_SECRET not in repr(KEYS)


RAW, RECORD = signed(report())


@settings(max_examples=300, deadline=None)
@given(st.integers(0, len(RAW) - 1), st.integers(0, 255))
def test_any_byte_changed_is_refused_or_not_believed(index: int, value: int) -> None:
    if RAW[index] == value:
        return
    changed = RAW[:index] + bytes([value]) + RAW[index + 1 :]
    try:
        record = parse_record(changed, Stream.EVENTS)
    except RecordError:
        return  # not a record at all: the engine counts it malformed
    assert KEYS.forgery(changed, record) is not None


def handles(tmp_path: Path) -> tuple[LogConnector, LogConnector, LogConnector]:
    """The job's writer (its keys), a forger with no key, one with the wrong secret."""
    url = f"sqlite:///{tmp_path / 'log.db'}"
    writer, forger, wrong = open_log(url), open_log(url), open_log(url)
    writer.sign_with(KEYS)
    wrong.sign_with(Keyring("not-the-jobs-secret-0123456789"))
    return writer, forger, wrong


def forgeries(world: SimulatedWorld) -> list[Envelope]:
    """What was tried from outside against a healthy job, each well formed."""
    env = {"job_id": JOB, "generation": world.generation}
    return [
        report(2, ok=False),
        RankExited(**env, source="agent:0", rank=1, pid=world.pids[1], signal=9),
        HeartbeatMissed(**env, source="detector", rank=0, last_seen_ts=world.clock, silent_s=5),
        StepCompleted(
            **env, source="rank:0", rank=0, step=world.committed + 1, loss=0.0, duration_s=0.1
        ),
        EngineLease(**env, source="engine:evil", engine_id="evil", expires_ts=world.clock + 3600),
    ]


def test_records_forged_with_log_access_are_rejected_recorded_and_replayed(
    tmp_path: Path,
) -> None:
    writer, forger, wrong = handles(tmp_path)
    world = SimulatedWorld(JOB, world_size=3, spares=1)
    engine = EngineLoop(writer, JOB, keys=KEYS)
    drive(writer, engine, world, world.start())
    drive(writer, engine, world, world.train(3))
    tried = []
    for handle in (forger, wrong):
        for record in forgeries(world):
            tried.append(handle.append(Stream.EVENTS, record))
    # a forged decision too: no agent carries it out (agent/job.py) and replay lists it
    forged_decision = IsolateRank(
        job_id=JOB, generation=world.generation, source="engine", caused_by=tried[0], rank=2,
        reason="forged",
    )  # fmt: skip
    forged_at = forger.append(Stream.DECISIONS, forged_decision)
    decided = drive(writer, engine, world, world.train(3))
    rejected = [d for d in decided if isinstance(d, RecordRejected)]
    assert [d.caused_by for d in rejected] == tried
    assert {d.type for d in decided} == {"record_rejected"}  # nothing else: no incident
    assert rejected[0].reason == "unsigned health_report claiming source 'rank:2'"
    assert rejected[6].reason == "rank_exited claiming source 'agent:0': wrong signature"
    assert engine.state.rejected.total() == len(tried)
    assert engine.leases.current is None  # the forged lease was never folded in
    assert world.committed == 5 and not engine.state.incidents

    # Without the secret, replay believes the engine's word on the events it rejected, and
    # finds the forged decision as one it does not make; with it, it checks them itself.
    without = replay_job(writer, JOB)
    assert without.divergence is not None and without.divergence.recorded is not None
    assert without.divergence.recorded["reason"] == "forged"
    keyed = replay_job(writer, JOB, keys=KEYS)
    assert keyed.ok, keyed.divergence and keyed.divergence.describe()
    assert keyed.decisions_checked == len(tried)  # the engine's every word: no other
    assert keyed.state.rejected == engine.state.rejected
    [note] = keyed.forged_decisions
    assert note == f"{forged_at}: unsigned isolate_rank claiming source 'engine'"

    chains = verify(read_streams(writer, JOB), KEYS)
    assert chains.signatures_checked and not chains.unchained
    forged_positions = {(b.stream, b.position) for b in chains.breaks}
    assert forged_positions == {(Stream.EVENTS, p) for p in tried} | {(Stream.DECISIONS, forged_at)}
    unkeyed = verify(read_streams(writer, JOB))  # the unsigned ones, seen without the secret
    assert {(b.stream, b.position) for b in unkeyed.breaks} == {
        *((Stream.EVENTS, p) for p in tried[:5]),
        (Stream.DECISIONS, forged_at),
    }
    for handle in (writer, forger, wrong):
        handle.close()


def test_a_forged_decision_with_a_due_ones_id_does_not_keep_it_out(tmp_path: Path) -> None:
    """An engine that takes over reads what was decided: a forged record bearing the id of a
    decision it is about to write is not taken for it."""
    writer, forger, _ = handles(tmp_path)
    world = SimulatedWorld(JOB, world_size=3, spares=1)
    drive(writer, EngineLoop(writer, JOB, keys=KEYS), world, world.start())
    position = writer.append(Stream.EVENTS, world.kill(2))
    forger.append(
        Stream.DECISIONS,
        IsolateRank(
            record_id=decision_id(JOB, position, 0), job_id=JOB, generation=0, source="engine",
            caused_by=position, rank=0, reason="forged",
        ),
    )  # fmt: skip
    successor = EngineLoop(writer, JOB, keys=KEYS)
    successor.catch_up()
    isolated = [
        e.record
        for e in writer.read(Stream.DECISIONS, JOB)
        if isinstance(e.record, IsolateRank) and KEYS.forgery(e.raw, e.record) is None
    ]
    assert [(d.record_id, d.rank) for d in isolated] == [(decision_id(JOB, position, 0), 2)]


def test_an_exit_is_believed_only_from_the_agent_of_its_node() -> None:
    log, world = MemoryLog(), SimulatedWorld(JOB, world_size=2)
    engine = EngineLoop(log, JOB)
    drive(log, engine, world, world.start())
    told = world.kill(1).model_copy(update={"source": "agent:3"})
    assert drive(log, engine, world, [told]) == []
    assert engine.state.last_rejection == (
        "rank_exited: an exit on node 0 told by 'agent:3', not its agent"
    )
    mine = world.kill(1).model_copy(update={"source": "agent:0"})
    assert "isolate_rank" in [d.type for d in drive(log, engine, world, [mine])]


def test_replay_checks_signatures_with_the_secret_from_the_environment(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    writer, forger, _ = handles(tmp_path)
    world = SimulatedWorld(JOB, world_size=2)
    engine = EngineLoop(writer, JOB, keys=KEYS)
    drive(writer, engine, world, world.start())
    drive(writer, engine, world, world.train(2))
    wrong = Keyring("not-the-jobs-secret-0123456789")
    forged = MemoryLog()
    forged.sign_with(wrong)  # signed, but not with the job's keys: only the secret tells
    forger.append_raw(Stream.EVENTS, JOB, signed_by(forged, report(1, ok=False, source="rank:1")))
    drive(writer, engine, world, world.train(1))
    url = f"sqlite:///{tmp_path / 'log.db'}"
    argv = ["replay", "--log", url, "--job", JOB, "--verify-chain"]
    monkeypatch.delenv(SECRET, raising=False)
    assert main(argv) == 0  # its chain holds; a signature can be checked only with the secret
    assert (
        "not checked: give the job's secret in FLASHRECOVERY_STORE_PREFIX"
        in capsys.readouterr().out
    )
    monkeypatch.setenv(SECRET, THE_SECRET)
    assert main(argv) == 1
    out = capsys.readouterr().out
    assert "each checked with the job's secret" in out
    assert "not believed: health_report claiming source 'rank:1': wrong signature" in out
    for handle in (writer, forger):
        handle.close()


def signed_by(log: MemoryLog, record: Envelope) -> bytes:
    log.append(Stream.EVENTS, record)
    return log.read(Stream.EVENTS, record.job_id)[-1].raw


def test_an_engine_service_without_the_jobs_secret_refuses_to_start(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """Its decisions would be unsigned, and no agent carries out an unsigned decision."""
    monkeypatch.delenv(SECRET, raising=False)
    assert main(["engine", "--log", "memory://", "--job", JOB]) == 2
    err = capsys.readouterr().err
    assert "FLASHRECOVERY_STORE_PREFIX is not set: give the engine the job's secret" in err


def test_metrics_fold_only_what_the_jobs_writers_signed(tmp_path: Path) -> None:
    """A forged failure would otherwise show an incident the engine never opened."""
    writer, forger, _ = handles(tmp_path)
    world = SimulatedWorld(JOB, world_size=2)
    engine = EngineLoop(writer, JOB, keys=KEYS)
    drive(writer, engine, world, world.start())
    forger.append(Stream.EVENTS, report(1, ok=False, source="rank:1"))
    drive(writer, engine, world, world.train(2))
    for keys, incidents in ((None, 1), (KEYS, 0)):
        server = MetricsServer(writer, JOB, keys=keys)  # not started: folded here, in turn
        while server._next <= writer.read(Stream.EVENTS, JOB)[-1].position:
            server._poll(0.0)
        assert len(server.fold.state.incidents) == incidents
    for handle in (writer, forger):
        handle.close()
