"""Is recovery flat in scale? Real processes up to what the machine holds, a simulated world of
up to 100,000 ranks through the real engine and log, and a projection to the method's 4,800
devices (DESIGN.md §8).

    python -m bench.scale [--worlds 2 4 8 16] [--kills 3] [--sim 1000 10000 100000]
                          [--kafka HOST:PORT] [--name scale] [--compare OLD.json] [--quick]

(a) Real processes: for each world size, one job of a tiny model (examples/train_mlp.py, one
    thread per rank) with a hot spare under `flashrecovery run`; a random rank is SIGKILLed
    ``--kills`` times (bench/rto.py's measure) and each recovery's phases come from the incident
    machine: detection, isolation, replacement, regroup, restore, resume.
(b) Simulated: ranks in nodes of 8 plus a spare node (tests/simworld.py's SimulatedNodes), every
    agent writing one node heartbeat per default interval, through the real engine (EngineLoop,
    driven in this thread on the simulated clock, polling as often as the service does) and the
    real log (embedded; Kafka too with ``--kafka`` or FLASHRECOVERY_TEST_BROKER). One node goes
    silent. Per world size: the engine CPU per second of records (above 1 it falls behind), the
    records per second the log takes, and the latency from the detector's finding to the
    decisions being in the log.
(c) A projection to 4,800 devices from each phase's growth, next to the method's 150 s.

``--compare`` prints the real phases of an earlier run (e.g. before a change) next to this one.
Writes bench/results/<name>.json and <name>_real.png, <name>_sim.png, <name>_projection.png. It
measures, it asserts nothing; the load average is recorded beside every figure.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import tempfile
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from matplotlib import pyplot as plt  # harness chose the Agg backend
from rich.console import Console

from bench import rto
from bench.lib.results import RESULTS, machine, ms, save_figure, stacked_bars, table, write_json
from flashrecovery.connectors import open_log
from flashrecovery.connectors.base import LogConnector
from flashrecovery.engine.loop import EngineLoop
from flashrecovery.records import Envelope, IsolateNode, NodeMissed, Stream

# The simulated world (no torch) lives with the tests: tests/simworld.py.
from flashrecovery.testing.simworld import SimulatedNodes

TINY_MODEL = Path(__file__).resolve().parent.parent / "examples" / "train_mlp.py"
PER_NODE = 8
POLL_S = 0.05  # how often the engine service looks at the log (EngineLoop's default)
CHUNK = 5_000  # records per append at the job's start
PAPER = {"devices": 4_800, "rto_s": 150.0}

# ------------------------------------------------------------------ (a) real processes


def real(worlds: list[int], kills: int, seed: int, timeout: float, console: Console) -> list[Any]:
    """Hot-spare recoveries of the tiny model at each world size, with the load around each."""
    configs = []
    with tempfile.TemporaryDirectory(prefix="flashrecovery-scale-") as tmp:
        for world in worlds:
            console.print(f"(a) {world} ranks + a hot spare: {kills} kills …")
            load = os.getloadavg()
            rows = rto.measure(
                world, "hook", "hot spare", kills, seed, Path(tmp), timeout, TINY_MODEL
            )
            configs.append(
                {
                    **rto.aggregate(world, "hook", "hot spare", rows),
                    "loadavg_before": load,
                    "loadavg_after": os.getloadavg(),
                }
            )
    return configs


def real_table(configs: list[Any], title: str) -> Any:
    return table(
        title,
        ["", *(f"{c['world_size']} ranks" for c in configs)],
        [
            ["kills measured", *(str(c["kills_measured"]) for c in configs)],
            ["RTO from the SIGKILL", *(ms(c["median_rto_from_kill_s"]) for c in configs)],
            *([f"  {s}", *(ms(c["median_segments_s"][s]) for c in configs)] for s in rto.SEGMENTS),
            ["load (1 min) before", *(f"{c['loadavg_before'][0]:.1f}" for c in configs)],
        ],
    )


def regroup_comparison(before: list[Any], after: list[Any]) -> Any:
    """Regroup ms (and the RTO) by world size, an earlier run beside this one."""
    old = {c["world_size"]: c for c in before}
    rows = []
    for c in after:
        b = old.get(c["world_size"])
        rows.append(
            [
                str(c["world_size"]),
                ms(b["median_segments_s"]["regrouped"]) if b else "-",
                ms(c["median_segments_s"]["regrouped"]),
                ms(b["median_rto_from_kill_s"]) if b else "-",
                ms(c["median_rto_from_kill_s"]),
            ]
        )
    return table(
        "regroup against world size, ms (median)",
        ["ranks", "regroup before", "regroup after", "RTO before", "RTO after"],
        rows,
    )


# ------------------------------------------------------------------ (b) simulated


class EngineMeter:
    """Drives an engine on the simulated clock, one poll at a time, counting its CPU."""

    def __init__(self, log: LogConnector, world: SimulatedNodes) -> None:
        self.log, self.world = log, world
        self.engine = EngineLoop(log, world.job_id, clock=lambda: world.clock)
        self.cpu_s = self.wall_s = self.append_s = 0.0
        self.records = 0

    def append(self, records: list[Envelope]) -> None:
        started = time.perf_counter()
        for first in range(0, len(records), CHUNK):
            self.log.append_many(Stream.EVENTS, records[first : first + CHUNK])
        self.append_s += time.perf_counter() - started
        self.records += len(records)

    def poll(self) -> list[Envelope]:
        """What the service does every POLL_S: apply the new records, run the detectors."""
        cpu, wall = time.thread_time(), time.perf_counter()
        self.engine.catch_up()
        found = self.engine.detect()
        self.cpu_s += time.thread_time() - cpu
        self.wall_s += time.perf_counter() - wall
        return found

    def reset(self) -> None:
        self.cpu_s = self.wall_s = self.append_s = 0.0
        self.records = 0


def beating(world: SimulatedNodes, silent: set[int]) -> Iterator[list[int]]:
    """The nodes that beat at each poll: every agent once per interval, spread over it."""
    ticks = round(world.heartbeat_interval_s / POLL_S)
    tick = 0
    while True:
        yield [n for n in range(tick % ticks, world.nodes + 1, ticks) if n not in silent]
        tick += 1


def simulate(ranks: int, url: str, steady_intervals: int) -> dict[str, Any]:
    """One world of ``ranks``: start, beat for ``steady_intervals``, then a node falls silent."""
    world = SimulatedNodes(f"scale-{ranks}-{uuid.uuid4().hex[:6]}", nodes=ranks // PER_NODE)
    lost, silent = world.nodes // 2, set[int]()
    schedule = beating(world, silent)
    with open_log(url) as log:
        meter = EngineMeter(log, world)
        started = time.perf_counter()
        meter.append(world.start())
        meter.poll()
        start_s = time.perf_counter() - started

        def tick() -> list[Envelope]:
            world.clock = round(world.clock + POLL_S, 6)
            meter.append([world.beat(n) for n in next(schedule)])
            return meter.poll()

        meter.reset()
        polls = round(steady_intervals * world.heartbeat_interval_s / POLL_S)
        for _ in range(polls):
            tick()
        seconds = polls * POLL_S  # of simulated time: the records of that many seconds
        steady = {
            "records_per_s_offered": meter.records / seconds,
            "engine_cpu_s_per_s": meter.cpu_s / seconds,
            "engine_us_per_record": meter.cpu_s / meter.records * 1e6,
            "engine_records_per_s_capacity": meter.records / meter.wall_s,
            "log_append_records_per_s_capacity": meter.records / meter.append_s,
        }
        silent.add(lost)
        silent_from, missed = world.clock, list[NodeMissed]()
        while not missed:
            if world.clock - silent_from > 20 * world.heartbeat_interval_s:
                raise RuntimeError(f"{ranks} ranks: the silent node {lost} was never found")
            missed = [f for f in tick() if isinstance(f, NodeMissed)]
        seen = len(log.read(Stream.DECISIONS, world.job_id))
        began = time.perf_counter()
        meter.engine.catch_up()  # the finding is in the log: decide and write the decisions
        latency = time.perf_counter() - began
        decisions = [e.record for e in log.read(Stream.DECISIONS, world.job_id)[seen:]]
    isolated = [d for d in decisions if isinstance(d, IsolateNode)]
    return {
        "ranks": ranks,
        "nodes": world.nodes,
        "start_s": start_s,
        **steady,
        "silence_to_finding_s": missed[0].silent_s,  # from the node's last beat
        "finding_to_decisions_ms": latency * 1000,
        "decisions": [d.type for d in decisions if d is not None],
        "isolated_node": isolated[0].node if isolated else None,
    }


def sim_urls(tmp: Path, kafka: str | None) -> dict[str, Callable[[int], str]]:
    urls: dict[str, Callable[[int], str]] = {
        "embedded": lambda ranks: f"sqlite://{tmp / f'sim-{ranks}.db'}"
    }
    if kafka:
        prefix = f"scale{uuid.uuid4().hex[:6]}"
        urls["kafka"] = lambda ranks: f"kafka://{kafka}?topic_prefix={prefix}-{ranks}."
    return urls


def simulated(sizes: list[int], kafka: str | None, intervals: int, console: Console) -> list[Any]:
    rows = []
    with tempfile.TemporaryDirectory(prefix="flashrecovery-scale-sim-") as tmp:
        for label, url in sim_urls(Path(tmp), kafka).items():
            for ranks in sizes:
                console.print(f"(b) {ranks:,} simulated ranks, {label} log …")
                load = os.getloadavg()
                rows.append({"log": label, **simulate(ranks, url(ranks), intervals), "load": load})
    return rows


def sim_table(rows: list[Any]) -> Any:
    return table(
        "simulated: nodes of 8, a beat per node per s, one node lost (rec/s: records into the "
        "log; CPU s/s: engine CPU per second of records; decide: finding -> decisions in the "
        "log; found: the node's last beat -> finding)",
        ["log", "ranks", "rec/s", "CPU s/s", "µs/rec", "decide ms", "found s", "load"],
        [
            [
                r["log"],
                f"{r['ranks']:,}",
                f"{r['records_per_s_offered']:,.0f}",
                f"{r['engine_cpu_s_per_s']:.3f}",
                f"{r['engine_us_per_record']:.0f}",
                f"{r['finding_to_decisions_ms']:.1f}",
                f"{r['silence_to_finding_s']:.2f}",
                f"{r['load'][0]:.1f}",
            ]
            for r in rows
        ],
    )


# ------------------------------------------------------------------ (c) projection


def growth(sizes: list[int], values: list[float]) -> dict[str, float]:
    """``value = c * size^k`` fitted on log-log by least squares (k: how the phase grows)."""
    xs = [math.log(s) for s in sizes]
    ys = [math.log(max(v, 1e-6)) for v in values]
    mean_x, mean_y = sum(xs) / len(xs), sum(ys) / len(ys)
    spread = sum((x - mean_x) ** 2 for x in xs)
    k = sum((x - mean_x) * (y - mean_y) for x, y in zip(xs, ys, strict=True)) / spread
    return {"c": math.exp(mean_y - k * mean_x), "k": k}


def projection(configs: list[Any], sim: list[Any]) -> dict[str, Any]:
    """Each phase at PAPER['devices'] from its fitted growth; the engine's decision from the
    simulated worlds, the real phases from the real ones."""
    devices = PAPER["devices"]
    phases: dict[str, Any] = {}
    real = [c for c in configs if c["median_rto_from_kill_s"] is not None]
    if len(real) >= 2:
        sizes = [c["world_size"] for c in real]
        for segment in rto.SEGMENTS:
            values = [c["median_segments_s"][segment] or 0.0 for c in real]
            fit = growth(sizes, values)
            phases[segment] = {**fit, "at_devices_s": fit["c"] * devices ** fit["k"]}
    embedded = [r for r in sim if r["log"] == "embedded"]
    if len(embedded) >= 2:
        fit = growth(
            [r["ranks"] for r in embedded], [r["finding_to_decisions_ms"] / 1000 for r in embedded]
        )
        phases["engine decision (simulated)"] = {
            **fit,
            "at_devices_s": fit["c"] * devices ** fit["k"],
        }
    total = sum(p["at_devices_s"] for p in phases.values())
    return {
        "devices": devices,
        "phases": phases,
        "projected_rto_s": total,
        "paper_rto_s": PAPER["rto_s"],
        "assumptions": [
            "each phase grows as a power of the world size, fitted on the medians measured here "
            "(real: 2-16 ranks on one 2-core machine, so ranks beyond 2 share the cores and the "
            "fit of CPU-bound phases is pessimistic; simulated: the engine alone)",
            "detection is the agent seeing the exit of a SIGKILLed rank; a lost node is found "
            "after missed_heartbeats x interval of silence instead (3 s by default, part (b))",
            "the engine's decision at scale is the simulated finding-to-decisions latency, added "
            "to the real phases, which already hold it at their own size",
            "restore moves one replica's state (the tiny model's); a real model's transfer "
            "time is its state size over the link, independent of the world size",
            "the method's 150 s is for 4,800 devices with real models and checkpoints, on its "
            "own hardware: the comparison is of growth, not of absolute speed",
        ],
    }


def projection_table(proj: dict[str, Any]) -> Any:
    rows = [
        [name, f"{p['k']:.2f}", f"{p['at_devices_s'] * 1000:.0f}"]
        for name, p in proj["phases"].items()
    ]
    rows.append(["projected RTO", "", f"{proj['projected_rto_s'] * 1000:.0f}"])
    rows.append(["the method's RTO (paper)", "", f"{proj['paper_rto_s'] * 1000:.0f}"])
    return table(
        f"projection to {proj['devices']:,} devices (value = c * size^k)",
        ["phase", "growth k", "ms"],
        rows,
    )


# ------------------------------------------------------------------ plots


def plot_sim(rows: list[Any], name: str) -> Path:
    path = RESULTS / f"{name}_sim.png"
    fig, axes = plt.subplots(1, 3, figsize=(13, 4))
    metrics = [
        ("finding_to_decisions_ms", "finding → decisions (ms)"),
        ("engine_cpu_s_per_s", "engine CPU s per s of records"),
        ("records_per_s_offered", "records/s into the log"),
    ]
    for ax, (key, label) in zip(axes, metrics, strict=True):
        for log in dict.fromkeys(r["log"] for r in rows):
            mine = [r for r in rows if r["log"] == log]
            ax.plot([r["ranks"] for r in mine], [r[key] for r in mine], "o-", label=log)
        ax.set_xscale("log")
        ax.set_xlabel("ranks (nodes of 8)")
        ax.set_title(label, fontsize=10)
        ax.legend(fontsize=8)
    return save_figure(fig, path)


def plot_projection(proj: dict[str, Any], name: str) -> Path:
    path = RESULTS / f"{name}_projection.png"
    fig, ax = plt.subplots(figsize=(7, 4.2))
    names = [*proj["phases"], "projected RTO"]
    values = [p["at_devices_s"] for p in proj["phases"].values()] + [proj["projected_rto_s"]]
    ax.barh(names, values)
    ax.axvline(proj["paper_rto_s"], color="red", linestyle="--", label="the method's 150 s")
    ax.set_xscale("log")
    ax.set_xlabel(f"seconds at {proj['devices']:,} devices (log scale)")
    ax.legend(fontsize=8)
    return save_figure(fig, path)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--worlds", type=int, nargs="*", default=[2, 4, 8, 16], help="ranks")
    parser.add_argument("--kills", type=int, default=3, help="kills per world (medians)")
    parser.add_argument("--seed", type=int, default=0, help="which ranks are killed")
    parser.add_argument("--timeout", type=float, default=300.0, help="seconds per job at most")
    parser.add_argument(
        "--sim", type=int, nargs="*", default=[1_000, 10_000, 100_000], help="simulated ranks"
    )
    parser.add_argument("--intervals", type=int, default=5, help="simulated steady seconds")
    parser.add_argument("--kafka", default=os.environ.get("FLASHRECOVERY_TEST_BROKER"))
    parser.add_argument("--name", default="scale", help="results file name")
    parser.add_argument("--compare", type=Path, help="an earlier run's JSON: regroup before/after")
    parser.add_argument("--quick", action="store_true", help="2 ranks, 1 kill, 1k-2k simulated")
    args = parser.parse_args()
    if args.quick:
        args.worlds, args.kills, args.sim, args.intervals = [2], 1, [1_000, 2_000], 1
    console = Console()
    settings = {"kills": args.kills, "seed": args.seed, "model": str(TINY_MODEL.name)}
    data: dict[str, Any] = {"machine": machine(), "settings": settings}
    data["real"] = real(args.worlds, args.kills, args.seed, args.timeout, console)
    write_json(args.name, data)  # each part as soon as it is measured
    data["simulated"] = sim = simulated(args.sim, args.kafka, args.intervals, console)
    configs = data["real"]
    data["projection"] = proj = projection(configs, sim)
    path = write_json(args.name, data)
    if configs:
        console.print(real_table(configs, "hot-spare recovery, median ms (tiny model)"))
        stacked_bars(
            f"{args.name}_real",
            "hot-spare recovery by phase (medians, tiny model)",
            "ms",
            [f"{c['world_size']} ranks" for c in configs],
            {s: [(c["median_segments_s"][s] or 0.0) * 1000 for c in configs] for s in rto.SEGMENTS},
        )
    if args.compare:
        before = json.loads(args.compare.read_text())["real"]
        console.print(regroup_comparison(before, configs))
    if sim:
        console.print(sim_table(sim))
        plot_sim(sim, args.name)
    if proj["phases"]:
        console.print(projection_table(proj))
        plot_projection(proj, args.name)
    console.print(f"written {path} and its plots")


if __name__ == "__main__":
    main()
