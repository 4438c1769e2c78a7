"""`flashrecovery events | replay | engine` on the log the scripted example writes."""

from __future__ import annotations

import json
import os
import shutil
import socket
import sqlite3
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from flashrecovery.cli import build_parser, main
from flashrecovery.connectors import open_log
from flashrecovery.records import Stream
from flashrecovery.testing.simworld import SimulatedWorld

ROOT = Path(__file__).resolve().parents[1]
JOB = "scripted"


@pytest.fixture(scope="module")
def scripted_log(tmp_path_factory: pytest.TempPathFactory) -> str:
    """The log written by examples/scripted_scenario.py, run as a user would."""
    db = tmp_path_factory.mktemp("scripted") / "log.db"
    done = subprocess.run(
        [sys.executable, str(ROOT / "examples" / "scripted_scenario.py"), str(db)],
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    )
    assert "flashrecovery replay" in done.stdout
    return f"sqlite:///{db}"


def run_cli(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def test_events_json_lines_cover_both_streams(
    capsys: pytest.CaptureFixture[str], scripted_log: str
) -> None:
    code, out, _ = run_cli(capsys, "events", "--log", scripted_log, "--job", JOB, "--json")
    assert code == 0
    rows = [json.loads(line) for line in out.splitlines()]
    with open_log(scripted_log) as log:
        total = sum(len(log.read(s, JOB)) for s in Stream)
    assert len(rows) == total
    types = [r["type"] for r in rows]
    assert types.index("rank_exited") < types.index("isolate_rank") < types.index("resume_planned")
    assert {r["stream"] for r in rows} == {"events", "decisions"}


def events_json(
    capsys: pytest.CaptureFixture[str], url: str, *filters: str
) -> list[dict[str, Any]]:
    code, out, _ = run_cli(capsys, "events", "--log", url, "--job", JOB, *filters, "--json")
    assert code == 0
    return [json.loads(line) for line in out.splitlines()]


def test_events_filters(capsys: pytest.CaptureFixture[str], scripted_log: str) -> None:
    [row] = events_json(capsys, scripted_log, "--rank", "2", "--type", "isolate_rank")
    assert row["type"] == "isolate_rank" and row["rank"] == 2
    since = events_json(
        capsys, scripted_log, "--since", str(row["caused_by"]), "--stream", "events"
    )
    positions = [r["position"] for r in since]
    assert positions and min(positions) == row["caused_by"]
    assert {r["stream"] for r in since} == {"events"}


def test_events_table_is_readable(capsys: pytest.CaptureFixture[str], scripted_log: str) -> None:
    code, out, _ = run_cli(
        capsys, "events", "--log", scripted_log, "--job", JOB, "--type", "incident_closed"
    )
    assert code == 0
    assert "incident_closed" in out and "rto_s" in out


def test_replay_json_reports_the_incident(
    capsys: pytest.CaptureFixture[str], scripted_log: str
) -> None:
    code, out, _ = run_cli(capsys, "replay", "--log", scripted_log, "--job", JOB, "--json")
    assert code == 0
    report = json.loads(out)
    assert report["ok"] and report["job_state"] == "completed"
    [incident] = report["incidents"]
    assert incident["state"] == "closed" and incident["failed_rank"] == 2
    assert list(incident["phases_s"]) == [
        "detected",
        "isolated",
        "replacement_ready",
        "regrouped",
        "restored",
        "resumed",
    ]
    assert (
        incident["rpo_steps"] == 0 and incident["recomputed_steps"] == 1 and incident["rto_s"] > 0
    )


def test_replay_table_and_until(capsys: pytest.CaptureFixture[str], scripted_log: str) -> None:
    code, out, _ = run_cli(capsys, "replay", "--log", scripted_log, "--job", JOB)
    assert code == 0 and "replay OK" in out and "RTO" in out
    with open_log(scripted_log) as log:
        isolate = next(
            e.record
            for e in log.read(Stream.DECISIONS, JOB)
            if e.record and e.record.type == "isolate_rank"
        )
    code, out, _ = run_cli(
        capsys,
        "replay",
        "--log",
        scripted_log,
        "--job",
        JOB,
        "--until",
        str(isolate.caused_by),
        "--json",
    )  # type: ignore[union-attr]
    report = json.loads(out)
    assert code == 0 and report["job_state"] == "regrouping" and report["ranks"]["2"] == "isolated"


def test_replay_of_a_doctored_sqlite_log_fails_at_the_edit(
    capsys: pytest.CaptureFixture[str], scripted_log: str, tmp_path: Path
) -> None:
    doctored = tmp_path / "doctored.db"
    shutil.copy(scripted_log.removeprefix("sqlite:///"), doctored)
    with open_log(f"sqlite:///{doctored}") as log:
        entry = next(
            e
            for e in log.read(Stream.DECISIONS, JOB)
            if e.record and e.record.type == "assign_spare"
        )
    edited = entry.raw.replace(b'"spare_id":0', b'"spare_id":7')
    assert edited != entry.raw
    with sqlite3.connect(doctored) as db:
        tables = [r[0] for r in db.execute("select name from sqlite_master where type='table'")]
        table = next(t for t in tables if "decision" in t)
        columns = [r[1] for r in db.execute(f"pragma table_info({table})")]
        value_column = next(c for c in columns if c in ("raw", "value", "record", "data", "body"))
        db.execute(
            f"update {table} set {value_column} = ? where {value_column} = ?", (edited, entry.raw)
        )
    code, out, _ = run_cli(
        capsys, "replay", "--log", f"sqlite:///{doctored}", "--job", JOB, "--json"
    )
    report = json.loads(out)
    assert code == 1 and not report["ok"]
    assert report["divergence"]["recorded"]["spare_id"] == 7
    assert report["divergence"]["replayed"]["spare_id"] == 0
    assert report["divergence"]["position"] == entry.record.caused_by  # type: ignore[union-attr]


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["events", "--log", "nosuchscheme://x"], "unknown scheme"),
        (["events", "--log", "not a url"], "malformed"),
        (["replay", "--log", "memory://", "--job", "nope"], "no records"),
        (["replay", "--log", "sqlite://{missing}", "--job", "j"], "no log at"),
        (["events", "--log", "sqlite://{missing}"], "no log at"),
        (
            ["run", "--checkpoint-dir", "{missing}", "--nproc-per-node", "2", __file__],
            "--checkpoint-dir and --checkpoint-every go together",
        ),
        (
            ["run", "--checkpoint-every", "3", "--nproc-per-node", "2", __file__],
            "--checkpoint-dir and --checkpoint-every go together",
        ),
    ],
)
def test_bad_input_is_a_clear_error(
    capsys: pytest.CaptureFixture[str], tmp_path: Path, argv: list[str], message: str
) -> None:
    missing = tmp_path / "missing" / "log.db"
    code, out, err = run_cli(capsys, *(a.format(missing=missing) for a in argv))
    assert code == 2
    assert message in out + err
    assert not missing.parent.exists()  # reading tools create nothing


def test_console_script_is_installed(scripted_log: str) -> None:
    exe = shutil.which("flashrecovery")
    assert exe is not None
    done = subprocess.run(
        [exe, "replay", "--log", scripted_log, "--job", JOB, "--json"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout)["ok"]


def test_events_follow_prints_records_as_they_arrive_and_ends_with_the_job(tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path / 'live.db'}"
    world = SimulatedWorld("followed", world_size=1, spares=0)
    with open_log(url) as log:
        first, *rest = world.start()
        log.append(Stream.EVENTS, first)
        follower = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "flashrecovery.cli",
                "events",
                "--log",
                url,
                "--job",
                "followed",
                "--follow",
                "--json",
            ],
            stdout=subprocess.PIPE,
            text=True,
        )
        try:
            assert follower.stdout is not None
            assert json.loads(follower.stdout.readline())["type"] == "job_started"
            log.append(Stream.EVENTS, rest[0])  # appended while the command is following
            assert json.loads(follower.stdout.readline())["type"] == "rank_joined"
            for record in world.finish():  # the job's end ends the command, rc 0
                log.append(Stream.EVENTS, record)
            assert follower.wait(timeout=30) == 0
            assert json.loads(follower.stdout.read().splitlines()[-1])["type"] == "job_finished"
        finally:
            follower.kill()
            follower.wait(timeout=30)


def test_a_mistyped_record_type_names_the_types_there_are(
    capsys: pytest.CaptureFixture[str], scripted_log: str
) -> None:
    with pytest.raises(SystemExit) as exited:
        main(["events", "--log", scripted_log, "--type", "bogus"])
    _, err = capsys.readouterr()
    assert exited.value.code == 2
    assert "no record type 'bogus'" in err and "isolate_rank" in err and "step_completed" in err


@pytest.mark.parametrize("command", ["events", "replay"])
def test_the_job_is_named_with_job_or_job_id_on_every_command(
    capsys: pytest.CaptureFixture[str], scripted_log: str, command: str
) -> None:
    outputs = [
        run_cli(capsys, command, "--log", scripted_log, spelling, JOB, "--json")
        for spelling in ("--job", "--job-id")
    ]
    assert outputs[0] == outputs[1] and outputs[0][0] == 0 and outputs[0][1]
    for argv, dest in (
        (["run", "--nproc-per-node", "2", "x.py"], "job_id"),
        (["control-plane", "--log", "memory://", "--bind", "127.0.0.1:0"], "job_id"),
        (["engine", "--log", "memory://"], "job"),
        (["metrics", "--log", "memory://"], "job"),
    ):
        for spelling in ("--job", "--job-id"):
            full = [*argv[:1], spelling, JOB, *argv[1:]]
            assert getattr(build_parser(full).parse_args(full), dest) == JOB


@pytest.mark.parametrize("command", ["events", "replay", "metrics"])
@pytest.mark.parametrize("kind", ["another program's", "empty", "not sqlite"])
def test_a_file_that_is_not_a_log_is_named_so_and_left_as_it_was(
    capsys: pytest.CaptureFixture[str], tmp_path: Path, command: str, kind: str
) -> None:
    path = tmp_path / "other.db"
    if kind == "another program's":
        with sqlite3.connect(path) as db:
            db.execute("create table mydata(x)")
        db.close()
    else:
        path.write_bytes(b"" if kind == "empty" else b"hello\n")
    before = path.read_bytes()
    argv = [command, "--log", f"sqlite://{path}", *([] if command == "events" else ["--job", JOB])]
    code, out, err = run_cli(capsys, *argv)
    assert code == 2
    assert f"{path} is not a flashrecovery log" in out + err
    assert path.read_bytes() == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["other.db"]


@pytest.mark.parametrize(
    ("plot", "message"),
    [
        ("timeline.txt", "the timeline is a picture; end the name in .png"),
        ("/proc/x.png", "cannot write the timeline to /proc/x.png"),
        ("{tmp}/missing/dir/x.png", "no directory {tmp}/missing/dir"),
    ],
)
def test_a_timeline_that_cannot_be_written_is_one_line_and_makes_no_directory(
    capsys: pytest.CaptureFixture[str], scripted_log: str, tmp_path: Path, plot: str, message: str
) -> None:
    argv = ["replay", "--log", scripted_log, "--job", JOB, "--plot", plot.format(tmp=tmp_path)]
    try:
        code, out, err = run_cli(capsys, *argv)
    except SystemExit as exited:  # refused by the argument parser, before anything is read
        code, (out, err) = int(str(exited.code)), capsys.readouterr()
    assert code == 2
    assert message.format(tmp=tmp_path) in err and "Traceback" not in out + err
    assert sum("error" in line for line in (out + err).splitlines()) == 1
    assert list(tmp_path.iterdir()) == []


def test_a_quieted_store_client_that_gives_up_raises_without_a_cpp_backtrace() -> None:
    """An agent's store client to a host just lost: c10d logs an error with a C++ backtrace
    before it raises (seen on a survivor of node 0's loss); quieted, only the exception is left."""
    with socket.create_server(("127.0.0.1", 0)) as probe:
        port = probe.getsockname()[1]  # closed again: nothing listens there
    script = (
        "import datetime\n"
        "from flashrecovery.logs import quiet_c10d\n"
        "quiet_c10d()\n"
        "import torch.distributed as dist\n"
        "try:\n"
        f"    dist.TCPStore('127.0.0.1', {port}, is_master=False,\n"
        "                  timeout=datetime.timedelta(seconds=1))\n"
        "except RuntimeError as exc:\n"
        "    print('gave up:', exc)\n"
    )
    env = {k: v for k, v in os.environ.items() if k != "TORCH_CPP_LOG_LEVEL"}
    done = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=60, env=env
    )
    assert done.stdout.startswith("gave up:"), done.stdout + done.stderr
    assert "frame #" not in done.stderr and "Exception raised from" not in done.stderr, done.stderr


def test_the_agents_quiet_c10d_and_leave_the_ranks_the_users_own_level(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from flashrecovery import logs
    from flashrecovery.agent.job import _base_env

    monkeypatch.delenv(logs.TORCH_LOG_LEVEL, raising=False)
    monkeypatch.delenv(logs.QUIETED_C10D, raising=False)
    logs.quiet_c10d()
    assert os.environ[logs.TORCH_LOG_LEVEL] == "FATAL"
    assert logs.TORCH_LOG_LEVEL not in _base_env()  # the ranks: torch's default, as the user's
    monkeypatch.setenv(logs.TORCH_LOG_LEVEL, "INFO")
    monkeypatch.delenv(logs.QUIETED_C10D)
    logs.quiet_c10d()
    assert (
        os.environ[logs.TORCH_LOG_LEVEL] == "INFO" and _base_env()[logs.TORCH_LOG_LEVEL] == "INFO"
    )
