"""Run a single-node Kafka broker from Maven Central jars (start | stop | status).

The project needs a real broker for its tests and demo on machines without Docker or the Apache
download site: Maven fetches the jars once into a cache outside the repo, and the broker runs in
KRaft mode on free loopback ports with a fresh data dir per start (KAFKA.md).
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
from collections.abc import Callable, Iterator
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
node.id=1
controller.quorum.bootstrap.servers=127.0.0.1:{cport}
listeners=PLAINTEXT://127.0.0.1:{port},CONTROLLER://127.0.0.1:{cport}
advertised.listeners=PLAINTEXT://127.0.0.1:{port},CONTROLLER://127.0.0.1:{cport}
inter.broker.listener.name=PLAINTEXT
controller.listener.names=CONTROLLER
listener.security.protocol.map=CONTROLLER:PLAINTEXT,PLAINTEXT:PLAINTEXT
log.dirs={data}
num.partitions=1
offsets.topic.replication.factor=1
offsets.topic.num.partitions=1
transaction.state.log.replication.factor=1
transaction.state.log.min.isr=1
share.coordinator.state.topic.replication.factor=1
share.coordinator.state.topic.min.isr=1
group.initial.rebalance.delay.ms=0
log.cleaner.dedupe.buffer.size=8388608
"""


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


def free_port() -> int:
    """A loopback port nobody listens on now (the OS picks it when binding port 0)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


def _accepts(port: int) -> bool:
    with socket.socket() as sock:
        sock.settimeout(1.0)
        return sock.connect_ex(("127.0.0.1", port)) == 0


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

    @property
    def bootstrap(self) -> str:
        return f"127.0.0.1:{self.port}"


class KafkaBroker:
    """One single-node KRaft broker: ``start()`` returns its bootstrap address, ``stop()``
    ends it; ``stop(keep_data=True)`` then ``start()`` restarts it on the same data and port."""

    def __init__(
        self,
        version: str = KAFKA_VERSION,
        cache: Path | None = None,
        die_with_parent: bool = True,
    ) -> None:
        self.version = version
        self.cache = cache
        self.die_with_parent = die_with_parent
        self.run_dir: Path | None = None
        self.port = 0
        self.controller_port = 0
        self.process: psutil.Process | None = None
        self._popen: subprocess.Popen[bytes] | None = None  # only for a broker we started

    @property
    def bootstrap(self) -> str:
        return f"127.0.0.1:{self.port}"

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
        libs = ensure_jars(self.version, self.cache)
        classpath = f"{libs}/*"
        if self.run_dir is None:
            self._prepare(classpath)
        assert self.run_dir is not None and self.log_path is not None
        java = [
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
        self._await_serving(timeout, progress)
        return self.bootstrap

    def _prepare(self, classpath: str) -> None:
        """A fresh run dir with config, a formatted data dir and free ports."""
        run_dir = Path(tempfile.mkdtemp(prefix="flashrecovery-kafka-"))
        self.port, self.controller_port = free_port(), free_port()
        while self.controller_port == self.port:
            self.controller_port = free_port()
        props = run_dir / "server.properties"
        props.write_text(
            _SERVER_PROPERTIES.format(
                port=self.port, cport=self.controller_port, data=run_dir / "data"
            )
        )
        (run_dir / "log4j2.properties").write_text(_LOG4J2)
        cluster_id = base64.urlsafe_b64encode(secrets.token_bytes(16)).decode().rstrip("=")
        fmt = [
            "java", *JVM_OPTS, "-cp", classpath, "kafka.tools.StorageTool", "format",
            # "=" form: an id may start with "-", which argparse would take for an option
            "--standalone", f"--cluster-id={cluster_id}", "-c", str(props),
        ]  # fmt: skip
        done = subprocess.run(fmt, capture_output=True, text=True, timeout=120, check=False)
        if done.returncode != 0:
            shutil.rmtree(run_dir, ignore_errors=True)
            raise BrokerError(f"formatting the KRaft data dir failed:\n{done.stdout}{done.stderr}")
        self.run_dir = run_dir

    def _await_serving(self, timeout: float, progress: Callable[[float], None] | None) -> None:
        """Poll until the client port accepts (it opens only once the broker serves)."""
        assert self._popen is not None
        started = time.monotonic()
        while not _accepts(self.port):
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
        )

    @classmethod
    def attach(cls, state: BrokerState) -> KafkaBroker:
        """The broker a state file describes (for stop/status from another process)."""
        broker = cls(die_with_parent=False)
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


# ------------------------------------------------------------------------ CLI


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("action", choices=("start", "stop", "status"))
    parser.add_argument(
        "--state-dir",
        type=Path,
        default=None,
        help="where the background broker's state file lives (default: the jar cache)",
    )
    parser.add_argument("--timeout", type=float, default=START_TIMEOUT_S, help="start bound, s")


def _state_file(args: argparse.Namespace) -> Path:
    return (args.state_dir or cache_root()) / "broker.json"


def _load_state(path: Path) -> BrokerState | None:
    try:
        return BrokerState(**json.loads(path.read_text()))
    except (OSError, ValueError, TypeError):
        return None


def run(args: argparse.Namespace) -> int:
    """Print the bootstrap address on stdout (for scripts); progress goes to stderr."""
    path = _state_file(args)
    state = _load_state(path)
    known = KafkaBroker.attach(state) if state else None
    running = known if known is not None and known.process is not None else None
    if args.action == "status":
        if running is None:
            print("stopped", file=sys.stderr)
            return 1
        serving = "serving" if _accepts(running.port) else "not serving yet"
        print(f"running ({serving}), data in {running.run_dir}", file=sys.stderr)
        print(running.bootstrap)
        return 0
    if known is not None:
        if args.action == "start" and running is not None:
            print("already running", file=sys.stderr)
            print(running.bootstrap)
            return 0
        known.stop()  # `stop`, or a stale state file whose broker died: drop its data dir
    path.unlink(missing_ok=True)
    if args.action == "stop":
        print("stopped", file=sys.stderr)
        return 0
    return _start_background(path, args.timeout)


def _start_background(state_file: Path, timeout: float) -> int:
    broker = KafkaBroker(die_with_parent=False)
    shown = -1

    def progress(elapsed: float) -> None:
        nonlocal shown
        if int(elapsed) > shown:
            shown = int(elapsed)
            print(f"\rstarting Kafka {broker.version} … {shown} s", end="", file=sys.stderr)

    if not (cache_root() / broker.version / "libs" / _COMPLETE).exists():
        print(f"fetching Kafka {broker.version} jars into {cache_root()}", file=sys.stderr)
    try:
        bootstrap = broker.start(timeout=timeout, progress=progress)
    except BrokerError as exc:
        print(f"\nbroker failed: {exc}", file=sys.stderr)
        return 1
    state_file.parent.mkdir(parents=True, exist_ok=True)
    state_file.write_text(json.dumps(asdict(broker.state())))
    print(
        f"\rKafka {broker.version} serves at {bootstrap}; log: {broker.log_path}", file=sys.stderr
    )
    print(bootstrap)
    return 0
