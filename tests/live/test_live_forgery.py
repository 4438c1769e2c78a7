"""A process that can append to a running job's log, through the project's own `open_log`, but
holds none of the job's keys, writes one well-formed record of every type about a healthy rank
(it failed, exited with its live pid, went silent, finished; the job ended; isolate it, fail
the job): nothing is acted on (docs/protocol.md, "Who may write"). The job ends bitwise equal to
a fault-free run with every process it started, each forged event answered by the engine's
RecordRejected, and replay and verify with the job's secret name every forged record."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from livejob import WORLD, Processes, run_job
from test_live_recovery import assert_survivors_kept

from flashrecovery.connectors.believed import BelievedLog
from flashrecovery.connectors.chain import read_streams
from flashrecovery.connectors.signing import Keyring
from flashrecovery.records import Envelope, RecordRejected, StepCompleted, Stream
from flashrecovery.replay.replayer import replay_job
from flashrecovery.replay.verify import verify

pytestmark = pytest.mark.timeout(240)
SECRET = "forgery-test-secret-77a1c0e2"  # the job's: the test checks the signatures with it
TARGET = 1


class Forger:
    """A scenario step: once rank 1 has committed step 3, a process of its own forges."""

    def __init__(self, log_url: str, out: Path) -> None:
        self.log_url, self.out = log_url, out
        self.process: subprocess.Popen[bytes] | None = None

    def __call__(self, record: Envelope, known: Processes) -> bool:
        if not (isinstance(record, StepCompleted) and record.rank == TARGET and record.step >= 3):
            return False
        command = [sys.executable, "-m", "flashrecovery.chaos.forge", "--log", self.log_url]
        command += ["--job", record.job_id, "--rank", str(TARGET), "--pid"]
        command += [str(known.ranks[TARGET]), "--step", str(record.step + 1)]
        command += ["--generation", str(record.generation), "--out", str(self.out)]
        self.process = subprocess.Popen(command)
        return True


def test_records_forged_by_a_process_without_a_key_change_nothing(
    tmp_path: Path, reference: torch.Tensor
) -> None:
    log_url = f"sqlite:///{tmp_path / 'log.db'}"
    forger = Forger(log_url, tmp_path / "forged.json")
    job = run_job(tmp_path, log_url=log_url, store_secret=SECRET, scenario=[forger])
    assert forger.process is not None and forger.process.wait(60) == 0
    assert job.exit_code == 0, job.records(type="job_finished")
    for rank in range(WORLD):
        assert torch.equal(job.final(rank)["params"], reference), f"rank {rank} diverged"
    assert_survivors_kept(job, failed=set())
    keys = Keyring(SECRET)
    believed = [e.record for e in BelievedLog(job.log, keys).read(Stream.DECISIONS, job.job_id)]
    assert {d.type for d in believed if d is not None} == {"record_rejected"}  # no incident

    wrote = json.loads((tmp_path / "forged.json").read_text())
    events, decisions = wrote["events"], wrote["decisions"]
    assert len(events) == 30 and len(decisions) == 14  # one of every type
    assert wrote["rejected_after_s"] is not None  # every one within the forger's bound
    rejected = {
        e.record.caused_by: e.record
        for e in job.log.read(Stream.DECISIONS, job.job_id)
        if isinstance(e.record, RecordRejected) and keys.forgery(e.raw, e.record) is None
    }
    assert set(rejected) == set(events.values())
    exited = rejected[events["rank_exited"]]
    assert exited.reason == "unsigned rank_exited claiming source 'agent:0'"

    report = replay_job(job.log, job.job_id, keys=keys)
    assert report.ok, report.divergence and report.divergence.describe()
    assert len(report.forged_decisions) == len(decisions)
    chains = verify(read_streams(job.log, job.job_id), keys)
    assert chains.sealed and chains.signatures_checked
    forged_at = {(Stream.EVENTS, p) for p in events.values()}
    forged_at |= {(Stream.DECISIONS, p) for p in decisions.values()}
    assert {(b.stream, b.position) for b in chains.breaks} == forged_at
    assert all(b.reason.startswith("not believed: unsigned ") for b in chains.breaks)
