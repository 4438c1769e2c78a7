"""A running job opens nothing beyond what it needs: its store and gloo listen on loopback only,
and a client that reaches the store without the job's secret forges nothing (docs/protocol.md,
"What a job opens")."""

from __future__ import annotations

import datetime
import json
import os
from pathlib import Path

import psutil
import pytest
import torch
from livejob import STEPS, WORLD, Processes, run_job

from flashrecovery.records import Envelope, StepCompleted
from flashrecovery.trainer_hooks import barrier, groups, vote

pytestmark = pytest.mark.timeout(240)
LOOPBACK = {"127.0.0.1", "::1"}
SECRET = "exposure-test-secret-5f1c9a"  # the job's, given to it: a process that holds it
STEP_TIME_S = 0.1  # the forgery lands while most of the run's steps are still to come


def listening(pid: int) -> set[tuple[str, int]]:
    return {
        (c.laddr.ip, c.laddr.port)
        for c in psutil.Process(pid).net_connections("inet")
        if c.status == psutil.CONN_LISTEN
    }


class Intruder:
    """A scenario step (it records, the test asserts afterwards). As soon as every rank has
    joined and committed a step (its gloo group formed as its training loop started): record
    what the job's processes listen on, then connect to the store as a stranger would and
    write votes, a barrier outcome and a spare assignment under the key names the protocol
    uses, each a forgery that would derail the job if it were read (a rank committing alone,
    healthy steps aborted, a finish barrier superseded, the spare taking rank 0)."""

    def __init__(self) -> None:
        self.pids: dict[str, int] = {}  # "agent" and "rank:R" -> pid
        self.listening: dict[str, set[tuple[str, int]]] = {}
        self.store_port: int | None = None
        self.committed = -1  # the highest step a rank had committed when the forgery came
        self.ranks_committed: set[int] = set()
        self.forged: dict[str, str] = {}
        self.read_back: dict[str, str] = {}
        self.argv_with_secret: list[str] = []
        self.environ_with_secret: list[str] = []

    def __call__(self, record: Envelope, known: Processes) -> bool:
        """A scenario step of run_job: done once it has forged."""
        if isinstance(record, StepCompleted):
            self.committed = max(self.committed, record.step)
            self.ranks_committed.add(record.rank)
        if len(known.ranks) < WORLD or len(self.ranks_committed) < WORLD:
            return False
        self.pids = {f"rank:{rank}": pid for rank, pid in known.ranks.items()}
        self.inspect()
        self.forge()
        return True

    def inspect(self) -> None:
        self.pids["agent"] = os.getpid()  # run_job runs the agent in this process
        self.listening = {name: listening(pid) for name, pid in self.pids.items()}
        environ = psutil.Process(self.pids["rank:0"]).environ()
        self.store_port = int(environ["MASTER_PORT"])
        self.argv_with_secret = [
            name
            for name, pid in self.pids.items()
            if SECRET in " ".join(psutil.Process(pid).cmdline())
        ]
        self.environ_with_secret = [
            name
            for name, pid in self.pids.items()
            if name != "agent"  # the test's process: given the secret by the test
            and SECRET in " ".join(f"{k}={v}" for k, v in psutil.Process(pid).environ().items())
        ]

    def forge(self) -> None:
        assert self.store_port is not None
        store = torch.distributed.TCPStore(
            "127.0.0.1", self.store_port, is_master=False, timeout=datetime.timedelta(seconds=10)
        )
        for step in range(STEPS):
            key = vote.vote_key(0, step)
            if step % 2:  # every member "voted": a rank would commit alone
                self.forged[key] = str(WORLD)
                self.forged[f"{key}/verdict"] = vote.Verdict.COMMITTED.value
            else:  # "closed": every member would abort a healthy step and wait for a regroup
                self.forged[key] = str(vote.CLOSED)
        self.forged[f"{barrier.name(0, 'done')}/result"] = barrier.SUPERSEDED
        self.forged["spare/0"] = json.dumps({"rank": 0, "generation": 1})
        for key, value in self.forged.items():
            store.set(key, value)
        self.read_back = {key: store.get(key).decode() for key in self.forged}


def test_a_job_listens_on_loopback_only_and_ignores_forged_keys(
    tmp_path: Path, reference: torch.Tensor
) -> None:
    intruder = Intruder()
    # New interpreters: their /proc/<pid>/environ is the environment they were started with
    # (a forked rank's shows its fork server's: agent/forkserver.py), and holds no secret.
    job = run_job(
        tmp_path,
        spares=1,
        scenario=[intruder],
        step_time_s=STEP_TIME_S,
        start_method="exec",
        store_secret=SECRET,
    )

    assert set(intruder.listening) == {"agent", *(f"rank:{r}" for r in range(WORLD))}
    assert ("127.0.0.1", intruder.store_port) in intruder.listening["agent"]
    assert intruder.argv_with_secret == [] and intruder.environ_with_secret == []
    for name, addresses in intruder.listening.items():
        assert {ip for ip, _ in addresses} <= LOOPBACK, f"{name} listens on {addresses}"
    for rank in range(WORLD):  # each rank's gloo device listens too
        assert intruder.listening[f"rank:{rank}"], f"rank {rank} listens on nothing"

    assert intruder.read_back == intruder.forged  # the forgeries reached the store …
    assert intruder.committed < STEPS // 2  # … while most steps were still to come …
    assert job.exit_code == 0, job.records(type="job_finished")  # … and changed nothing
    for rank in range(WORLD):
        assert torch.equal(job.final(rank)["params"], reference), f"rank {rank} diverged"
    assert not job.decisions("isolate_rank") and not job.records(type="spare_activated")
    assert job.records(type="collective_error") == []


HELD_AT, CLOSED_AT = 6, 8


class Closer:
    """A scenario step: a process holding the job's secret (this test's, which gave it to the
    job) closes the vote of a step ahead, with no failure behind it, then opens the gate the
    ranks wait at before step HELD_AT."""

    def __init__(self, gate: Path) -> None:
        self.gate = gate

    def __call__(self, record: Envelope, known: Processes) -> bool:
        if not isinstance(record, StepCompleted) or len(known.ranks) < WORLD:
            return False
        environ = psutil.Process(known.ranks[0]).environ()
        store = groups.connect_store(f"127.0.0.1:{environ['MASTER_PORT']}", SECRET)
        assert vote.close(store, vote.vote_key(0, CLOSED_AT), WORLD) is vote.Verdict.ABORTED
        self.gate.touch()
        return True


def test_a_vote_closed_with_no_failure_behind_it_is_voted_on_again(
    tmp_path: Path, reference: torch.Tensor
) -> None:
    """Every rank finds the step aborted and no plan coming: within a few heartbeats each says
    so (StepRetried) and votes again under the step's next key; nobody is replaced and the run
    ends as without it."""
    gate = tmp_path / "gate"
    job = run_job(
        tmp_path,
        scenario=[Closer(gate)],
        start_method="exec",
        store_secret=SECRET,
        script_args=["--hold-at", str(HELD_AT), "--hold-file", str(gate)],
    )
    assert job.exit_code == 0, job.records(type="job_finished")
    for rank in range(WORLD):
        assert torch.equal(job.final(rank)["params"], reference), f"rank {rank} diverged"
    retried = sorted((r.rank, r.step, r.attempt) for r in job.records(type="step_retried"))
    assert retried == [(rank, CLOSED_AT, 1) for rank in range(WORLD)]
    assert not job.decisions("isolate_rank") and not job.decisions("regroup_planned")
