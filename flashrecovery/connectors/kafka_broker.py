"""Run Kafka from Maven Central jars: one broker, or a KRaft cluster of several (start | stop |
status).

The project needs real brokers for its tests and demo on machines without Docker or the Apache
download site: Maven fetches the jars once into a cache outside the repo, and each broker runs
in KRaft mode (broker and controller in one process) with a fresh data dir per start, on free
loopback ports or inside a network namespace of its own.
"""

from __future__ import annotations

import argparse
import base64
import contextlib
import ctypes
import fcntl
import json
import os
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass
from pathlib import Path

import psutil

from flashrecovery.errors import BrokerError

KAFKA_VERSION = "4.3.1"
LOG4J_VERSION = "2.25.3"
START_TIMEOUT_S = 120.0
STOP_TIMEOUT_S = 30.0
JVM_OPTS = ("-Xms256m", "-Xmx512m", "-XX:+UseSerialGC", "-Djava.awt.headless=true")
_COMPLETE = ".complete"  # written into libs/ once every jar is there
_POM = """<project xmlns="http://maven.apache.org/POM/4.0.0">
  <modelVersion>4.0.0</modelVersion>
  <groupId>flashrecovery</groupId>
  <artifactId>kafka-broker-libs</artifactId>
  <version>0</version>
  <packaging>pom</packaging>
  <dependencies>
{deps}
  </dependencies>
</project>
"""
_DEPENDENCIES = (
    ("org.apache.kafka", "kafka_2.13", KAFKA_VERSION),
    ("org.apache.kafka", "kafka-tools", KAFKA_VERSION),  # the console consumer, for checks
    ("org.apache.logging.log4j", "log4j-api", LOG4J_VERSION),
    ("org.apache.logging.log4j", "log4j-core", LOG4J_VERSION),
    ("org.apache.logging.log4j", "log4j-slf4j-impl", LOG4J_VERSION),
)
# INFO to stdout, which the broker process writes to broker.log in its run dir.
_LOG4J2 = """status = warn
appender.out.type = Console
appender.out.name = OUT
appender.out.layout.type = PatternLayout
appender.out.layout.pattern = [%d] %p %m (%c)%n
rootLogger.level = INFO
rootLogger.appenderRef.out.ref = OUT
logger.kafka.name = org.apache.kafka
logger.kafka.level = INFO
"""
_SERVER_PROPERTIES = """process.roles=broker,controller
node.id={node_id}
{quorum}
listeners=PLAINTEXT://{host}:{port},CONTROLLER://{host}:{cport}
advertised.listeners=PLAINTEXT://{host}:{port},CONTROLLER://{host}:{cport}
inter.broker.listener.name=PLAINTEXT
controller.listener.names=CONTROLLER
listener.security.protocol.map=CONTROLLER:PLAINTEXT,PLAINTEXT:PLAINTEXT
log.dirs={data}
num.partitions=1
default.replication.factor={replicas}
min.insync.replicas={min_isr}
unclean.leader.election.enable=false
offsets.topic.replication.factor={replicas}
offsets.topic.num.partitions=1
transaction.state.log.replication.factor={replicas}
transaction.state.log.min.isr={min_isr}
# The engines' decisions are written in transactions (docs/kafka.md): one partition for their
# state, not 50 made on the first fence
transaction.state.log.num.partitions=1
share.coordinator.state.topic.replication.factor={replicas}
share.coordinator.state.topic.min.isr={min_isr}
group.initial.rebalance.delay.ms=0
log.cleaner.dedupe.buffer.size=8388608
# A broker lost is fenced (its partitions led elsewhere) after 3 s instead of 9: the log is
# away for that long
broker.session.timeout.ms=3000
broker.heartbeat.interval.ms=500
"""


@dataclass(frozen=True)
class Plan:
    """One KRaft node of a cluster: where it listens and who its fellow controllers are."""

    node_id: int
    host: str
    port: int
    controller_port: int
    voters: str  # "1@host:cport,2@…": the static controller quorum ("" for one node alone)
    cluster_id: str
    replicas: int  # of the internal topics; min.insync.replicas is one fewer (at least 1)

    def properties(self, data: Path) -> str:
        quorum = (
            f"controller.quorum.voters={self.voters}"
            if self.voters
            else f"controller.quorum.bootstrap.servers={self.host}:{self.controller_port}"
        )
        return _SERVER_PROPERTIES.format(
            node_id=self.node_id,
            quorum=quorum,
            host=self.host,
            port=self.port,
            cport=self.controller_port,
            data=data,
            replicas=self.replicas,
            min_isr=max(1, self.replicas - 1),
        )


def new_cluster_id() -> str:
    """A URL-safe base64 of 16 random bytes without padding, as KRaft wants it."""
    return base64.urlsafe_b64encode(secrets.token_bytes(16)).decode().rstrip("=")


def cache_root() -> Path:
    """Where jars and the CLI's state live: never inside the work tree."""
    env = os.environ.get("FLASHRECOVERY_KAFKA_CACHE")
    return Path(env) if env else Path.home() / ".cache" / "flashrecovery" / "kafka"


@contextlib.contextmanager
def _locked(path: Path) -> Iterator[None]:
    """Serialise jar fetches of concurrent processes (two test sessions, a CLI)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        yield


def ensure_jars(version: str = KAFKA_VERSION, root: Path | None = None) -> Path:
    """The folder holding every broker jar, fetched with Maven unless already complete for
    exactly this dependency list (the pom is the cache key)."""
    base = (root or cache_root()) / version
    libs, pom = base / "libs", base / "pom.xml"
    deps = "\n".join(
        f"    <dependency><groupId>{g}</groupId><artifactId>{a}</artifactId>"
        f"<version>{version if g == 'org.apache.kafka' else v}</version></dependency>"
        for g, a, v in _DEPENDENCIES
    )
    wanted = _POM.format(deps=deps)

    def complete() -> bool:
        return (libs / _COMPLETE).exists() and pom.exists() and pom.read_text() == wanted

    if complete():
        return libs
    with _locked(base / ".lock"):
        if complete():
            return libs
        shutil.rmtree(libs, ignore_errors=True)
        pom.write_text(wanted)
        cmd = [
            "mvn", "-B", "-q", "-f", str(pom), "dependency:copy-dependencies",
            "-DincludeScope=runtime", f"-DoutputDirectory={libs}",
        ]  # fmt: skip
        try:
            done = subprocess.run(cmd, capture_output=True, text=True, timeout=900, check=False)
        except FileNotFoundError:
            raise BrokerError("Maven (mvn) is not installed; it fetches the broker jars") from None
        if done.returncode != 0:
            raise BrokerError(f"fetching Kafka {version} jars failed:\n{done.stdout[-3000:]}")
        (libs / _COMPLETE).write_text("\n".join(sorted(p.name for p in libs.glob("*.jar"))))
    return libs


LOOPBACK = "127.0.0.1"


def free_port() -> int:
    """A loopback port nobody listens on now (the OS picks it when binding port 0)."""
    with socket.socket() as sock:
        sock.bind((LOOPBACK, 0))
        port: int = sock.getsockname()[1]
        return port


def _accepts(host: str, port: int) -> bool:
    with socket.socket() as sock:
        sock.settimeout(1.0)
        return sock.connect_ex((host, port)) == 0


def _die_with_parent() -> None:
    """Child-side: SIGTERM the broker if the test process dies without cleaning up."""
    pr_set_pdeathsig = 1
    ctypes.CDLL(None).prctl(pr_set_pdeathsig, signal.SIGTERM)


@dataclass
class BrokerState:
    """What a later `broker stop|status` needs to find a broker started in the background."""

    pid: int
    create_time: float  # guards against a recycled pid
    port: int
    controller_port: int
    run_dir: str
    host: str = LOOPBACK

    @property
    def bootstrap(self) -> str:
        return f"{self.host}:{self.port}"


class KafkaBroker:
    """One KRaft broker (and controller): ``start()`` returns its bootstrap address, ``stop()``
    ends it; ``stop(keep_data=True)`` then ``start()`` restarts it on the same data and port.
    Alone (no ``plan``) it is a single-node cluster on free loopback ports; a KafkaCluster
    plans each of its nodes. ``netns``: run it inside that network namespace."""

    def __init__(
        self,
        version: str = KAFKA_VERSION,
        cache: Path | None = None,
        die_with_parent: bool = True,
        *,
        plan: Plan | None = None,
        netns: str | None = None,
    ) -> None:
        self.version = version
        self.cache = cache
        self.die_with_parent = die_with_parent
        self.plan = plan
        self.netns = netns
        self.host = plan.host if plan else LOOPBACK
        self.run_dir: Path | None = None
        self.port = 0
        self.controller_port = 0
        self.process: psutil.Process | None = None
        self._popen: subprocess.Popen[bytes] | None = None  # only for a broker we started

    @property
    def bootstrap(self) -> str:
        return f"{self.host}:{self.port}"

    @property
    def log_path(self) -> Path | None:
        return self.run_dir / "broker.log" if self.run_dir else None

    def start(
        self,
        timeout: float = START_TIMEOUT_S,
        progress: Callable[[float], None] | None = None,
    ) -> str:
        """Start (or restart on the kept data dir) and wait until the broker serves."""
        if self.process is not None and self.process.is_running():
            return self.bootstrap
        self.launch(ensure_jars(self.version, self.cache))
        self.await_serving(timeout, progress)
        return self.bootstrap

    def launch(self, libs: Path) -> None:
        """Start the process (formatting a fresh data dir first), without waiting for it."""
        classpath = f"{libs}/*"
        if self.run_dir is None:
            self._prepare(classpath)
        assert self.run_dir is not None and self.log_path is not None
        java = [
            *(["ip", "netns", "exec", self.netns] if self.netns else []),
            "java",
            *JVM_OPTS,
            f"-Dlog4j2.configurationFile={self.run_dir / 'log4j2.properties'}",
            "-cp",
            classpath,
        ]
        with self.log_path.open("ab") as log:
            popen = subprocess.Popen(
                [*java, "kafka.Kafka", str(self.run_dir / "server.properties")],
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                cwd=self.run_dir,
                start_new_session=True,
                preexec_fn=_die_with_parent if self.die_with_parent else None,
            )
        self.process = psutil.Process(popen.pid)
        self._popen = popen

    def _prepare(self, classpath: str) -> None:
        """A fresh run dir with config and a formatted data dir (alone: on free ports)."""
        run_dir = Path(tempfile.mkdtemp(prefix="flashrecovery-kafka-"))
        plan = self.plan
        if plan is None:
            port, controller_port = free_port(), free_port()
            while controller_port == port:
                controller_port = free_port()
            plan = Plan(1, LOOPBACK, port, controller_port, "", new_cluster_id(), 1)
        self.port, self.controller_port = plan.port, plan.controller_port
        props = run_dir / "server.properties"
        props.write_text(plan.properties(run_dir / "data"))
        (run_dir / "log4j2.properties").write_text(_LOG4J2)
        fmt = [
            "java", *JVM_OPTS, "-cp", classpath, "kafka.tools.StorageTool", "format",
            # "=" form: an id may start with "-", which argparse would take for an option
            f"--cluster-id={plan.cluster_id}", "-c", str(props),
            *([] if plan.voters else ["--standalone"]),
        ]  # fmt: skip
        done = subprocess.run(fmt, capture_output=True, text=True, timeout=120, check=False)
        if done.returncode != 0:
            shutil.rmtree(run_dir, ignore_errors=True)
            raise BrokerError(f"formatting the KRaft data dir failed:\n{done.stdout}{done.stderr}")
        self.run_dir = run_dir

    def await_serving(
        self, timeout: float = START_TIMEOUT_S, progress: Callable[[float], None] | None = None
    ) -> None:
        """Poll until the client port accepts (it opens only once the broker serves)."""
        assert self._popen is not None
        started = time.monotonic()
        while not _accepts(self.host, self.port):
            elapsed = time.monotonic() - started
            if self._popen.poll() is not None:
                raise BrokerError(f"the broker exited while starting:\n{self.log_tail()}")
            if elapsed > timeout:
                self.stop()
                raise BrokerError(f"the broker did not serve within {timeout:.0f} s")
            if progress:
                progress(elapsed)
            with contextlib.suppress(subprocess.TimeoutExpired):
                self._popen.wait(timeout=0.25)  # a bounded pause that ends early on exit

    def log_tail(self, lines: int = 30) -> str:
        if self.log_path is None or not self.log_path.exists():
            return "(no log)"
        return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])

    def stop(self, keep_data: bool = False, timeout: float = STOP_TIMEOUT_S) -> None:
        """SIGTERM, a bounded wait for the clean shutdown, then SIGKILL; remove the data dir
        unless it is kept for a restart."""
        if self.process is not None:
            _terminate(self.process, timeout)
            if self._popen is not None:
                self._popen.wait()  # reap it
            self.process, self._popen = None, None
        if not keep_data and self.run_dir is not None:
            shutil.rmtree(self.run_dir, ignore_errors=True)
            self.run_dir = None

    def state(self) -> BrokerState:
        assert self.process is not None and self.run_dir is not None
        return BrokerState(
            self.process.pid,
            self.process.create_time(),
            self.port,
            self.controller_port,
            str(self.run_dir),
            self.host,
        )

    @classmethod
    def attach(cls, state: BrokerState) -> KafkaBroker:
        """The broker a state file describes (for stop/status from another process)."""
        broker = cls(die_with_parent=False)
        broker.host = state.host
        broker.port, broker.controller_port = state.port, state.controller_port
        broker.run_dir = Path(state.run_dir)
        with contextlib.suppress(psutil.NoSuchProcess):
            process = psutil.Process(state.pid)
            if abs(process.create_time() - state.create_time) < 1e-3:
                broker.process = process
        return broker

    def __enter__(self) -> KafkaBroker:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


def _terminate(process: psutil.Process, timeout: float) -> None:
    with contextlib.suppress(psutil.NoSuchProcess):
        process.terminate()
        try:
            process.wait(timeout=timeout)
        except psutil.TimeoutExpired:
            process.kill()
            process.wait(timeout=timeout)


class KafkaCluster:
    """``brokers`` KRaft nodes, each a broker and a controller of one static quorum, with the
    internal topics (and, by the log's default, its own) replicated on up to 3 of them and
    ``min.insync.replicas`` one fewer: acks=all then survives the loss of one broker.
    ``hosts``: each node's address and network namespace (default: all on loopback, free
    ports); ``stop(node)``/``start(node)`` kill and bring back one of them."""

    def __init__(
        self,
        brokers: int = 3,
        *,
        hosts: Sequence[tuple[str, str | None]] | None = None,
        version: str = KAFKA_VERSION,
        cache: Path | None = None,
        die_with_parent: bool = True,
    ) -> None:
        if brokers < 1:
            raise BrokerError(f"a cluster needs at least 1 broker, got {brokers}")
        places = hosts or [(LOOPBACK, None)] * brokers
        if len(places) != brokers:
            raise BrokerError(f"{brokers} brokers but {len(places)} hosts for them")
        ports = _distinct_ports(2 * brokers) if hosts is None else [9092, 9093] * brokers
        voters = ",".join(
            f"{i + 1}@{host}:{ports[2 * i + 1]}" for i, (host, _) in enumerate(places)
        )
        cluster_id, replicas = new_cluster_id(), min(3, brokers)
        self.brokers = [
            KafkaBroker(
                version,
                cache,
                die_with_parent,
                plan=Plan(
                    i + 1,
                    host,
                    ports[2 * i],
                    ports[2 * i + 1],
                    voters if brokers > 1 else "",
                    cluster_id,
                    replicas,
                ),
                netns=netns,
            )
            for i, (host, netns) in enumerate(places)
        ]

    @property
    def bootstrap(self) -> str:
        return ",".join(broker.bootstrap for broker in self.brokers)

    def start(
        self, timeout: float = START_TIMEOUT_S, progress: Callable[[float], None] | None = None
    ) -> str:
        """Start every node at once (a controller quorum forms only once most of it is up)."""
        libs = ensure_jars(self.brokers[0].version, self.brokers[0].cache)
        try:
            for broker in self.brokers:
                broker.launch(libs)
            for broker in self.brokers:
                broker.await_serving(timeout, progress)
        except BaseException:
            self.stop()
            raise
        return self.bootstrap

    def stop(self, keep_data: bool = False) -> None:
        """All at once: stopped one after another, the last ones have lost their controllers'
        majority and wait out their clean shutdown's bound (30 s) before they are killed."""
        with ThreadPoolExecutor(len(self.brokers)) as pool:
            list(pool.map(lambda broker: broker.stop(keep_data=keep_data), self.brokers))

    def __enter__(self) -> KafkaCluster:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


def _distinct_ports(count: int) -> list[int]:
    ports: list[int] = []
    while len(ports) < count:
        port = free_port()
        if port not in ports:
            ports.append(port)
    return ports


# ------------------------------------------------------------------------ CLI


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("action", choices=("start", "stop", "status"))
    parser.add_argument(
        "--brokers",
        type=int,
        default=1,
        metavar="N",
        help="start: a KRaft cluster of N brokers on loopback (3: every topic on 3 of them, "
        "min.insync.replicas 2, so one may be lost; default 1)",
    )
    parser.add_argument(
        "--state-dir",
        type=Path,
        default=None,
        help="where the background broker's state file lives (default: the jar cache)",
    )
    parser.add_argument("--timeout", type=float, default=START_TIMEOUT_S, help="start bound, s")


def _state_file(args: argparse.Namespace) -> Path:
    return (args.state_dir or cache_root()) / "broker.json"


def _load_states(path: Path) -> list[BrokerState]:
    try:
        data = json.loads(path.read_text())
        return [BrokerState(**state) for state in data["brokers"]]
    except (OSError, ValueError, TypeError, KeyError):
        return []


def _bootstrap(brokers: list[KafkaBroker]) -> str:
    return ",".join(broker.bootstrap for broker in brokers)


def run(args: argparse.Namespace) -> int:
    """Print the bootstrap address on stdout (for scripts); progress goes to stderr."""
    path = _state_file(args)
    known = [KafkaBroker.attach(state) for state in _load_states(path)]
    running = [broker for broker in known if broker.process is not None]
    if args.action == "status":
        if not running:
            print("stopped", file=sys.stderr)
            return 1
        for broker in running:
            serving = "serving" if _accepts(broker.host, broker.port) else "not serving yet"
            print(
                f"{broker.bootstrap}: running ({serving}), data in {broker.run_dir}",
                file=sys.stderr,
            )
        print(_bootstrap(running))
        return 0
    if known:
        if args.action == "start" and running and len(running) == len(known):
            print("already running", file=sys.stderr)
            print(_bootstrap(running))
            return 0
        for broker in known:  # `stop`, or a stale state file whose brokers died
            broker.stop()
    path.unlink(missing_ok=True)
    if args.action == "stop":
        print("stopped", file=sys.stderr)
        return 0
    if args.brokers < 1:
        print(f"--brokers must be at least 1, got {args.brokers}", file=sys.stderr)
        return 2
    return _start_background(path, args.brokers, args.timeout)


def _start_background(state_file: Path, brokers: int, timeout: float) -> int:
    cluster = KafkaCluster(brokers, die_with_parent=False)
    version = cluster.brokers[0].version
    shown = -1

    def progress(elapsed: float) -> None:
        nonlocal shown
        if int(elapsed) > shown:
            shown = int(elapsed)
            print(f"\rstarting Kafka {version} ({brokers}) … {shown} s", end="", file=sys.stderr)

    if not (cache_root() / version / "libs" / _COMPLETE).exists():
        print(f"fetching Kafka {version} jars into {cache_root()}", file=sys.stderr)
    try:
        bootstrap = cluster.start(timeout=timeout, progress=progress)
    except BrokerError as exc:
        print(f"\nbroker failed: {exc}", file=sys.stderr)
        return 1
    state_file.parent.mkdir(parents=True, exist_ok=True)
    states = [asdict(broker.state()) for broker in cluster.brokers]
    state_file.write_text(json.dumps({"brokers": states}))
    logs = ", ".join(str(broker.log_path) for broker in cluster.brokers)
    print(f"\rKafka {version} serves at {bootstrap}; logs: {logs}", file=sys.stderr)
    print(bootstrap)
    return 0
