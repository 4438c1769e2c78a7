"""Soak: many faults, in several `flashrecovery chaos` runs, and what recovery cost each kind.

    python -m bench.soak [--faults 100] [--per-run 10] [--seed 0] [--quick]
                         [--external-engine] [--kafka]

Each run is the chaos command as a user runs it (its own seed, a fault-free reference, a seeded
schedule); the verdicts are pooled: recovered % (of the faults sent: one the job never met, an
idle-spare signal with no idle spare ready before the job ended, is counted apart), RTO and
detection p50/p99 per fault kind,
committed steps lost, records stored twice, step records lost or duplicated, and how many runs
completed bitwise equal to their reference with a clean replay and no process left. JSON goes to
bench/results/soak.json, a table to the terminal, RTO per kind to bench/results/soak.png.
``--quick`` (one run of two faults) is what CI can afford. It measures, it asserts nothing.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from rich.console import Console

from bench.lib.results import RESULTS, machine, plt, save_figure, table, write_json
from bench.lib.stats import percentile

REPO = Path(__file__).resolve().parents[1]
RUN_CHECKS = (
    "completed",
    "bitwise_equal_to_reference",
    "replay_no_divergence",
    "survivor_pids_unchanged",
    "no_unplanned_incident",
    "no_process_left",
)


def chaos(
    faults: int, seed: int, run_dir: Path, args: argparse.Namespace, more: tuple[str, ...] = ()
) -> dict[str, Any]:
    """One `flashrecovery chaos` run (with ``more`` of its options); its verdict (or why there
    is none)."""
    command = [
        sys.executable, "-m", "flashrecovery.cli", "chaos",
        "--faults", str(faults), "--seed", str(seed), "--gap", str(args.gap),
        "--min-step-s", str(args.min_step_s), "--run-dir", str(run_dir), "--json",
        *(["--external-engine"] if args.external_engine else []),
        *(["--kafka"] if args.kafka else []),
        *more,
    ]  # fmt: skip
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    started = time.monotonic()
    done = subprocess.run(command, capture_output=True, text=True, env=env, cwd=run_dir.parent)
    seconds = time.monotonic() - started
    try:
        verdict: dict[str, Any] = json.loads(done.stdout)
    except json.JSONDecodeError:
        return {"seed": seed, "seconds": seconds, "error": done.stderr[-2000:]}
    return {"seed": seed, "seconds": seconds, **verdict}


def pool(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """Every fault of every run, per kind and in total."""
    faults = [row for run in runs for row in run.get("faults", [])]
    kinds: dict[str, dict[str, Any]] = {}
    for kind in sorted({row["kind"] for row in faults}):
        rows = [row for row in faults if row["kind"] == kind]
        rtos = [row["rto_ms"] for row in rows if row["rto_ms"] is not None]
        detections = [row["detection_ms"] for row in rows if row["detection_ms"] is not None]
        sent = [row for row in rows if row.get("sent", True)]
        kinds[kind] = {
            "faults": len(rows),
            "sent": len(sent),
            "recovered": sum(row["recovered"] for row in sent),
            "rto_p50_ms": statistics.median(rtos) if rtos else None,
            "rto_p99_ms": percentile(rtos, 0.99) if rtos else None,
            "detection_p50_ms": statistics.median(detections) if detections else None,
            "committed_steps_lost": sum(row["committed_steps_lost"] for row in rows),
        }
    records = [run["records"] for run in runs if "records" in run]
    sent = [row for row in faults if row.get("sent", True)]  # a fault never met proves nothing
    return {
        "faults": len(faults),
        "sent": len(sent),
        "recovered": sum(row["recovered"] for row in sent),
        "recovered_pct": 100.0 * sum(row["recovered"] for row in sent) / max(1, len(sent)),
        "committed_steps_lost": sum(row["committed_steps_lost"] for row in faults),
        "records": sum(r["records"] for r in records),
        "records_stored_twice": sum(r["duplicate_record_ids"] for r in records),
        "step_records_missing": sum(r["step_records_missing"] for r in records),
        "step_records_lost_with_nodes": sum(
            r.get("step_records_lost_with_nodes", 0) for r in records
        ),
        "step_records_reached_by_restore": sum(
            r.get("step_records_reached_by_restore", 0) for r in records
        ),
        "step_records_duplicated": sum(r["step_records_duplicated"] for r in records),
        "runs": len(runs),
        "runs_without_verdict": sum("error" in run for run in runs),
        "runs_passing": {
            check: sum(bool(run.get("checks", {}).get(check)) for run in runs)
            for check in RUN_CHECKS
        },
        "kinds": kinds,
    }


def plot(name: str, kinds: dict[str, dict[str, Any]]) -> Path:
    path = RESULTS / f"{name}.png"
    labels = list(kinds)
    fig, ax = plt.subplots(figsize=(max(6.0, 1.2 * len(labels) + 2), 4.5))
    x = range(len(labels))
    for offset, key in ((-0.2, "rto_p50_ms"), (0.2, "rto_p99_ms")):
        values = [(kinds[k][key] or 0.0) / 1000 for k in labels]
        ax.bar([i + offset for i in x], values, width=0.4, label=key.split("_")[1])
    ax.set_xticks(list(x), labels, rotation=30, ha="right")
    ax.set_ylabel("RTO (s)")
    ax.set_title("RTO per fault kind (fault → every rank committed a new step)")
    ax.legend()
    return save_figure(fig, path)


def _ms(value: float | None) -> str:
    return "-" if value is None else f"{value:.0f}"


def add_arguments(parser: argparse.ArgumentParser, faults: int, per_run: int) -> None:
    """The options a soak of chaos runs takes (the nemesis bench's too)."""
    parser.add_argument("--faults", type=int, default=faults)
    parser.add_argument("--per-run", type=int, default=per_run)
    parser.add_argument("--seed", type=int, default=0, help="the first run's; then +1 per run")
    parser.add_argument("--gap", type=int, default=6)
    parser.add_argument("--min-step-s", type=float, default=0.05)
    parser.add_argument("--external-engine", action="store_true")
    parser.add_argument("--kafka", action="store_true")


def _state(run: dict[str, Any]) -> str:
    """OK, or what failed: the checks, and each fault sent but not recovered."""
    if "error" in run:
        return "no verdict"
    if run["ok"]:
        return "OK"
    failed = [check for check, held in run["checks"].items() if not held]
    missed = [
        f"{row['kind']} ({'; '.join(row['notes']) or 'not recovered'})"
        for row in run["faults"]
        if row["sent"] and not row["recovered"]
    ]
    return f"FAILED: {', '.join(failed + missed)}"


def run_all(
    console: Console, args: argparse.Namespace, more: tuple[str, ...] = ()
) -> list[dict[str, Any]]:
    """``args.faults`` faults in chaos runs of ``args.per_run`` each, seeds counting up."""
    runs = []
    with tempfile.TemporaryDirectory(prefix="soak-") as tmp:
        for index in range(math.ceil(args.faults / args.per_run)):
            faults = min(args.per_run, args.faults - index * args.per_run)
            run = chaos(faults, args.seed + index, Path(tmp) / f"run{index}", args, more)
            runs.append(run)
            took = f"{run['seconds']:.0f} s"
            console.print(f"run {index} (seed {run['seed']}): {_state(run)} in {took}")
    return runs


def show(console: Console, name: str, pooled: dict[str, Any]) -> None:
    """The table per kind, the records and the runs' checks."""
    rows = [
        [
            kind,
            str(k["faults"]),
            str(k["sent"]),
            f"{100.0 * k['recovered'] / max(1, k['sent']):.0f} %",
            _ms(k["detection_p50_ms"]),
            _ms(k["rto_p50_ms"]),
            _ms(k["rto_p99_ms"]),
            str(k["committed_steps_lost"]),
        ]
        for kind, k in pooled["kinds"].items()
    ]
    rows.append(
        [
            "all",
            str(pooled["faults"]),
            str(pooled["sent"]),
            f"{pooled['recovered_pct']:.0f} %",
            "",
            "",
            "",
            str(pooled["committed_steps_lost"]),
        ]
    )
    columns = ["kind", "faults", "sent", "recovered", "detect p50 ms", "RTO p50 ms", "RTO p99 ms"]
    console.print(table(name, [*columns, "steps lost"], rows))
    console.print(
        f"records {pooled['records']}: stored twice {pooled['records_stored_twice']}, "
        f"step records missing {pooled['step_records_missing']} "
        f"(and {pooled['step_records_lost_with_nodes']} a lost node took with it, "
        f"{pooled['step_records_reached_by_restore']} reached by a restore), "
        f"duplicated {pooled['step_records_duplicated']}"
    )
    passing = ", ".join(f"{k.replace('_', ' ')} {v}" for k, v in pooled["runs_passing"].items())
    console.print(f"runs {pooled['runs']}: {passing}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_arguments(parser, faults=100, per_run=10)
    parser.add_argument("--quick", action="store_true", help="one run of two faults")
    args = parser.parse_args()
    if args.quick:
        args.faults, args.per_run = 2, 2
    console = Console()
    runs = run_all(console, args)
    pooled = pool(runs)
    data = {"machine": machine(), "args": vars(args), "pooled": pooled, "runs": runs}
    json_path = write_json("soak", data)
    show(console, "soak", pooled)
    console.print(f"wrote {json_path} and {plot('soak', pooled['kinds'])}")


if __name__ == "__main__":
    main()
