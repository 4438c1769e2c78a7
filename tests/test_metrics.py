"""Metrics folded from a scripted job's log: the values, their cardinality bound, and the
`flashrecovery metrics` command serving them over HTTP from a finished log."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
from factories import engine_env, signed
from scrape import scrape, value

from flashrecovery.connectors import open_log
from flashrecovery.connectors.memory import MemoryLog
from flashrecovery.observe.metrics import JobFold, families
from flashrecovery.records import Stream
from flashrecovery.testing.simworld import SimulatedWorld, scripted_failure

JOB = "scripted"
ROOT = Path(__file__).resolve().parents[1]
START_S = 60.0  # bound on the command starting up and answering


def fold_of(log: MemoryLog | object, job_id: str = JOB) -> JobFold:
    fold = JobFold(job_id)
    for entry in log.read(Stream.EVENTS, job_id):  # type: ignore[attr-defined]
        fold.apply(entry)
    return fold


def samples(fold: JobFold, now: float, **options: int) -> dict[tuple[str, tuple[str, ...]], float]:
    return {
        (s.name, tuple(v for k, v in sorted(s.labels.items()) if k != "job_id")): s.value
        for family in families(fold, now, **options)
        for s in family.samples
    }


def test_a_kill_and_recovery_in_numbers() -> None:
    log = MemoryLog()
    decisions = scripted_failure(log, JOB, world_size=4, spares=1, steps_before=3, steps_after=2)
    [closed] = [d for d in decisions if d.type == "incident_closed"]
    fold = fold_of(log)
    got = samples(fold, now=fold.state.incidents[0].detected.ts)
    assert got[("flashrecovery_steps_committed_total", ())] == 5
    assert got[("flashrecovery_incidents_total", ("rank_exited",))] == 1
    assert got[("flashrecovery_incidents_open", ())] == 0
    assert got[("flashrecovery_rto_seconds_count", ())] == 1
    assert got[("flashrecovery_rto_seconds_sum", ())] == pytest.approx(closed.rto_s)
    assert got[("flashrecovery_steps_lost_total", ())] == closed.rpo_steps
    assert got[("flashrecovery_steps_recomputed_total", ())] == closed.recomputed_steps
    assert got[("flashrecovery_spares_ready", ())] == 0  # the world does not refill its pool
    assert got[("flashrecovery_ranks", ("finished",))] == 4
    assert got[("flashrecovery_ranks", ("healthy",))] == 0
    assert got[("flashrecovery_job_state", ("completed",))] == 1
    # 4 ranks x 5 steps, all 0.2 s: each in the (0.1, 0.25] bucket.
    assert got[("flashrecovery_step_duration_seconds_count", ())] == 20
    assert got[("flashrecovery_step_duration_seconds_bucket", ("0.1",))] == 0
    assert got[("flashrecovery_step_duration_seconds_bucket", ("0.25",))] == 20
    assert not any(name.endswith("heartbeat_age_seconds") for name, _ in got)  # all finished


def test_heartbeat_ages_are_per_rank_up_to_the_limit_then_per_host() -> None:
    log = MemoryLog()
    scripted_failure(log, JOB, world_size=4)
    fold = JobFold(JOB)
    for entry in log.read(Stream.EVENTS, JOB):
        if entry.record is not None and entry.record.type == "rank_exited":
            break  # mid-job: every rank beating
        fold.apply(entry)
    last = max(v.last_heartbeat_ts or 0 for v in fold.state.ranks.values())
    per_rank = samples(fold, now=last + 2.0)
    ages = {k: v for k, v in per_rank.items() if k[0] == "flashrecovery_rank_heartbeat_age_seconds"}
    assert sorted(labels for _, labels in ages) == [("sim-host", str(r)) for r in range(4)]
    assert all(2.0 <= age < 3.0 for age in ages.values())
    per_host = samples(fold, now=last + 2.0, per_rank_limit=2)
    hosts = {k: v for k, v in per_host.items() if "heartbeat_age" in k[0]}
    assert list(hosts) == [("flashrecovery_host_heartbeat_age_seconds", ("sim-host",))]
    assert hosts[("flashrecovery_host_heartbeat_age_seconds", ("sim-host",))] == max(ages.values())


def test_lag_counts_the_events_a_reader_has_not_applied() -> None:
    log = MemoryLog()
    scripted_failure(log, JOB)
    fold = fold_of(log)
    positions = [e.position for e in log.read(Stream.EVENTS, JOB)]
    lag = samples(fold, 0.0, reader_position=positions[-3])[("flashrecovery_log_lag_records", ())]
    assert lag == 3


def test_metrics_command_serves_a_finished_log(tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path / 'log.db'}"
    with open_log(url) as log:
        scripted_failure(log, JOB)
        expected = samples(fold_of(log), 0.0)
    command = [sys.executable, "-m", "flashrecovery.cli", "metrics", "--log", url, "--job", JOB]
    server = subprocess.Popen(
        [*command, "--port", "0", "--host", "127.0.0.1"], stdout=subprocess.PIPE, text=True
    )
    try:
        assert server.stdout is not None
        line = server.stdout.readline()  # blocks until it serves (or dies: empty line)
        assert "serving metrics" in line, line
        endpoint = line.split(" on ")[-1].strip()
        got = scrape(endpoint, timeout=START_S)  # it says "serving" once it has folded the log
    finally:
        server.terminate()
        assert server.wait(START_S) == 0
    assert value(got, "flashrecovery_job_state", state="completed") == 1
    for (name, labels), number in expected.items():
        keys = [k for k in got if k[0] == name and tuple(v for _, v in k[1]) == labels]
        assert len(keys) == 1 and got[keys[0]] == number, name


def test_metrics_command_refuses_a_missing_job(tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path / 'log.db'}"
    with open_log(url) as log:
        scripted_failure(log, JOB)
    done = subprocess.run(
        [sys.executable, "-m", "flashrecovery.cli", "metrics", "--log", url, "--job", "nope",
         "--port", "0"],
        capture_output=True, text=True, timeout=START_S,
    )  # fmt: skip
    assert done.returncode == 2 and "no records" in done.stderr


def test_the_grafana_dashboard_queries_only_metrics_that_exist() -> None:
    dashboard = json.loads((ROOT / "docs" / "grafana-dashboard.json").read_text())
    queried = {
        name
        for panel in dashboard["panels"]
        for target in panel["targets"]
        for name in re.findall(r"flashrecovery_[a-z_]+", target["expr"])
    }
    log = MemoryLog()
    scripted_failure(log, JOB)
    fold = fold_of(log)
    served = {
        family.name
        for limit in (64, 0)  # heartbeat ages per rank, then per host
        for family in families(fold, 0.0, reader_position=0, per_rank_limit=limit)
    }
    served |= {f"{name}_total" for name in served}  # counters are exposed with _total
    served |= {f"{name}_{part}" for name in served for part in ("bucket", "sum", "count")}
    served |= {
        "flashrecovery_rank_heartbeat_age_seconds",
        "flashrecovery_host_heartbeat_age_seconds",
    }
    assert queried and queried <= served, queried - served


def test_engine_service_serves_metrics_with_its_log_lag(tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path / 'log.db'}"
    world = SimulatedWorld(JOB, world_size=2, spares=0)
    with signed(open_log(url)) as log:
        for record in [*world.start(), *world.train(3)]:  # a job still running
            log.append(Stream.EVENTS, record)
    command = [sys.executable, "-m", "flashrecovery.cli", "engine", "--log", url, "--job", JOB]
    engine = subprocess.Popen(
        [*command, "--metrics-port", "0"], stdout=subprocess.PIPE, text=True, env=engine_env()
    )
    try:
        assert engine.stdout is not None
        lines = [engine.stdout.readline(), engine.stdout.readline()]  # serving…, metrics on…
        assert lines[1].startswith("metrics on http://"), lines
        got = scrape(lines[1].removeprefix("metrics on ").strip(), timeout=START_S)
    finally:
        engine.terminate()
        assert engine.wait(START_S) == 0
    assert value(got, "flashrecovery_log_lag_records") is not None
    assert value(got, "flashrecovery_ranks", state="pending") is not None


def test_engine_service_stopped_as_soon_as_it_announces_itself_exits_cleanly(
    tmp_path: Path,
) -> None:
    """A supervisor may stop the engine the moment it reads its first line: the engine must
    already handle SIGTERM then (it once installed its handler after starting its metrics
    server, so an early stop killed it with -15)."""
    url = f"sqlite:///{tmp_path / 'log.db'}"
    with signed(open_log(url)) as log:
        for record in SimulatedWorld(JOB, world_size=2, spares=0).start():
            log.append(Stream.EVENTS, record)
    command = [sys.executable, "-m", "flashrecovery.cli", "engine", "--log", url, "--job", JOB]
    engine = subprocess.Popen(
        [*command, "--metrics-port", "0"], stdout=subprocess.PIPE, text=True, env=engine_env()
    )
    try:
        assert engine.stdout is not None
        assert engine.stdout.readline().startswith("engine ")
    finally:
        engine.terminate()
        assert engine.wait(START_S) == 0
