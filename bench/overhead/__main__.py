"""`python -m bench.overhead`: the command line (the package's docstring says what it measures)."""

from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path
from typing import Any

import torch
from rich.console import Console
from rich.markup import escape

import bench.overhead
from bench.lib.results import machine
from bench.overhead.rank import MODELS, SHARDED
from bench.overhead.report import report, report_pooled
from bench.overhead.sides import PHASE_SKIP, SIDES, WARMUP, run, take_turns
from bench.overhead.summary import pool, resummarize, summarize, summarize_turns


def main() -> None:
    parser = argparse.ArgumentParser(description=(bench.overhead.__doc__ or "").splitlines()[0])
    parser.add_argument("--models", nargs="+", choices=MODELS, default=list(MODELS))
    parser.add_argument("--worlds", type=int, nargs="+", default=[2, 4], help="ranks per run")
    parser.add_argument("--sides", nargs="+", choices=list(SIDES), default=list(SIDES))
    parser.add_argument("--steps", type=int, default=60, help="steps per run")
    parser.add_argument(
        "--repeats", type=int, default=5, help="runs of each side (5 or more decide the goal)"
    )
    parser.add_argument("--timeout", type=float, default=300.0, help="seconds per run at most")
    parser.add_argument(
        "--phases",
        type=int,
        default=0,
        help="take turns instead (turns.py): each hook side and its baseline run at once, "
        "PHASES phases each of --phase-steps steps",
    )
    parser.add_argument("--phase-steps", type=int, default=30, help="steps per phase")
    parser.add_argument("--quick", action="store_true", help="CI: the MLP, 2 ranks, one run")
    parser.add_argument(
        "--render",
        type=Path,
        nargs="+",
        metavar="JSON",
        help="summarize the runs of an earlier JSON again; given several, pool each cell's "
        "pairs over all of them",
    )
    args = parser.parse_args()
    console = Console(width=170)  # the table is wide; CI logs are not a terminal
    if args.render:
        earlier = [resummarize(json.loads(path.read_text())) for path in args.render]
        if len(earlier) == 1:
            report(console, earlier[0])
        else:
            report_pooled(console, args.render, pool(earlier))
        return
    if args.quick:
        args.models, args.worlds, args.steps, args.repeats = ["mlp"], [2], WARMUP + 7, 1
        args.phase_steps = PHASE_SKIP + 3
    sharded = {name for name, side in SIDES.items() if side.parallel in SHARDED} & set(args.sides)
    if sharded and any(w % 2 for w in args.worlds):
        parser.error(f"{', '.join(sorted(sharded))}: replicas of 2 ranks, give even --worlds")
    torch.set_num_threads(1)
    results = []
    with tempfile.TemporaryDirectory(prefix="flashrecovery-overhead-") as tmp:
        for model in args.models:
            for world in args.worlds:
                if args.phases:
                    for name in args.sides:
                        if SIDES[name].baseline is None:
                            continue
                        console.print(
                            f"{model}, {world} ranks: {name} and {SIDES[name].baseline} taking "
                            f"{args.phases} turns of {args.phase_steps} steps"
                        )
                        result = take_turns(
                            name,
                            model,
                            world,
                            args.phases,
                            args.phase_steps,
                            Path(tmp),
                            args.timeout,
                        )
                        result["sides"] = summarize_turns(result)
                        results.append(result)
                    continue
                console.print(f"{model}, {world} ranks: {args.repeats} x {', '.join(args.sides)}")
                runs: list[dict[str, Any]] = []
                failed: list[dict[str, Any]] = []
                for repeat in range(args.repeats):  # rotate, so a busy spell hits every side
                    shift = repeat % len(args.sides)
                    for name in args.sides[shift:] + args.sides[:shift]:
                        out = Path(tmp) / f"{model}-{world}-{name}-{repeat}"
                        try:
                            runs.append(
                                run(name, model, world, args.steps, out, args.timeout, repeat)
                            )
                        except (RuntimeError, TimeoutError) as exc:  # say so, measure the rest
                            why = escape(str(exc))
                            console.print(f"[red]{name} run {repeat} failed:[/red] {why}")
                            failed.append({"side": name, "repeat": repeat, "error": str(exc)})
                runs.sort(key=lambda r: args.sides.index(r["side"]))  # stable: repeat order
                results.append(
                    {
                        "model": model,
                        "world_size": world,
                        "sides": summarize(runs),
                        "runs": runs,
                        "failed_runs": failed,
                    }
                )
    settings = {
        "phases": args.phases,
        "phase_steps": args.phase_steps,
        "steps": args.steps,
        "warmup_steps": WARMUP,
        "repeats": args.repeats,
        "quick": args.quick,
    }
    report(console, {"machine": machine(), "settings": settings, "results": results})


if __name__ == "__main__":
    main()
