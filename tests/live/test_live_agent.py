"""`flashrecovery run` as a user meets it: argument errors, the job's exit status, teardown."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import psutil
import pytest
from livejob import SCRIPT, run_job

from flashrecovery.cli import main
from flashrecovery.connectors import open_log
from flashrecovery.records import Stream
from flashrecovery.trainer_hooks import probe

pytestmark = pytest.mark.timeout(120)


PLANNED = f"{probe.ENV}="  # a fault plan in the launch environment (test-only: no flag names it)


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["missing.py"], "does not exist"),
        (["--nproc-per-node", "0", str(SCRIPT)], "at least 1"),
        (["--spares", "-1", str(SCRIPT)], "0 or more"),
        (["--log", "nope", str(SCRIPT)], "malformed"),
        (["--log", "gopher://x", str(SCRIPT)], "unknown scheme"),
        (["--log", "memory://", str(SCRIPT)], "one process"),
        (
            [f"{PLANNED}5:raise@1", str(SCRIPT)],
            f"{probe.ENV}: planned fault 5:raise@1: rank outside",
        ),
        ([f"{PLANNED}1:explode@3", str(SCRIPT)], f"{probe.ENV}: planned fault '1:explode@3'"),
    ],
)
def test_bad_arguments_fail_before_anything_starts(
    args: list[str],
    message: str,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    monkeypatch.chdir(tmp_path)
    for arg in args:
        if arg.startswith(PLANNED):
            monkeypatch.setenv(probe.ENV, arg.removeprefix(PLANNED))
    args = [arg for arg in args if not arg.startswith(PLANNED)]
    if "--nproc-per-node" not in args:
        args = ["--nproc-per-node", "2", *args]
    assert main(["run", *args]) == 2
    assert message in capsys.readouterr().err
    assert not (tmp_path / "runs").exists() or not any((tmp_path / "runs").iterdir())


def test_no_replica_left_falls_back_and_fails(tmp_path: Path) -> None:
    """The only rank dies: nobody holds its state, so the job says so and exits non-zero."""
    job = run_job(tmp_path, nproc=1, kill_at={0: 3})
    assert job.exit_code == 1
    assert [d.shards for d in job.decisions("fallback_to_checkpoint")] == [[0]]
    finished = job.records(type="job_finished")
    assert [(f.status, "fallback" in f.detail) for f in finished] == [("failed", True)]


def test_sigterm_tears_down_every_process(tmp_path: Path) -> None:
    """The CLI with its default log location; SIGTERM ends ranks and spares alike."""
    agent = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "flashrecovery.cli",
            "run",
            "--nproc-per-node",
            "2",
            "--spares",
            "1",
            "--job-id",
            "term",
            "--output-dir",
            str(tmp_path / "output"),
            str(SCRIPT),
            "--steps",
            "100000",
            "--out",
            str(tmp_path),
            "--step-time",
            "0.05",
        ],
        cwd=tmp_path,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        assert agent.stderr is not None
        banner = agent.stderr.readline()
        url = f"sqlite://{tmp_path / 'runs' / 'term' / 'log.db'}"
        assert banner.strip() == f"flashrecovery: job term, log {url}"
        log = open_log(url)
        seen: set[str] = set()
        position = 0
        while not {"spare_ready", "step_completed"} <= seen:
            assert agent.poll() is None, agent.stderr.read()
            for entry in log.follow(Stream.EVENTS, "term", position, 1.0):
                position = entry.position + 1
                assert entry.record is not None
                seen.add(entry.record.type)
        agent.send_signal(signal.SIGTERM)
        assert agent.wait(30) == 128 + signal.SIGTERM
    finally:
        agent.kill()
        agent.wait(10)
    records = [e.record for e in log.read(Stream.EVENTS, "term")]
    finished = [r for r in records if r is not None and r.type == "job_finished"]
    assert [(f.status, f.exit_code) for f in finished] == [("failed", 143)]
    pids = {r.pid for r in records if r is not None and r.type in ("rank_joined", "spare_ready")}
    assert len(pids) == 3
    for pid in pids:
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)


def test_an_agent_sigkilled_leaves_its_fork_server_to_end_quietly(tmp_path: Path) -> None:
    """The agent's end of the fork server's socket is reset when the agent is SIGKILLed; the
    server ends without a traceback (its stderr is the agent's, which a user reads)."""
    command = [
        sys.executable, "-m", "flashrecovery.cli", "run", "--nproc-per-node", "2",
        "--spares", "1", "--job-id", "lost", "--output-dir", str(tmp_path / "output"),
        str(SCRIPT), "--steps", "100000", "--out", str(tmp_path), "--step-time", "0.05",
    ]  # fmt: skip
    agent = subprocess.Popen(command, cwd=tmp_path, stderr=subprocess.PIPE, text=True)
    log = open_log(f"sqlite://{tmp_path / 'runs' / 'lost' / 'log.db'}")
    try:
        assert agent.stderr is not None
        agent.stderr.readline()  # the banner: the log exists from here on
        position, seen = 0, set()
        while "spare_ready" not in seen or "step_completed" not in seen:
            assert agent.poll() is None
            for entry in log.follow(Stream.EVENTS, "lost", position, 1.0):
                position = entry.position + 1
                seen.add(entry.record.type if entry.record else "")
        started = psutil.Process(agent.pid).children(recursive=True)
        agent.kill()
        agent.wait(10)
        said = agent.stderr.read()  # to its end: every process that held the pipe is gone
    finally:
        agent.kill()
        for process in psutil.Process().children(recursive=True):
            if process in started:
                process.kill()
    assert "Traceback" not in said and "ConnectionResetError" not in said, said
    _, left = psutil.wait_procs(started, timeout=30)
    assert left == []
