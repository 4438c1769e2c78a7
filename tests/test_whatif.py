"""What-if replay over recorded logs: the recorded settings reproduce the recorded decisions
exactly; a shorter heartbeat interval finds a hung (SIGSTOPped) rank earlier."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from flashrecovery.cli import main
from flashrecovery.connectors import open_log
from flashrecovery.connectors.memory import MemoryLog
from flashrecovery.errors import ConfigError
from flashrecovery.records import SpareHeartbeat, Stream
from flashrecovery.replay.whatif import compare, parse_settings
from flashrecovery.testing.simworld import scripted_failure, scripted_hang

JOB = "hung"
BEAT_S = 0.5  # the recorded heartbeat interval: a rank is missed after 3 x 0.5 s of silence
POLL_S = 0.05  # how often the recorded engine looked, as the engine loop polls


@pytest.fixture
def hung_log() -> MemoryLog:
    log = MemoryLog()
    scripted_hang(log, JOB, heartbeat_interval_s=BEAT_S, poll_s=POLL_S)
    return log


def test_the_recorded_settings_reproduce_the_recorded_decisions_exactly(
    hung_log: MemoryLog,
) -> None:
    events = hung_log.read(Stream.EVENTS, JOB)
    recorded = [e.record for e in hung_log.read(Stream.DECISIONS, JOB)]
    for settings in ([], [f"heartbeat_interval={BEAT_S}", "spares=1", "missed_heartbeats=3"]):
        comparison = compare(JOB, events, parse_settings(settings))
        assert comparison.what_if.decisions == recorded  # ids, causes and times included
        assert comparison.exact and comparison.first_difference() is None
        assert comparison.changed == {}


def test_a_shorter_heartbeat_interval_finds_the_hung_rank_earlier(hung_log: MemoryLog) -> None:
    events = hung_log.read(Stream.EVENTS, JOB)
    comparison = compare(JOB, events, parse_settings(["heartbeat_interval=0.2"]))
    assert comparison.changed == {"heartbeat_interval_s": (BEAT_S, 0.2)}
    [row] = comparison.incident_rows()  # the same incident; no false alarm from the resampling
    assert row["failed_rank"] == 1
    assert row["recorded_cause"] == row["what_if_cause"] == "heartbeat_missed"
    # Recorded: silent for 3 x 0.5 s, found at the next look. What-if: 3 x 0.2 s.
    assert 1.5 < row["recorded_detection_s"] <= 1.5 + POLL_S + 1e-6
    assert 0.6 < row["what_if_detection_s"] <= 0.6 + POLL_S + 1e-6
    earlier = row["recorded_detected_at_s"] - row["what_if_detected_at_s"]
    assert earlier == pytest.approx(row["recorded_detection_s"] - row["what_if_detection_s"])
    assert row["what_if_rto_s"] == pytest.approx(row["recorded_rto_s"] - earlier, abs=1e-6)
    assert "earlier" in row["note"]
    # The decisions are the same ones, the incident's first ones made earlier.
    first = comparison.first_difference()
    rows = comparison.decision_rows()
    assert first is not None and rows[first]["recorded"] == rows[first]["what_if"]
    assert rows[first]["recorded"].startswith("isolate_rank(rank=1")
    assert rows[first]["what_if_at_s"] < rows[first]["recorded_at_s"]
    assert [r["what_if"] for r in rows] == [r["recorded"] for r in rows]


def test_a_longer_interval_finds_it_later_and_a_tight_limit_gives_false_alarms(
    hung_log: MemoryLog,
) -> None:
    events = hung_log.read(Stream.EVENTS, JOB)
    later = compare(JOB, events, parse_settings(["missed_heartbeats=5"]))
    [row] = later.incident_rows()
    assert 2.5 < row["what_if_detection_s"] <= 2.5 + POLL_S + 1e-6
    # One missed beat of 0.1 s: the ranks beat every 0.2 s while training, so healthy ranks
    # look silent: incidents the recorded run did not have, whose sequel is not derivable.
    tight = compare(JOB, events, parse_settings(["heartbeat_interval=0.1", "missed_heartbeats=1"]))
    rows = tight.incident_rows()
    assert any(r["recorded_cause"] is None and r["what_if_rto_s"] is None for r in rows)


def test_no_spare_means_a_fresh_process_whose_rto_is_not_derivable(hung_log: MemoryLog) -> None:
    comparison = compare(JOB, hung_log.read(Stream.EVENTS, JOB), parse_settings(["spares=0"]))
    differing = [
        (r["recorded"] or "-").split("(")[0] + " / " + (r["what_if"] or "-").split("(")[0]
        for r in comparison.decision_rows()
        if not r["same"]
    ]
    assert differing == ["- / spawn_replacement", "assign_spare / -"]
    [row] = comparison.incident_rows()
    assert row["what_if_rto_s"] is None and "fresh process" in row["note"]


def test_more_spares_change_nothing_when_one_was_enough() -> None:
    log = MemoryLog()
    scripted_failure(log, "scripted")
    comparison = compare(
        "scripted", log.read(Stream.EVENTS, "scripted"), parse_settings(["spares=3"])
    )
    assert comparison.first_difference() is None
    [row] = comparison.incident_rows()
    assert row["what_if_rto_s"] == row["recorded_rto_s"]


@pytest.mark.parametrize(
    ("spec", "message"),
    [("heartbeat=1", "NAME one of"), ("spares", "NAME=VALUE"), ("spares=-1", "spares")],
)
def test_bad_settings_are_refused_with_the_reason(
    hung_log: MemoryLog, spec: str, message: str
) -> None:
    with pytest.raises(ConfigError, match=message):
        compare(JOB, hung_log.read(Stream.EVENTS, JOB), parse_settings([spec]))


def test_replay_what_if_on_the_command_line(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    url = f"sqlite:///{tmp_path / 'log.db'}"
    with open_log(url) as log:
        scripted_hang(log, JOB, heartbeat_interval_s=BEAT_S, poll_s=POLL_S)
    argv = ["replay", "--log", url, "--job", JOB, "--what-if", "heartbeat_interval=0.2"]
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert "what if heartbeat_interval_s 0.5 -> 0.2" in out and "earlier" in out
    assert main([*argv, "--json"]) == 0
    document = json.loads(capsys.readouterr().out)
    [row] = document["what_if"]["incidents"]
    assert row["what_if_detection_s"] < row["recorded_detection_s"]
    assert main([*argv[:-1], "nonsense=1"]) == 2
    assert "NAME one of" in capsys.readouterr().err


def test_spare_heartbeats_are_resampled_too(hung_log: MemoryLog) -> None:
    """A spare beating every 0.5 s is not declared missing under a 0.2 s interval."""
    events = hung_log.read(Stream.EVENTS, JOB)
    assert any(isinstance(e.record, SpareHeartbeat) for e in events)
    comparison = compare(JOB, events, parse_settings(["heartbeat_interval=0.2"]))
    assert not [d for d in comparison.what_if.decisions if d.type == "retire_spare"]


@pytest.mark.parametrize("fixture", ["recovery", "node_loss", "chaos"])
def test_beats_a_node_record_carries_are_resampled_per_process(fixture: str) -> None:
    """A recorded demo's ranks and spare beat through their agent's node records; a shorter
    interval must find no silence where the recorded processes were beating (a rank's beat
    that missed one node record and rode the next is no gap)."""
    db = Path(__file__).resolve().parent / "fixtures" / f"{fixture}.db"
    with open_log(f"sqlite://{db}", read_only=True) as log:
        job = next(j for j in log.jobs() if not j.endswith("-reference"))
        events = log.read(Stream.EVENTS, job)
    assert any(getattr(e.record, "beats", None) for e in events)
    comparison = compare(job, events, parse_settings(["heartbeat_interval=0.5"]))
    decided = [d.type for d in comparison.what_if.decisions]
    assert "retire_spare" not in decided
    recorded = [d.type for d in comparison.recorded.decisions]
    assert decided.count("isolate_rank") == recorded.count("isolate_rank")
