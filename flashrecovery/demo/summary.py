"""What a demo run proves, computed after the fact from the log, the ranks' result files and
the kills the demo sent: detection time, RTO and its phases, steps lost and recomputed, whether
survivors kept their processes, whether the loss curve is continuous, whether the replay
reproduces every decision, and (with a reference run) whether the parameters are bitwise equal.
It also draws the run's timeline (replay/plot.py) next to the log.
"""

from __future__ import annotations

import shlex
import statistics
from dataclasses import asdict
from typing import Any

from flashrecovery.connectors.base import LogConnector
from flashrecovery.demo.job import JobSpec
from flashrecovery.demo.results import read_results
from flashrecovery.demo.watch import Kill, KillOutcome
from flashrecovery.records import (
    AssignSpare,
    IncidentClosed,
    IsolateNode,
    RankJoined,
    RankRegrouped,
    RegroupPlanned,
    ResumePlanned,
    SpawnReplacement,
    StepCompleted,
    Stream,
)
from flashrecovery.replay.plot import plot_job
from flashrecovery.replay.replayer import replay_job
from flashrecovery.statemachines.incident import IncidentState

SPARK = "▁▂▃▄▅▆▇█"
StepLosses = dict[int, list[tuple[int, float | None]]]  # rank -> committed (step, loss), in order


def step_losses(log: LogConnector, job_id: str) -> StepLosses:
    """Each rank id's committed steps in log order, across every process that held it."""
    out: StepLosses = {}
    for entry in log.read(Stream.EVENTS, job_id):
        if isinstance(entry.record, StepCompleted):
            out.setdefault(entry.record.rank, []).append((entry.record.step, entry.record.loss))
    return out


def lost_with_nodes(log: LogConnector, job_id: str) -> dict[int, set[int]]:
    """Step records a lost node may have taken with it: its agent writes its ranks' records
    in batches, so the newest steps a rank committed and handed over, not yet written when the
    node died, are not in the log (docs/multinode.md). Per rank of a lost node: the steps after
    its last record up to the highest step committed in the generation it was lost in (a step
    commits only once every member voted, the lost ones too; its survivors may record it after
    the loss was found, so the records' times cannot tell)."""
    steps = [
        e.record for e in log.read(Stream.EVENTS, job_id) if isinstance(e.record, StepCompleted)
    ]
    out: dict[int, set[int]] = {}
    for entry in log.read(Stream.DECISIONS, job_id):
        if not isinstance(loss := entry.record, IsolateNode):
            continue
        voted = [r for r in steps if r.generation <= loss.generation]  # the lost ranks too
        top = max((r.step for r in voted), default=-1)
        for rank in loss.ranks:
            last = max((r.step for r in voted if r.rank == rank), default=-1)
            out.setdefault(rank, set()).update(range(last + 1, top + 1))
    return out


def reached_by_restore(log: LogConnector, job_id: str) -> dict[int, set[int]]:
    """The step a restore brought each recipient to (its plan's resume step). A rank whose
    process died once the step's vote had committed, before it handed the step's record over,
    has no record of it from anyone: the step is the job's (every other member recorded it),
    and its replacement holds it from its donors, not from computing it."""
    out: dict[int, set[int]] = {}
    for entry in log.read(Stream.DECISIONS, job_id):
        if isinstance(plan := entry.record, ResumePlanned) and plan.resume_step >= 0:
            for rank in plan.recipients:
                out.setdefault(rank, set()).add(plan.resume_step)
    return out


def loss_curve(
    per_rank: StepLosses,
    world_size: int,
    steps: int,
    rolled_back: frozenset[int] = frozenset(),
    lost: dict[int, set[int]] | None = None,
    restored: dict[int, set[int]] | None = None,
) -> dict[str, Any]:
    """Continuous means every rank committed every step exactly once (twice for a step a
    checkpoint fallback rolled back): no gap but the records a lost node took with it
    (``lost``) and a recipient's resume step its dead process did not record (``restored``),
    each reported apart, no duplicate. The curve is the mean over ranks of each step's loss
    (the last commit of a step)."""
    gaps: dict[int, list[int]] = {}
    with_nodes: dict[int, list[int]] = {}
    by_restore: dict[int, list[int]] = {}
    duplicates: dict[int, list[int]] = {}
    for rank in range(world_size):
        seen = [step for step, _ in per_rank.get(rank, [])]
        absent = set(range(steps)) - set(seen)
        if taken := sorted(absent & (lost or {}).get(rank, set())):
            with_nodes[rank] = taken
            absent -= set(taken)
        if held := sorted(absent & (restored or {}).get(rank, set())):
            by_restore[rank] = held
            absent -= set(held)
        if missing := sorted(absent):
            gaps[rank] = missing
        allowed = {s: 2 if s in rolled_back else 1 for s in seen}
        if repeated := sorted({s for s in seen if seen.count(s) > allowed[s]}):
            duplicates[rank] = repeated
    by_step: dict[int, list[float]] = {}
    for committed in per_rank.values():
        last = {step: loss for step, loss in committed}  # a rolled-back step: its recomputation
        for step, loss in last.items():
            if loss is not None:
                by_step.setdefault(step, []).append(loss)
    mean = [round(statistics.fmean(by_step[s]), 6) for s in sorted(by_step)]
    return {
        "continuous": not gaps and not duplicates,
        "gaps": gaps,
        "lost_with_nodes": with_nodes,
        "reached_by_restore": by_restore,
        "duplicates": duplicates,
        "mean_loss": mean,
        "sparkline": sparkline(mean),
    }


def sparkline(values: list[float]) -> str:
    if not values:
        return ""
    low, high = min(values), max(values)
    span = (high - low) or 1.0
    return "".join(SPARK[round((v - low) / span * (len(SPARK) - 1))] for v in values)


def process_history(
    log: LogConnector, job_id: str
) -> tuple[dict[int, int], dict[int, int], list[str]]:
    """Which process held each rank: at launch, at the end, and every change the protocol did
    not plan. A member of a new generation must regroup in the same process unless the engine
    named its rank as replaced; anything else is a healthy rank that restarted."""
    replaced = {
        e.record.generation: set(e.record.replaced)
        for e in log.read(Stream.DECISIONS, job_id)
        if isinstance(e.record, RegroupPlanned)
    }
    joined: dict[int, int] = {}
    holder: dict[int, int] = {}
    unplanned: list[str] = []
    for entry in log.read(Stream.EVENTS, job_id):
        record = entry.record
        if isinstance(record, RankJoined):
            joined[record.rank] = holder[record.rank] = record.pid
        elif isinstance(record, RankRegrouped):
            planned = record.rank in replaced.get(record.generation, set())
            if not planned and holder.get(record.rank) != record.pid:
                unplanned.append(
                    f"rank {record.rank}: pid {holder.get(record.rank)} -> {record.pid} "
                    f"in generation {record.generation}"
                )
            holder[record.rank] = record.pid
    return joined, holder, unplanned


def _replacements(log: LogConnector, job_id: str, nodes: int) -> dict[str, str]:
    """incident id -> how its rank(s) were replaced."""
    out: dict[str, list[str]] = {}
    for entry in log.read(Stream.DECISIONS, job_id):
        record = entry.record
        if isinstance(record, AssignSpare) and record.incident_id:
            how = f"hot spare {record.spare_id}" + (f" (node {record.node})" if nodes > 1 else "")
            out.setdefault(record.incident_id, []).append(how)
        elif isinstance(record, SpawnReplacement) and record.incident_id:
            out.setdefault(record.incident_id, []).append("fresh process")
    return {incident: ", ".join(ways) for incident, ways in out.items()}


def incidents(log: LogConnector, job_id: str, kills: list[Kill], nodes: int = 1) -> dict[str, Any]:
    """Each incident with its timings, matched in order to the kill that caused it, and the
    replay verdict."""
    report = replay_job(log, job_id)
    closures = {d.incident_id: d for d in report.recorded_closures if isinstance(d, IncidentClosed)}
    replaced = _replacements(log, job_id, nodes)
    unmatched = [k for k in kills if k.outcome is KillOutcome.KILLED]
    rows = []
    for incident, row in zip(report.state.incidents, report.incidents(), strict=True):
        kill = next(
            (
                k
                for k in unmatched
                if (
                    k.rank == incident.failed_rank
                    if k.node is None
                    else k.node == incident.failed_node
                )
                and (k.ts or 0.0) <= incident.detected.ts
            ),
            None,
        )  # the first kill of that rank (or node) sent before the incident was detected
        if kill is not None:
            unmatched.remove(kill)
        close = closures.get(incident.incident_id)
        kill_ts = kill.ts if kill is not None else None
        rows.append(
            {
                "incident_id": incident.incident_id,
                "generation": incident.generation,  # the one that recovered from it
                "failed_rank": incident.failed_rank,
                "failed_node": incident.failed_node,
                "failed": incident.what_failed,
                "reason": incident.reason,
                "state": row["state"],
                "replacement": replaced.get(incident.incident_id),
                "killed_pid": kill.pid if kill is not None else None,
                "detection_s": _since(kill_ts, incident.detected.ts),
                "detected_ts": incident.detected.ts,
                "closed_ts": close.ts if close else None,
                "rto_s": row["rto_s"],
                "rto_from_kill_s": _since(kill_ts, close.ts if close else None),
                "phases_s": row["phases_s"],
                "resume_step": row["resume_step"],
                "checkpoint_step": row["checkpoint_step"],
                "committed_steps_lost": row["rpo_steps"],
                "steps_recomputed": row["recomputed_steps"],
            }
        )
    data = report.to_json()
    return {
        "incidents": rows,
        "replay": {
            key: data[key]
            for key in (
                "ok",
                "events",
                "decisions_checked",
                "divergence",
                "job_state",
                # what must hold whatever the network did: one engine decides, one generation
                # commits each step, nothing a lost node wrote is believed
                "unleased_deciders",
                "double_commits",
                "believed_from_lost_nodes",
            )
        },
    }


def _since(start: float | None, end: float | None) -> float | None:
    return None if start is None or end is None else round(end - start, 6)


def summarize(
    log: LogConnector,
    spec: JobSpec,
    kills: list[Kill],
    returncode: int | None,
    reference: JobSpec | None = None,
) -> dict[str, Any]:
    """The demo's verdict as plain JSON; ``ok`` is true only when every check holds."""
    found = incidents(log, spec.job_id, kills, spec.nodes)
    results = read_results(spec.run_dir, spec.nproc)
    joined, holder, unplanned = process_history(log, spec.job_id)
    for rank, result in results.items():
        if holder.get(rank) != result.pid:
            unplanned.append(f"rank {rank}: pid {holder.get(rank)} -> {result.pid} at the end")
    pids = {
        rank: {"joined": joined.get(rank), "final": results[rank].pid if rank in results else None}
        for rank in range(spec.nproc)
    }
    per_rank = step_losses(log, spec.job_id)
    lost, restored = lost_with_nodes(log, spec.job_id), reached_by_restore(log, spec.job_id)
    rows = found["incidents"]
    fallbacks = [r for r in rows if r["checkpoint_step"] is not None]
    rolled_back = frozenset(
        step
        for r in fallbacks
        for step in range(r["resume_step"] + 1, r["resume_step"] + 1 + r["committed_steps_lost"])
    )
    summary: dict[str, Any] = {
        "job_id": spec.job_id,
        "log": spec.log_url,
        "run_dir": str(spec.run_dir),
        "world_size": spec.nproc,
        "nodes": spec.nodes,
        "spares": spec.spares,
        "steps": spec.steps,
        "seed": spec.seed,
        "completed": returncode == 0 and len(results) == spec.nproc,
        "agent_returncode": returncode,
        "kills": [asdict(k) for k in kills],
        **found,
        "committed_steps_lost": sum(r["committed_steps_lost"] or 0 for r in rows),
        # what checkpoint fallbacks rolled back (no replica was left): the only loss allowed
        "steps_rolled_back_by_fallbacks": sum(r["committed_steps_lost"] or 0 for r in fallbacks),
        "steps_recomputed": sum(r["steps_recomputed"] or 0 for r in rows),
        "pids": pids,
        "survivor_pids_unchanged": not unplanned and len(joined) == spec.nproc,
        "unplanned_pid_changes": unplanned,
        "loss_curve": loss_curve(per_rank, spec.nproc, spec.steps, rolled_back, lost, restored),
        "timeline": str(plot_job(log, spec.job_id, spec.run_dir / "timeline.png")),
        "verify": None if reference is None else verify(log, spec, reference, per_rank, lost),
        "commands": {
            "events": f"flashrecovery events --log {shlex.quote(spec.log_url)} --job {spec.job_id}",
            "replay": f"flashrecovery replay --log {shlex.quote(spec.log_url)} --job {spec.job_id}",
        },
    }
    summary["ok"] = (
        summary["completed"]
        and found["replay"]["ok"]
        and all(k.outcome is KillOutcome.KILLED for k in kills)
        and len(rows) == len(kills)
        and all(r["state"] == IncidentState.CLOSED for r in rows)
        and summary["committed_steps_lost"] == summary["steps_rolled_back_by_fallbacks"]
        and summary["survivor_pids_unchanged"]
        and summary["loss_curve"]["continuous"]
        and (reference is None or summary["verify"]["bitwise_equal"])
    )
    return summary


def verify(
    log: LogConnector,
    spec: JobSpec,
    reference: JobSpec,
    per_rank: StepLosses,
    lost: dict[int, set[int]] | None = None,
) -> dict[str, Any]:
    """Bitwise comparison with a fault-free run of the same seed: every rank's final
    parameters, and every committed step's loss (but those a lost node took with it)."""
    ours = {r: res.params_sha256 for r, res in read_results(spec.run_dir, spec.nproc).items()}
    theirs = {
        r: res.params_sha256 for r, res in read_results(reference.run_dir, reference.nproc).items()
    }
    ranks_equal = len(ours) == spec.nproc and len(set(ours.values())) == 1
    equal_to_reference = ranks_equal and len(theirs) == reference.nproc and ours == theirs
    ours_losses = _final_losses(per_rank)
    expected = {
        key: loss
        for key, loss in _final_losses(step_losses(log, reference.job_id)).items()
        if key in ours_losses or key[1] not in (lost or {}).get(key[0], set())
    }
    return {
        "reference_job_id": reference.job_id,
        "params_sha256": ours,
        "reference_params_sha256": theirs,
        "ranks_equal": ranks_equal,
        "equal_to_reference": equal_to_reference,
        "losses_equal": ours_losses == expected,
        "bitwise_equal": ranks_equal and equal_to_reference,
    }


def _final_losses(per_rank: StepLosses) -> dict[tuple[int, int], float | None]:
    return {(rank, step): loss for rank, rows in per_rank.items() for step, loss in rows}
