"""Faults a real cluster hits every week, on real processes: a crash loop, a script that can't
start, two ranks lost at once, idle spares that die or hang. Each recovered job ends bitwise
equal to a fault-free run; each job that can't recover ends, says why, and leaves no process."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from livejob import Processes, run_job
from test_live_recovery import assert_lossless, assert_survivors_kept

from flashrecovery.records import Envelope
from flashrecovery.replay.replayer import replay_job

pytestmark = pytest.mark.timeout(240)
MAX_REPLACEMENTS = 3


def test_a_crash_loop_fails_the_job_naming_rank_step_and_error(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    job = run_job(tmp_path, nproc=2, spares=1, script_args=["--raise-at", "1@5"])
    assert job.exit_code != 0
    [verdict] = job.decisions("fail_job")
    assert (verdict.rank, verdict.step, verdict.failures) == (1, 4, MAX_REPLACEMENTS)
    assert "bad batch at step 5" in verdict.last_error
    replacements = job.decisions("assign_spare") + job.decisions("spawn_replacement")
    assert len(replacements) <= MAX_REPLACEMENTS + 1
    assert job.records(type="job_finished")[-1].status == "failed"
    line = capsys.readouterr().err
    assert "rank 1 failed 3 times at committed step 4" in line and "bad batch" in line
    report = replay_job(job.log, job.job_id)
    assert report.ok and report.state.job.state == "failed"
    assert report.state.verdict is not None and "bad batch" in report.state.verdict
    shown = subprocess.run(
        [
            sys.executable,
            "-m",
            "flashrecovery.cli",
            "replay",
            "--log",
            job.log.url,
            "--job",
            job.job_id,
        ],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert "the engine failed the job: rank 1 failed 3 times" in shown.stdout


def test_a_script_that_cannot_start_ends_the_job(tmp_path: Path) -> None:
    broken = tmp_path / "broken.py"
    broken.write_text("def main(:\n    pass\n")
    job = run_job(tmp_path, nproc=2, spares=1, script=broken)
    assert job.exit_code != 0
    [verdict] = job.decisions("fail_job")
    assert verdict.step == -1 and verdict.failures == MAX_REPLACEMENTS
    started = {r.pid for r in job.records() if r.type == "rank_exited"}
    # ranks and spare at launch, then a bounded number of replacements and refills
    assert len(started) <= 2 + 1 + 2 * MAX_REPLACEMENTS + MAX_REPLACEMENTS
    assert replay_job(job.log, job.job_id).ok


def test_two_simultaneous_kills_are_each_taken_by_a_hot_spare(
    tmp_path: Path, reference: torch.Tensor
) -> None:
    job = run_job(tmp_path, spares=2, kill_at={0: 6, 2: 6})
    activated = job.records(type="spare_activated")  # in the order the exits were seen
    assert sorted(a.rank for a in activated) == [0, 2]
    assert sorted(a.spare_id for a in activated) == [0, 1]
    assert job.decisions("spawn_replacement") == []
    assert_lossless(job, reference, incidents=2)
    assert_survivors_kept(job, failed={0, 2})


def gated(tmp_path: Path) -> tuple[Path, list[str]]:
    """Ranks wait before step 6 until the returned file exists: the scenario opens the gate
    once its faults are in place, so they land while training is still going on."""
    gate = tmp_path / "gate"
    return gate, ["--hold-at", "6", "--hold-file", str(gate)]


@pytest.mark.parametrize(
    ("fault", "why"),
    [(signal.SIGKILL, "exited (signal 9)"), (signal.SIGSTOP, "no heartbeat")],
    ids=["killed", "stopped"],
)
def test_a_lost_idle_spare_is_replaced_and_never_assigned(
    fault: signal.Signals, why: str, tmp_path: Path, reference: torch.Tensor
) -> None:
    """An idle spare that dies (or hangs: SIGSTOP) is retired and replaced; the next failure
    is taken by the new spare, never by the lost one."""
    gate, args = gated(tmp_path)

    def lose_spare(record: Envelope, known: Processes) -> bool:
        if 0 in known.spares:  # any record once spare 0 is ready (the ranks may be held)
            os.kill(known.spares[0], fault)
            return True
        return False

    def kill_rank_once_replaced(record: Envelope, known: Processes) -> bool:
        if record.type == "spare_ready" and record.spare_id == 1:
            os.kill(known.ranks[1], signal.SIGKILL)
            gate.touch()
            return True
        return False

    job = run_job(
        tmp_path, spares=1, script_args=args, scenario=[lose_spare, kill_rank_once_replaced]
    )
    [retired] = job.decisions("retire_spare")
    assert retired.spare_id == 0 and why in retired.reason and retired.refill
    assert [(a.rank, a.spare_id) for a in job.records(type="spare_activated")] == [(1, 1)]
    assert job.decisions("spawn_replacement") == []
    assert_lossless(job, reference, incidents=1)
    assert_survivors_kept(job, failed={1})


def test_a_spare_stopped_just_before_it_is_needed_is_not_handed_the_rank(
    tmp_path: Path, reference: torch.Tensor
) -> None:
    """SIGSTOP the only idle spare and kill a rank at once: its last beat is too fresh for the
    engine to know, so the engine assigns it; the agent sees it stopped, kills it instead of
    handing it the rank, and the rank is placed again on a runnable process."""
    gate, args = gated(tmp_path)

    def stop_spare_and_kill_rank(record: Envelope, known: Processes) -> bool:
        # Any record once spare 0 is ready and rank 1 has joined (the ranks may be held).
        if 0 in known.spares and 1 in known.ranks:
            os.kill(known.spares[0], signal.SIGSTOP)
            os.kill(known.ranks[1], signal.SIGKILL)
            gate.touch()
            return True
        return False

    job = run_job(tmp_path, spares=1, script_args=args, scenario=[stop_spare_and_kill_rank])
    assigned = [(a.rank, a.spare_id) for a in job.decisions("assign_spare")]
    assert assigned[0] == (1, 0)  # fresh beats: the engine could not know
    activated = job.records(type="spare_activated")
    assert all(a.spare_id != 0 for a in activated)
    [stopped_exit] = [r for r in job.records(type="rank_exited") if r.spare_id == 0]
    assert stopped_exit.signal == signal.SIGKILL
    taken = len(activated) + len(job.decisions("spawn_replacement"))
    assert taken == 1  # then one runnable process took rank 1
    assert_lossless(job, reference, incidents=1)
    assert_survivors_kept(job, failed={1})
