"""Logs of real jobs, recorded once (tests/fixtures/record.py), replay to exactly the decisions
they hold on every commit: a recovery, a lost node, a checkpoint fallback and a chaos run. A
change of the records' schema or of the engine that an old log no longer replays to fails here,
as a recorded history fails a workflow replayer."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import pytest

from flashrecovery.connectors import open_log
from flashrecovery.connectors.chain import read_streams
from flashrecovery.records import Stream
from flashrecovery.replay.replayer import replay_job
from flashrecovery.replay.verify import verify
from tests.fixtures.record import expected

FIXTURES = Path(__file__).resolve().parent / "fixtures"
MANIFEST: dict[str, Any] = json.loads((FIXTURES / "manifest.json").read_text())


@pytest.mark.parametrize("name", sorted(MANIFEST))
def test_a_recorded_log_replays_to_the_decisions_it_holds(name: str, tmp_path: Path) -> None:
    copy = tmp_path / f"{name}.db"  # the checkout's file stays as it was recorded
    shutil.copyfile(FIXTURES / f"{name}.db", copy)
    jobs = MANIFEST[name]["jobs"]
    with open_log(f"sqlite://{copy}", read_only=True) as log:
        assert sorted(log.jobs()) == sorted(jobs)
        for job in jobs:
            for stream in Stream:
                unread = [e.error for e in log.read(stream, job) if e.record is None]
                assert not unread, f"{job} {stream}: records this build cannot read: {unread[:3]}"
            report = replay_job(log, job)
            assert report.ok, report.divergence.describe() if report.divergence else ""
            assert not report.pending and not report.state.rejected
            assert report.state.engine_faults == []
            assert verify(read_streams(log, job)).ok
    assert expected(f"sqlite://{copy}") == jobs


def test_the_fixtures_cover_a_recovery_a_node_loss_a_fallback_and_chaos() -> None:
    incidents = {
        name: [i for job in entry["jobs"].values() for i in job["incidents"]]
        for name, entry in MANIFEST.items()
    }
    assert set(incidents) == {"recovery", "node_loss", "fallback", "chaos"}
    assert all(i["state"] == "closed" for found in incidents.values() for i in found)
    [recovery] = incidents["recovery"]
    assert recovery["from"] == "replica" and recovery["rpo_steps"] == 0
    [node] = incidents["node_loss"]
    assert node["failed"].startswith("node")
    [fallback] = incidents["fallback"]
    assert fallback["from"] == "checkpoint" and fallback["rpo_steps"] > 0
    assert len(incidents["chaos"]) >= 3
