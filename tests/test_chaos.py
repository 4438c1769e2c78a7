"""`flashrecovery chaos`: the seeded schedule (pure), and a short schedule end to end on real
processes: six faults of six kinds, each recovered, the job bitwise equal to its reference."""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from factories import JOB, T0, TYPES_BY_NAME, make

from flashrecovery.chaos.cli import MIN_STEP_S, NETNS_STEP_S, Plan, add_arguments
from flashrecovery.chaos.schedule import NODE_LOST, TWO_FAILURES, available_kinds, draw
from flashrecovery.chaos.verdict import Sent, judge, spare_outcome, straggler_outcome
from flashrecovery.connectors.memory import MemoryLog
from flashrecovery.demo.watch import Kill, KillOutcome
from flashrecovery.records import Stream
from flashrecovery.trainer_hooks.probe import FaultPlan

REPO = Path(__file__).resolve().parents[1]
# The kinds CI draws from: every kind a 3-rank job on the embedded log can take; seed 3 deals
# six distinct ones, both idle-spare losses among them.
KINDS = [
    "sigkill",
    "sigstop",
    "raise",
    "stall",
    "donor",
    "replacement",
    "regroup",
    "group_build",
    "spare_kill",
    "spare_stop",
]


def test_a_seed_gives_one_schedule_and_faults_land_at_distinct_steps() -> None:
    kinds = available_kinds(3, external_engine=True, broker=True, spares=2)
    one = draw(40, 7, 3, kinds, first_step=4, gap=6)
    assert one == draw(40, 7, 3, kinds, first_step=4, gap=6)
    assert one != draw(40, 8, 3, kinds, first_step=4, gap=6)
    assert [f.step for f in one] == [4 + 6 * i for i in range(40)]
    assert set(f.kind for f in one[: len(kinds)]) == set(kinds)  # dealt from a deck
    planned = FaultPlan.parse(",".join(e for f in one for e in f.plan)).faults
    # No rank meets two planned faults at one step, except a replacement's on purpose.
    places = [(fault.rank, fault.point, fault.step) for fault in planned]
    replacements = sum(f.kind == "replacement" for f in one)
    assert len(places) - len(set(places)) == replacements


def test_faults_inside_a_recovery_hit_another_member_at_the_committed_step() -> None:
    faults = draw(8, 1, 3, list(TWO_FAILURES), first_step=10, gap=8)
    for fault in faults:
        first, second = fault.plan
        assert first == f"{fault.rank}:before_reduce@{fault.step}"
        if fault.kind == "replacement":
            assert second == first and fault.failed_ranks == [fault.rank, fault.rank]
            continue
        assert fault.second is not None and fault.second != fault.rank
        assert second.startswith(f"{fault.second}:") and second.endswith(f"@{fault.step - 1}")
        if fault.kind == "donor":  # the planner's donor: the lowest survivor
            assert fault.second == min(r for r in range(3) if r != fault.rank)


def test_two_ranks_take_only_single_failures() -> None:
    assert not set(TWO_FAILURES) & set(available_kinds(2, False, False))
    assert "engine_kill" not in available_kinds(3, False, False)
    assert "spare_kill" not in available_kinds(3, False, False, spares=0)


def test_node_faults_take_nodes_still_in_the_job_node_0_once() -> None:
    """Node 0's kinds act on node 0 once; a node given up on is never taken again; a kind
    no node can take any more is passed over; more losses than nodes is refused up front."""
    kinds = ["node0_kill", "node0_partition", "partition", "flap"]
    faults = draw(6, 5, 4, kinds, first_step=4, gap=8, nodes=4)
    lost = [f.node for f in faults if f.kind in NODE_LOST]
    assert len(lost) == len(set(lost)) and lost.count(0) == 1  # each node lost once at most
    for fault in faults:  # and nothing acts on a node after it was lost
        assert fault.node not in [f.node for f in faults[: fault.index] if f.kind in NODE_LOST]
    assert {"partition", "flap"} <= {f.kind for f in faults}
    with pytest.raises(ValueError, match="take more nodes or brokers than the job has"):
        draw(4, 3, 3, ["partition", "node0_kill"], first_step=4, gap=8, nodes=3)


def test_a_run_kills_one_broker_at_most() -> None:
    """A killed broker stays down, and 3 brokers with min.insync.replicas 2 store nothing
    with two of them lost: a second broker kill would stop the job by design, not find a
    fault of it (nemesis seed 1 dealt two, and its run could only stall)."""
    kinds = ["broker_kill", "flap", "degraded"]
    for seed in range(20):
        faults = draw(9, seed, 6, kinds, first_step=4, gap=8, nodes=3)
        assert [f.kind for f in faults].count("broker_kill") == 1
    # nor is a leader cut off once one is killed: two of three lost at once, for the cut
    kinds = ["broker_kill", "broker_partition", "flap", "degraded"]
    for seed in range(20):
        dealt = [f.kind for f in draw(9, seed, 8, kinds, first_step=4, gap=8, nodes=3)]
        assert "broker_partition" not in dealt[dealt.index("broker_kill") :]
    with pytest.raises(ValueError, match="or brokers"):
        draw(2, 0, 6, ["broker_kill"], first_step=4, gap=8, nodes=3)


def test_a_slowed_link_is_dealt_only_where_three_nodes_can_tell_whose_it_is() -> None:
    """Two nodes cannot tell whose link is slow (docs/multinode.md): a flap or a degraded
    link comes while two of the job's nodes and the spare node are still in it."""
    kinds = ["node_kill", "partition", "oneway", "flap", "degraded", "broker_kill"]
    for seed in range(30):
        faults = draw(5, seed, 6, kinds, first_step=4, gap=8, nodes=3)
        lost = 0
        for fault in faults:
            assert fault.kind not in ("flap", "degraded") or 3 - lost >= 2, (seed, faults)
            lost += fault.kind in NODE_LOST


def test_an_idle_spare_fault_fails_no_rank_and_plans_nothing_inside() -> None:
    [fault] = draw(1, 0, 3, ["spare_stop"], first_step=5, gap=6)
    assert fault.plan == [] and fault.failed_ranks == []
    assert fault.describe() == "an idle spare at step 5"


def test_an_outside_kill_stops_waiting_for_a_spare_before_the_next_fault() -> None:
    """A kill held back for a ready spare must not reach the next fault's step: it would take
    that fault's process with it (a stall planned on the same rank was never seen)."""
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    args = parser.parse_args(["--faults", "4", "--seed", "0", "--kinds", "sigkill,sigstop"])
    plan = Plan.from_args(args)
    steps = [f.step for f in plan.faults]
    assert [k.spare_wait_until for k in plan.kills] == [s - 2 for s in steps[1:]] + [None]


@pytest.mark.parametrize(
    ("argv", "pace"),
    [
        ([], MIN_STEP_S),
        (["--nodes", "3", "--netns"], NETNS_STEP_S),  # the pace a step keeps there anyway
        (["--nodes", "3", "--netns", "--min-step-s", "0.05"], 0.05),
    ],
)
def test_steps_are_paced_to_what_the_job_keeps_unless_told(argv: list[str], pace: float) -> None:
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    args = parser.parse_args(["--faults", "1", "--seed", "0", *argv])
    Plan.from_args(args)
    assert args.min_step_s == pace


def test_faults_come_one_at_a_time_a_kill_waits_for_the_link_before_it_to_heal() -> None:
    """A network fault holds its link for seconds while the job trains on: the kill planned
    after it must wait until it is healed, not land on its recovery (seen: a degraded link,
    then a node cut off and a node killed at once, no replica left)."""
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    argv = ["--faults", "3", "--seed", "0", "--nodes", "3", "--netns"]
    plan = Plan.from_args(parser.parse_args([*argv, "--kinds", "degraded,node_kill"]))
    assert [f.kind for f in plan.faults] == ["node_kill", "degraded", "node_kill"]  # seed 0
    kills = [plan.sent[i].kill for i in (0, 2)]
    assert kills[0] is not None
    watch = Progress(running=True, step=9)
    released: list[Kill] = []
    plan.release(released, watch)
    assert released == kills[:1]
    plan.release(released, watch)
    assert released == kills[:1]  # the next waits for this one to be sent
    kills[0].outcome, kills[0].committed = KillOutcome.KILLED, 9
    assert not plan.turn(1, watch)  # sent, its recovery not over
    watch.step = 11
    assert plan.turn(1, watch)  # the job is 2 steps past it
    plan.release(released, watch)
    assert released == kills[:1]  # and the degraded link between them must heal
    plan.sent.setdefault(1, Sent()).network_ts = T0
    plan.sent[1].healed_ts = T0 + 8
    plan.release(released, watch)
    assert released == kills[:1]  # healed, but the job is not past it yet
    plan.sent[1].settled = True
    plan.release(released, watch)
    assert released == kills


def test_a_node_killed_with_its_leader_cut_is_a_kill_then_a_cut_over_once_healed() -> None:
    """The killer SIGKILLs the node; the cut follows it and holds the next fault until the job
    got over it; a kill the job never met frees the next at once."""
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    argv = ["--faults", "2", "--seed", "0", "--nodes", "3", "--netns"]
    plan = Plan.from_args(parser.parse_args([*argv, "--kinds", "node_kill_leader_cut"]))
    first = plan.faults[0]
    assert first.kind == "node_kill_leader_cut" and first.failed_ranks == list(first.ranks[:1])
    kill = plan.sent[0].kill
    assert kill is not None and kill.node == first.node and kill.rank is None
    watch = Progress(running=True, step=20)
    kill.outcome, kill.committed = KillOutcome.KILLED, 9
    assert not plan.turn(1, watch)  # killed, its leader not yet cut and healed
    plan.sent[0].settled = True
    assert plan.turn(1, watch)
    plan.sent[0].settled, kill.outcome = False, KillOutcome.MISSED
    assert plan.turn(1, watch)


@dataclass
class Progress:
    """What the fault sequencing reads of a job: whether it runs, its committed step."""

    running: bool
    step: int

    def committed(self) -> int:
        return self.step


def test_an_impossible_kind_is_refused_before_anything_starts(tmp_path: Path) -> None:
    done = subprocess.run(
        [sys.executable, "-m", "flashrecovery.cli", "chaos", "--kinds", "engine_kill"],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=tmp_path,
    )
    assert done.returncode == 2
    assert "fault kind 'engine_kill' is not possible in this job" in done.stderr


LONG_RUN_DIR = "run-with-a-name-long-enough-that-its-line-is-wider-than-a-terminal"


def run_chaos(tmp_path: Path, *args: str) -> tuple[dict[str, Any], str, str]:
    """A chaos run that must pass every check: its verdict, the verdict as text (for a
    failure's message) and its stderr."""
    command = [
        sys.executable, "-m", "flashrecovery.cli", "chaos", "--gap", "6", "--min-step-s", "0.05",
        *args, "--json", "--timeout", "200",
    ]  # fmt: skip
    env = {**os.environ, "PYTHONPATH": str(REPO)}  # the ranks import this checkout
    done = subprocess.run(
        command, capture_output=True, text=True, timeout=270, cwd=tmp_path, env=env
    )
    assert done.stdout.strip(), f"no verdict; stderr:\n{done.stderr[-3000:]}"
    verdict: dict[str, Any] = json.loads(done.stdout)
    context = json.dumps(verdict, indent=1)[:6000]
    assert done.returncode == 0, context
    assert verdict["ok"] and all(verdict["checks"].values()), context
    return verdict, context, done.stderr


@pytest.mark.timeout(280)
def test_chaos_six_faults_all_recovered_bitwise_equal(tmp_path: Path) -> None:
    verdict, context, stderr = run_chaos(
        tmp_path, "--faults", "6", "--seed", "3", "--kinds", ",".join(KINDS),
        "--run-dir", str(tmp_path / LONG_RUN_DIR),
    )  # fmt: skip
    rows = verdict["faults"]
    assert len({r["kind"] for r in rows}) == 6, context
    assert all(r["recovered"] and r["committed_steps_lost"] == 0 for r in rows), context
    two = [r for r in rows if r["kind"] in TWO_FAILURES]
    assert all(len(r["incidents"]) == 2 for r in two), context
    assert verdict["processes_left"] == []
    run_dir = f"run dir {tmp_path / LONG_RUN_DIR}"  # over 80 columns: piped, never folded
    assert len(run_dir) > 80 and run_dir in stderr.splitlines(), stderr[-3000:]


@pytest.mark.timeout(280)
def test_chaos_quiet_faults_are_found_and_change_nothing_they_should_not(tmp_path: Path) -> None:
    """A NaN costs no incident; a flipped bit costs one (the odd replica replaced), and the job
    still ends bitwise equal to its reference: both were found before any rank stepped. A rank
    made 3x slower is named a straggler within its window of 5 steps, and left in place (the
    report policy). A record of every type forged by a process with no key is rejected or
    ignored, every one, at no cost."""
    verdict, context, _ = run_chaos(
        tmp_path, "--faults", "4", "--seed", "0", "--kinds", "forge,bitflip,slow,nan",
        "--spares", "1",
    )  # fmt: skip
    rows = {r["kind"]: r for r in verdict["faults"]}
    assert sorted(rows) == ["bitflip", "forge", "nan", "slow"], context
    assert rows["forge"]["incidents"] == [] and rows["forge"]["detection_ms"] is not None, context
    assert rows["forge"]["notes"] == [
        "30/30 forged events rejected, 14/14 forged decisions not believed"
    ], context
    assert all(r["recovered"] for r in rows.values()), context
    assert rows["nan"]["detection_steps"] == rows["bitflip"]["detection_steps"] == 0, context
    assert rows["nan"]["incidents"] == [] and "computed again" in rows["nan"]["notes"][0], context
    assert len(rows["bitflip"]["incidents"]) == 1, context
    assert rows["slow"]["incidents"] == [] and 2 <= rows["slow"]["detection_steps"] <= 5, context
    assert rows["slow"]["notes"][0].startswith("named (reported), "), context


@pytest.mark.parametrize(
    ("records", "recovered", "note"),
    [
        ([], False, "was not retired and replaced"),
        (["job_finished"], True, "before spare 0 was found"),
        (["retire_spare", "job_finished"], True, "before its replacement was ready"),
        (["retire_spare", "spare_ready", "job_finished"], True, "its replacement ready"),
        (["spare_activated", "job_finished"], False, "was handed a rank"),
        (["rank_exited", "job_finished"], True, "the agent killed it instead"),
    ],
)
def test_an_idle_spare_fault_is_judged_by_what_the_log_shows(
    records: list[str], recovered: bool, note: str
) -> None:
    """Recovered when the lost spare was never handed a rank and either it was retired and
    replaced, or the job ended first; otherwise not."""
    log = MemoryLog()
    for ts, name in enumerate(records, start=1):
        stream = Stream.DECISIONS if name == "retire_spare" else Stream.EVENTS
        fields = {
            "spare_ready": {"spare_id": 1, "pid": 2002},
            "rank_exited": {"spare_id": 0, "rank": 1, "pid": 2001},
        }.get(name, {})
        log.append(stream, make(TYPES_BY_NAME[name], record_id=f"r-{ts}", ts=T0 + ts, **fields))
    sent = Sent(spare=(0, 2001, T0))
    ok, notes, _, _ = spare_outcome(log, JOB, sent)
    assert ok is recovered and note in notes[0]


@pytest.mark.parametrize(
    ("named", "recovered", "note"),
    [
        ([], False, "node 1 was not named as the cause"),
        ([(T0 - 5, 1)], False, "node 1 was not named as the cause"),  # before the fault
        ([(T0 + 3, 2)], False, "node 1 was not named as the cause"),  # another node
        ([(T0 + 3, 1)], True, "node 1 named (reported), 10% of probes late"),
    ],
)
def test_a_degraded_link_is_judged_by_whether_its_node_was_named(
    named: list[tuple[float, int]], recovered: bool, note: str
) -> None:
    log = MemoryLog()
    for i, (ts, node) in enumerate(named):
        record = make(TYPES_BY_NAME["straggler_found"], record_id=f"r-{i}", ts=ts, node=node)
        log.append(Stream.DECISIONS, record)
    ok, notes, detection = straggler_outcome(log, JOB, 1, Sent(network_ts=T0))
    assert ok is recovered and notes == [note]
    assert detection == (3.0 if recovered else None)


def test_a_fault_the_job_never_met_is_counted_apart_not_as_recovered() -> None:
    """An idle-spare signal with no idle spare ready before the job ended was never sent: it
    proves nothing either way, so it is neither a miss nor a recovery."""
    log = MemoryLog()
    log.append(Stream.EVENTS, make(TYPES_BY_NAME["job_started"], record_id="r-0", ts=T0))
    log.append(Stream.EVENTS, make(TYPES_BY_NAME["job_finished"], record_id="r-1", ts=T0 + 1))
    faults = draw(1, 0, 3, ["spare_stop"], first_step=5, gap=6)
    verdict = judge(log, JOB, 3, 10, faults, {0: Sent()}, 0, {}, {}, [])
    [row] = verdict["faults"]
    assert (row["sent"], row["recovered"], row["notes"]) == (
        False,
        False,
        ["no idle spare to signal"],
    )
    assert (verdict["sent"], verdict["recovered"]) == (0, 0)
    assert verdict["checks"]["every_fault_sent_recovered"]
