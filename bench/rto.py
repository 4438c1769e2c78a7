"""Recovery time of a SIGKILLed rank, with a hot spare and with a freshly spawned replacement.

    python bench/rto.py [--worlds 2 4] [--kills 5] [--quick]

For each world size and mode, one job of the demo's model runs under `flashrecovery run` while a
seeded random rank is SIGKILLed from outside, ``--kills`` times, each once the job runs again
(and, with a spare, once the refilled spare is ready). RTO is the time from the SIGKILL to every
rank having committed a new step (the engine's IncidentClosed); the phases come from the incident
machine. Medians go to bench/results/rto.json, a table and bench/results/rto.png. It measures,
it asserts nothing.
"""

from __future__ import annotations

import argparse
import random
import statistics
import tempfile
from collections import Counter
from pathlib import Path
from typing import Any

from harness import job_spec, machine, stacked_bars, table, write_json
from rich.console import Console

from flashrecovery.connectors import open_log
from flashrecovery.demo.job import LaunchedJob
from flashrecovery.demo.summary import incidents
from flashrecovery.demo.watch import JobWatch, Kill, Killer, follow
from flashrecovery.statemachines.incident import PHASES

MODES = {"hot spare": 1, "fresh spawn": 0}
GAP_STEPS = 3  # steps of normal training between a recovery and the next kill
SPARE_WAIT_S = 90.0  # a refilled spare starts python and torch on busy cores
STEPS = 1_000_000  # never reached: the bench ends the job once it has its kills
SEGMENTS = ["detection", *PHASES[1:]]  # the engine's "detected" phase is the exit record itself


def measure(world: int, mode: str, kills: int, seed: int, tmp: Path, timeout: float) -> list[Any]:
    """Kill ``kills`` ranks of one job, one at a time; the closed incidents' rows."""
    spec = job_spec(f"rto-{world}-{MODES[mode]}", tmp, nproc=world, spares=MODES[mode], steps=STEPS)
    rng = random.Random(seed)
    with open_log(spec.log_url) as log:
        with LaunchedJob(spec) as job:
            watch = JobWatch(log, spec.job_id)
            killer = Killer(job, spare_wait_s=SPARE_WAIT_S)

            def plan_next(_: Kill | None) -> None:
                if watch.running and not killer.pending and len(killer.plan) < kills:
                    killer.plan.append(Kill(rng.randrange(world), watch.committed() + GAP_STEPS))

            follow(
                job, watch, killer, timeout, plan_next, until=lambda: watch.incidents[1] >= kills
            )
        rows = incidents(log, spec.job_id, killer.plan)["incidents"]
    return [r for r in rows if r["state"] == "closed" and r["rto_from_kill_s"] is not None]


def segments(row: dict[str, Any]) -> dict[str, float]:
    return {"detection": row["detection_s"], **{p: row["phases_s"].get(p, 0.0) for p in PHASES[1:]}}


def aggregate(world: int, mode: str, rows: list[dict[str, Any]]) -> dict[str, Any]:
    def median(values: list[float]) -> float | None:
        return statistics.median(values) if values else None

    parts = [segments(r) for r in rows]
    return {
        "world_size": world,
        "mode": mode,
        "kills_measured": len(rows),
        "replacements": dict(Counter(str(r["replacement"]) for r in rows)),
        "median_rto_from_kill_s": median([r["rto_from_kill_s"] for r in rows]),
        "median_rto_engine_s": median([r["rto_s"] for r in rows]),
        "median_segments_s": {s: median([p[s] for p in parts]) for s in SEGMENTS},
        "incidents": rows,
    }


def _ms(seconds: float | None) -> str:
    return "-" if seconds is None else f"{seconds * 1000:.0f}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--worlds", type=int, nargs="+", default=[2, 4], help="ranks per job")
    parser.add_argument("--kills", type=int, default=5, help="kills per job (median over them)")
    parser.add_argument("--seed", type=int, default=0, help="which ranks are killed")
    parser.add_argument("--timeout", type=float, default=240.0, help="seconds per job at most")
    parser.add_argument("--quick", action="store_true", help="2 ranks, 2 kills per mode")
    args = parser.parse_args()
    if args.quick:
        args.worlds, args.kills = [2], 2
    console = Console()
    configs = []
    with tempfile.TemporaryDirectory(prefix="flashrecovery-rto-") as tmp:
        for world in args.worlds:
            for mode in MODES:
                console.print(f"{world} ranks, {mode}: {args.kills} kills …")
                rows = measure(world, mode, args.kills, args.seed, Path(tmp), args.timeout)
                configs.append(aggregate(world, mode, rows))
    settings = {"kills": args.kills, "gap_steps": GAP_STEPS, "seed": args.seed}
    path = write_json("rto", {"machine": machine(), "settings": settings, "configs": configs})

    console.print(
        table(
            f"RTO, median ms over {args.kills} kills (SIGKILL → every rank committed a new step)",
            ["", *(f"{c['world_size']} ranks, {c['mode']}" for c in configs)],
            [
                ["kills measured", *(str(c["kills_measured"]) for c in configs)],
                ["RTO from the SIGKILL", *(_ms(c["median_rto_from_kill_s"]) for c in configs)],
                ["RTO (engine)", *(_ms(c["median_rto_engine_s"]) for c in configs)],
                *([f"  {s}", *(_ms(c["median_segments_s"][s]) for c in configs)] for s in SEGMENTS),
            ],
        )
    )
    plot = stacked_bars(
        "rto",
        "recovery time by phase (medians)",
        "ms",
        [f"{c['world_size']} ranks\n{c['mode']}" for c in configs],
        {s: [(c["median_segments_s"][s] or 0.0) * 1000 for c in configs] for s in SEGMENTS},
    )
    console.print(f"written {path} and {plot}")


if __name__ == "__main__":
    main()
