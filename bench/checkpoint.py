"""What checkpoints cost a step, and how long a checkpoint fallback takes (pure FSDP).

    python -m bench.checkpoint [--rounds 3] [--steps 40] [--every 4] [--kills 3] [--quick]

Cost: the demo's GPT sharded with FSDP2 over 2 ranks (``--parallel fsdp``, no replica) runs
``--steps`` steps with checkpoints every ``--every`` steps and without, the two alternating
round by round (interleaved, so the machine's load falls on both alike). A step's time is its
``StepCompleted.duration_s`` (from the step's start to its commit, so a checkpoint's staged
copy on the step path counts; its write runs in the background); the first steps (start-up)
are left out. Fallback: a rank of the same job with a hot spare is SIGKILLed ``--kills``
times; with no replica the engine falls back to the latest complete checkpoint; RTO (kill ->
every rank committed a new step), its phases and the committed steps lost (RPO) come from the
engine's records. Results go to bench/results/checkpoint.json, a table and
bench/results/checkpoint.png. It measures, it asserts nothing.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import statistics
import tempfile
from pathlib import Path
from typing import Any

from rich.console import Console

from bench.lib.launch import job_spec
from bench.lib.results import machine, stacked_bars, table, write_json
from flashrecovery.connectors import open_log
from flashrecovery.demo.job import JobSpec, LaunchedJob
from flashrecovery.demo.summary import incidents
from flashrecovery.demo.watch import JobWatch, Kill, Killer, follow
from flashrecovery.records import CheckpointSaved, StepCompleted, Stream
from flashrecovery.statemachines.incident import PHASES

WORLD = 2
WARMUP_STEPS = 3  # start-up steps left out of the step times
GAP_STEPS = 3  # steps of training between a recovery and the next kill
SEGMENTS = ["detection", *PHASES[1:]]


def fsdp_spec(name: str, tmp: Path, steps: int, spares: int, every: int) -> JobSpec:
    return dataclasses.replace(
        job_spec(name, tmp, nproc=WORLD, spares=spares, steps=steps),
        parallel="fsdp",
        checkpoint_every=every,
    )


def step_times(spec: JobSpec, timeout: float) -> dict[str, Any]:
    """Run the job to its end; its step times (every rank) and the checkpoints it completed."""
    with LaunchedJob(spec) as job:
        code = job.wait(timeout)
    with open_log(spec.log_url) as log:
        records = [e.record for e in log.read(Stream.EVENTS, spec.job_id)]
    steps = [
        r.duration_s for r in records if isinstance(r, StepCompleted) and r.step >= WARMUP_STEPS
    ]
    return {
        "exit_code": code,
        "step_s": steps,
        "checkpoints": sum(isinstance(r, CheckpointSaved) for r in records),
    }


def cost(rounds: int, steps: int, every: int, tmp: Path, timeout: float) -> dict[str, Any]:
    runs: dict[str, list[dict[str, Any]]] = {"without": [], "with": []}
    for i in range(rounds):
        order = ["without", "with"] if i % 2 == 0 else ["with", "without"]
        for mode in order:
            spec = fsdp_spec(f"cost-{mode}-{i}", tmp, steps, 0, every if mode == "with" else 0)
            runs[mode].append(step_times(spec, timeout))
    out: dict[str, Any] = {"every": every, "steps": steps, "rounds": rounds}
    for mode, done in runs.items():
        samples = [s for run in done for s in run["step_s"]]
        medians = [statistics.median(run["step_s"]) for run in done if run["step_s"]]
        out[mode] = {
            "median_step_ms": round(statistics.median(samples) * 1000, 3) if samples else None,
            "mean_step_ms": round(statistics.mean(samples) * 1000, 3) if samples else None,
            "round_medians_ms": [round(m * 1000, 3) for m in medians],
            "checkpoints": [run["checkpoints"] for run in done],
            "exit_codes": [run["exit_code"] for run in done],
        }
    if out["with"]["mean_step_ms"] and out["without"]["mean_step_ms"]:
        out["mean_cost_ratio"] = round(
            out["with"]["mean_step_ms"] / out["without"]["mean_step_ms"], 4
        )
    return out


def fallback(kills: int, every: int, tmp: Path, timeout: float) -> list[dict[str, Any]]:
    """Kill a rank ``kills`` times, each after a checkpoint and a few steps; the incidents."""
    spec = fsdp_spec("fallback", tmp, 1_000_000, 1, every)
    with open_log(spec.log_url) as log:
        with LaunchedJob(spec) as job:
            watch = JobWatch(log, spec.job_id)
            killer = Killer(job, spare_wait_s=90.0)

            def plan_next(_: Kill | None) -> None:
                if watch.running and not killer.pending and len(killer.plan) < kills:
                    step = max(every, watch.committed()) + GAP_STEPS  # a checkpoint is complete
                    killer.plan.append(Kill(len(killer.plan) % WORLD, step))

            follow(
                job, watch, killer, timeout, plan_next, until=lambda: watch.incidents[1] >= kills
            )
        rows = incidents(log, spec.job_id, killer.plan)["incidents"]
    return [r for r in rows if r["state"] == "closed" and r["rto_from_kill_s"] is not None]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--every", type=int, default=4)
    parser.add_argument("--kills", type=int, default=3)
    parser.add_argument("--timeout", type=float, default=300.0)
    parser.add_argument("--quick", action="store_true", help="1 round of 8 steps, 1 kill")
    args = parser.parse_args()
    if args.quick:
        args.rounds, args.steps, args.kills = 1, 8, 1
    console = Console()
    load_before = os.getloadavg()
    with tempfile.TemporaryDirectory(prefix="flashrecovery-checkpoint-") as tmp:
        measured = cost(args.rounds, args.steps, args.every, Path(tmp), args.timeout)
        closed = fallback(args.kills, args.every, Path(tmp), args.timeout)
    data: dict[str, Any] = {
        "machine": {**machine(), "loadavg_before": load_before},
        "world": WORLD,
        "cost": measured,
        "fallback": {
            "incidents": closed,
            "median_rto_s": statistics.median(r["rto_from_kill_s"] for r in closed)
            if closed
            else None,
            "median_rpo_steps": statistics.median(r["committed_steps_lost"] for r in closed)
            if closed
            else None,
        },
    }
    path = write_json("checkpoint", data)
    load = data["machine"]["loadavg_1_5_15m"]
    rows = [
        [mode, str(measured[mode]["median_step_ms"]), str(measured[mode]["mean_step_ms"])]
        for mode in ("without", "with")
    ]
    console.print(
        table(
            f"step time, FSDP over {WORLD} ranks, checkpoint every {args.every} steps "
            f"(load {load[0]:.1f})",
            ["checkpoints", "median ms", "mean ms"],
            rows,
        )
    )
    console.print(
        table(
            "checkpoint fallback (a rank SIGKILLed, no replica)",
            ["kill", "RTO ms", "RPO steps", "resume after"],
            [
                [
                    r["failed"],
                    f"{r['rto_from_kill_s'] * 1000:.0f}",
                    str(r["committed_steps_lost"]),
                    str(r["resume_step"]),
                ]
                for r in closed
            ],
        )
    )
    plot = stacked_bars(
        "checkpoint",
        f"checkpoint fallback RTO by phase, FSDP {WORLD} ranks (load {load[0]:.1f})",
        "ms",
        [f"kill {i + 1}: RPO {r['committed_steps_lost']}" for i, r in enumerate(closed)],
        {
            segment: [
                1000
                * (r["detection_s"] if segment == "detection" else r["phases_s"].get(segment, 0.0))
                for r in closed
            ]
            for segment in SEGMENTS
        },
    )
    console.print(f"results: {path}, {plot}")


if __name__ == "__main__":
    main()
