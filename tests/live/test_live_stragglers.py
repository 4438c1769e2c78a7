"""Live rank stragglers (docs/hook.md, "Stragglers"): one rank's process slowed from outside —
SIGSTOP/SIGCONT duty cycles, or a CPU quota on its cgroup (v1) — is named by the engine from
its steps' compute times against its peers', and replaced with a spare under the replace
policy (the job ends bitwise equal to a fault-free run); a rank that is merely noisy (a long
pause now and then) is not."""

from __future__ import annotations

import contextlib
import os
import signal
import threading
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import torch
from livejob import JobResult, Processes, run_job
from test_live_recovery import assert_lossless, assert_survivors_kept

from flashrecovery.records import Envelope, StragglerPolicy

pytestmark = pytest.mark.timeout(240)
WORK = ["--work", "400"]  # real compute a step (~20 ms here), which a slowed CPU slows
SLOW = 1
CGROUP_CPU = Path("/sys/fs/cgroup/cpu")


class DutyCycle:
    """Stops a process for ``stopped_s`` of every ``period_s`` from a thread of its own, until
    it exits or the cycle is ended (it is left running)."""

    def __init__(self, pid: int, stopped_s: float, period_s: float) -> None:
        self.pid, self.stopped_s, self.period_s = pid, stopped_s, period_s
        self.ended = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        try:
            while not self.ended.is_set():
                os.kill(self.pid, signal.SIGSTOP)
                self.ended.wait(self.stopped_s)
                os.kill(self.pid, signal.SIGCONT)
                self.ended.wait(self.period_s - self.stopped_s)
        except ProcessLookupError:
            return  # it exited (replaced, or the job ended)

    def end(self) -> None:
        self.ended.set()
        self.thread.join(5)
        with contextlib.suppress(ProcessLookupError):
            os.kill(self.pid, signal.SIGCONT)


@contextlib.contextmanager
def slowed_by(make: Callable[[int], DutyCycle]) -> Iterator[Callable[[Envelope, Processes], bool]]:
    """A scenario step that slows rank SLOW's first process once step 2 is committed."""
    cycles: list[DutyCycle] = []

    def step(record: Envelope, known: Processes) -> bool:
        if record.type == "step_completed" and getattr(record, "step", -1) >= 2:
            cycles.append(make(known.ranks[SLOW]))
            return True
        return False

    try:
        yield step
    finally:
        for cycle in cycles:
            cycle.end()


def cycled_job(tmp_path: Path, stopped_s: float, period_s: float, window: int) -> JobResult:
    """The job with rank SLOW duty-cycled from step 2 on, under the replace policy (a spare)."""
    with slowed_by(lambda pid: DutyCycle(pid, stopped_s, period_s)) as slow:
        return run_job(
            tmp_path,
            spares=1,
            script_args=WORK,
            step_time_s=0.0,
            scenario=[slow],
            straggler_policy=StragglerPolicy.REPLACE,
            straggler_steps=window,
        )


def named(job: JobResult) -> list[tuple[int, bool]]:
    return [
        (found.ranks[0], found.replaced)
        for found in job.decisions("straggler_found")
        if found.cause == "step_time"
    ]


def test_a_rank_stopped_most_of_the_time_is_replaced_and_the_job_ends_bitwise_equal(
    tmp_path: Path, reference: torch.Tensor
) -> None:
    job = cycled_job(tmp_path, stopped_s=0.018, period_s=0.02, window=5)
    assert named(job) == [(SLOW, True)]
    [found] = job.decisions("straggler_found")
    assert found.slowdown is not None and found.slowdown >= 2.0
    assert found.reason.startswith(f"rank {SLOW}'s steps take ")
    [isolated] = job.decisions("isolate_rank")
    assert isolated.rank == SLOW and isolated.reason.startswith(f"rank {SLOW} slows the job: ")
    assert_lossless(job, reference, incidents=1)
    assert_survivors_kept(job, failed={SLOW})


class CpuQuota:
    """A cgroup (v1) of its own for a process, allowed ``share`` of one CPU; removed on end."""

    def __init__(self, pid: int, share: float) -> None:
        self.pid = pid
        self.group = CGROUP_CPU / f"flashrecovery-test-{uuid.uuid4().hex[:8]}"
        self.group.mkdir()
        period = int((self.group / "cpu.cfs_period_us").read_text())
        (self.group / "cpu.cfs_quota_us").write_text(str(int(period * share)))
        (self.group / "cgroup.procs").write_text(str(pid))

    def end(self) -> None:
        with contextlib.suppress(OSError):  # back to the root group, if it still runs
            (CGROUP_CPU / "cgroup.procs").write_text(str(self.pid))
        self.group.rmdir()


@pytest.mark.skipif(
    not (CGROUP_CPU / "cgroup.procs").exists() or os.geteuid() != 0,
    reason="needs root and the cgroup v1 cpu controller at /sys/fs/cgroup/cpu",
)
def test_a_rank_under_a_cpu_quota_is_named_and_left_in_place_by_the_report_policy(
    tmp_path: Path, reference: torch.Tensor
) -> None:
    quotas: list[CpuQuota] = []

    def throttle(record: Envelope, known: Processes) -> bool:
        if record.type == "step_completed" and getattr(record, "step", -1) >= 2:
            quotas.append(CpuQuota(known.ranks[SLOW], share=0.1))
            return True
        return False

    try:
        job = run_job(
            tmp_path, script_args=WORK, step_time_s=0.0, scenario=[throttle], straggler_steps=5
        )
    finally:
        for quota in quotas:
            quota.end()
    assert named(job) == [(SLOW, False)]
    [found] = job.decisions("straggler_found")
    assert found.reason.endswith("named only (--straggler-policy report)")
    assert_lossless(job, reference, incidents=0)


def test_a_rank_that_pauses_now_and_then_is_not_a_straggler(
    tmp_path: Path, reference: torch.Tensor
) -> None:
    """A pause of 50 ms every 200 ms: one step in several is slow, its median is not."""
    job = cycled_job(tmp_path, stopped_s=0.05, period_s=0.2, window=8)
    assert named(job) == []
    assert_lossless(job, reference, incidents=0)
