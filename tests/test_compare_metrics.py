"""bench/compare.py's reading of the committed-step lines (pure): which process holds a rank
after a kill, the RTO, the others' stall, the steps lost and the steady step times."""

from __future__ import annotations

from pathlib import Path

from bench.compare import Commit, Kill, ProgressTail, job_metrics, kill_metrics, steady_step_times

KILL_T = 10.5


def lines(rank: int, pid: int, steps: range, t0: float, period: float = 1.0) -> list[Commit]:
    """One commit every ``period`` seconds from ``t0``."""
    return [Commit(t0 + i * period, rank, pid, step) for i, step in enumerate(steps)]


def test_a_restart_from_a_checkpoint_counts_its_new_processes_and_its_lost_steps() -> None:
    commits = lines(0, 10, range(10), 1.0) + lines(1, 11, range(10), 1.0)
    commits.append(Commit(10.6, 0, 10, 10))  # in flight when rank 1 died: not a recovery
    commits += lines(0, 20, range(5, 8), 15.0) + lines(1, 21, range(5, 8), 16.0)
    row = kill_metrics(sorted(commits, key=lambda c: c.t), Kill(1, 11, KILL_T), until=99.0)
    assert row is not None
    assert row["rto_s"] == 16.0 - KILL_T  # rank 1's new process, the later one
    assert abs(row["stall_s"] - (15.0 - 10.6)) < 1e-9  # rank 0: the step in flight, then none
    assert row["steps_lost"] == 5  # steps 5..9 computed again


def test_a_replacement_that_resumes_after_the_committed_step_loses_none() -> None:
    commits = lines(0, 10, range(10), 1.0) + lines(1, 11, range(10), 1.0)
    commits += lines(0, 10, range(10, 12), 12.0) + lines(1, 30, range(10, 12), 12.2)
    row = kill_metrics(sorted(commits, key=lambda c: c.t), Kill(1, 11, KILL_T), until=99.0)
    assert row is not None
    assert abs(row["rto_s"] - (12.2 - KILL_T)) < 1e-9
    assert row["steps_lost"] == 0


def test_survivors_that_go_on_without_the_lost_rank_stall_only_until_they_do() -> None:
    commits = lines(0, 10, range(10), 1.0) + lines(1, 11, range(10), 1.0)
    commits += lines(0, 10, range(10, 20), 15.5) + lines(1, 40, range(19, 21), 25.0)
    row = kill_metrics(sorted(commits, key=lambda c: c.t), Kill(1, 11, KILL_T), until=99.0)
    assert row is not None
    assert row["rto_s"] == 25.0 - KILL_T
    assert row["stall_s"] == 15.5 - 10.0
    assert row["steps_lost"] == 0


def test_a_rank_with_no_step_after_the_kill_is_not_recovered() -> None:
    commits = lines(0, 10, range(10), 1.0) + lines(1, 11, range(10), 1.0)
    commits += lines(0, 10, range(10, 12), 12.0)
    assert kill_metrics(commits, Kill(1, 11, KILL_T), until=99.0) is None


def test_steady_step_times_skip_each_process_warmup_and_the_recovery() -> None:
    commits = lines(0, 10, range(20), 0.0)  # 1 s steps, then one of 5 s across the recovery
    commits += [Commit(24.0, 0, 10, 20), Commit(24.5, 0, 10, 21)]
    times = steady_step_times(commits, quiet=lambda a, b: b < 19.5 or a >= 24.0)
    assert times == [1.0] * (19 - 5) + [0.5]  # the first 5 steps of the process are skipped
    job = {
        "commits": [*commits, Commit(24.1, 1, 40, 20), *lines(1, 11, range(20), 0.1)],
        "kills": [{"rank": 1, "pid": 11, "t": 19.5, "recovered": True}],
    }
    rows, steady, refilling = job_metrics(job)
    assert [round(r["rto_s"], 3) for r in rows] == [4.6]
    assert 5.0 not in steady and 4.5 not in steady  # the intervals spanning the recovery
    assert refilling == []  # no spare in this job


def test_steps_while_the_next_spare_starts_are_not_steady() -> None:
    """Recovered at 22.1; the refilled spare reports ready at 30.0: steps in between (2 s each,
    slowed by its start) are reported apart, those after it are steady again."""
    survivor = lines(0, 10, range(20), 0.0) + lines(0, 10, range(20, 24), 22.1, 2.0)
    survivor += lines(0, 10, range(24, 40), 30.1)
    replacement = lines(1, 40, range(20, 24), 22.1, 2.0) + lines(1, 40, range(24, 40), 30.1)
    job = {
        "commits": sorted(
            [*survivor, *replacement, *lines(1, 11, range(20), 0.1)], key=lambda c: c.t
        ),
        "kills": [{"rank": 1, "pid": 11, "t": 19.5, "recovered": True}],
        "spares_ready_t": [0.5, 30.0],  # the first spare's, then its refill's
    }
    rows, steady, refilling = job_metrics(job)
    assert len(rows) == 1
    assert refilling and {round(t, 6) for t in refilling} == {2.0}
    assert steady and {round(t, 6) for t in steady} == {1.0}


def test_progress_lines_are_read_whole_as_they_are_appended(tmp_path: Path) -> None:
    path = tmp_path / "progress.jsonl"
    tail = ProgressTail(path)
    tail.poll()  # no file yet
    path.write_text('{"t": 1.0, "rank": 0, "pid": 7, "step": 0}\n{"t": 2.0, "ra')
    tail.poll()
    assert [c.step for c in tail.commits] == [0]
    with path.open("a") as f:
        f.write('nk": 1, "pid": 8, "step": 0}\n')
    tail.poll()
    assert tail.pid_of(1) == 8 and len(tail.commits) == 2
