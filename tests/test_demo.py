"""`flashrecovery demo` end to end, and the pieces it relies on to judge a run.

The end-to-end test is the product's promise in one command: a rank SIGKILLed mid-step, a hot
spare takes its place, survivors keep their processes, nothing committed is lost, and the final
parameters are bitwise equal to a fault-free run. The other tests pin down the determinism and
the bookkeeping that verdict rests on, without starting any process.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import psutil
import pytest
import torch
from factories import JOB, T0, TYPES_BY_NAME, make

from flashrecovery.chaos.verdict import record_counts
from flashrecovery.connectors import open_log
from flashrecovery.connectors.memory import MemoryLog
from flashrecovery.demo.cli import add_arguments, kill_plan
from flashrecovery.demo.data import batch_for
from flashrecovery.demo.job import JobSpec
from flashrecovery.demo.results import RankResult
from flashrecovery.demo.summary import (
    loss_curve,
    lost_with_nodes,
    process_history,
    reached_by_restore,
    sparkline,
    step_losses,
    summarize,
)
from flashrecovery.demo.train import build
from flashrecovery.demo.watch import Kill, KillOutcome
from flashrecovery.engine.loop import EngineLoop
from flashrecovery.errors import LogError
from flashrecovery.records import RankJoined, RankRegrouped, RegroupPlanned, Stream
from flashrecovery.testing.simworld import SimulatedWorld, drive
from flashrecovery.trainer_hooks.final_state import parameters_sha256

REPO = Path(__file__).resolve().parents[1]


def run_demo(tmp_path: Path, *options: str, timeout: float) -> tuple[dict[str, Any], str, int]:
    """`flashrecovery demo … --verify --json` as a user runs it: its summary, the summary as
    context for a failed assertion, and the exit code."""
    command = [
        sys.executable, "-m", "flashrecovery.cli", "demo", *options,
        "--verify", "--json", "--run-dir", str(tmp_path / "run"), "--min-step-s", "0.1",
    ]  # fmt: skip
    # Agent and ranks import this checkout, whichever copy the environment has installed.
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    done = subprocess.run(
        command, capture_output=True, text=True, timeout=timeout, cwd=tmp_path, env=env
    )
    assert done.stdout.strip(), f"no summary; stderr:\n{done.stderr[-3000:]}"
    summary = json.loads(done.stdout)
    return summary, json.dumps(summary, indent=1)[:4000], done.returncode


def run_kill_demo(
    tmp_path: Path, parallel: str, nproc: int, kill: str, *options: str
) -> tuple[dict[str, Any], str, int]:
    """One rank SIGKILLed in a 16-step demo with a hot spare."""
    return run_demo(
        tmp_path,
        *options,
        "--nproc", str(nproc),
        "--spares", "1",
        "--steps", "16",  # room for the kill to wait for the spare on a busy machine
        "--kill", kill,
        "--timeout", "120",
        "--parallel", parallel,
        timeout=280,
    )  # fmt: skip


@pytest.mark.parametrize(
    ("parallel", "nproc", "rebuild"),
    [
        ("hook", 2, "fresh"),
        ("hsdp", 4, "fresh"),
        ("tp-hsdp", 4, "fresh"),
        ("pp", 4, "fresh"),
    ],
)
def test_demo_kill_recovers_bitwise_equal(
    tmp_path: Path, parallel: str, nproc: int, rebuild: str
) -> None:
    """With the hook's own reduce, sharded with FSDP2 on a 2 x 2 HSDP mesh (rank 1 restored
    from rank 3, its shard's replica), its feed-forward layers split over "tp" beside FSDP2 on
    a 2 x 1 x 2 mesh (rank 1 from rank 3, its tp coordinate's), and in two pipeline stages with
    2 replicas each (rank 1 from rank 3, its stage's replica). (The GPT in torch DDP: the node
    kill below.)"""
    summary, context, code = run_kill_demo(
        tmp_path, parallel, nproc, "1@3", "--group-rebuild", rebuild
    )
    assert summary["completed"], context
    assert [k["outcome"] for k in summary["kills"]] == ["killed"], context
    assert summary["verify"]["bitwise_equal"] is True, context
    assert summary["verify"]["losses_equal"] is True, context
    assert summary["survivor_pids_unchanged"] is True, context
    assert summary["pids"]["1"]["final"] != summary["pids"]["1"]["joined"], context
    assert summary["committed_steps_lost"] == 0, context
    assert summary["steps_recomputed"] <= 1, context
    assert summary["replay"]["ok"] is True, context
    assert summary["loss_curve"]["continuous"] is True, context
    [incident] = summary["incidents"]
    assert incident["state"] == "closed" and incident["replacement"] == "hot spare 0", context
    assert summary["ok"] is True
    assert code == 0


def test_demo_with_no_replica_a_kill_falls_back_to_the_checkpoint_bitwise_equal(
    tmp_path: Path,
) -> None:
    """`--parallel fsdp` (FSDP2 over both ranks): one shard per rank, no replica, so the lost
    rank's state comes from the latest complete checkpoint; the survivor keeps its process and
    the job ends bitwise equal to a fault-free run, having lost exactly the steps the fallback
    rolled back. (DDP, a reconfigured group and tensor parallel alone, recovered the same way
    under the demo's launcher, are tested on the examples: tests/live/test_live_ddp.py,
    test_live_tp.py.)"""
    summary, context, code = run_kill_demo(tmp_path, "fsdp", 2, "1@6")
    assert summary["ok"] is True, context
    assert summary["verify"]["bitwise_equal"] is True, context
    assert summary["survivor_pids_unchanged"] is True, context
    [incident] = summary["incidents"]
    assert incident["state"] == "closed" and incident["checkpoint_step"] is not None, context
    assert incident["resume_step"] == incident["checkpoint_step"], context
    rolled_back = summary["steps_rolled_back_by_fallbacks"]
    assert rolled_back > 0 and summary["committed_steps_lost"] == rolled_back, context
    assert summary["replay"]["ok"] is True, context
    assert code == 0


def test_demo_node_kill_recovers_bitwise_equal(tmp_path: Path) -> None:
    """`--nodes 2 --kill-node 1@3`: 2 loopback nodes x 2 ranks and a spare node, the GPT in
    torch DDP on the stable group; node 1's agent and ranks are SIGKILLed, the spare node's two
    spares take its ranks together."""
    summary, context, code = run_demo(
        tmp_path,
        "--parallel", "ddp",
        "--nodes", "2",
        "--nproc", "4",
        "--steps", "16",
        "--kill-node", "1@3",
        "--timeout", "150",
        timeout=400,
    )  # fmt: skip
    assert summary["ok"] is True, context
    assert summary["verify"]["bitwise_equal"] is True, context
    [incident] = summary["incidents"]
    assert incident["failed"] == "node 1 (ranks 2, 3)", context
    # spare ids are numbered per node (node k from k * 100000): the spare node is node 2
    assert incident["replacement"] == "hot spare 200000 (node 2), hot spare 200001 (node 2)", (
        context
    )
    assert [(k["node"], k["outcome"]) for k in summary["kills"]] == [(1, "killed")], context
    assert code == 0


def test_batches_and_model_are_the_same_in_every_process() -> None:
    x1, y1 = batch_for(5, 1, 4)
    x2, y2 = batch_for(5, 1, 4)
    assert torch.equal(x1, x2) and torch.equal(y1, y2)
    assert torch.equal(x1[:, 1:], y1[:, :-1])  # targets are the next characters
    assert not torch.equal(x1, batch_for(5, 2, 4)[0])
    assert parameters_sha256(build(0)[0]) == parameters_sha256(build(0)[0])
    assert parameters_sha256(build(0)[0]) != parameters_sha256(build(1)[0])


@pytest.mark.parametrize(
    ("parallel", "nproc", "why"),
    [
        ("hsdp", 2, "2 dp_shard = 2 ranks, with at least 2 replicas: --nproc must be a multiple"),
        ("tp-hsdp", 6, None),
        ("tp-hsdp", 3, "1 dp_shard x 2 tp = 2 ranks"),
        ("3d", 4, "2 dp_shard x 2 tp = 4 ranks, with at least 2 replicas"),
        ("3d", 8, None),
        ("pp", 3, "2 pp = 2 ranks"),
    ],
)
def test_a_layout_takes_whole_replicas_of_its_mesh(
    parallel: str, nproc: int, why: str | None
) -> None:
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    args = parser.parse_args(["--nproc", str(nproc), "--spares", "1", "--parallel", parallel])
    if why is None:
        assert len(kill_plan(args)) == 1
    else:
        with pytest.raises(ValueError, match=re.escape(why)):
            kill_plan(args)


@pytest.mark.parametrize("spec", ["1", "a@3", "1@", "@2", "-1@2"])
def test_kill_spec_rejected_with_reason(spec: str) -> None:
    with pytest.raises(ValueError, match="RANK@STEP"):
        Kill.parse(spec)
    with pytest.raises(ValueError, match="NODE@STEP"):
        Kill.parse_node(spec)


def test_loss_curve_flags_gaps_and_duplicates() -> None:
    curve = loss_curve({0: [(0, 2.0), (1, 1.0), (1, 1.0)], 1: [(0, 2.0)]}, 2, 2)
    assert not curve["continuous"]
    assert curve["duplicates"] == {0: [1]} and curve["gaps"] == {1: [1]}
    assert curve["mean_loss"] == [2.0, 1.0]
    assert sparkline([3.0, 2.0, 1.0]) == "█▅▁"
    # a step a checkpoint fallback rolled back is committed again, once
    rolled = {0: [(0, 2.0), (1, 1.5), (1, 1.0)], 1: [(0, 2.0), (1, 1.5), (1, 1.0)]}
    curve = loss_curve(rolled, 2, 2, frozenset({1}))
    assert curve["continuous"] and curve["mean_loss"] == [2.0, 1.0]
    assert not loss_curve({0: [(0, 2.0), (0, 2.0), (1, 1.0)]}, 1, 2, frozenset({1}))["continuous"]


def test_a_lost_node_may_take_its_ranks_newest_step_records_and_only_those() -> None:
    """Node 1 (ranks 2, 3) lost while step 2 committed: its ranks recorded step 1 only (their
    step 2 records went with the node's agent), ranks 0, 1 recorded step 2 after the loss was
    found (the vote was complete before it). Any other gap still breaks the curve."""
    log = MemoryLog()
    ts = iter(range(100))
    for step, ranks in ((0, [0, 1, 2, 3]), (1, [0, 1, 2, 3]), (2, [0, 1])):
        for rank in ranks:
            record = make(TYPES_BY_NAME["step_completed"], record_id=f"s{step}{rank}",
                          ts=T0 + next(ts), rank=rank, step=step)  # fmt: skip
            log.append(Stream.EVENTS, record)
    found = T0 + 7.5  # after step 1's records, before step 2's
    log.append(Stream.DECISIONS, make(TYPES_BY_NAME["isolate_node"], ts=found))
    lost = lost_with_nodes(log, JOB)
    assert lost == {2: {2}, 3: {2}}
    per_rank = step_losses(log, JOB)
    for rank in (2, 3):
        per_rank[rank].append((3, 0.5))
    per_rank[0].append((3, 0.5))
    per_rank[1].append((3, 0.5))
    curve = loss_curve(per_rank, 4, 4, frozenset(), lost)
    assert curve["continuous"] and curve["lost_with_nodes"] == {2: [2], 3: [2]}
    del per_rank[0][1]  # a survivor's step 1: a real gap
    assert loss_curve(per_rank, 4, 4, frozenset(), lost)["gaps"] == {0: [1]}
    # chaos counts them apart too: the log lost none of what it was given
    counts = record_counts(log, JOB, 4, 3)
    assert counts["step_records_missing"] == 0 and counts["step_records_lost_with_nodes"] == 2
    assert record_counts(log, JOB, 4, 4)["step_records_missing"] == 4  # step 3: never recorded


def test_a_recipient_s_resume_step_its_dead_process_did_not_record_is_counted_apart() -> None:
    """Rank 1 died once step 2's vote had committed, before it handed step 2's record over:
    its replacement was restored to step 2 and records step 3 on. Its step 2 is the job's, held
    by the restore; a step before it with no record is still a gap."""
    log = MemoryLog()
    steps = {0: [0, 1, 2, 3], 1: [0, 1, 3]}
    for rank, done in steps.items():
        for step in done:
            record = make(TYPES_BY_NAME["step_completed"], record_id=f"s{step}{rank}",
                          rank=rank, step=step)  # fmt: skip
            log.append(Stream.EVENTS, record)
    plan = make(TYPES_BY_NAME["resume_planned"], resume_step=2, donors={0: 0}, recipients=[1])
    log.append(Stream.DECISIONS, plan)
    assert reached_by_restore(log, JOB) == {1: {2}}
    curve = loss_curve(step_losses(log, JOB), 2, 4, restored=reached_by_restore(log, JOB))
    assert curve["continuous"] and curve["reached_by_restore"] == {1: [2]}
    counts = record_counts(log, JOB, 2, 4)
    assert counts["step_records_missing"] == 0 and counts["step_records_reached_by_restore"] == 1
    late = make(TYPES_BY_NAME["resume_planned"], record_id="p2", resume_step=3, recipients=[0])
    log.append(Stream.DECISIONS, late)  # rank 0 recorded its step 3: nothing to explain there
    assert record_counts(log, JOB, 2, 4)["step_records_reached_by_restore"] == 1
    gapped = step_losses(log, JOB)
    del gapped[1][1]  # its step 1 too: not the resume step, a real gap
    assert loss_curve(gapped, 2, 4, restored=reached_by_restore(log, JOB))["gaps"] == {1: [1]}


def test_summary_of_a_scripted_recovery(tmp_path: Path) -> None:
    """The verdict from a log written by the scripted world (no torch processes)."""
    url = f"sqlite://{tmp_path / 'log.db'}"
    world = SimulatedWorld("scripted", world_size=2, spares=1)
    with open_log(url) as log:
        engine = EngineLoop(log, "scripted")
        drive(log, engine, world, world.start())
        drive(log, engine, world, world.train(3))
        kill = Kill(
            1, 3, pid=world.pids[1], committed=2, ts=world.clock, outcome=KillOutcome.KILLED
        )
        drive(log, engine, world, [world.kill(1)])
        drive(log, engine, world, world.train(3))
        drive(log, engine, world, world.finish())
        for rank, pid in world.pids.items():
            RankResult(rank, pid, world.generation, 6, "digest").write(tmp_path)
        spec = JobSpec("scripted", url, tmp_path, nproc=2, spares=1, steps=6)
        summary = summarize(log, spec, [kill], returncode=0)
    assert summary["ok"], summary
    assert summary["survivor_pids_unchanged"]
    assert summary["pids"][1]["final"] != summary["pids"][1]["joined"]
    [incident] = summary["incidents"]
    assert incident["replacement"] == "hot spare 0"
    assert incident["committed_steps_lost"] == 0 and incident["steps_recomputed"] == 1
    assert incident["rto_from_kill_s"] >= incident["rto_s"] > 0
    assert Path(summary["timeline"]) == tmp_path / "timeline.png"
    assert Path(summary["timeline"]).read_bytes().startswith(b"\x89PNG\r\n\x1a\n")


def test_a_survivor_in_a_new_process_is_an_unplanned_restart() -> None:
    envelope = {"job_id": "j", "source": "test"}
    with open_log("memory://") as log:
        for rank, pid in ((0, 10), (1, 11)):
            log.append(
                Stream.EVENTS, RankJoined(**envelope, generation=0, rank=rank, pid=pid, host="h")
            )
        log.append(
            Stream.DECISIONS,
            RegroupPlanned(**envelope, generation=1, caused_by=2, members=[0, 1], replaced=[1]),
        )
        for rank, pid in ((0, 12), (1, 13)):  # rank 1 was replaced; rank 0 was not
            log.append(
                Stream.EVENTS,
                RankRegrouped(**envelope, generation=1, rank=rank, committed_step=3, pid=pid),
            )
        joined, holder, unplanned = process_history(log, "j")
    assert joined == {0: 10, 1: 11} and holder == {0: 12, 1: 13}
    assert unplanned == ["rank 0: pid 10 -> 12 in generation 1"]


def test_ctrl_c_ends_the_demo_in_one_line_and_leaves_no_process(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    command = [
        sys.executable, "-m", "flashrecovery.cli", "demo", "--nproc", "2", "--spares", "0",
        "--steps", "2000", "--min-step-s", "0.1", "--run-dir", str(run_dir),
    ]  # fmt: skip
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    demo = subprocess.Popen(
        command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=tmp_path, env=env
    )
    try:
        deadline = time.monotonic() + 120
        while not _committed(run_dir / "log.db"):  # training, with every process started
            assert demo.poll() is None and time.monotonic() < deadline, demo.stderr
            time.sleep(0.2)
        started = psutil.Process(demo.pid).children(recursive=True)
        demo.send_signal(signal.SIGINT)
        _, err = demo.communicate(timeout=60)
    finally:
        demo.kill()
    assert demo.returncode == 130, err[-3000:]
    assert "flashrecovery demo: interrupted" in err and "Traceback" not in err, err[-3000:]
    _, left = psutil.wait_procs(started, timeout=30)
    assert left == []


def _committed(db: Path) -> bool:
    """Whether some rank has committed a step in the demo's log (read-only, bounded)."""
    if not db.exists():
        return False
    try:
        with open_log(f"sqlite://{db}", read_only=True) as log:
            return any(
                e.record is not None and e.record.type == "step_completed"
                for job in log.jobs()
                for e in log.read(Stream.EVENTS, job)
            )
    except LogError:
        return False  # not a log yet: its tables are being made
