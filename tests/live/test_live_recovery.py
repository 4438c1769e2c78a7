"""Live recovery of real training: a rank dies (SIGKILL, an exception, mid-vote), the job
goes on with the survivors' processes and ends bitwise equal to a fault-free run."""

from __future__ import annotations

from pathlib import Path

import psutil
import pytest
import torch
from livejob import STEPS, WORLD, JobResult, Processes, run_job

from flashrecovery.chaos.verdict import record_counts
from flashrecovery.records import Envelope, Stream
from flashrecovery.replay.replayer import replay_job

pytestmark = pytest.mark.timeout(240)


def assert_lossless(
    job: JobResult, reference: torch.Tensor, incidents: int, world: int = WORLD
) -> None:
    assert job.exit_code == 0, job.records(type="job_finished")
    for rank in range(world):
        assert torch.equal(job.final(rank)["params"], reference), f"rank {rank} diverged"
    closed = job.decisions("incident_closed")
    assert len(closed) == incidents
    for incident in closed:
        assert incident.rpo_steps == 0
        assert incident.recomputed_steps <= 1
    report = replay_job(job.log, job.job_id)
    assert report.ok, report.divergence and report.divergence.describe()


def assert_survivors_kept(job: JobResult, failed: set[int], world: int = WORLD) -> None:
    """Healthy ranks never restart: the process that joined is the one that finished."""
    joined = {r.rank: r.pid for r in job.records(type="rank_joined")}
    for rank in set(range(world)) - failed:
        assert job.final(rank)["pid"] == joined[rank]
    for rank in failed:
        assert job.final(rank)["pid"] != joined[rank]


def test_kill_with_hot_spare(tmp_path: Path, reference: torch.Tensor) -> None:
    """The spare is restored striped: both survivors send half of the state."""
    job = run_job(tmp_path, spares=1, kill_at={1: 8})
    assert_lossless(job, reference, incidents=1)
    assert_survivors_kept(job, failed={1})
    activated = job.records(type="spare_activated")
    assert [(a.rank, a.spare_id) for a in activated] == [(1, 0)]
    assert job.final(1)["pid"] == activated[0].pid
    # Survivors and the spare froze their start-up heap (flashrecovery/heap.py): a full
    # collection no longer walks it in a step or in the restore.
    assert all(job.final(rank)["frozen"] > 0 for rank in range(WORLD))
    [plan] = job.decisions("resume_planned")
    assert (plan.donors, plan.stripes, plan.recipients) == ({0: 0}, {0: [0, 2]}, [1])
    [moved] = job.records(type="state_transferred")
    assert (moved.rank, moved.donor, sorted(moved.donor_bytes)) == (1, 0, [0, 2])
    lead, other = moved.donor_bytes[0], moved.donor_bytes[2]
    # Each sends half the tensors; the lead adds the structure, RNG and extras (13 kB here).
    assert moved.bytes == lead + other and lead > other > 0


def test_kill_without_spare_spawns_a_replacement(tmp_path: Path, reference: torch.Tensor) -> None:
    job = run_job(tmp_path, spares=0, kill_at={2: 8})
    assert_lossless(job, reference, incidents=1)
    assert_survivors_kept(job, failed={2})
    spawned = job.records(type="replacement_spawned")
    assert [s.rank for s in spawned] == [2]
    assert job.final(2)["pid"] == spawned[0].pid


def test_two_failures_one_of_them_an_exception(tmp_path: Path, reference: torch.Tensor) -> None:
    job = run_job(tmp_path, spares=1, kill_at={1: 5}, fault_plan=["2:raise@14"])
    assert_lossless(job, reference, incidents=2)
    assert_survivors_kept(job, failed={1, 2})
    assert [i.failed_rank for i in job.decisions("incident_closed")] == [1, 2]
    reports = job.records(type="health_report")
    assert [(r.rank, r.ok) for r in reports] == [(2, False)]
    assert "injected fault at step 14" in reports[0].detail


def test_kill_between_reduce_and_vote(tmp_path: Path, reference: torch.Tensor) -> None:
    """The delicate point: the survivors hold reduced gradients that include the dead rank's,
    yet the step must not commit for anyone; it is recomputed with the replacement."""
    job = run_job(tmp_path, spares=1, fault_plan=["0:after_reduce@8"])
    assert_lossless(job, reference, incidents=1)
    assert_survivors_kept(job, failed={0})
    committed = {(r.rank, r.step) for r in job.records(type="step_completed") if r.generation == 0}
    assert all(step < 8 for _, step in committed)
    resume = job.decisions("resume_planned")
    assert [(p.resume_step, p.donors, p.recipients) for p in resume] == [(7, {0: 1}, [0])]


def test_kill_between_the_commit_and_its_record(tmp_path: Path, reference: torch.Tensor) -> None:
    """Step 8 committed on every member, the dead one too, which never handed its record
    over: the step is not recomputed, the replacement is restored to it, and the checks count
    the rank's step 8 as reached by the restore, not as a record the log lost."""
    job = run_job(tmp_path, spares=1, fault_plan=["1:committed@8"])
    assert_lossless(job, reference, incidents=1)
    assert_survivors_kept(job, failed={1})
    [plan] = job.decisions("resume_planned")
    assert (plan.resume_step, plan.recipients) == (8, [1])
    recorded = {(r.rank, r.step) for r in job.records(type="step_completed")}
    assert (1, 8) not in recorded and {(0, 8), (2, 8), (1, 9)} <= recorded
    counts = record_counts(job.log, job.job_id, WORLD, STEPS)
    assert counts["step_records_missing"] == 0, counts
    assert counts["step_records_reached_by_restore"] == 1, counts


def test_hung_rank_is_found_by_its_silence(tmp_path: Path, reference: torch.Tensor) -> None:
    """A SIGSTOPped rank blocks its peers' collective; the heartbeat detector finds it, the
    agent SIGKILLs it, which frees the peers at once."""
    job = run_job(tmp_path, spares=1, fault_plan=["1:hang@6"])
    assert_lossless(job, reference, incidents=1)
    assert_survivors_kept(job, failed={1})
    assert [m.rank for m in job.records(type="heartbeat_missed")] == [1]


def test_no_rank_or_spare_holds_the_log_open(tmp_path: Path, reference: torch.Tensor) -> None:
    """Only agents write to the log: a rank stopped in the middle of a write would otherwise
    hold the embedded log's lock, and the engine could not even record that it is silent."""
    files: dict[int, list[str]] = {}

    def look(record: Envelope, known: Processes) -> bool:
        if len(known.ranks) < WORLD or not known.spares:
            return False
        for pid in [*known.ranks.values(), *known.spares.values()]:
            files[pid] = [f.path for f in psutil.Process(pid).open_files()]
        return True

    job = run_job(tmp_path, spares=1, scenario=[look])
    assert_lossless(job, reference, incidents=0)
    assert len(files) == WORLD + 1, "the job ended before every process was seen"
    assert {pid: [f for f in open_ if "log.db" in f] for pid, open_ in files.items()} == {
        pid: [] for pid in files
    }


def test_stalled_rank_is_found_while_its_heartbeats_go_on(
    tmp_path: Path, reference: torch.Tensor
) -> None:
    """Stuck in its own code (not dead, still beating) while its peers wait in the commit."""
    job = run_job(tmp_path, spares=1, fault_plan=["1:stall@8"], stall_floor_s=1.0)
    assert_lossless(job, reference, incidents=1)
    assert_survivors_kept(job, failed={1})
    suspected = [s.rank for s in job.records(type="stall_suspected")]
    assert suspected.count(1) >= 2  # found in two windows: failed
    # A peer's waiting flag reaches the engine with its node's next heartbeat, up to an interval
    # late: a first window can name a rank that had just begun to wait, a second never does.
    assert all(suspected.count(rank) == 1 for rank in set(suspected) - {1}), suspected
    [isolate] = job.decisions("isolate_rank")
    assert isolate.rank == 1 and "no progress" in isolate.reason
    assert job.records(type="heartbeat_missed") == []  # it was alive all along


def test_a_rank_that_dies_after_it_finished_does_not_hold_the_job(
    tmp_path: Path, reference: torch.Tensor
) -> None:
    """Its work is done and its RankFinished in the log: a crash in its teardown is recorded,
    nobody replaces it, and the job completes at once instead of waiting for it to come back
    (it waited 120 s, then failed)."""
    job = run_job(tmp_path, fault_plan=[f"1:exit@{STEPS - 1}"])
    assert job.exit_code == 0, job.records(type="job_finished")
    exits = [r for r in job.records(type="rank_exited") if r.rank == 1]
    assert [(r.exit_code, r.signal) for r in exits] == [(None, 9)]
    assert job.records(Stream.DECISIONS) == []  # nothing to recover
    for rank in range(WORLD):
        assert torch.equal(job.final(rank)["params"], reference), f"rank {rank} diverged"
    [finished] = job.records(type="job_finished")
    assert finished.status == "completed"
    report = replay_job(job.log, job.job_id)
    assert report.ok, report.divergence and report.divergence.describe()


def test_rank_lost_after_the_last_commit_is_still_replaced(
    tmp_path: Path, reference: torch.Tensor
) -> None:
    """The peers wait for each other before reporting finished, so a rank that dies once the
    work is done is replaced from a live replica and the job still ends with every rank."""
    job = run_job(tmp_path, spares=1, fault_plan=[f"1:finish@{STEPS - 1}"])
    assert job.exit_code == 0, job.records(type="job_finished")
    for rank in range(WORLD):
        assert torch.equal(job.final(rank)["params"], reference), f"rank {rank} diverged"
    assert_survivors_kept(job, failed={1})
    resume = job.decisions("resume_planned")
    assert [(p.resume_step, p.recipients) for p in resume] == [(STEPS - 1, [1])]
    report = replay_job(job.log, job.job_id)
    assert report.ok, report.divergence and report.divergence.describe()
