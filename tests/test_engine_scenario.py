"""The scripted failure scenario (no torch): exact decisions, replay, doctored log, restart."""

from __future__ import annotations

from typing import Any

import pytest
from structlog.testing import capture_logs

from flashrecovery.connectors.memory import MemoryLog
from flashrecovery.engine.loop import EngineLoop
from flashrecovery.errors import LogError
from flashrecovery.records import Decision, RankExited, StepCompleted, StepNonFinite, Stream
from flashrecovery.replay.replayer import replay_job
from flashrecovery.testing.simworld import SimulatedWorld, drive, scripted_failure

JOB = "scripted"
VOLATILE = {"schema_version", "record_id", "job_id", "source", "ts", "chain"}


def running(
    world_size: int, spares: int, steps: int
) -> tuple[MemoryLog, SimulatedWorld, EngineLoop]:
    """A job on a memory log whose engine has seen it start and train ``steps`` steps."""
    log, world = MemoryLog(), SimulatedWorld(JOB, world_size=world_size, spares=spares)
    engine = EngineLoop(log, JOB)
    drive(log, engine, world, world.start())
    drive(log, engine, world, world.train(steps))
    return log, world, engine


def essentials(decisions: list[Decision]) -> list[dict[str, Any]]:
    out = []
    for d in decisions:
        fields = d.model_dump(exclude=VOLATILE)
        if d.type == "incident_closed":
            fields.pop("rto_s")
            fields["phases"] = sorted(fields["phases"])
        out.append(fields)
    return out


def test_kill_with_spare_decides_isolate_replace_regroup_restore_resume() -> None:
    log = MemoryLog()
    decisions = scripted_failure(log, JOB, world_size=4, spares=1, kill_rank=2, steps_before=3)
    kill = next(
        e for e in log.read(Stream.EVENTS, JOB) if e.record and e.record.type == "rank_exited"
    )
    regrouped = [
        e for e in log.read(Stream.EVENTS, JOB) if e.record and e.record.type == "rank_regrouped"
    ]
    steps_after = [
        e
        for e in log.read(Stream.EVENTS, JOB)
        if e.record and e.record.type == "step_completed" and e.record.generation == 1
    ]
    assert kill.record is not None and hasattr(kill.record, "pid")
    incident = f"{JOB}-incident-1"
    assert essentials(decisions) == [
        {
            "generation": 0,
            "type": "isolate_rank",
            "caused_by": kill.position,
            "incident_id": incident,
            "rank": 2,
            "pid": kill.record.pid,
            "reason": f"process {kill.record.pid} exited (signal 9)",
            "kill": True,
            "node": 0,
        },
        {
            "generation": 1,
            "type": "assign_spare",
            "caused_by": kill.position,
            "incident_id": incident,
            "rank": 2,
            "spare_id": 0,
            "node": 0,
            "store": None,  # a single-node job meets on its one store throughout
        },
        {
            "generation": 1,
            "type": "regroup_planned",
            "caused_by": kill.position,
            "incident_id": incident,
            "members": [0, 1, 2, 3],
            "replaced": [2],
            "store": None,
        },
        {
            "generation": 1,
            "type": "resume_planned",
            "caused_by": regrouped[-1].position,
            "incident_id": incident,
            "resume_step": 2,
            "donors": {0: 0},
            "recipients": [2],
            "stripes": {0: [0, 1, 3]},  # every survivor sends a third of the state
        },
        {
            "generation": 1,
            "type": "incident_closed",
            "caused_by": steps_after[3].position,  # the 4th rank to commit step 3
            "incident_id": incident,
            "failed_rank": 2,
            "failed_ranks": [],
            "failed_node": None,
            "rpo_steps": 0,
            "recomputed_steps": 1,
            "phases": sorted(
                ["detected", "isolated", "replacement_ready", "regrouped", "restored", "resumed"]
            ),
        },
    ]
    closed = decisions[-1]
    assert closed.type == "incident_closed"
    assert closed.rto_s == pytest.approx(steps_after[3].record.ts - kill.record.ts)  # type: ignore[union-attr]


def test_without_a_spare_the_engine_spawns_a_replacement() -> None:
    decisions = scripted_failure(MemoryLog(), JOB, spares=0, kill_rank=1)
    assert [d.type for d in decisions] == [
        "isolate_rank",
        "spawn_replacement",
        "regroup_planned",
        "resume_planned",
        "incident_closed",
    ]
    assert decisions[1].model_dump()["rank"] == 1


def test_second_failure_uses_the_next_generation() -> None:
    log, world, engine = running(3, spares=1, steps=2)
    first = drive(log, engine, world, [world.kill(0)])
    drive(log, engine, world, world.train(2))
    second = drive(log, engine, world, [world.raise_in(2)])
    drive(log, engine, world, world.train(1))
    assert [d.type for d in first][:3] == ["isolate_rank", "assign_spare", "regroup_planned"]
    assert [d.type for d in second][:3] == ["isolate_rank", "spawn_replacement", "regroup_planned"]
    regroups = [d for d in first + second if d.type == "regroup_planned"]
    assert [d.generation for d in regroups] == [1, 2]
    resume = next(d for d in second if d.type == "resume_planned")
    assert resume.model_dump()["donors"] == {0: 0}  # rank 0's replacement is a healthy donor now
    assert engine.state.job.state == "running"
    assert [i.machine.state for i in engine.state.incidents] == ["closed", "closed"]


def test_stale_generation_records_are_fenced() -> None:
    log, world, engine = running(2, spares=1, steps=1)
    drive(log, engine, world, [world.kill(1)])
    world.generation = 0  # a survivor's late record from generation 0
    late = list(world.train(1))
    before = engine.state.ranks[0].committed_step
    decisions = drive(log, engine, world, late)
    assert decisions == []
    assert engine.state.fenced == len(late)
    assert engine.state.ranks[0].committed_step == before


def test_replay_reproduces_every_decision() -> None:
    log = MemoryLog()
    decisions = scripted_failure(log, JOB)
    report = replay_job(log, JOB)
    assert report.ok, report.divergence
    assert report.decisions_checked == len(decisions)
    assert report.state.job.state == "completed"
    [incident] = report.incidents()
    assert incident["state"] == "closed" and incident["rpo_steps"] == 0


def copy_log(
    source: MemoryLog, edit: dict[str, Any] | None = None, record_id: str = ""
) -> MemoryLog:
    """A copy of one job's log (same positions), with one decision's fields overwritten."""
    copy = MemoryLog()
    for stream in Stream:
        for entry in source.read(stream, JOB):
            record = entry.record
            assert record is not None
            if record.record_id == record_id and edit:
                record = record.model_copy(update=edit)
            assert copy.append(stream, record) == entry.position
    return copy


def test_doctored_log_diverges_at_the_edited_decision() -> None:
    log = MemoryLog()
    decisions = scripted_failure(log, JOB)
    resume = next(d for d in decisions if d.type == "resume_planned")
    doctored = copy_log(log, {"resume_step": 1}, resume.record_id)
    assert replay_job(copy_log(log), JOB).ok
    report = replay_job(doctored, JOB)
    assert not report.ok and report.divergence is not None
    assert report.divergence.position == resume.caused_by
    assert report.divergence.recorded is not None and report.divergence.replayed is not None
    assert report.divergence.recorded["resume_step"] == 1
    assert report.divergence.replayed["resume_step"] == 2


def test_replay_until_rebuilds_the_state_as_it_stood() -> None:
    log = MemoryLog()
    decisions = scripted_failure(log, JOB)
    regroup = next(d for d in decisions if d.type == "regroup_planned")
    report = replay_job(log, JOB, until=regroup.caused_by)
    assert report.ok
    assert report.state.job.state == "regrouping"
    assert report.state.ranks[2].machine.state == "isolated"
    assert report.incidents()[0]["state"] == "isolated"


class CrashingLog(MemoryLog):
    """A log whose engine dies after storing a given number of decisions (in the middle of a
    batch, if that is where the count runs out)."""

    def __init__(self, decisions_before_crash: int) -> None:
        super().__init__()
        self.budget = decisions_before_crash

    def append_raw(self, stream: Stream, job_id: str, raw: bytes) -> int:
        if stream == Stream.DECISIONS:
            if self.budget == 0:
                raise RuntimeError("engine killed")
            self.budget -= 1
        return super().append_raw(stream, job_id, raw)


# 1, 2: killed between the decisions of one event; 3: killed while planning the resume.
@pytest.mark.parametrize("written_before_crash", [1, 2, 3])
def test_engine_restart_mid_incident_finishes_with_the_same_decisions(
    written_before_crash: int,
) -> None:
    log = CrashingLog(written_before_crash)
    world, _ = fail_mid_incident(log, RuntimeError, "engine killed")
    assert len(log.read(Stream.DECISIONS, JOB)) == written_before_crash

    log.budget = -1  # the new engine's appends succeed
    restarted = EngineLoop(log, JOB)
    restarted.catch_up()
    finishes_as_the_reference(log, restarted, world)


def fail_mid_incident(
    log: MemoryLog, error: type[Exception], match: str
) -> tuple[SimulatedWorld, EngineLoop]:
    """Train 3 steps, then kill rank 2: the engine's append of its decisions fails."""
    world = SimulatedWorld(JOB)
    engine = EngineLoop(log, JOB)
    drive(log, engine, world, world.start())
    drive(log, engine, world, world.train(3))
    with pytest.raises(error, match=match):
        drive(log, engine, world, [world.kill(2)])
    return world, engine


def finishes_as_the_reference(log: MemoryLog, engine: EngineLoop, world: SimulatedWorld) -> None:
    """The decisions in the log so far are the fault-free engine's, none twice; answered, the
    job ends with exactly its decisions, and replay agrees."""
    reference = scripted_failure(MemoryLog(), JOB)
    written = [e.record for e in log.read(Stream.DECISIONS, JOB)]
    assert written == reference[: len(written)]  # nothing lost, nothing twice
    unanswered = written[world.answered :]
    drive(log, engine, world, [r for d in unanswered for r in world.react(d)])  # type: ignore[arg-type]
    drive(log, engine, world, world.train(2))
    drive(log, engine, world, world.finish())
    assert [e.record for e in log.read(Stream.DECISIONS, JOB)] == reference
    assert replay_job(log, JOB).ok


class AckLostLog(MemoryLog):
    """A log that stores the first batch of decisions and then fails the append, as a broker
    cut off after it replicated the batch leaves its writer unanswered."""

    def __init__(self) -> None:
        super().__init__()
        self.lose_ack = True

    def append_raw_many(
        self, stream: Stream, job_id: str, raws: list[bytes], *, routine: bool = False
    ) -> list[int]:
        positions = super().append_raw_many(stream, job_id, raws, routine=routine)
        if stream == Stream.DECISIONS and self.lose_ack:
            self.lose_ack = False
            raise LogError("no answer from the broker within the request timeout")
        return positions


def test_decisions_stored_but_unacknowledged_are_not_written_again() -> None:
    log = AckLostLog()
    world, engine = fail_mid_incident(log, LogError, "request timeout")
    engine.apply([])  # the log is back: what is due is written, unless it is there already
    finishes_as_the_reference(log, engine, world)


def test_rank_lost_after_the_last_step_closes_its_incident_when_all_finish() -> None:
    log, world, engine = running(2, spares=1, steps=3)
    recovery = drive(log, engine, world, [world.kill(1)])
    assert [d.type for d in recovery] == [
        "isolate_rank",
        "assign_spare",
        "regroup_planned",
        "resume_planned",
    ]
    closing = drive(log, engine, world, world.finish())  # no step left to train
    [closed] = [d for d in closing if d.type == "incident_closed"]
    assert closed.model_dump()["rpo_steps"] == 0
    assert engine.state.job.state == "completed"
    assert replay_job(log, JOB).ok


def test_rank_that_dies_before_joining_is_replaced() -> None:
    log = MemoryLog()
    world = SimulatedWorld(JOB, world_size=3, spares=1)
    engine = EngineLoop(log, JOB)
    opening = [r for r in world.start() if not (r.type == "rank_joined" and r.rank == 1)]  # type: ignore[attr-defined]
    drive(log, engine, world, opening)
    assert engine.state.job.state == "starting"
    decisions = drive(log, engine, world, [world.kill(1)])
    assert [d.type for d in decisions] == [
        "isolate_rank",
        "assign_spare",
        "regroup_planned",
        "resume_planned",
    ]
    resume = decisions[-1].model_dump()
    assert resume["resume_step"] == -1 and resume["recipients"] == [1]
    late_joins = [r for r in SimulatedWorld(JOB, world_size=3).start() if r.type == "rank_joined"]
    assert drive(log, engine, world, late_joins) == []
    assert engine.state.fenced == 3  # generation-0 joins arriving after the regroup
    drive(log, engine, world, world.train(1))
    assert engine.state.job.state == "running"
    assert [i.machine.state for i in engine.state.incidents] == ["closed"]


def test_the_loop_counts_explains_and_reports_a_rejected_record() -> None:
    log, world, engine = running(2, spares=0, steps=0)
    bad = log.append_raw(Stream.EVENTS, JOB, b'{"schema_version": 1, "type": "heartbeat"}')
    with capture_logs() as logs:
        engine.apply(log.read(Stream.EVENTS, JOB, engine.next_position))
    [reason] = engine.state.rejected
    assert reason.startswith("malformed: ") and "job_id" in reason
    assert {
        "event": "record rejected",
        "position": bad,
        "reason": reason,
        "log_level": "warning",
    } in logs
    assert drive(log, engine, world, world.train(1)) == []  # and the engine carries on
    assert engine.state.ranks[0].committed_step == 0


def test_a_spare_that_dies_before_taking_over_is_replaced_in_turn() -> None:
    log, world, engine = running(2, spares=1, steps=2)
    for record in [world.kill(1)]:
        log.append(Stream.EVENTS, record)
    engine.apply(log.read(Stream.EVENTS, JOB, engine.next_position))
    assign = next(
        e.record for e in log.read(Stream.DECISIONS, JOB) if e.record.type == "assign_spare"
    )
    spare_pid = world.spare_pids[assign.spare_id]  # type: ignore[union-attr]
    died = RankExited(
        job_id=JOB, generation=1, source="agent", ts=world.clock + 0.01, rank=1, spare_id=0,
        pid=spare_pid, signal=9,
    )  # fmt: skip
    log.append(Stream.EVENTS, died)
    engine.apply(log.read(Stream.EVENTS, JOB, engine.next_position))
    types = [e.record.type for e in log.read(Stream.DECISIONS, JOB) if e.record]
    assert types == ["isolate_rank", "assign_spare", "regroup_planned", "spawn_replacement"]
    assert engine.state.spares[0].status == "gone"
    assert engine.state.ranks[1].pid is None  # the fresh process names itself when spawned


def test_spares_that_fail_before_they_regroup_are_no_crash_loop_of_the_rank() -> None:
    """A hot spare that dies (or was stopped) before it regrouped as the rank is the spare's
    failure: the rank is given another spare however often that happens."""
    log, world = MemoryLog(), SimulatedWorld(JOB, world_size=2, spares=3)
    engine = EngineLoop(log, JOB)
    started, *rest = world.start()
    drive(log, engine, world, [started.model_copy(update={"max_replacements": 2}), *rest])
    drive(log, engine, world, world.train(2))
    log.append(Stream.EVENTS, world.kill(1))
    for spare_id in range(3):
        engine.apply(log.read(Stream.EVENTS, JOB, engine.next_position))
        decisions = [e.record for e in log.read(Stream.DECISIONS, JOB) if e.record]
        assign = decisions[-1] if spare_id else decisions[1]
        assert (assign.type, assign.spare_id) == ("assign_spare", spare_id)  # type: ignore[union-attr]
        died = RankExited(
            job_id=JOB, generation=1, source="agent", ts=world.clock + 0.01 * (spare_id + 1),
            rank=1, spare_id=spare_id, pid=world.spare_pids[spare_id], signal=9,
        )  # fmt: skip
        log.append(Stream.EVENTS, died)
    engine.apply(log.read(Stream.EVENTS, JOB, engine.next_position))
    types = [e.record.type for e in log.read(Stream.DECISIONS, JOB) if e.record]
    assert "fail_job" not in types and types[-1] == "spawn_replacement"
    assert engine.state.failures[(1, 1)] == 1  # the rank's own failure, once


def test_a_spare_not_heard_from_lately_is_passed_over() -> None:
    """A spare stopped (SIGSTOP) shortly before a failure is not yet retired, but its last
    heartbeat is too old: the rank gets a fresh process rather than a hung spare."""
    log, world, engine = running(2, spares=1, steps=2)  # the spare beat with every step
    interval = world.heartbeat_interval_s
    kill = world.kill(1).model_copy(update={"ts": world.clock + 2.5 * interval})
    log.append(Stream.EVENTS, kill)
    engine.apply(log.read(Stream.EVENTS, JOB, engine.next_position))
    types = [e.record.type for e in log.read(Stream.DECISIONS, JOB) if e.record]
    assert types[:2] == ["isolate_rank", "spawn_replacement"]
    assert engine.state.spares[0].status == "ready"  # still in the pool until it is retired


def test_a_replacement_that_regroups_before_the_agent_reports_it_is_no_rejection() -> None:
    log, world, engine = running(2, spares=1, steps=2)
    decisions = drive(log, engine, world, [world.kill(1)])
    assert [d.type for d in decisions][-1] == "resume_planned"
    events = [e.record for e in log.read(Stream.EVENTS, JOB)]
    activated = next(r for r in events if r.type == "spare_activated")
    reordered = MemoryLog()  # the same records, the agent's report after the regroup records
    rest = [r for r in events if r is not activated]
    position = rest.index(next(r for r in rest if r.type == "rank_regrouped" and r.rank == 1))  # type: ignore[union-attr]
    for record in [*rest[: position + 1], activated, *rest[position + 1 :]]:
        reordered.append(Stream.EVENTS, record)
    report = replay_job(reordered, JOB)
    assert not report.state.rejected
    assert report.state.ranks[1].machine.state == "healthy"


def test_a_failure_once_ranks_have_finished_opens_no_incident() -> None:
    log, world, engine = running(2, spares=1, steps=2)
    finished, _, _ = world.finish()
    assert drive(log, engine, world, [finished, world.kill(1)]) == []
    assert engine.state.incidents == []


def test_an_isolated_rank_whose_process_exits_after_the_job_failed_is_no_engine_fault() -> None:
    """A crash loop fails the job with the rank isolated and nothing placed; its process's exit
    reported after that (or reported twice) must neither replace it nor stop the engine."""
    log, world = MemoryLog(), SimulatedWorld(JOB, world_size=2, spares=0)
    engine = EngineLoop(log, JOB)
    started, *rest = world.start()
    drive(log, engine, world, [started.model_copy(update={"max_replacements": 1}), *rest])
    drive(log, engine, world, world.train(2))
    kill = world.kill(1)
    log.append(Stream.EVENTS, kill)
    engine.apply(log.read(Stream.EVENTS, JOB, engine.next_position))
    assert engine.state.job.state == "failed"
    decided = len(log.read(Stream.DECISIONS, JOB))
    log.append(Stream.EVENTS, kill.model_copy(update={"ts": kill.ts + 0.5}))
    engine.apply(log.read(Stream.EVENTS, JOB, engine.next_position))
    assert len(log.read(Stream.DECISIONS, JOB)) == decided
    assert engine.state.engine_faults == [] and engine.state.fenced == 1
    assert replay_job(log, JOB).ok


def test_a_process_that_says_the_script_cannot_run_fails_the_job_at_once() -> None:
    """A ScriptError (the script makes torch's default group itself) is no crash loop to wait
    out: the first such exit fails the job, naming the error; a spare's stops the refills."""
    log, world = MemoryLog(), SimulatedWorld(JOB, world_size=3, spares=1)
    engine = EngineLoop(log, JOB)
    drive(log, engine, world, [r for r in world.start() if r.type != "rank_joined"])
    error = "flashrecovery.errors.ScriptError: the script calls torch.distributed.init_…"
    spare = RankExited(
        **world._env("agent"), spare_id=7, pid=4343, exit_code=1, error=error, fatal=True
    )
    [retired] = drive(log, engine, world, [spare])
    assert retired.type == "retire_spare" and not retired.refill  # type: ignore[attr-defined]
    assert "the script cannot run" in retired.reason  # type: ignore[attr-defined]
    rank = world.kill(1).model_copy(update={"signal": None, "exit_code": 1, "error": error})
    assert "fail_job" not in [d.type for d in drive(log, engine, world, [rank])]  # not fatal
    fatal = world.kill(2).model_copy(
        update={"signal": None, "exit_code": 1, "error": error, "fatal": True}
    )
    decisions = drive(log, engine, world, [fatal])
    [failed] = [d for d in decisions if d.type == "fail_job"]
    assert failed.failures == 1 and "no replacement would do better" in failed.reason  # type: ignore[attr-defined]
    assert error in failed.last_error  # type: ignore[attr-defined]
    assert engine.state.job.state == "failed"


def test_a_nonfinite_step_is_counted_and_decides_nothing_a_skipped_one_is_a_step() -> None:
    log, world, engine = running(2, spares=0, steps=3)

    def nonfinite(step: int, attempt: int, action: str) -> StepNonFinite:
        return StepNonFinite(
            job_id=JOB, generation=0, source="rank:1", rank=1, step=step, found="loss nan",
            attempt=attempt, action=action,
        )  # fmt: skip

    assert drive(log, engine, world, [nonfinite(3, 1, "recompute")]) == []
    assert drive(log, engine, world, [nonfinite(3, 2, "skip")]) == []
    assert engine.state.nonfinite == {"recompute": 1, "skip": 1}
    # Of a step the rank is not in, it is believed by no one.
    assert drive(log, engine, world, [nonfinite(5, 1, "recompute")]) == []
    [reason] = engine.state.rejected
    assert "its step in progress is 3, not 5" in reason
    skipped = [
        StepCompleted(job_id=JOB, generation=0, source=f"rank:{r}", rank=r, step=3,
                      duration_s=0.1, loss=float("nan"), skipped=True)
        for r in range(2)
    ]  # fmt: skip
    assert drive(log, engine, world, skipped) == []
    assert [engine.state.ranks[r].committed_step for r in range(2)] == [3, 3]
    assert engine.state.nonfinite == {"recompute": 1, "skip": 1}
    report = replay_job(log, JOB)
    assert report.ok, report.divergence and report.divergence.describe()
