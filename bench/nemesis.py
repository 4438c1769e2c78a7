"""Nemesis: a seeded soak of network and node faults on nodes with networks of their own.

    python -m bench.nemesis [--faults 50] [--per-run 5] [--nodes 3] [--seed 0]
                            [--kinds node_kill,partition,…] [--straggler-policy report|replace]
                            [--quick]

Each run is `flashrecovery chaos --nodes N --netns` as a user runs it (nodes in network
namespaces of their own, the log on a 3-broker Kafka cluster, a fault-free reference, a seeded
schedule of node kills, cuts, one-way losses, flaps, degraded links and broker kills). The
verdicts are pooled as the soak bench pools them (recovered %, detection and RTO p50/p99 per
kind, committed steps lost, records lost or stored twice), with what must hold whatever the
network did, over each run's whole log: every decision written by an engine holding the lease
(one engine decides), no step committed by two generations, nothing believed that a node wrote
after it was given up. JSON goes to bench/results/nemesis.json, a table to the terminal, RTO
per kind to bench/results/nemesis.png. Needs root: where network namespaces cannot be made it
says why and writes nothing. Steps are paced to 0.25 s (``--min-step-s``; chaos's default with
``--netns``), the pace such a job keeps anyway. ``--quick`` (one run of one degraded link) is
what CI runs.
"""

from __future__ import annotations

import argparse
import sys
from typing import Any

from rich.console import Console

from bench.lib.results import machine, write_json
from bench.soak import add_arguments, plot, pool, run_all, show
from flashrecovery.agent import netns
from flashrecovery.agent.launcher import one_of
from flashrecovery.chaos.cli import NETNS_STEP_S
from flashrecovery.records import StragglerPolicy

KINDS = (
    "node_kill,node0_kill,partition,node0_partition,oneway,flap,degraded,broker_kill,"
    "broker_partition,node_kill_leader_cut"
)
QUICK_KINDS = "degraded"  # the straggler policy's default (report) in a live run
SPLIT_BRAIN = ("unleased_deciders", "double_commits", "believed_from_lost_nodes")


def split_brain(runs: list[dict[str, Any]]) -> dict[str, int]:
    """How many findings of each consistency check the runs' replays made (0 each: none)."""
    return {
        check: sum(len(run.get("replay", {}).get(check) or []) for run in runs)
        for check in SPLIT_BRAIN
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_arguments(parser, faults=50, per_run=5)
    parser.set_defaults(min_step_s=NETNS_STEP_S)  # chaos's pace on netns nodes
    parser.add_argument("--nodes", type=int, default=3)
    parser.add_argument("--kinds", default=KINDS, help=f"default: {KINDS}")
    parser.add_argument("--straggler-policy", **one_of(StragglerPolicy.REPORT))
    parser.add_argument("--quick", action="store_true", help=f"one run of one fault: {QUICK_KINDS}")
    args = parser.parse_args()
    if args.quick:
        args.faults, args.per_run, args.kinds = 1, 1, QUICK_KINDS
    console = Console()
    why = netns.unavailable()
    if why is not None:
        console.print(f"nemesis skipped: no network namespaces here ({why})")
        sys.exit(0)
    more = (
        *("--nodes", str(args.nodes), "--netns", "--kinds", args.kinds),
        *("--straggler-policy", str(args.straggler_policy)),
    )
    runs = run_all(console, args, more)
    pooled = pool(runs)
    pooled["split_brain"] = split_brain(runs)
    data = {"machine": machine(), "args": vars(args), "pooled": pooled, "runs": runs}
    json_path = write_json("nemesis", data)
    show(console, "nemesis", pooled)
    found = ", ".join(f"{k.replace('_', ' ')} {v}" for k, v in pooled["split_brain"].items())
    console.print(f"split brain (replay over every run's log): {found}")
    console.print(f"wrote {json_path} and {plot('nemesis', pooled['kinds'])}")


if __name__ == "__main__":
    main()
