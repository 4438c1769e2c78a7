"""Recovery time of a SIGKILLed rank, with a hot spare and with a freshly spawned replacement.

    python -m bench.rto [--worlds 2 4] [--parallel hook ddp hsdp] [--kills 5] [--quick]
                        [--modes "hot spare"] [--group-rebuild fresh reconfigure]
    python -m bench.rto --nodes [2 3]
    python -m bench.rto --state-mb [10 100 500 1200] [--kills 3] [--quick]

For each world size and mode, one job of the demo's model runs under `flashrecovery run` while a
seeded random rank is SIGKILLed from outside, ``--kills`` times, each once the job runs again
(and, with a spare, once the refilled spare is ready). RTO is the time from the SIGKILL to every
rank having committed a new step (the engine's IncidentClosed); the phases come from the incident
machine. ``--parallel`` picks how the demo trains: ``hook`` (pure data parallel, every rank a
replica of the whole state) and ``hsdp`` (FSDP2 on a replicas x 2 shards mesh, 4 or more ranks:
a replacement receives its shard's state only), or ``ddp`` (torch DDP over the stable group),
``tp-hsdp`` (tensor parallel beside FSDP2, replicas x 1 x 2) or ``3d`` (replicas x 2 x 2);
``--group-rebuild`` sets how the stable groups of ``ddp`` and ``hsdp`` change generation
(``flashrecovery run --group-rebuild``). The state moved (bytes, all recipients) and the
restore (the slowest recipient's receive, ms) come from StateTransferred. Medians go to
bench/results/rto.json, a table and bench/results/rto.png. It measures, it asserts nothing.

With ``--nodes``, each job runs on loopback nodes (an agent each, 2 ranks and 1 hot spare per
node, plus a spare node of 2 spares): rank 1 (on node 0) is SIGKILLed, then, each once the job
runs again, the last node and node 0 (its agent's process group: node 0's agent hosts the
store generation 0 meets on and the engine holding the lease). It also counts the records the job
writes into its log per second while it trains, per node and per rank (bench/results/
rto_nodes.json).

With ``--state-mb``, RTO against the state's size: bench/compare.py's MLP (torch DDP over the
session's stable group, AdamW) widened until its parameters and AdamW moments reach each size,
on 2 ranks (a replacement restored from 1 donor) and 3 ranks (from 2, each sending a stripe),
a hot spare each, the first kill once a few steady steps are measured. Beside each, the steady
step, RTO less one step, its phases, the restore, and the time raw gloo send/recv takes for
the same bytes on this machine (measured first, bench/transfer.py's ceiling):
bench/results/rto_state.json, a table and bench/results/rto_state.png. ``--quick``: 2 ranks,
1 kill.
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import random
import statistics
import tempfile
from collections import Counter
from pathlib import Path
from typing import Any

from matplotlib import pyplot as plt
from rich.console import Console

from bench import transfer
from bench.compare_workers.workload import mlp_width
from bench.lib.launch import job_spec
from bench.lib.results import RESULTS, machine, ms, save_figure, stacked_bars, table, write_json
from flashrecovery.connectors import open_log
from flashrecovery.demo.job import REPLICA_MESH, LaunchedJob, whole_replicas
from flashrecovery.demo.summary import incidents
from flashrecovery.demo.watch import JobWatch, Kill, Killer, follow
from flashrecovery.records import ResumePlanned, StepCompleted, Stream
from flashrecovery.replay.verify import handle_runs
from flashrecovery.statemachines.incident import PHASES

MODES = {"hot spare": 1, "fresh spawn": 0}
GAP_STEPS = 3  # steps of normal training between a recovery and the next kill
WARMUP_STEPS = 2  # a job's first steps pay one-time costs: not counted in its steady step
STEADY_STEPS = 5  # with --state-mb, steps measured for the steady step before the first kill
CEILING_LAYERS = 20  # raw gloo's ceiling measured on this many 1024 x 1024 layers (252 MB)
WORKER = Path(__file__).resolve().parent / "compare_workers" / "flash_worker.py"
SPARE_WAIT_S = 90.0  # a refilled spare starts python and torch on busy cores
STEPS = 1_000_000  # never reached: the bench ends the job once it has its kills
SEGMENTS = ["detection", *PHASES[1:]]
BEAT_TYPES = (
    "heartbeat",
    "spare_heartbeat",
    "node_heartbeat",
)  # proofs of life, any writer  # the engine's "detected" phase is the exit record itself


def measure(
    world: int,
    parallel: str,
    mode: str,
    kills: int,
    seed: int,
    tmp: Path,
    timeout: float,
    script: Path | None = None,
    group_rebuild: str = "fresh",
    script_args: tuple[str, ...] = (),
    first_kill_step: int = 0,
    spare_refill: str = "immediate",
) -> list[Any]:
    """Kill ``kills`` ranks of one job, one at a time; the closed incidents' rows. ``script``:
    a training script taking ``--steps`` (and ``script_args``) instead of the demo's model."""
    spec = dataclasses.replace(
        job_spec(
            f"rto-{world}-{parallel}-{MODES[mode]}-{group_rebuild}", tmp, world, MODES[mode], STEPS
        ),
        parallel=parallel,
        agent_args=("--group-rebuild", group_rebuild, "--spare-refill", spare_refill),
    )
    if script is not None:
        spec = dataclasses.replace(
            spec, script=script, script_args=("--steps", str(STEPS), *script_args)
        )
    rng = random.Random(seed)
    with open_log(spec.log_url) as log:
        with LaunchedJob(spec) as job:
            watch = JobWatch(log, spec.job_id)
            killer = Killer(job, spare_wait_s=SPARE_WAIT_S)

            def plan_next(_: Kill | None) -> None:
                if watch.running and not killer.pending and len(killer.plan) < kills:
                    step = max(first_kill_step, watch.committed() + GAP_STEPS)
                    killer.plan.append(Kill(rng.randrange(world), step))

            follow(
                job, watch, killer, timeout, plan_next, until=lambda: watch.incidents[1] >= kills
            )
        rows = incidents(log, spec.job_id, killer.plan)["incidents"]
        moved = transfers(log, spec.job_id)
        step_s = steady_step_s(log, spec.job_id, killer.plan[0].ts if killer.plan else None)
    closed = [r for r in rows if r["state"] == "closed" and r["rto_from_kill_s"] is not None]
    return [{**r, **moved.get(r["generation"], {}), "steady_step_s": step_s} for r in closed]


def transfers(log: Any, job_id: str) -> dict[int, dict[str, float]]:
    """Per generation, the state it moved: bytes to every recipient, the slowest receive, and
    the most donors sharing one shard's transfer."""
    moved: dict[int, dict[str, float]] = {}
    for entry in itertools.chain(
        log.read(Stream.EVENTS, job_id), log.read(Stream.DECISIONS, job_id)
    ):
        record = entry.record
        if record.type not in ("state_transferred", "resume_planned"):
            continue
        m = moved.setdefault(record.generation, {"bytes_moved": 0, "restore_ms": 0.0})
        if isinstance(record, ResumePlanned):
            m["donors"] = max((len(record.donors_of(shard)) for shard in record.donors), default=0)
        else:
            m["bytes_moved"] += record.bytes
            m["restore_ms"] = max(m["restore_ms"], record.ms)
    return moved


def steady_step_s(log: Any, job_id: str, until: float | None) -> float | None:
    """The median time between two steps one rank committed before ``until`` (the first
    kill), its first WARMUP_STEPS left out: what one step costs undisturbed."""
    times: dict[int, list[float]] = {}
    for entry in log.read(Stream.EVENTS, job_id):
        record = entry.record
        if isinstance(record, StepCompleted) and (until is None or record.ts < until):
            times.setdefault(record.rank, []).append(record.ts)
    gaps = [b - a for ts in times.values() for a, b in itertools.pairwise(ts[WARMUP_STEPS:])]
    return statistics.median(gaps) if gaps else None


def measure_nodes(nodes: int, tmp: Path, timeout: float) -> dict[str, Any]:
    """A rank kill, then the last node's kill, then node 0's (the meeting store's host and the
    deciding engine's), on ``nodes`` loopback nodes; the closed incidents' rows and the job's
    record rate while it trained undisturbed."""
    per_node = 2
    spec = dataclasses.replace(
        job_spec(f"rto-nodes-{nodes}", tmp, nproc=nodes * per_node, spares=1, steps=STEPS),
        nodes=nodes,
        spare_nodes=1,
    )
    last = nodes - 1
    with open_log(spec.log_url) as log:
        with LaunchedJob(spec) as job:
            watch = JobWatch(log, spec.job_id)
            killer = Killer(job, spare_wait_s=SPARE_WAIT_S)

            # a rank on node 0 first: the node killed next still holds its ranks
            kills = [Kill(1, 0), Kill(None, 0, node=last), Kill(None, 0, node=0)]

            def plan_next(_: Kill | None) -> None:
                if not watch.running or killer.pending or len(killer.plan) >= len(kills):
                    return
                step = watch.committed() + GAP_STEPS * (4 if not killer.plan else 1)
                killer.plan.append(dataclasses.replace(kills[len(killer.plan)], step=step))

            follow(job, watch, killer, timeout, plan_next, until=lambda: watch.incidents[1] >= 3)
        rows = incidents(log, spec.job_id, killer.plan, nodes)["incidents"]
        first_kill = killer.plan[0].ts if killer.plan else None
        rate = record_rate(log, spec.job_id, until=first_kill)
    closed = [r for r in rows if r["state"] == "closed" and r["rto_from_kill_s"] is not None]
    return {
        "nodes": nodes,
        "ranks": nodes * per_node,
        "kills": [dataclasses.asdict(k) for k in killer.plan],
        "incidents": closed,
        "records": rate,
    }


def record_rate(log: Any, job_id: str, until: float | None) -> dict[str, float]:
    """Records per second into the events stream from the first committed step to ``until``."""
    stored = [e for e in log.read(Stream.EVENTS, job_id) if e.record is not None]
    entries = [e.record for e in stored]
    start = next((r.ts for r in entries if isinstance(r, StepCompleted)), None)
    if start is None or until is None or until <= start:
        return {}
    window = [r for r in entries if start <= r.ts < until]
    runs = handle_runs(e for e in stored if start <= e.record.ts < until)
    seconds = until - start
    by_writer = Counter(r.source.partition(":")[0] for r in window)
    beats = sum(r.type in BEAT_TYPES for r in window)
    return {
        "window_s": round(seconds, 3),
        "total_per_s": round(len(window) / seconds, 2),
        "heartbeat_records_per_s": round(beats / seconds, 2),
        "write_runs_per_s": round(len(runs) / seconds, 2),  # one log handle's, consecutive
        **{f"{writer}_per_s": round(n / seconds, 2) for writer, n in by_writer.items()},
    }


def nodes_main(node_counts: list[int], timeout: float, console: Console) -> None:
    configs = []
    with tempfile.TemporaryDirectory(prefix="flashrecovery-rto-nodes-") as tmp:
        for nodes in node_counts:
            console.print(f"{nodes} loopback nodes: a rank kill, the last node's, node 0's …")
            configs.append(measure_nodes(nodes, Path(tmp), timeout))
    path = write_json("rto_nodes", {"machine": machine(), "configs": configs})
    columns, rows = [""], []
    for config in configs:
        for row in config["incidents"]:
            columns.append(f"{config['nodes']} nodes: {row['failed']}")
            rows.append(row)
    console.print(
        table(
            "RTO by failure, ms (SIGKILL → every rank committed a new step)",
            columns,
            [
                ["replaced by", *(str(r["replacement"]) for r in rows)],
                ["RTO from the SIGKILL", *(ms(r["rto_from_kill_s"]) for r in rows)],
                *([f"  {s}", *(ms(segments(r)[s]) for r in rows)] for s in SEGMENTS),
            ],
        )
    )
    console.print(
        table(
            "records/s into the log while training",
            ["", *(f"{c['nodes']} nodes x 2 ranks" for c in configs)],
            [
                ["total", *(str(c["records"].get("total_per_s", "-")) for c in configs)],
                [
                    "  heartbeat records",
                    *(str(c["records"].get("heartbeat_records_per_s", "-")) for c in configs),
                ],
                [
                    "per node (the spare node too)",
                    *(_per(c["records"].get("total_per_s"), c["nodes"] + 1) for c in configs),
                ],
                [
                    "per rank, from it",
                    *(_per(c["records"].get("rank_per_s"), c["ranks"]) for c in configs),
                ],
                [
                    "  of which agents",
                    *(str(c["records"].get("agent_per_s", "-")) for c in configs),
                ],
                [
                    "writes (at least: runs of one handle)",
                    *(str(c["records"].get("write_runs_per_s", "-")) for c in configs),
                ],
            ],
        )
    )
    console.print(f"written {path}")


def state_main(sizes: list[float], args: argparse.Namespace, console: Console) -> None:
    """RTO against the state's size: the compare bench's MLP (DDP, AdamW) widened until its
    parameters and moments reach each size, 2 ranks (1 donor) and 3 ranks (2 donors, each a
    stripe), a hot spare each; beside it, the raw gloo transfer of that many bytes."""
    worlds = [2] if args.quick else [2, 3]
    console.print("raw gloo send/recv, the ceiling …")
    ceiling = transfer.gloo_ceiling_gb_per_s(1 if args.quick else CEILING_LAYERS, 3)
    configs = []
    with tempfile.TemporaryDirectory(prefix="flashrecovery-rto-state-") as tmp:
        for state_mb in sizes:
            width = mlp_width(state_mb)
            for world in worlds:
                console.print(
                    f"{state_mb:g} MB (width {width}), {world} ranks: {args.kills} kills …"
                )
                rows = measure(
                    world,
                    f"state{state_mb:g}",
                    "hot spare",
                    args.kills,
                    args.seed,
                    Path(tmp),
                    args.timeout,
                    script=WORKER,
                    script_args=(
                        *("--model", "mlp", "--width", str(width)),
                        *("--out", str(Path(tmp) / f"witness-{state_mb:g}-{world}")),
                    ),
                    first_kill_step=WARMUP_STEPS + STEADY_STEPS,
                    spare_refill=args.spare_refill,
                )
                config = aggregate(world, "ddp", "hot spare", rows)
                donors = Counter(r["donors"] for r in rows if "donors" in r).most_common(1)
                config.update(state_mb=state_mb, width=width, donors=donors[0][0] if donors else 0)
                configs.append(config)
    settings = {
        "kills": args.kills,
        "seed": args.seed,
        "spare_refill": args.spare_refill,
        "gloo_ceiling_gb_per_s": ceiling,
    }
    path = write_json("rto_state", {"machine": machine(), "settings": settings, "configs": configs})
    console.print(
        table(
            f"RTO against the state, median ms over {args.kills} kills (gloo ceiling "
            f"{ceiling:.2f} GB/s)",
            ["", *(f"{c['state_mb']:g} MB, {c['donors']} donor(s)" for c in configs)],
            [
                ["kills measured", *(str(c["kills_measured"]) for c in configs)],
                ["steady step", *(ms(c["median_steady_step_s"]) for c in configs)],
                ["RTO from the SIGKILL", *(ms(c["median_rto_from_kill_s"]) for c in configs)],
                ["RTO - one step", *(ms(_less_step(c)) for c in configs)],
                *([f"  {s}", *(ms(c["median_segments_s"][s]) for c in configs)] for s in SEGMENTS),
                ["state moved, MB", *(_bytes(c["median_bytes_moved"], 1e6, 1) for c in configs)],
                ["restore (transfer)", *(_ms2(c["median_restore_ms"]) for c in configs)],
                ["moved at the ceiling", *(_at(c["median_bytes_moved"], ceiling) for c in configs)],
            ],
        )
    )
    console.print(f"written {path} and {_state_plot(configs, ceiling)}")


def _less_step(config: dict[str, Any]) -> float | None:
    rto, step = config["median_rto_from_kill_s"], config["median_steady_step_s"]
    return None if rto is None or step is None else rto - step


def _bytes(nbytes: float | None, unit: float, digits: int) -> str:
    """Bytes in ``unit`` (1e3: kB, 1e6: MB) for a table cell ("-" for none)."""
    return "-" if nbytes is None else f"{nbytes / unit:.{digits}f}"


def _at(nbytes: float | None, gb_per_s: float) -> str:
    return "-" if nbytes is None else f"{nbytes / gb_per_s / 1e6:.0f}"


def _state_plot(configs: list[dict[str, Any]], ceiling: float) -> Path:
    """RTO less one step and the restore against the state, per donor count; the transfer at
    the gloo ceiling as the line they should follow."""
    RESULTS.mkdir(parents=True, exist_ok=True)
    path = RESULTS / "rto_state.png"
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for donors in sorted({c["donors"] for c in configs}):
        mine = [
            (c, less)
            for c in configs
            if c["donors"] == donors and (less := _less_step(c)) is not None
        ]
        mb = [c["state_mb"] for c, _ in mine]
        ax.plot(
            mb,
            [less * 1000 for _, less in mine],
            marker="o",
            label=f"RTO - step, {donors} donor(s)",
        )
        ax.plot(
            mb,
            [c["median_restore_ms"] or 0.0 for c, _ in mine],
            linestyle="--",
            marker=".",
            label=f"restore, {donors} donor(s)",
        )
    sizes = sorted({c["state_mb"] for c in configs})
    ax.plot(
        sizes,
        [mb / ceiling for mb in sizes],
        color="gray",
        linestyle=":",
        label=f"state at the gloo ceiling ({ceiling:.2f} GB/s)",
    )
    ax.set_xlabel("state (parameters + AdamW moments), MB")
    ax.set_ylabel("ms (median)")
    ax.set_title("hot-spare recovery against the state's size")
    ax.legend(fontsize=8)
    return save_figure(fig, path)


def _per(rate: float | None, count: int) -> str:
    return "-" if rate is None else f"{rate / count:.1f}"


def segments(row: dict[str, Any]) -> dict[str, float]:
    return {"detection": row["detection_s"], **{p: row["phases_s"].get(p, 0.0) for p in PHASES[1:]}}


def aggregate(
    world: int, parallel: str, mode: str, rows: list[dict[str, Any]], group_rebuild: str = "fresh"
) -> dict[str, Any]:
    def median(values: list[float]) -> float | None:
        return statistics.median(values) if values else None

    parts = [segments(r) for r in rows]
    return {
        "world_size": world,
        "parallel": parallel,
        "group_rebuild": group_rebuild,
        "mode": mode,
        "kills_measured": len(rows),
        "replacements": dict(Counter(str(r["replacement"]) for r in rows)),
        "median_rto_from_kill_s": median([r["rto_from_kill_s"] for r in rows]),
        "median_rto_engine_s": median([r["rto_s"] for r in rows]),
        "median_bytes_moved": median([r["bytes_moved"] for r in rows if "bytes_moved" in r]),
        "median_steady_step_s": median(
            [r["steady_step_s"] for r in rows if r.get("steady_step_s")]
        ),
        "median_restore_ms": median([r["restore_ms"] for r in rows if "restore_ms" in r]),
        "median_segments_s": {s: median([p[s] for p in parts]) for s in SEGMENTS},
        "incidents": rows,
    }


def _label(config: dict[str, Any]) -> str:
    rebuild = "" if config["group_rebuild"] == "fresh" else f" ({config['group_rebuild']})"
    return f"{config['world_size']} {config['parallel']}{rebuild}"


def _ms2(ms: float | None) -> str:
    return "-" if ms is None else f"{ms:.1f}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--worlds", type=int, nargs="+", default=[2, 4], help="ranks per job")
    parser.add_argument("--kills", type=int, default=5, help="kills per job (median over them)")
    parser.add_argument("--seed", type=int, default=0, help="which ranks are killed")
    parser.add_argument("--timeout", type=float, default=240.0, help="seconds per job at most")
    parser.add_argument(
        "--parallel",
        nargs="+",
        default=["hook", "hsdp"],
        choices=["hook", "ddp", *REPLICA_MESH],
        help="how the demo trains (hsdp, tp-hsdp: worlds of 4 or more, even; 3d: of 8 or "
        "more, a multiple of 4)",
    )
    parser.add_argument(
        "--modes", nargs="+", default=list(MODES), choices=list(MODES), help="replacements"
    )
    parser.add_argument(
        "--group-rebuild",
        nargs="+",
        default=["fresh"],
        choices=["fresh", "reconfigure"],
        help="how ddp's and hsdp's groups change generation (hook has none: fresh only)",
    )
    parser.add_argument(
        "--spare-refill",
        default="immediate",
        choices=["immediate", "after-recovery"],
        help="when a taken hot spare is replaced (flashrecovery run --spare-refill)",
    )
    parser.add_argument(
        "--quick", action="store_true", help="hook on 2 ranks, hsdp on 4, 1 kill per mode"
    )
    parser.add_argument(
        "--state-mb",
        type=float,
        nargs="*",
        default=None,
        metavar="MB",
        help="RTO against the state's size (default 10 100 500 1200), 1 and 2 donors",
    )
    parser.add_argument(
        "--nodes",
        type=int,
        nargs="*",
        default=None,
        metavar="N",
        help="loopback nodes per job (default 2 3): a rank kill and a node kill each",
    )
    args = parser.parse_args()
    console = Console()
    if args.nodes is not None:
        nodes_main(args.nodes or [2, 3], args.timeout, console)
        return
    if args.state_mb is not None:
        if args.quick:
            args.kills = 1
        state_main(args.state_mb or [10, 100, 500, 1200], args, console)
        return
    if args.quick:
        args.worlds, args.kills = [2, 4], 1
    runs = [
        (world, parallel, rebuild)
        for world in args.worlds
        for parallel in args.parallel
        for rebuild in (["fresh"] if parallel == "hook" else args.group_rebuild)
        if (parallel in ("hook", "ddp") and not (args.quick and world > 2))
        or (parallel in REPLICA_MESH and whole_replicas(parallel, world))
    ]
    configs = []
    with tempfile.TemporaryDirectory(prefix="flashrecovery-rto-") as tmp:
        for world, parallel, rebuild in runs:
            for mode in args.modes:
                console.print(f"{world} ranks {parallel} ({rebuild}), {mode}: {args.kills} kills …")
                rows = measure(
                    world,
                    parallel,
                    mode,
                    args.kills,
                    args.seed,
                    Path(tmp),
                    args.timeout,
                    group_rebuild=rebuild,
                    spare_refill=args.spare_refill,
                )
                configs.append(aggregate(world, parallel, mode, rows, rebuild))
    settings = {
        "kills": args.kills,
        "gap_steps": GAP_STEPS,
        "seed": args.seed,
        "spare_refill": args.spare_refill,
    }
    path = write_json("rto", {"machine": machine(), "settings": settings, "configs": configs})

    console.print(
        table(
            f"RTO, median ms over {args.kills} kills (SIGKILL → every rank committed a new step)",
            ["", *(f"{_label(c)}, {c['mode']}" for c in configs)],
            [
                ["kills measured", *(str(c["kills_measured"]) for c in configs)],
                ["state moved, kB", *(_bytes(c["median_bytes_moved"], 1e3, 0) for c in configs)],
                ["restore (transfer), ms", *(_ms2(c["median_restore_ms"]) for c in configs)],
                ["RTO from the SIGKILL", *(ms(c["median_rto_from_kill_s"]) for c in configs)],
                ["RTO (engine)", *(ms(c["median_rto_engine_s"]) for c in configs)],
                *([f"  {s}", *(ms(c["median_segments_s"][s]) for c in configs)] for s in SEGMENTS),
            ],
        )
    )
    plot = stacked_bars(
        "rto",
        "recovery time by phase (medians)",
        "ms",
        [f"{_label(c)}\n{c['mode']}" for c in configs],
        {s: [(c["median_segments_s"][s] or 0.0) * 1000 for c in configs] for s in SEGMENTS},
    )
    console.print(f"written {path} and {plot}")


if __name__ == "__main__":
    main()
