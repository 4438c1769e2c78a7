"""Each side summarized, each hook side against its baseline: the paired overheads, their
median, its distribution-free interval and the verdict on the 5 % goal; several runs pooled."""

from __future__ import annotations

import os
import statistics
from typing import Any

from bench.lib.stats import median_interval, median_ms
from bench.overhead.sides import PARTS, SIDES, WARMUP

GOAL_PCT = 5.0  # the step time the hook may add (issue: "a step path as fast as DDP")
CONFIDENCE = 0.9  # how surely the interval of the overhead's median must hold it


def summarize(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """Each side over its runs, and each hook side against its baseline, repeat by repeat."""
    by_side: dict[str, list[dict[str, Any]]] = {}
    for r in runs:
        by_side.setdefault(r["side"], []).append(r)
    sides: dict[str, Any] = {}
    for name, side_runs in by_side.items():
        steps = [t for r in side_runs for t in r["step_ms"]]
        deciles = statistics.quantiles(steps, n=10)
        sides[name] = {
            "median_ms": statistics.median(steps),
            "p10_ms": deciles[0],
            "p90_ms": deciles[-1],
            "run_medians_ms": [r["median_ms"] for r in side_runs],
            "parts_ms": {
                part: statistics.median(r["parts_ms"][part] for r in side_runs)
                for part in side_runs[0]["parts_ms"]
            },
        }
        base_by_repeat = {r["repeat"]: r for r in by_side.get(SIDES[name].baseline or "", [])}
        pairs = [
            (r, base_by_repeat[r["repeat"]]) for r in side_runs if r["repeat"] in base_by_repeat
        ]
        if pairs:
            baseline = pairs[0][1]["side"]
            per_repeat = [100 * (a["median_ms"] / b["median_ms"] - 1) for a, b in pairs]
            low, high, coverage = median_interval(per_repeat, CONFIDENCE)
            sides[name]["baseline"] = baseline
            sides[name]["overhead_pct"] = statistics.median(per_repeat)  # paired, repeat by repeat
            sides[name]["overhead_pct_per_repeat"] = per_repeat
            sides[name]["overhead_pct_interval"] = {
                "low": low,
                "high": high,
                "coverage": coverage,
            }
            sides[name]["within_goal"] = verdict(low, high, coverage)
            base_cpu = statistics.median(r["parts_ms"]["job_cpu"] for r in by_side[baseline])
            sides[name]["job_cpu_overhead_pct"] = 100 * (
                sides[name]["parts_ms"]["job_cpu"] / base_cpu - 1
            )
            sides[name]["bitwise_equal_to_baseline"] = all(
                a["params_sha256"] == b["params_sha256"] for a, b in pairs
            )
    return sides


def summarize_turns(result: dict[str, Any]) -> dict[str, Any]:
    """Both sides of a ``take_turns`` run, and the hook side against its baseline phase by
    phase (each pair of neighbouring phases is a paired overhead). The waiting job's CPU is
    charged against the hook: what the waiting hook job takes beyond what the waiting baseline
    takes, as a share of the machine's cores, is added to every paired overhead (the most it
    could have slowed the baseline's phases), so the verdict errs against the hook."""
    every, skip = result["turns"]["steps_per_phase"], result["turns"]["skipped_per_phase"]
    base_name, hook_name = list(result["ranks"])
    sides: dict[str, Any] = {}
    phase_ms: dict[str, dict[int, float]] = {}
    for name, ranks in result["ranks"].items():
        phases = [p for p in result["phases"] if p["side"] == name]
        by_phase: dict[int, list[dict[str, float]]] = {}
        for r in ranks:
            for i, step in enumerate(r["step"]):
                phase, offset = divmod(step - WARMUP, every)
                if step >= WARMUP and offset >= skip and phase < result["turns"]["phases"]:
                    by_phase.setdefault(phase, []).append({p: r[p][i] for p in PARTS})
        phase_ms[name] = {k: median_ms([s["total"] for s in v]) for k, v in by_phase.items()}
        steps = [s for v in by_phase.values() for s in v]
        totals = [1000 * s["total"] for s in steps]
        deciles = statistics.quantiles(totals, n=10)
        parts = {part: median_ms([s[part] for s in steps]) for part in PARTS[1:]}
        parts["job_cpu"] = statistics.median(1000 * p["job_cpu_s"] / every for p in phases)
        parts["agent_cpu"] = statistics.median(1000 * p["agent_cpu_s"] / every for p in phases)
        sides[name] = {
            "median_ms": statistics.median(totals),
            "p10_ms": deciles[0],
            "p90_ms": deciles[-1],
            "run_medians_ms": list(phase_ms[name].values()),
            "parts_ms": parts,
            "waiting_cpu_ms_per_s": statistics.median(
                1000 * p["waiting_cpu_s"] / p["seconds"]
                for p in result["phases"]
                if p["side"] != name
            ),
        }
    pairs = sorted(set(phase_ms[hook_name]) & set(phase_ms[base_name]))
    cores = os.cpu_count() or 1
    excess = sides[hook_name]["waiting_cpu_ms_per_s"] - sides[base_name]["waiting_cpu_ms_per_s"]
    charge = max(excess / (10 * cores), 0.0)  # ms/s over the cores' 1000 ms/s each, in percent
    per_pair = [100 * (phase_ms[hook_name][k] / phase_ms[base_name][k] - 1) + charge for k in pairs]
    low, high, coverage = median_interval(per_pair, CONFIDENCE)
    hook, base = sides[hook_name], sides[base_name]
    hook.update(
        {
            "baseline": base_name,
            "overhead_pct": statistics.median(per_pair),
            "overhead_pct_per_repeat": per_pair,
            "overhead_pct_interval": {"low": low, "high": high, "coverage": coverage},
            "waiting_bias_pct": charge,
            "within_goal": verdict(low, high, coverage),
            "job_cpu_overhead_pct": 100
            * (hook["parts_ms"]["job_cpu"] / base["parts_ms"]["job_cpu"] - 1),
            "bitwise_equal_to_baseline": result["ranks"][hook_name][0]["params_sha256"]
            == result["ranks"][base_name][0]["params_sha256"],
        }
    )
    return sides


def verdict(low: float, high: float, coverage: float) -> str:
    """Whether a run decides the goal: every plausible median within it, none, or neither (and
    with fewer than 5 repeats it cannot say)."""
    if coverage < CONFIDENCE:
        return "too few repeats"
    if high <= GOAL_PCT:
        return "yes"
    if low > GOAL_PCT:
        return "no"
    return "undecided"


def resummarize(data: dict[str, Any]) -> dict[str, Any]:
    """An earlier JSON's results, summarized again by this version of the bench."""
    for result in data["results"]:
        if "phases" in result:
            result["sides"] = summarize_turns(result)
        else:
            result["sides"] = summarize(result["runs"])
    return data


def pool(runs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Each cell's paired overheads over several runs (of the same code: the caller's word) as
    one sample, so that runs too short to decide a cell alone can decide it together. Every
    pair of every run counts, each with its own run's waiting charge; the pairs are independent
    but meet different machines from run to run, so the interval is that of the median of the
    runs' mixture. Cells keep the order they first appear in."""
    cells: dict[tuple[str, int, str], dict[str, Any]] = {}
    for data in runs:
        for result in data["results"]:
            for name, side in result["sides"].items():
                if "overhead_pct_per_repeat" not in side:
                    continue  # a baseline
                key = (result["model"], result["world_size"], name)
                cell = cells.setdefault(
                    key,
                    {"model": key[0], "world_size": key[1], "side": name, "runs": 0, "pairs": []},
                )
                cell["runs"] += 1
                cell["pairs"] += side["overhead_pct_per_repeat"]
    for cell in cells.values():
        low, high, coverage = median_interval(cell["pairs"], CONFIDENCE)
        cell["overhead_pct"] = statistics.median(cell["pairs"])
        cell["overhead_pct_interval"] = {"low": low, "high": high, "coverage": coverage}
        cell["within_goal"] = verdict(low, high, coverage)
    return list(cells.values())
