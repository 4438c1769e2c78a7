"""Host a multi-node job's rendezvous store and its preferred engine on a process of their own.

`flashrecovery control-plane --log URL --bind HOST:PORT [--job-id ID]` listens where the agents'
``--rdzv-endpoint`` points (they run with ``--control-plane``), waits for node 0's agent to start
the job, then decides for it until it ends, by the lease in the log like every engine of a
multi-node job: the agents' engines stand by and leave the lease to it while it lives. The
ranks never meet on its store (generation 0 meets on node 0's), so its loss costs the job one
lease: a standby engine on a node takes over from the log within LEASE_TTL_S and the job goes
on; only agents joining later, which rendezvous here, can no longer join (docs/multinode.md).
It needs the job's secret (FLASHRECOVERY_STORE_PREFIX) like every agent.
"""

from __future__ import annotations

import argparse
import datetime
import os
import signal
import sys
import time

from flashrecovery.agent import rendezvous
from flashrecovery.agent.config import MIN_SECRET, Endpoint, check_shared_log
from flashrecovery.agent.job import LEASE_TTL_S
from flashrecovery.agent.store import JobStore
from flashrecovery.connectors.signing import Keyring
from flashrecovery.engine.loop import EngineLoop
from flashrecovery.errors import ConfigError, LogError
from flashrecovery.observe.exporter import MetricsServer, add_metrics_port
from flashrecovery.options import add_job_option
from flashrecovery.statemachines.job import JobState

STORE_TIMEOUT = datetime.timedelta(seconds=60)
JOB_POLL_S = 0.2  # how often it looks whether node 0's agent has started the job


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--log", required=True, metavar="URL", help="the job's log URL")
    parser.add_argument(
        "--bind", required=True, metavar="HOST:PORT", help="where the agents' --rdzv-endpoint is"
    )
    add_job_option(parser, dest="job_id", help="refuse a job of another id (default: any)")
    add_metrics_port(parser)


def run(args: argparse.Namespace) -> int:
    secret = os.environ.get("FLASHRECOVERY_STORE_PREFIX", "")
    try:
        endpoint = Endpoint.parse(args.bind)
        check_shared_log(args.log, endpoint)
        if len(secret) < MIN_SECRET:
            raise ConfigError(
                f"FLASHRECOVERY_STORE_PREFIX (at least {MIN_SECRET} characters, the same for "
                "every agent) must be set"
            )
        store = JobStore.open(STORE_TIMEOUT, endpoint.host, endpoint.port, secret)
    except ConfigError as exc:
        print(f"flashrecovery control-plane: error: {exc}", file=sys.stderr)
        return 2
    signal.signal(signal.SIGTERM, signal.default_int_handler)  # before the line that announces it
    try:
        print(
            f"flashrecovery: control plane on {endpoint}, log {args.log}",
            file=sys.stderr,
            flush=True,
        )
        while not store.keys.check([rendezvous.JOB_KEY]):  # a signal can end this wait
            time.sleep(JOB_POLL_S)
        job_id = store.keys.get(rendezvous.JOB_KEY).decode()  # node 0's agent started it
        if args.job_id is not None and args.job_id != job_id:
            print(f"flashrecovery control-plane: error: job {job_id!r} is not {args.job_id!r}")
            return 2
        engine = EngineLoop(args.log, job_id, lease_ttl_s=LEASE_TTL_S, keys=Keyring(secret))
        metrics = None
        if args.metrics_port is not None:
            metrics = MetricsServer(
                args.log,
                job_id,
                args.metrics_port,
                reader_position=lambda: engine.next_position,
                keys=engine.keys,
            ).start()
            print(f"metrics on {metrics.url}", file=sys.stderr, flush=True)
        try:
            engine.run()
        finally:
            engine.stop()
            if metrics is not None:
                metrics.stop()
    except (KeyboardInterrupt, LogError) as exc:
        print(f"flashrecovery control-plane: stopped: {exc!r}", file=sys.stderr)
        return 1
    print(f"flashrecovery: job {job_id} {engine.state.job.state}", file=sys.stderr)
    return 0 if engine.state.job.state is JobState.COMPLETED else 1
