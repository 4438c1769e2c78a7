"""Faults a real cluster hits every week, on real processes: a crash loop, a script that can't
start, two ranks lost at once, idle spares that die or hang. Each recovered job ends bitwise
equal to a fault-free run; each job that can't recover ends, says why, and leaves no process."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from livejob import EXAMPLES, SCRIPT, STEPS, WORLD, JobResult, Processes, run_job
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


def reading_before_init(tmp_path: Path, variable: str) -> Path:
    """The test script behind a few lines that read ``variable`` before init, as published
    FSDP2 and CUDA DDP scripts do; each process notes what it saw, and again at its end."""
    script = tmp_path / "reads_env_first.py"
    script.write_text(
        "import json, os, runpy, sys, tempfile\n"
        "from pathlib import Path\n"
        f"seen = os.environ[{variable!r}]\n"
        "out = Path(sys.argv[sys.argv.index('--out') + 1])\n"
        "def note(when):\n"
        "    names = ('RANK', 'LOCAL_RANK', 'WORLD_SIZE', 'LOCAL_WORLD_SIZE', 'MASTER_ADDR')\n"
        "    env = {name: os.environ.get(name) for name in names}\n"
        "    env['tmpfile'] = tempfile.mkstemp(prefix='left-')[1]  # left behind on purpose\n"
        "    (out / f'{when}-{os.getpid()}.json').write_text(json.dumps(env))\n"
        "note('start')\n"
        "end = os._exit  # the test script skips the interpreter's teardown\n"
        "os._exit = lambda code: (note('end'), end(code))\n"
        f"sys.argv[0] = {str(SCRIPT)!r}\n"
        f"runpy.run_path({str(SCRIPT)!r}, run_name='__main__')\n"
    )
    return script


def noted(job: JobResult, when: str) -> dict[int, dict[str, str | None]]:
    return {
        int(path.stem.split("-")[1]): json.loads(path.read_text())
        for path in job.out.glob(f"{when}-*.json")
    }


def test_a_script_reading_local_rank_before_init_recovers_each_process_in_a_place_of_its_own(
    tmp_path: Path, reference: torch.Tensor
) -> None:
    script = reading_before_init(tmp_path, "LOCAL_RANK")
    job = run_job(
        tmp_path, spares=1, kill_at={1: 6}, script=script, script_args=["--steps", str(STEPS)]
    )
    assert_lossless(job, reference, incidents=1)
    started, ended = noted(job, "start"), noted(job, "end")
    # Each process's TMPDIR is its agent's, removed with the job: what the killed rank (and
    # every other) left there is gone.
    left = [seen["tmpfile"] for seen in [*started.values(), *ended.values()]]
    assert all("/flashrecovery-node-" in str(path) for path in left), left
    assert not [path for path in left if Path(str(path)).exists()]
    joined = {r.rank: r.pid for r in job.records(type="rank_joined")}
    [spare] = [r for r in job.records(type="spare_ready") if r.spare_id == 0]
    [taken] = job.records(type="spare_activated")
    [refill] = [r for r in job.records(type="spare_ready") if r.spare_id == 1]
    assert [started[joined[rank]]["LOCAL_RANK"] for rank in range(WORLD)] == ["0", "1", "2"]
    assert started[spare.pid]["LOCAL_RANK"] == str(WORLD)  # beyond the ranks' places
    assert started[spare.pid]["RANK"] is None and started[spare.pid]["WORLD_SIZE"] == "3"
    assert taken.pid == spare.pid and taken.rank == 1
    assert ended[spare.pid]["RANK"] == "1" and ended[spare.pid]["LOCAL_RANK"] == str(WORLD)
    assert started[refill.pid]["LOCAL_RANK"] == "1"  # the lost rank's place, free again


def test_a_script_reading_rank_before_init_is_told_to_read_it_after_and_runs_without_spares(
    tmp_path: Path, reference: torch.Tensor, capsys: pytest.CaptureFixture[str]
) -> None:
    """A spare has no rank until it takes one: each dies of the KeyError. The agent says so
    once with the fix, the engine stops refilling after --max-replacements and says that too,
    and the job trains on to its end without spares."""
    gate, held = gated(tmp_path)

    lost: list[Envelope] = []

    def open_gate_once_refill_stops(record: Envelope, known: Processes) -> bool:
        if record.type == "rank_exited" and record.spare_id is not None:  # type: ignore[attr-defined]
            lost.append(record)
        if len(lost) == MAX_REPLACEMENTS:  # the last one the engine replaces
            gate.touch()
            return True
        return False

    script = reading_before_init(tmp_path, "RANK")
    job = run_job(
        tmp_path,
        spares=1,
        script=script,
        script_args=["--steps", str(STEPS), *held],
        scenario=[open_gate_once_refill_stops],
    )
    assert_lossless(job, reference, incidents=0)
    spares_lost = [r for r in job.records(type="rank_exited") if r.spare_id is not None]
    assert len(spares_lost) == MAX_REPLACEMENTS
    assert {r.error for r in spares_lost} == {"KeyError: 'RANK'"}
    [stopped] = [d for d in job.decisions("retire_spare") if not d.refill]
    assert "KeyError: 'RANK'" in stopped.reason and "no more are started" in stopped.reason
    err = capsys.readouterr().err
    assert err.count("read it after") == 1 and "no more are started" in err


@pytest.mark.parametrize("start_method", ["forkserver", "exec"])
def test_a_script_that_makes_its_own_default_group_is_told_the_fix_and_ends_at_once(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], start_method: str
) -> None:
    """An unported script (dist.init_process_group itself) fails on the first try with the
    fix in the job's last line: no crash loop of replacements to sit through (forked, or a
    new interpreter each, started through agent/script_main.py)."""
    unported = tmp_path / "unported.py"
    unported.write_text(
        "import torch.distributed as dist\n"
        "dist.init_process_group('gloo')\n"
        "print('trained', dist.get_rank())\n"
    )
    job = run_job(tmp_path, nproc=2, spares=1, script=unported, start_method=start_method)
    assert job.exit_code != 0
    [verdict] = job.decisions("fail_job")
    assert verdict.failures == 1 and "no replacement would do better" in verdict.reason
    assert "call flashrecovery.init_process_group() instead" in verdict.last_error
    assert job.decisions("assign_spare") == job.decisions("spawn_replacement") == []
    fatal = [r for r in job.records(type="rank_exited") if r.fatal]
    assert fatal and all("ScriptError" in (r.error or "") for r in fatal)
    assert "call flashrecovery.init_process_group() instead" in capsys.readouterr().err
    assert replay_job(job.log, job.job_id).ok


@pytest.mark.parametrize(
    ("example", "hook_line", "as_written", "message"),
    [
        (
            "train_ddp.py",
            "session.epochs(args.epochs)",
            "range(args.epochs)",
            "the batches of epoch 0 again",
        ),
        ("train_ddp.py", "session.batches(loader)", "loader", "session.commit() outside a step"),
        (
            "train_ddp_stateful.py",
            "for x, y in loader:",
            "for x, y in session.batches(loader):",
            "loop over it as it is",
        ),
    ],
    ids=["range-around-batches", "plain-loader-in-epochs", "registered-loader-in-batches"],
)
def test_a_loop_the_hook_cannot_follow_ends_the_job_at_its_first_step_with_the_fix(
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    example: str,
    hook_line: str,
    as_written: str,
    message: str,
) -> None:
    """An example with one of its hook lines put back as the script had it (or doubled): the
    job must neither train silently on (one epoch of three) nor take it for a peer failure."""
    source = (EXAMPLES / example).read_text()
    assert hook_line in source
    script = tmp_path / "half_ported.py"
    script.write_text(source.replace(hook_line, as_written))
    job = run_job(tmp_path, nproc=2, script=script)
    assert job.exit_code != 0
    [verdict] = job.decisions("fail_job")
    assert verdict.failures == 1 and message in verdict.last_error
    assert "docs/hook.md" in verdict.last_error
    assert job.decisions("fallback_to_checkpoint") == []
    assert message in capsys.readouterr().err


def test_fsdp_on_its_default_mesh_is_refused_at_register_not_at_its_first_recovery(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """fully_shard without ``mesh=`` shards over a mesh of torch's making: it trains, but no
    replacement could be handed its shards. Found where the model is registered."""
    source = (EXAMPLES / "train_hsdp.py").read_text()
    assert source.count(", mesh=mesh)") == 2
    script = tmp_path / "default_mesh.py"
    script.write_text(source.replace(", mesh=mesh)", ")"))
    job = run_job(tmp_path, nproc=2, shards=2, script=script, script_args=["--replicas", "1"])
    assert job.exit_code != 0
    [verdict] = job.decisions("fail_job")
    assert verdict.failures == 1 and "mesh=session.device_mesh(...)" in verdict.last_error
    assert job.records(type="step_completed") == []
    assert "over a mesh the session did not make" in capsys.readouterr().err
