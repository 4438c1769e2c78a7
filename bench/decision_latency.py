"""Detection-to-decision latency per log backend: from a RankExited record appended by the agent
to the IsolateRank decision readable by a follower (engine loop running in its own thread).

    python -m bench.decision_latency [--trials 20] [--kafka 127.0.0.1:9092]
    python -m bench.decision_latency --relay [--ranks 4] [--trials 30] [--quick]

Without --kafka it starts the project's own broker (flashrecovery broker) for the run.
Writes bench/results/decision_latency.json and prints a table.

With ``--relay``: from a decision written to the (embedded) log to each rank acting on it (its
decisions thread's regroup callback, which releases a blocked vote), for ``--ranks`` follower
processes of one node that follow the log each (how every rank took them before the agent
relayed the decisions; the hook no longer has that path, so the bench keeps a copy of its
follow loop: a 0.5 s look on the decisions stream) against the same ranks taking the decisions
from their agent, which follows the log once (agent/links.py). Rounds of the two alternate.
Writes bench/results/decision_relay.json.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from collections.abc import Callable
from contextlib import ExitStack
from pathlib import Path

from rich.console import Console
from rich.progress import track
from rich.table import Table

from bench.lib.results import RESULTS, machine
from flashrecovery.agent.job import FOLLOW_TIMEOUT_S as AGENT_FOLLOW_S
from flashrecovery.agent.links import ProcessLinks
from flashrecovery.connectors import open_log
from flashrecovery.connectors.base import LogConnector
from flashrecovery.connectors.follow import StreamCursor
from flashrecovery.engine.loop import EngineLoop
from flashrecovery.logs import configure_logging
from flashrecovery.records import Decision, Envelope, RegroupPlanned, Stream
from flashrecovery.testing.simworld import SimulatedWorld
from flashrecovery.trainer_hooks.agent_link import AgentLink
from flashrecovery.trainer_hooks.decisions import FOLLOW_TIMEOUT_S as RANK_FOLLOW_S
from flashrecovery.trainer_hooks.decisions import PROCESS_DECISIONS, DecisionFollower

REPO = Path(__file__).resolve().parent.parent  # the followers run as `python -m bench.…` there


def follow_until(
    log: LogConnector, job: str, position: int, last_type: str
) -> tuple[list[Decision], int]:
    """Decisions from ``position`` up to and including one of ``last_type``."""
    got: list[Decision] = []
    while not got or got[-1].type != last_type:
        entries = log.follow(Stream.DECISIONS, job, position, timeout=10.0)
        if not entries:
            raise RuntimeError(f"no {last_type} decision within 10 s")
        position = entries[-1].position + 1
        got += [e.record for e in entries if isinstance(e.record, Decision)]
    return got, position


def measure(log: LogConnector, trials: int, label: str) -> list[float]:
    """Milliseconds from each kill record's append until the isolate, replace and regroup
    decisions are readable by a follower (what a rank or the agent waits for)."""
    job = f"latency-{uuid.uuid4().hex[:8]}"
    world = SimulatedWorld(
        job, world_size=4, spares=trials, heartbeat_interval_s=600.0, clock=time.time()
    )
    engine = EngineLoop(log, job, poll_s=0.5).start()
    position = 0
    latencies = []

    def append(records: list[Envelope]) -> None:
        for record in records:
            log.append(Stream.EVENTS, record)

    try:
        append([*world.start(), *world.train(1)])
        for trial in track(range(trials), description=f"{label}: kill -> decision"):
            start = time.perf_counter()
            append([world.kill(trial % world.world_size)])
            regroup, position = follow_until(log, job, position, "regroup_planned")
            latencies.append((time.perf_counter() - start) * 1000)
            append([r for d in regroup for r in world.react(d)])
            resume, position = follow_until(log, job, position, "resume_planned")
            append([r for d in resume for r in world.react(d)])
            append(list(world.train(1)))
    finally:
        engine.stop()
    return latencies


def summarise(samples: list[float]) -> dict[str, float]:
    ordered = sorted(samples)
    return {
        "median_ms": statistics.median(ordered),
        "p90_ms": ordered[int(0.9 * (len(ordered) - 1))],
        "min_ms": ordered[0],
        "max_ms": ordered[-1],
    }


# ---------------------------------------------------------------- --relay

PAUSE_S = 0.3  # between decisions: the followers' polls back off as on an idle log


def follower_main(log_url: str, job: str, link_path: str) -> None:
    """A rank's decisions thread (the child of --relay): prints when each regroup reaches it."""

    def on_regroup(generation: int) -> None:
        print(generation, time.time(), flush=True)

    if not link_path:
        follow_the_log(log_url, job, on_regroup)
        return
    link = AgentLink(link_path)
    follower = DecisionFollower(link, on_regroup)
    follower.start()
    sys.stdin.read()  # until the bench is done
    follower.stop()
    link.close()


def follow_the_log(log_url: str, job: str, on_regroup: Callable[[int], None]) -> None:
    """How a rank's decisions thread followed the log itself before the agent relayed them."""
    stop = threading.Event()

    def stop_at_eof() -> None:
        sys.stdin.read()
        stop.set()

    threading.Thread(target=stop_at_eof, daemon=True).start()
    with open_log(log_url) as log:
        cursor = StreamCursor(log, Stream.DECISIONS, job, stop=stop)
        while not stop.is_set():
            for entry in cursor.poll(RANK_FOLLOW_S):
                if isinstance(entry.record, RegroupPlanned):
                    on_regroup(entry.record.generation)


def agent_relay(log: LogConnector, job: str, links: ProcessLinks, stop: threading.Event) -> None:
    """The decision part of the agent's loop (agent/job.py, Agent._supervise)."""
    cursor = StreamCursor(log, Stream.DECISIONS, job, stop=stop)
    while not stop.is_set():
        for entry in cursor.poll(AGENT_FOLLOW_S):
            if isinstance(entry.record, PROCESS_DECISIONS):
                links.relay(entry.record)


def relay_round(tmp: Path, relay: bool, ranks: int, trials: int) -> list[list[float]]:
    """Per decision, each rank's milliseconds from its append to the rank's callback."""
    job = f"relay-{uuid.uuid4().hex[:8]}"
    url = f"sqlite:///{tmp}/{job}.db"
    with ExitStack() as stack:
        log = stack.enter_context(open_log(url))
        link_path = ""
        if relay:
            directory = tmp / job
            directory.mkdir()
            links = ProcessLinks(directory, log, patience_s=5.0)
            stack.callback(links.close, 5.0)
            stop = threading.Event()
            thread = threading.Thread(target=agent_relay, args=(log, job, links, stop))
            thread.start()
            stack.callback(thread.join)
            stack.callback(stop.set)
            link_path = links.path
        command = [
            sys.executable,
            "-m",
            "bench.decision_latency",
            "--follower",
            url,
            job,
            link_path,
        ]
        children = [
            subprocess.Popen(
                command, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, cwd=REPO
            )
            for _ in range(ranks)
        ]
        for child in children:
            stack.callback(child.wait, 30)
            stack.callback(child.stdin.close)  # type: ignore[union-attr]

        def decide(generation: int) -> list[float]:
            written = time.time()
            log.append(Stream.DECISIONS, regroup(job, generation))
            seen = []
            for child in children:
                got, at = child.stdout.readline().split()  # type: ignore[union-attr]
                assert int(got) == generation, (got, generation)
                seen.append((float(at) - written) * 1000)
            return seen

        decide(1)  # every follower is up and has read the stream once
        samples = []
        for generation in range(2, trials + 2):
            time.sleep(PAUSE_S)
            samples.append(decide(generation))
    return samples


def regroup(job: str, generation: int) -> RegroupPlanned:
    return RegroupPlanned(
        job_id=job,
        generation=generation,
        source="engine",
        caused_by=generation,
        members=[0],
        replaced=[],
    )


def relay_main(args: argparse.Namespace) -> None:
    console = Console()
    modes = {"each rank follows the log": False, "the agent relays": True}
    samples: dict[str, list[list[float]]] = {mode: [] for mode in modes}
    rounds = 1 if args.quick else 3
    with tempfile.TemporaryDirectory(prefix="flashrecovery-relay-") as tmp:
        for index in range(rounds):  # interleaved: the load changes between rounds
            for mode, relay in modes.items():
                console.print(f"round {index + 1}/{rounds}: {mode} ({args.ranks} ranks) …")
                samples[mode] += relay_round(Path(tmp), relay, args.ranks, args.trials)
    results: dict[str, object] = {"machine": machine(), "ranks": args.ranks}
    table = Table(title=f"decision written → rank acts ({args.ranks} ranks of one node), ms")
    for column in ("", "median (any rank)", "p90 (any rank)", "median (last rank)", "max"):
        table.add_column(column, justify="right")
    for mode, per_decision in samples.items():
        every = summarise([ms for decision in per_decision for ms in decision])
        last = summarise([max(decision) for decision in per_decision])
        results[mode] = {"any_rank": every, "last_rank": last, "decisions": len(per_decision)}
        table.add_row(
            mode,
            *(f"{v:.1f}" for v in (every["median_ms"], every["p90_ms"], last["median_ms"])),
            f"{every['max_ms']:.1f}",
        )
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "decision_relay.json").write_text(json.dumps(results, indent=2))
    console.print(table)
    console.print(f"load average {os.getloadavg()}")


def main() -> None:
    if sys.argv[1:2] == ["--follower"]:
        follower_main(*sys.argv[2:5])
        return
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--trials", type=int, default=20)
    parser.add_argument("--kafka", help="bootstrap of a running broker (default: start one)")
    parser.add_argument("--relay", action="store_true", help="log followers vs the agent's relay")
    parser.add_argument("--ranks", type=int, default=4, help="--relay: follower processes")
    parser.add_argument("--quick", action="store_true", help="--relay: one round of 5")
    args = parser.parse_args()
    configure_logging()
    if args.relay:
        if args.quick:
            args.trials, args.ranks = 5, 2
        relay_main(args)
        return
    results: dict[str, dict[str, float]] = {}
    with ExitStack() as stack:
        tmp = stack.enter_context(tempfile.TemporaryDirectory())
        bootstrap = args.kafka
        if bootstrap is None:
            from flashrecovery.connectors.kafka_broker import KafkaBroker

            broker = KafkaBroker()
            broker.start()
            stack.callback(broker.stop)
            bootstrap = broker.bootstrap
        urls = {
            "embedded": f"sqlite:///{tmp}/latency.db",
            "kafka": f"kafka://{bootstrap}?topic_prefix=latency{uuid.uuid4().hex[:6]}.",
        }
        for label, url in urls.items():
            log = stack.enter_context(open_log(url))
            results[label] = summarise(measure(log, args.trials, label))
    results["kafka_added_median_ms"] = {
        "value": results["kafka"]["median_ms"] - results["embedded"]["median_ms"]
    }
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "decision_latency.json").write_text(json.dumps(results, indent=2))
    table = Table(title=f"kill record → isolate decision readable ({args.trials} trials)")
    for column in ("log", "median ms", "p90 ms", "min ms", "max ms"):
        table.add_column(column, justify="right")
    for label in urls:
        r = results[label]
        table.add_row(label, *(f"{r[k]:.1f}" for k in ("median_ms", "p90_ms", "min_ms", "max_ms")))
    Console().print(table)
    Console().print(f"Kafka adds {results['kafka_added_median_ms']['value']:.1f} ms (median)")


if __name__ == "__main__":
    main()
