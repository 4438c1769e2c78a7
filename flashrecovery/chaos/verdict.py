"""What a chaos run proves, judged after the fact from its log, the ranks' final states and the
faults it sent: per fault its detection time, RTO, committed steps lost and whether it was
recovered; for the job, completion, bitwise equality with the fault-free reference, a replay
with no divergence, the survivors' processes kept, and no process left behind."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

from flashrecovery.chaos.schedule import (
    FORGED,
    IDLE_SPARE_SIGNAL,
    NETWORK,
    NO_INCIDENT,
    NODE_LOST,
    SLOWED,
    STRAGGLING,
    VERIFIED,
    PlannedFault,
)
from flashrecovery.connectors.base import LogConnector
from flashrecovery.demo.summary import (
    incidents,
    loss_curve,
    lost_with_nodes,
    process_history,
    reached_by_restore,
    step_losses,
)
from flashrecovery.demo.watch import Kill, KillOutcome
from flashrecovery.records import (
    EngineLease,
    JobFinished,
    RankExited,
    RecordRejected,
    RetireSpare,
    SpareActivated,
    SpareReady,
    StateDigest,
    StepNonFinite,
    StragglerFound,
    Stream,
)
from flashrecovery.statemachines.incident import IncidentState
from flashrecovery.trainer_hooks.final_state import FinalState


@dataclass
class Sent:
    """What the chaos command did from outside for one fault."""

    kill: Kill | None = None  # the rank signalled (outside kinds, and mid-incident ones)
    mid_incident_ts: float | None = None  # when the engine was killed / the broker restarted
    engine_killed: str | None = None  # that engine's id
    spare: tuple[int, int, float] | None = None  # the idle spare signalled: id, pid, when
    network_ts: float | None = None  # when a network fault began (chaos/network.py)
    lost_ts: float | None = None  # when the job had given its node up
    healed_ts: float | None = None  # when the link was healed (or the fault ended)
    host: str | None = None  # the testbed host a network fault acts on
    healed_step: int | None = None  # the job's committed step when it was seen healed
    settled: bool = False  # healed, and the job committed steps past it: the next may come
    forged: Path | None = None  # where the forger left what it wrote (chaos/forge.py)
    notes: list[str] = field(default_factory=list)


def _ms(seconds: float | None) -> float | None:
    return None if seconds is None else round(seconds * 1000, 1)


def _takeover_s(log: LogConnector, job_id: str, sent: Sent) -> float | None:
    """From the engine's death to the first lease another engine took."""
    if sent.mid_incident_ts is None:
        return None
    for entry in log.read(Stream.EVENTS, job_id):
        lease = entry.record
        if (
            isinstance(lease, EngineLease)
            and lease.engine_id != sent.engine_killed
            and lease.ts >= sent.mid_incident_ts
        ):
            return lease.ts - sent.mid_incident_ts
    return None


def record_counts(log: LogConnector, job_id: str, nproc: int, steps: int) -> dict[str, Any]:
    """Records stored twice (one id at two positions: which, where, by whom), and each rank's
    step records: a step committed with no record of it (missing), or recorded twice. The
    records a lost node still held in its agent's batch are counted apart: they never reached
    the log (docs/multinode.md), which lost nothing it was given; so is a recipient's resume
    step that its dead process never handed over (it died once the step committed)."""
    seen: dict[str, list[str]] = {}
    for stream in (Stream.EVENTS, Stream.DECISIONS):
        for e in log.read(stream, job_id):
            if e.record is not None:
                where = f"{stream}@{e.position} {e.record.type} from {e.record.source}"
                seen.setdefault(e.record.record_id, []).append(where)
    twice = {rid: at for rid, at in seen.items() if len(at) > 1}
    curve = loss_curve(
        step_losses(log, job_id),
        nproc,
        steps,
        lost=lost_with_nodes(log, job_id),
        restored=reached_by_restore(log, job_id),
    )
    return {
        "records": sum(len(at) for at in seen.values()),
        "duplicate_record_ids": sum(len(at) - 1 for at in twice.values()),
        "stored_twice": dict(list(twice.items())[:10]),
        "step_records_missing": sum(len(v) for v in curve["gaps"].values()),
        "step_records_lost_with_nodes": sum(len(v) for v in curve["lost_with_nodes"].values()),
        "step_records_reached_by_restore": sum(
            len(v) for v in curve["reached_by_restore"].values()
        ),
        "step_records_duplicated": sum(len(v) for v in curve["duplicates"].values()),
    }


def spare_outcome(
    log: LogConnector, job_id: str, sent: Sent
) -> tuple[bool, list[str], float | None, float | None]:
    """An idle spare signalled: recovered when no rank was handed to it afterwards (the agent
    kills a stopped spare it was told to assign) and either
    the engine retired it and a spare started in its place got ready (detection: the
    retirement; RTO: that spare ready, from the signal), or the job ended before its silence
    was due to be found or before the spare started in its place was ready."""
    if sent.spare is None:
        return False, ["no idle spare to signal"], None, None
    spare_id, _, ts = sent.spare
    decisions = [e.record for e in log.read(Stream.DECISIONS, job_id)]
    events = [e.record for e in log.read(Stream.EVENTS, job_id)]
    used = any(
        isinstance(r, SpareActivated) and r.spare_id == spare_id and r.ts >= ts for r in events
    )
    retired = next(
        (r.ts for r in decisions if isinstance(r, RetireSpare) and r.spare_id == spare_id), None
    )
    ready = next(
        (
            r.ts
            for r in events
            if isinstance(r, SpareReady) and r.spare_id > spare_id and r.ts >= (retired or ts)
        ),
        None,
    )
    ended = next((r.ts for r in events if isinstance(r, JobFinished)), None)
    if used:
        return False, [f"spare {spare_id} was handed a rank after the signal"], None, None
    refused = next(
        (
            r.ts
            for r in events
            if isinstance(r, RankExited) and r.spare_id == spare_id and r.rank is not None
        ),
        None,
    )
    if refused is not None:  # assigned before its silence was found: killed, not handed over
        notes = [f"spare {spare_id} was assigned while stopped; the agent killed it instead"]
        return True, notes, refused - ts, None
    if retired is not None and ready is not None:
        notes = [f"spare {spare_id} retired; RTO: its replacement ready"]
        return True, notes, retired - ts, ready - ts
    if retired is None and ended is not None:
        return (
            True,
            [f"the job ended {ended - ts:.1f} s after, before spare {spare_id} was found"],
            None,
            None,
        )
    if retired is not None and ended is not None:
        notes = [f"spare {spare_id} retired; the job ended before its replacement was ready"]
        return True, notes, retired - ts, None
    return False, [f"spare {spare_id} was not retired and replaced"], None, None


SLOW_REASON = "slows the job"  # in the reason of an incident that replaced a straggler


def straggler_outcome(
    log: LogConnector, job_id: str, node: int | None, sent: Sent
) -> tuple[bool, list[str], float | None]:
    """A degraded (or flapping) link: whether the engine named its node as the cause once the
    link was made slow, what it did, and when (detection: from the moment the link failed to
    the naming). An incident that replaced the node (the replace policy) is judged apart."""
    since = sent.network_ts
    if since is None:
        return False, [], None
    named = next(
        (
            r
            for e in log.read(Stream.DECISIONS, job_id)
            if isinstance(r := e.record, StragglerFound)
            and (r.cause, r.node) == ("link", node)
            and r.ts >= since
        ),
        None,
    )
    if named is None:
        return False, [f"node {node} was not named as the cause"], None
    said = "and replaced" if named.replaced else "(reported)"
    return (
        True,
        [f"node {node} named {said}, {named.late_ratio or 0:.0%} of probes late"],
        named.ts - since,
    )


def rank_straggler_outcome(
    log: LogConnector, job_id: str, fault: PlannedFault
) -> tuple[bool, list[str], int | None]:
    """A rank slowed: whether the engine named it from its compute times, how, and how many
    steps after the slowing began (the step whose records named it)."""
    named = next(
        (
            r
            for e in log.read(Stream.DECISIONS, job_id)
            if isinstance(r := e.record, StragglerFound)
            and (r.cause, r.ranks) == ("step_time", [fault.rank])
        ),
        None,
    )
    if named is None:
        return False, [f"rank {fault.rank} was not named a straggler"], None
    [cause] = log.read(Stream.EVENTS, job_id, named.caused_by, limit=1)
    step = getattr(cause.record, "step", fault.step)
    said = "and replaced" if named.replaced else "(reported)"
    return True, [f"named {said}, {named.slowdown}x its peers' median"], step - fault.step


def nonfinite_outcome(
    log: LogConnector, job_id: str, fault: PlannedFault
) -> tuple[bool, list[str], int | None]:
    """A NaN put in a rank's gradients: whether that rank reported its step non-finite and the
    step was computed again (not skipped, not failed), and how many steps after the fault."""
    reports = _reports(log, job_id, fault, StepNonFinite)
    if not reports:
        return False, [f"rank {fault.rank} did not report the NaN"], None
    first = reports[0]
    recomputed = all(r.action == "recompute" for r in reports)
    said = "computed again" if recomputed else f"then {reports[-1].action}"
    return (
        recomputed,
        [f"found in step {first.step} ({first.found}), {said}"],
        first.step - fault.step,
    )


R = TypeVar("R", StepNonFinite, StateDigest)


def _reports(log: LogConnector, job_id: str, fault: PlannedFault, kind: type[R]) -> list[R]:
    """The fault's rank's records of ``kind`` from the fault's step on."""
    return [
        r
        for e in log.read(Stream.EVENTS, job_id)
        if isinstance(r := e.record, kind) and r.rank == fault.rank and r.step >= fault.step
    ]


def digest_steps(log: LogConnector, job_id: str, fault: PlannedFault) -> int | None:
    """Steps from a flipped bit to the vote whose digests found it (None: never found)."""
    reports = _reports(log, job_id, fault, StateDigest)
    return reports[0].step - fault.step if reports else None


def forge_outcome(
    log: LogConnector, job_id: str, sent: Sent
) -> tuple[bool, list[str], float | None]:
    """Records forged by a process with no key (``log``: the job's believed view): each forged
    event answered by a RecordRejected the engine signed, each forged decision not believed,
    and how long the rejections took to reach the log."""
    if sent.forged is None or not sent.forged.exists():
        return False, ["the forger left no account of what it wrote"], None
    wrote = json.loads(sent.forged.read_text())
    events, decisions = set(wrote["events"].values()), set(wrote["decisions"].values())
    rejected = {
        r.caused_by
        for e in log.read(Stream.DECISIONS, job_id)
        if isinstance(r := e.record, RecordRejected)
    }
    believed = [
        e.position
        for e in log.read(Stream.DECISIONS, job_id)
        if e.position in decisions and e.record is not None
    ]
    notes = [
        f"{len(events & rejected)}/{len(events)} forged events rejected, "
        f"{len(decisions) - len(believed)}/{len(decisions)} forged decisions not believed"
    ]
    ok = events <= rejected and not believed
    return ok, notes, wrote["rejected_after_s"]


def _caused_by(fault: PlannedFault, rank: int, row: dict[str, Any]) -> bool:
    """A lost node's incident by the node's number (ranks may have moved onto it since the plan
    was drawn); any other by its rank."""
    if fault.kind in NODE_LOST:
        return bool(row["failed_node"] == fault.node)
    return bool(row["failed_rank"] == rank)


def judge(
    log: LogConnector,
    job_id: str,
    nproc: int,
    steps: int,
    faults: list[PlannedFault],
    sent: dict[int, Sent],
    returncode: int | None,
    final: dict[int, FinalState],
    reference: dict[int, FinalState],
    left: list[int],
) -> dict[str, Any]:
    """The verdict as plain JSON; ``ok`` only when every check holds."""
    kills = [s.kill for s in sent.values() if s.kill is not None]
    found = incidents(log, job_id, kills)
    unclaimed = list(found["incidents"])
    signalled: dict[int, dict[str, Any]] = {}  # fault index -> the incident its kill caused
    for index, action in sent.items():
        pid = action.kill.pid if action.kill is not None else None
        row = next((r for r in unclaimed if pid is not None and r["killed_pid"] == pid), None)
        if row is not None:
            unclaimed.remove(row)
            signalled[index] = row
    rows = []
    for fault in faults:
        mine = [signalled[fault.index]] if fault.index in signalled else []
        for rank in fault.failed_ranks[len(mine) :]:
            match = next((r for r in unclaimed if _caused_by(fault, rank, r)), None)
            if match is not None:
                unclaimed.remove(match)
                mine.append(match)
        if fault.kind in (*SLOWED, *STRAGGLING):  # replaced by the straggler policy
            replaced = [
                r
                for r in unclaimed
                if SLOW_REASON in (r["reason"] or "")
                and (
                    r["failed_node"] == fault.node
                    if fault.kind in SLOWED
                    else r["failed_rank"] == fault.rank
                )
            ]
            unclaimed = [r for r in unclaimed if r not in replaced]
            mine += replaced
        action = sent.get(fault.index, Sent())
        first = mine[0] if mine else None
        if first is None:
            detection = None
        elif fault.index in signalled:
            detection = first["detection_s"]  # from the signal the chaos command sent
        else:
            detection = first["phases_s"].get("detected")  # from the failure the engine dated
        # From the signal the chaos command sent, else from the failure the engine dated.
        rtos = [
            r["rto_from_kill_s"] if r is signalled.get(fault.index) else r["rto_s"] for r in mine
        ]
        recovered = len(mine) == len(fault.failed_ranks) and all(
            r["state"] == IncidentState.CLOSED for r in mine
        )
        notes = list(action.notes)
        kill = action.kill
        if kill is not None and kill.committed is not None and kill.committed + 1 != fault.step:
            notes.append(f"sent during step {kill.committed + 1}")  # it waited for a spare
        takeover = _takeover_s(log, job_id, action) if action.engine_killed else None
        if takeover is not None:
            notes.append(f"engine takeover {takeover * 1000:.0f} ms")
        if fault.kind in ("engine_kill", "broker_restart") and action.mid_incident_ts is None:
            recovered = False
            notes.append("the mid-incident fault was not sent")
        if fault.kind in IDLE_SPARE_SIGNAL:
            recovered, said, detection, rto = spare_outcome(log, job_id, action)
            notes += said
            rtos = [] if rto is None else [rto]
        detection_steps = digest_steps(log, job_id, fault) if fault.kind in VERIFIED else None
        if fault.kind in NO_INCIDENT:
            found_it, said, detection_steps = nonfinite_outcome(log, job_id, fault)
            recovered = found_it and not mine
            notes += said
        if fault.kind in FORGED:
            rejected, said, detection = forge_outcome(log, job_id, action)
            recovered = rejected and not mine
            notes += said
        if fault.kind in STRAGGLING:
            named, said, detection_steps = rank_straggler_outcome(log, job_id, fault)
            recovered = named and len(mine) <= 1
            recovered = recovered and all(r["state"] == IncidentState.CLOSED for r in mine)
            notes += said
        if fault.kind in SLOWED:
            named, said, detection = straggler_outcome(log, job_id, fault.node, action)
            # degraded: it must be named; a flap may be, or pass unnoticed
            recovered = (named or fault.kind == "flap") and len(mine) <= 1
            recovered = recovered and all(r["state"] == IncidentState.CLOSED for r in mine)
            notes += said if named or fault.kind == "degraded" else []
        if action.network_ts is not None and mine and kill is None:  # from the link's failure
            detection = mine[0]["detected_ts"] - action.network_ts
            rtos = [
                None if r["closed_ts"] is None else r["closed_ts"] - action.network_ts for r in mine
            ]
        # A fault the job never met proves nothing either way: counted apart, not as a miss.
        sent_out = not (
            (fault.kind in IDLE_SPARE_SIGNAL and action.spare is None)
            or (fault.kind in ("engine_kill", "broker_restart") and action.mid_incident_ts is None)
            or (kill is not None and kill.outcome is KillOutcome.MISSED)
            or (fault.kind in NETWORK and action.network_ts is None)
            or (fault.kind in FORGED and action.forged is None)
        )
        rows.append(
            {
                "index": fault.index,
                "kind": fault.kind,
                "where": fault.describe(),
                "incidents": [r["incident_id"] for r in mine],
                "detection_ms": _ms(detection),
                "detection_steps": detection_steps,  # a fault found by a step's values
                "rto_ms": _ms(max(rtos)) if rtos and None not in rtos else None,
                "committed_steps_lost": sum(r["committed_steps_lost"] or 0 for r in mine),
                "sent": sent_out,
                "recovered": recovered,
                "notes": notes,
            }
        )
    joined, _, unplanned = process_history(log, job_id)
    records = record_counts(log, job_id, nproc, steps)
    digests = {r: s.params_sha256 for r, s in final.items()}
    expected = {r: s.params_sha256 for r, s in reference.items()}
    checks = {
        "completed": returncode == 0 and len(final) == nproc,
        "every_fault_sent_recovered": all(r["recovered"] for r in rows if r["sent"]),
        "bitwise_equal_to_reference": len(expected) == nproc and digests == expected,
        "replay_no_divergence": bool(found["replay"]["ok"]),
        "survivor_pids_unchanged": not unplanned and len(joined) == nproc,
        "no_unplanned_incident": not unclaimed,  # no healthy rank taken for a failed one
        "no_process_left": not left,
        "no_committed_step_lost": all(r["committed_steps_lost"] == 0 for r in rows)
        and not any(r["committed_steps_lost"] for r in unclaimed),
        "no_record_duplicated": records["duplicate_record_ids"] == 0
        and records["step_records_duplicated"] == 0,
    }
    return {
        "job_id": job_id,
        "faults": rows,
        "unplanned_incidents": unclaimed,
        "unplanned_pid_changes": unplanned,
        "processes_left": left,
        "records": records,
        "agent_returncode": returncode,
        "params_sha256": digests,
        "reference_params_sha256": expected,
        "replay": found["replay"],
        "checks": checks,
        "sent": sum(r["sent"] for r in rows),
        "recovered": sum(r["recovered"] for r in rows if r["sent"]),
        "ok": all(checks.values()),
    }
