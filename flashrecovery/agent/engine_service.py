"""Run the engine for a job as a service, apart from the agent.

`flashrecovery engine --log URL --job ID`, with the job's secret in FLASHRECOVERY_STORE_PREFIX
as its agents have it: rebuilds the job's state from the log, writes the
decisions still due, then follows the events until the job ends. Several engines may serve one
job: they share it through a lease recorded in the log (engine/lease.py), so only one decides at
a time and a standby takes over within the lease TTL when the active one dies.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys

from flashrecovery.connectors import open_log
from flashrecovery.connectors.signing import SECRET, Keyring
from flashrecovery.engine.loop import EngineLoop
from flashrecovery.errors import LogError
from flashrecovery.observe.exporter import MetricsServer, add_metrics_port
from flashrecovery.options import add_job_option


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--log", required=True, help="log URL")
    add_job_option(parser, dest="job", required=True, help="job id")
    parser.add_argument("--poll", type=float, default=0.05, help="longest wait per follow (s)")
    parser.add_argument(
        "--lease-ttl", type=float, default=3.0, help="seconds a lease lasts without renewal"
    )
    parser.add_argument("--engine-id", help="name of this engine in the lease records")
    add_metrics_port(parser)


def run(args: argparse.Namespace) -> int:
    secret = os.environ.get(SECRET, "")
    if not secret:
        print(
            f"error: {SECRET} is not set: give the engine the job's secret, as its agents have "
            "it (the engine signs its decisions with it and believes only signed records: "
            "docs/protocol.md)",
            file=sys.stderr,
        )
        return 2
    if args.lease_ttl <= 0:
        print("error: --lease-ttl must be positive", file=sys.stderr)
        return 2
    try:
        log = open_log(args.log)
    except LogError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    loop = EngineLoop(
        log,
        args.job,
        poll_s=args.poll,
        lease_ttl_s=args.lease_ttl,
        engine_id=args.engine_id,
        keys=Keyring(secret),
    )
    # Before the first line out: whoever reads that line may stop the engine at once.
    signal.signal(signal.SIGTERM, lambda *_: loop.stop(timeout=0))
    print(f"engine {loop.engine_id} serving job {args.job} on {args.log}", flush=True)
    metrics = None
    if args.metrics_port is not None:
        try:
            metrics = MetricsServer(
                args.log,
                args.job,
                args.metrics_port,
                reader_position=lambda: loop.next_position,
                keys=loop.keys,
            ).start()
        except OSError as exc:
            print(f"error: metrics port: {exc}", file=sys.stderr)
            log.close()
            return 2
        print(f"metrics on {metrics.url}", flush=True)
    try:
        loop.run()
    except KeyboardInterrupt:
        return 130
    finally:
        if metrics is not None:
            metrics.stop()
        log.close()
    print(f"job {args.job}: {loop.state.job.state}")
    return 0
