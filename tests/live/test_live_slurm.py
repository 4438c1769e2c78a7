"""flashrecovery under a real Slurm: Debian's slurmctld and slurmd on this host run
examples/slurm.sbatch as the docs say (`sbatch examples/slurm.sbatch train.py …`), three tasks
on the one node as three loopback nodes (two training nodes, one of hot spares). Every agent
takes its node rank, the node count, the head node and the job id from SLURM_*; a rank is
SIGKILLed mid-training, a spare of the spare node takes its place, and the job ends bitwise equal
to a fault-free run.
"""

from __future__ import annotations

import os
import secrets
import signal
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from livejob import EXAMPLES, SCRIPT, STEPS, JobResult, Processes, _alive, run_job
from slurm_cluster import SlurmCluster, missing

from flashrecovery.connectors import LogConnector, open_log
from flashrecovery.errors import LogError
from flashrecovery.records import Stream

pytestmark = [
    pytest.mark.timeout(300),
    pytest.mark.skipif(missing() is not None, reason=missing() or ""),
]
JOB_S = 180.0  # three agents and their ranks importing torch on two cores, then 30 steps
STEP_TIME_S = "0.1"


@pytest.fixture(scope="module")
def slurm(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SlurmCluster]:
    cluster = SlurmCluster(tmp_path_factory.mktemp("slurm"))
    try:
        yield cluster.start()
    finally:
        cluster.stop()


def _log(url: str, deadline: float, slurm: SlurmCluster, job: str) -> LogConnector:
    """The job's log once node 0 has created it and written the job's first record."""
    while True:
        try:
            log = open_log(url, read_only=True)
            if log.jobs():
                return log
            log.close()
        except LogError:
            pass
        state = slurm.job(job)["JobState"]
        assert state in ("PENDING", "RUNNING"), f"the Slurm job ended first: {state}"
        assert time.monotonic() < deadline, "node 0 never opened the log"
        time.sleep(0.2)  # node 0's agent creates the log and starts the job on its own time


def test_sbatch_script_recovers_a_killed_rank(slurm: SlurmCluster, tmp_path: Path) -> None:
    out = tmp_path / "out"
    out.mkdir()
    log_url = f"sqlite:///{tmp_path / 'log.db'}"
    script_args = ["--steps", str(STEPS), "--out", str(out), "--step-time", STEP_TIME_S]
    env = {
        **os.environ,
        "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}",
        "FLASHRECOVERY_STORE_PREFIX": secrets.token_hex(16),
        "NPROC": "1",
        "LOG": log_url,
    }
    # The script asks for 3 nodes with one task each; this cluster is one host, so its 3 tasks
    # run there (loopback nodes), as a command-line override of the script's #SBATCH line.
    job = slurm.run(
        "sbatch",
        "--parsable",
        "--nodes=1",
        "--ntasks=3",
        "--ntasks-per-node=3",
        f"--chdir={tmp_path}",
        f"--output={tmp_path / 'slurm.out'}",
        str(EXAMPLES / "slurm.sbatch"),
        str(SCRIPT),
        *script_args,
        env=env,
    ).strip()
    deadline = time.monotonic() + JOB_S
    log = _log(log_url, deadline, slurm, job)
    try:
        job_id = f"slurm-{job}.0"
        assert log.jobs() == [job_id]
        known, position, killed, finished = Processes(), 0, 0, False
        while not finished and time.monotonic() < deadline:
            for entry in log.follow(Stream.EVENTS, job_id, position, 0.5):
                position = entry.position + 1
                record = entry.record
                assert record is not None, entry.error
                known.observe(record)
                if record.type == "step_completed" and (record.rank, killed) == (1, 0):
                    killed = known.ranks[1] if record.step >= 8 else 0
                    if killed:
                        os.kill(killed, signal.SIGKILL)
                finished = finished or record.type == "job_finished"
            if not finished:
                assert slurm.job(job)["JobState"] in ("PENDING", "RUNNING"), (
                    tmp_path / "slurm.out"
                ).read_text()
        assert finished, "the job did not finish in time"
        while slurm.job(job)["JobState"] == "RUNNING" and time.monotonic() < deadline:
            time.sleep(0.2)  # the agents seal the log, then exit; Slurm then ends the job
        fields = slurm.job(job)
        output = (tmp_path / "slurm.out").read_text()
        print(output)  # what the agents said, in the test's output
        assert (fields["JobState"], fields["ExitCode"]) == ("COMPLETED", "0:0"), output

        result = JobResult(0, log, job_id, out, {1: killed})
        joined = {r.node: r for r in result.records(type="node_joined")}
        assert {n: r.ranks for n, r in joined.items()} == {0: 1, 1: 1, 2: 0}  # SLURM_PROCID
        node_of = {r.spare_id: r.node for r in result.records(type="spare_ready")}
        [activated] = result.records(type="spare_activated")
        assert activated.rank == 1 and node_of[activated.spare_id] == 2  # the spare node's
        assert len(result.decisions("incident_closed")) == 1
        agents = {r.pid for r in joined.values()}
        left = [pid for pid in result.pids() | agents if _alive(pid)]
        assert not left, f"processes of the job still running: {left}"
        finals = [result.final(rank)["params"] for rank in (0, 1)]
        assert result.final(1)["pid"] != killed
    finally:
        log.close()

    (tmp_path / "fault-free").mkdir()
    fault_free = run_job(tmp_path / "fault-free", nproc=2, step_time_s=float(STEP_TIME_S))
    assert fault_free.exit_code == 0
    for rank, params in enumerate(finals):
        assert torch.equal(params, fault_free.final(0)["params"]), f"rank {rank} diverged"
