"""`events` and `replay` never crash on what a log holds or on where their output goes: record
text with square brackets (gloo's error messages) prints as it is, and a reader that closes the
pipe early (`| head -1`) ends the command quietly."""

from __future__ import annotations

import os
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from flashrecovery.cli import main
from flashrecovery.connectors import open_log
from flashrecovery.records import (
    CollectiveError,
    HealthReport,
    Heartbeat,
    JobStarted,
    NodeHeartbeat,
    RankJoined,
    Stream,
)

JOB = "bracketed"
# What gloo says when a peer is SIGKILLed mid-collective, and text that looks like rich markup.
GLOO_ERROR = (
    "[/pytorch/third_party/gloo/gloo/transport/tcp/pair.cc:534] Connection closed by peer "
    "[127.0.0.1]:1234"
)
EXCEPTION = f"RuntimeError({GLOO_ERROR!r})"  # a rank's HealthReport detail
MARKUP_LOOKALIKE = "[bold red]not a style[/] [/] [link=x]"
# Enough output to fill a pipe's buffer (64 KiB on Linux) many times over, so the writer is
# still writing when `head` has gone.
PADDED_ERRORS = 300
CLI_TIMEOUT_S = 120


@pytest.fixture(scope="module")
def bracketed_log(tmp_path_factory: pytest.TempPathFactory) -> str:
    """A job whose rank 0 failed with gloo's bracketed error, then many more such errors."""
    url = f"sqlite:///{tmp_path_factory.mktemp('inspect') / 'log.db'}"
    envelope = {"job_id": JOB, "generation": 0}
    with open_log(url) as log:
        log.append(
            Stream.EVENTS,
            JobStarted(**envelope, source="agent", world_size=2, spares=0, heartbeat_interval_s=1),
        )
        for rank in (0, 1):
            log.append(
                Stream.EVENTS,
                RankJoined(**envelope, source=f"rank:{rank}", rank=rank, pid=100 + rank, host="h"),
            )
        log.append(
            Stream.EVENTS,
            CollectiveError(**envelope, source="rank:1", rank=1, step=3, error=GLOO_ERROR),
        )
        log.append(
            Stream.EVENTS,
            HealthReport(
                **envelope,
                source="rank:0",
                rank=0,
                ok=False,
                detail=f"RuntimeError({GLOO_ERROR!r})",
            ),
        )
        for i in range(PADDED_ERRORS):
            error = f"{MARKUP_LOOKALIKE} {GLOO_ERROR} #{i} " + "x" * 400
            log.append(
                Stream.EVENTS,
                CollectiveError(**envelope, source="rank:1", rank=1, step=3, error=error),
            )
    return url


def test_events_table_prints_bracketed_error_text_as_it_is(
    capsys: pytest.CaptureFixture[str], bracketed_log: str
) -> None:
    code = main(["events", "--log", bracketed_log, "--job", JOB, "--type", "collective_error"])
    out = capsys.readouterr().out
    assert code == 0
    assert GLOO_ERROR in out
    assert MARKUP_LOOKALIKE in out


def test_replay_prints_a_bracketed_failure_reason_as_it_is(
    capsys: pytest.CaptureFixture[str], bracketed_log: str
) -> None:
    code = main(["replay", "--log", bracketed_log, "--job", JOB])
    out = capsys.readouterr().out
    assert code == 0
    assert f"health check failed: {EXCEPTION}" in out


def test_events_table_in_a_subprocess(bracketed_log: str) -> None:
    done = subprocess.run(
        [sys.executable, "-m", "flashrecovery.cli", "events", "--log", bracketed_log, "--job", JOB],
        capture_output=True,
        text=True,
        timeout=CLI_TIMEOUT_S,
    )
    assert done.returncode == 0, done.stderr
    assert done.stderr == ""
    assert GLOO_ERROR in done.stdout and MARKUP_LOOKALIKE in done.stdout


@pytest.mark.parametrize(
    ("command", "first_line"),
    [
        (["events", "--json"], '{"stream": "events"'),
        (["events"], "time"),  # the table's header
    ],
)
def test_a_reader_that_stops_early_ends_the_command_quietly(
    bracketed_log: str, command: list[str], first_line: str
) -> None:
    """In a real shell pipeline: both sides exit 0, and stderr holds no traceback."""
    cli = [sys.executable, "-m", "flashrecovery.cli", *command, "--log", bracketed_log]
    cli += ["--job", JOB]
    script = f'{shlex.join(cli)} | head -1; echo "status ${{PIPESTATUS[*]}}"'
    done = subprocess.run(
        ["bash", "-c", script],
        capture_output=True,
        text=True,
        timeout=CLI_TIMEOUT_S,
        env={**os.environ, "COLUMNS": "100"},
    )
    head, status = done.stdout.splitlines()
    assert head.lstrip().startswith(first_line)
    assert status == "status 0 0", done.stderr
    assert done.stderr == ""


def test_events_of_a_rank_include_the_node_heartbeats_that_carry_its_beats(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    url = f"sqlite:///{tmp_path}/log.db"
    envelope = {"job_id": JOB, "generation": 0}
    beat = Heartbeat(**envelope, source="rank:3", rank=3, step=5, pid=303, host="h")
    with open_log(url) as log:
        for carried in ([beat], []):
            log.append(
                Stream.EVENTS,
                NodeHeartbeat(**envelope, source="agent:1", node=1, pid=900, beats=carried),
            )
    assert main(["events", "--log", url, "--job", JOB, "--rank", "3", "--json"]) == 0
    [shown] = capsys.readouterr().out.splitlines()
    assert '"rank": 3' in shown and '"step": 5' in shown
