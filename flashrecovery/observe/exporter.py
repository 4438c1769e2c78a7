"""Serve a job's Prometheus metrics over HTTP, folded from its log, live or finished.

`flashrecovery metrics --log URL --job ID [--port 9464] [--host 0.0.0.0]`: follows the job's
events into a JobFold (observe/metrics.py) and answers /metrics from it. The agent
(`run --metrics-port`) and `flashrecovery engine --metrics-port` run the same server, and also
report how far their engine is behind the log.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import threading
import time
from collections.abc import Callable, Iterator
from wsgiref.simple_server import WSGIServer

import structlog
from prometheus_client.core import Metric
from prometheus_client.exposition import start_http_server
from prometheus_client.registry import Collector, CollectorRegistry

from flashrecovery.connectors import open_log
from flashrecovery.connectors.base import LogConnector
from flashrecovery.connectors.believed import BelievedLog
from flashrecovery.connectors.signing import SECRET, Keyring
from flashrecovery.errors import LogError
from flashrecovery.observe.metrics import PER_RANK_LIMIT, JobFold, families
from flashrecovery.options import add_job_option
from flashrecovery.records import Stream

log = structlog.get_logger("flashrecovery.metrics")
FOLLOW_S = 0.2  # longest wait per follow: how quickly stop() is noticed
DEFAULT_PORT = 9464
CATCH_UP_S = 300.0  # longest wait for the first fold of a big log before saying "serving"


class MetricsServer(Collector):
    """Follows one job's events in a thread and serves its metrics on ``port`` (0: any free
    port; read ``.port`` once started). ``reader_position`` gives the next events position of
    the engine in this process, for the log lag."""

    def __init__(
        self,
        log_or_url: LogConnector | str,
        job_id: str,
        port: int = DEFAULT_PORT,
        *,
        host: str = "0.0.0.0",
        reader_position: Callable[[], int] | None = None,
        per_rank_limit: int = PER_RANK_LIMIT,
        clock: Callable[[], float] = time.time,
        keys: Keyring | None = None,
    ) -> None:
        self._log = (
            open_log(log_or_url, read_only=True) if isinstance(log_or_url, str) else log_or_url
        )
        self.log: LogConnector = self._log
        self._owns_log = isinstance(log_or_url, str)
        if keys is not None:
            self.believe(keys)
        self.fold = JobFold(job_id)
        self.host, self.port = host, port
        self._reader_position = reader_position
        self._per_rank_limit = per_rank_limit
        self._clock = clock
        self._folded = threading.Condition()  # held while folding; notified after
        self._stop = threading.Event()
        self._next = 0
        self._thread: threading.Thread | None = None
        self._server: WSGIServer | None = None

    def believe(self, keys: Keyring) -> None:
        """Fold only what the job's keys signed from now on (a forged record would otherwise
        show an incident the engine never opened): the agent learns its job's keys only once
        it has joined the job, after its metrics already serve."""
        self.log = BelievedLog(self._log, keys)

    def collect(self) -> Iterator[Metric]:
        with self._folded:
            reader = self._reader_position() if self._reader_position else None
            yield from list(
                families(
                    self.fold,
                    self._clock(),
                    reader_position=reader,
                    per_rank_limit=self._per_rank_limit,
                )
            )

    def _poll(self, timeout: float) -> None:
        """Fold the events that arrived (waiting up to ``timeout`` for one)."""
        entries = self.log.follow(Stream.EVENTS, self.fold.job_id, self._next, timeout)
        with self._folded:
            for entry in entries:
                self.fold.apply(entry)
                self._next = entry.position + 1
            self._folded.notify_all()

    def wait_caught_up(self, timeout: float) -> bool:
        """Wait until every event in the log now has been folded; False if ``timeout`` passed."""
        last = self.log.read(Stream.EVENTS, self.fold.job_id, self._next)
        target = last[-1].position + 1 if last else 0
        with self._folded:
            return self._folded.wait_for(lambda: self._next >= target, timeout)

    def _follow(self) -> None:
        while not self._stop.is_set():
            try:
                self._poll(FOLLOW_S)
            except LogError as exc:  # the log is briefly away: serve what we have, retry
                log.warning("log unavailable, retrying", error=str(exc))
                self._stop.wait(FOLLOW_S)

    def start(self) -> MetricsServer:
        registry = CollectorRegistry(auto_describe=False)
        registry.register(self)
        server, _ = start_http_server(self.port, self.host, registry)
        self._server = server
        self.port = server.server_port
        self._thread = threading.Thread(target=self._follow, name="metrics", daemon=True)
        self._thread.start()
        return self

    @property
    def url(self) -> str:
        host = "127.0.0.1" if self.host in ("0.0.0.0", "") else self.host
        return f"http://{host}:{self.port}/metrics"

    def stop(self, timeout: float = 5.0) -> None:
        self._stop.set()
        server = self._server
        if server is not None:
            server.shutdown()
            server.server_close()
        if self._thread is not None:
            self._thread.join(timeout)
        if self._owns_log:
            self._log.close()


def add_metrics_port(parser: argparse.ArgumentParser) -> None:
    """The option `run`, `engine` and `control-plane` share."""
    parser.add_argument(
        "--metrics-port",
        type=int,
        default=None,
        metavar="PORT",
        help="serve the job's Prometheus metrics on this port (0: any free port)",
    )


# ------------------------------------------------------------------ command line


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--log", required=True, help="log URL")
    add_job_option(parser, dest="job", required=True, help="job id")
    parser.add_argument(
        "--port", type=int, default=DEFAULT_PORT, help=f"0: any free port (default {DEFAULT_PORT})"
    )
    parser.add_argument("--host", default="0.0.0.0", help="address to listen on")
    parser.add_argument(
        "--per-rank-limit",
        type=int,
        default=PER_RANK_LIMIT,
        help="heartbeat ages per rank up to this many ranks, per host beyond",
    )


def run(args: argparse.Namespace) -> int:
    if not 0 <= args.port <= 65535:
        print(f"error: --port must be 0..65535, got {args.port}", file=sys.stderr)
        return 2
    try:
        log = open_log(args.log, read_only=True)
        if args.job not in log.jobs():
            log.close()
            raise LogError(f"job {args.job!r} has no records in {args.log}")
    except LogError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    secret = os.environ.get(SECRET)  # the job's: fold only what its writers signed
    server = MetricsServer(
        log,
        args.job,
        args.port,
        host=args.host,
        per_rank_limit=args.per_rank_limit,
        keys=Keyring(secret) if secret else None,
    )
    try:
        server.start()
    except OSError as exc:
        log.close()
        print(f"error: cannot listen on {args.host}:{args.port}: {exc}", file=sys.stderr)
        return 2
    # Say so only once the log as it stands is folded: a first scrape then sees the whole job.
    server.wait_caught_up(CATCH_UP_S)
    stopped = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stopped.set())  # before the line that says it serves
    print(f"serving metrics of job {args.job} on {server.url}", flush=True)
    try:
        stopped.wait()
    except KeyboardInterrupt:
        pass
    finally:
        server.stop()
        log.close()
    return 0
