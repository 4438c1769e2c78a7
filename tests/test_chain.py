"""Hash chains: every writer's records link to its previous one; the agent's final record seals
the heads. A changed, lost or appended-around record is found at its position and writer."""

from __future__ import annotations

import json
import sqlite3
from pathlib import Path

import pytest

from flashrecovery.cli import main
from flashrecovery.connectors import LogConnector, open_log
from flashrecovery.connectors.chain import read_streams, seal
from flashrecovery.engine.loop import EngineLoop
from flashrecovery.records import JobFinished, StepCompleted, Stream, dump_record
from flashrecovery.replay.verify import handle_runs, verify
from flashrecovery.testing.simworld import SimulatedWorld, drive

JOB = "chained"


def sealed_job(log: LogConnector) -> str | None:
    """The scripted failure (rank 2 killed after step 2, a spare takes over), ended by a
    JobFinished that seals the log the way the agent does."""
    world = SimulatedWorld(JOB, world_size=3)
    engine = EngineLoop(log, JOB)
    drive(log, engine, world, world.start())
    drive(log, engine, world, world.train(3))
    drive(log, engine, world, [world.kill(2)])
    drive(log, engine, world, world.train(2))
    *finished, _ = world.finish()
    drive(log, engine, world, finished)
    log.append(
        Stream.EVENTS,
        JobFinished(job_id=JOB, generation=1, source="agent", status="completed", **seal(log, JOB)),
    )
    return log.chain_head(JOB, Stream.EVENTS, "agent")  # what the agent prints as the seal hash


SEAL_HASH = "seal-hash"


@pytest.fixture
def db(tmp_path: Path) -> Path:
    path = tmp_path / "log.db"
    with open_log(f"sqlite:///{path}") as log:
        (path.parent / SEAL_HASH).write_text(str(sealed_job(log)))
    return path


def rewrite(db: Path, position: int, raw: bytes | None) -> None:
    """Change (or with None, delete) the stored events record at a position, behind the log."""
    with sqlite3.connect(db) as conn:
        if raw is None:
            conn.execute("DELETE FROM events WHERE position = ?", (position,))
        else:
            conn.execute("UPDATE events SET raw = ? WHERE position = ?", (raw, position))


def events(db: Path) -> list[tuple[int, bytes, StepCompleted | None]]:
    with open_log(f"sqlite:///{db}") as log:
        return [
            (e.position, e.raw, e.record if isinstance(e.record, StepCompleted) else None)
            for e in log.read(Stream.EVENTS, JOB)
        ]


def writer_of(raw: bytes) -> str | None:
    link = json.loads(raw).get("chain")
    return link["writer"] if link else None


def check(db: Path) -> dict[str, object]:
    with open_log(f"sqlite:///{db}") as log:
        return verify(read_streams(log, JOB)).to_json()


def test_an_untouched_log_verifies_and_its_seal_names_every_writer_and_commit(db: Path) -> None:
    report = check(db)
    assert report["ok"] and report["sealed"] and report["unchained"] == 0
    assert report["after_seal"] == 0
    assert report["seal_hash"] == (db.parent / SEAL_HASH).read_text()
    with open_log(f"sqlite:///{db}") as log:
        final = log.read(Stream.EVENTS, JOB)[-1].record
    assert isinstance(final, JobFinished)
    # Every writer of either stream, and no other, has its head in the seal.
    with open_log(f"sqlite:///{db}") as log:
        written = {
            (stream.value, e.record.chain.writer)
            for stream in Stream
            for e in log.read(stream, JOB)[: -1 if stream == Stream.EVENTS else None]
            if e.record is not None and e.record.chain is not None
        }
    assert {(h.stream, h.writer) for h in final.chain_heads} == written
    assert {w.split("/")[0] for _, w in written} >= {
        "rank:0",
        "rank:1",
        "rank:2",
        "agent",
        "engine",
    }
    assert report["writers"] == len(final.chain_heads)
    runs = [(c.first_step, c.last_step, c.ranks) for c in final.committed]
    assert runs == [(0, 4, [0, 1, 2])]


def test_a_doctored_record_breaks_its_writers_chain_at_its_position(db: Path) -> None:
    position, raw, step = next((p, r, s) for p, r, s in events(db) if s and s.step == 1)
    assert step is not None and step.chain is not None
    rewrite(db, position, raw.replace(b'"loss":0.5', b'"loss":0.25'))
    report = check(db)
    assert not report["ok"]
    assert report["first_break"] == {
        "stream": "events",
        "position": position,
        "writer": step.chain.writer,
        "reason": report["first_break"]["reason"],  # type: ignore[index]
    }
    assert "changed" in str(report["first_break"])


def test_a_lost_record_breaks_its_writers_chain_where_the_gap_starts(db: Path) -> None:
    rows = events(db)
    index = next(i for i, (_, _, s) in enumerate(rows) if s and s.step == 2 and s.rank == 1)
    lost = rows[index][2]
    assert lost is not None and lost.chain is not None
    previous_of_writer = [p for p, raw, _ in rows[:index] if writer_of(raw) == lost.chain.writer][
        -1
    ]
    rewrite(db, rows[index][0], None)
    first = check(db)["first_break"]
    assert isinstance(first, dict)
    assert first["position"] == previous_of_writer and first["writer"] == lost.chain.writer
    assert "lost" in first["reason"]


@pytest.mark.parametrize("edit", ["change", "lose"])
def test_a_writers_last_record_is_covered_by_the_seal(db: Path, edit: str) -> None:
    """Nothing follows rank 0's rank_finished in its chain: only the seal can vouch for it."""
    rows = events(db)
    writer = writer_of(next(raw for _, raw, s in rows if s and s.rank == 0))
    mine = [(p, raw) for p, raw, _ in rows if writer_of(raw) == writer]
    (before, _), (position, raw) = mine[-2], mine[-1]
    assert json.loads(raw)["type"] == "rank_finished"
    rewrite(db, position, raw.replace(b'"step":4', b'"step":5') if edit == "change" else None)
    first = check(db)["first_break"]
    assert isinstance(first, dict) and first["writer"] == writer
    if edit == "change":
        assert first["position"] == position and "seal" in first["reason"]
    else:
        assert first["position"] == before and "lost" in first["reason"]


def test_records_without_a_link_still_read_and_are_counted_not_broken(tmp_path: Path) -> None:
    with open_log(f"sqlite:///{tmp_path / 'old.db'}") as log:
        old = StepCompleted(job_id=JOB, generation=0, source="rank:0", rank=0, step=0, duration_s=1)
        log.append_raw(Stream.EVENTS, JOB, dump_record(old))  # as a build without chains wrote it
        assert b'"chain"' not in log.read(Stream.EVENTS, JOB)[0].raw
        assert log.read(Stream.EVENTS, JOB)[0].record == old
        report = verify(read_streams(log, JOB))
    assert report.ok and report.unchained == 1 and not report.sealed


def test_replay_verify_chain_reports_the_first_break(
    capsys: pytest.CaptureFixture[str], db: Path
) -> None:
    url = f"sqlite:///{db}"
    assert main(["replay", "--log", url, "--job", JOB, "--verify-chain"]) == 0
    assert "chain OK" in capsys.readouterr().out
    position, raw, step = next((p, r, s) for p, r, s in events(db) if s and s.step == 3)
    rewrite(db, position, raw.replace(b'"rank":', b'"rank": '))  # same record, other bytes
    assert main(["replay", "--log", url, "--job", JOB, "--verify-chain", "--json"]) == 1
    document = json.loads(capsys.readouterr().out)
    assert document["ok"]  # the decisions still replay: only the chain sees the edit
    assert document["chain"]["first_break"]["position"] == position
    assert document["chain"]["first_break"]["writer"] == step.chain.writer  # type: ignore[union-attr]


def test_handle_runs_group_the_records_one_handle_stored_together(tmp_path: Path) -> None:
    def step(rank: int, s: int) -> StepCompleted:
        return StepCompleted(
            job_id=JOB, generation=0, source=f"rank:{rank}", rank=rank, step=s, duration_s=0.1
        )

    with open_log(f"sqlite:///{tmp_path / 'log.db'}") as agent, open_log(agent.url) as own:
        agent.append_many(Stream.EVENTS, [step(0, 0), step(1, 0)])  # a node's batch
        own.append(Stream.EVENTS, step(2, 0))  # a rank writing its own
        agent.append_many(Stream.EVENTS, [step(0, 1), step(1, 1)])
        agent.append(Stream.EVENTS, step(3, 0))  # right after: one run, two writes
        entries = agent.read(Stream.EVENTS, JOB)
    runs = handle_runs(entries)
    assert [[(e.record.rank, e.record.step) for e in run] for run in runs] == [
        [(0, 0), (1, 0)],
        [(2, 0)],
        [(0, 1), (1, 1), (3, 0)],
    ]
