"""What one `flashrecovery run` needs, checked before anything starts."""

from __future__ import annotations

import importlib.util
import ipaddress
import os
import re
import socket
import sys
import time
import uuid
from dataclasses import dataclass, field, replace
from enum import StrEnum
from importlib.machinery import PathFinder
from pathlib import Path
from typing import TypeVar
from urllib.parse import urlsplit

from flashrecovery.connectors import open_log
from flashrecovery.errors import ConfigError, LogError
from flashrecovery.records import NonFinitePolicy, StragglerPolicy, Stream
from flashrecovery.trainer_hooks.digest import DEFAULT_VERIFY_EVERY
from flashrecovery.trainer_hooks.env import GroupRebuild
from flashrecovery.trainer_hooks.probe import ENV, FaultPlan

_JOB_ID = re.compile(r"^[A-Za-z0-9_.\-]{1,200}$")
LOOPBACK = "127.0.0.1"
MAX_NODE_WAIT_S = 50.0  # below the members' wait at the regroup barrier (groups.COLLECTIVE_TIMEOUT)
MIN_SECRET = 16  # characters of FLASHRECOVERY_STORE_PREFIX a multi-node job needs


E = TypeVar("E", bound=StrEnum)


class SpareRefill(StrEnum):
    """When a hot spare taken by a recovery is replaced in the pool."""

    IMMEDIATE = "immediate"
    AFTER_RECOVERY = "after-recovery"


class RunAs(StrEnum):
    """What the script argument names, as torchrun reads it."""

    SCRIPT = "script"  # python script.py args (the default)
    MODULE = "module"  # python -m pkg.mod args (torchrun's -m)
    PROGRAM = "program"  # an executable of its own (torchrun's --no-python)


class StartMethod(StrEnum):
    """How the agent starts its processes (agent/forkserver.py)."""

    FORKSERVER = "forkserver"  # forked from one process per node that has imported torch
    EXEC = "exec"  # a new interpreter each


def _choice(kind: type[E], value: str, flag: str) -> E:
    try:
        return kind(value)
    except ValueError:
        raise ConfigError(f"{flag} {value!r}: expected one of {', '.join(kind)}") from None


def is_loopback(host: str) -> bool:
    """Whether ``host`` names this machine's loopback (every "node" of the job on one host)."""
    try:
        return ipaddress.ip_address(socket.gethostbyname(host)).is_loopback
    except (OSError, ValueError):
        return False


@dataclass(frozen=True)
class Endpoint:
    host: str
    port: int

    @classmethod
    def parse(cls, text: str) -> Endpoint:
        host, sep, port = text.rpartition(":")
        if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
            raise ConfigError(f"--rdzv-endpoint {text!r}: expected HOST:PORT")
        return cls(host.strip("[]"), int(port))

    @property
    def loopback(self) -> bool:
        return is_loopback(self.host)

    def free_here(self) -> bool:
        """This host can listen on the endpoint: it is one of its addresses and nobody hosts a
        store there yet (how an agent given no ``--node-rank`` knows it is node 0)."""
        try:
            with socket.create_server((self.host, self.port)):
                return True
        except OSError:
            return False

    def __str__(self) -> str:
        return f"{self.host}:{self.port}"


@dataclass(frozen=True)
class AgentConfig:
    script: Path  # a module's dotted name with run_as MODULE
    script_args: list[str] = field(default_factory=list)
    run_as: RunAs = RunAs.SCRIPT
    nproc: int = 1
    spares: int = 0
    log_url: str | None = None  # default: sqlite://<cwd>/runs/<job-id>/log.db
    job_id: str | None = None  # default: generated
    heartbeat_interval_s: float = 1.0
    stall_floor_s: float = 5.0  # no step progress this long (at least) while peers wait: stall
    straggler_policy: StragglerPolicy = StragglerPolicy.REPORT  # a node or rank slowing the job
    straggler_ratio: float = 2.0  # a rank this much slower than its peers' median, steadily,
    straggler_steps: int = 20  # over this many steps (its median slowdown): a straggler
    nonfinite_policy: NonFinitePolicy = NonFinitePolicy.FAIL  # a step non-finite twice
    verify_every: int = DEFAULT_VERIFY_EVERY  # replicas compare state digests (0: never)
    external_engine: bool = False  # decisions come from `flashrecovery engine` services
    fault_plan: FaultPlan = field(
        default_factory=FaultPlan
    )  # tests only: FLASHRECOVERY_FAULT_PLAN (probe.py)
    final_state_dir: Path | None = None  # each rank's finish() leaves its final state here
    output_dir: Path | None = None  # each child's stdout+stderr in its own file; else inherited
    max_replacements: int = 3  # the same rank failing this often at one step fails the job
    max_incidents: int | None = None  # incidents recovered at most (None: no bound)
    spare_refill: SpareRefill = SpareRefill.IMMEDIATE
    start_method: StartMethod = StartMethod.FORKSERVER
    metrics_port: int | None = None  # serve Prometheus metrics here (0: any free port)
    shards: int = 1  # model shards: rank r holds shard r % shards (a mesh's last dimension)
    checkpoint_dir: Path | None = None  # ranks save sharded checkpoints here (async, DCP)
    checkpoint_every: int = 0  # after every this many committed steps
    group_rebuild: GroupRebuild = GroupRebuild.FRESH
    # Nodes (docs/multinode.md): one agent per node; node 0's hosts the store and the engine.
    nnodes: int = 1
    node_rank: int | None = 0  # None: assigned at rendezvous ("auto")
    rdzv_endpoint: Endpoint | None = None  # None: a single-node job, as before
    spare_nodes: int = 0  # whole nodes of hot spares, node ranks nnodes..nnodes+spare_nodes-1
    node_wait_s: float = 30.0  # a lost node's ranks wait this long for capacity
    store_secret: str | None = field(default=None, repr=False)  # FLASHRECOVERY_STORE_PREFIX
    control_plane: bool = False  # rendezvous store, preferred engine: `flashrecovery control-plane`

    @property
    def command(self) -> list[str]:
        """The command line every rank and spare runs."""
        head = {
            RunAs.SCRIPT: [sys.executable, str(self.script)],
            RunAs.MODULE: [sys.executable, "-m", str(self.script)],
            RunAs.PROGRAM: [str(self.script)],
        }[self.run_as]
        return [*head, *self.script_args]

    @property
    def multinode(self) -> bool:
        return self.rdzv_endpoint is not None

    @property
    def starts_job(self) -> bool:
        """Node 0's agent starts the job (JobStarted) and ends it (JobFinished)."""
        return self.node_rank == 0

    @property
    def hosts_store(self) -> bool:
        """Node 0's agent hosts the store and (unless external) the engine, unless a control
        plane of its own does."""
        return self.starts_job and not self.control_plane

    def resolved(self) -> AgentConfig:
        """The config with defaults filled in and every argument checked (ConfigError)."""
        return replace(
            self,
            spare_refill=_choice(SpareRefill, self.spare_refill, "--spare-refill"),
            start_method=_choice(StartMethod, self.start_method, "--start-method"),
            group_rebuild=_choice(GroupRebuild, self.group_rebuild, "--group-rebuild"),
            run_as=RunAs(self.run_as),
        )._checked()

    def _checked(self) -> AgentConfig:
        self._check_script()
        if self.nproc < 1:
            raise ConfigError(f"--nproc-per-node must be at least 1, got {self.nproc}")
        if self.spares < 0:
            raise ConfigError(f"--spares must be 0 or more, got {self.spares}")
        if not self.heartbeat_interval_s > 0:
            raise ConfigError(
                f"--heartbeat-interval must be positive, got {self.heartbeat_interval_s}"
            )
        if not self.stall_floor_s > 0:
            raise ConfigError(f"--stall-timeout must be positive, got {self.stall_floor_s}")
        if self.max_replacements < 1:
            raise ConfigError(f"--max-replacements must be at least 1, got {self.max_replacements}")
        if self.shards < 1 or self.nproc % self.shards:
            raise ConfigError(
                f"--shards must divide --nproc-per-node {self.nproc}, got {self.shards}"
            )
        if (self.checkpoint_dir is None) != (self.checkpoint_every == 0):
            raise ConfigError("--checkpoint-dir and --checkpoint-every go together")
        if self.checkpoint_every < 0:
            raise ConfigError(f"--checkpoint-every must be positive, got {self.checkpoint_every}")
        if self.straggler_ratio <= 1:
            raise ConfigError(f"--straggler-ratio must be above 1, got {self.straggler_ratio}")
        if self.straggler_steps < 2:
            raise ConfigError(f"--straggler-steps must be 2 or more, got {self.straggler_steps}")
        if self.verify_every < 0:
            raise ConfigError(f"--verify-every must be 0 (off) or more, got {self.verify_every}")
        if self.max_incidents is not None and self.max_incidents < 1:
            raise ConfigError(f"--max-incidents must be at least 1, got {self.max_incidents}")
        if self.metrics_port is not None and not 0 <= self.metrics_port <= 65535:
            raise ConfigError(f"--metrics-port must be 0..65535, got {self.metrics_port}")
        self._check_nodes()
        world = self.nproc * self.nnodes
        for fault in self.fault_plan.faults:
            if not 0 <= fault.rank < world:
                raise ConfigError(
                    f"{ENV}: planned fault {fault.spec()}: rank outside 0..{world - 1}"
                )
        if not self.starts_job:  # a node joining a job: the job and the log are node 0's
            if self.log_url is None:
                raise ConfigError("a node other than 0 needs --log: the log node 0 writes to")
            check_shared_log(self.log_url, self.rdzv_endpoint)
            return replace(self, script=self._script_path())
        job_id = self.job_id or f"job-{time.strftime('%Y%m%d-%H%M%S')}-{uuid.uuid4().hex[:6]}"
        if not _JOB_ID.match(job_id):
            raise ConfigError(f"job id {job_id!r} may hold only letters, digits, '_', '.', '-'")
        log_url = self.log_url or f"sqlite://{Path.cwd() / 'runs' / job_id / 'log.db'}"
        if urlsplit(log_url).scheme == "memory":
            raise ConfigError("memory:// logs live in one process; the ranks need sqlite or kafka")
        if self.log_url is None:
            (Path.cwd() / "runs" / job_id).mkdir(parents=True, exist_ok=True)
        check_shared_log(log_url, self.rdzv_endpoint)
        _check_log(log_url, job_id)
        return replace(self, script=self._script_path(), job_id=job_id, log_url=log_url)

    def _script_path(self) -> Path:
        """The script's absolute path (a module's name stays a name)."""
        return self.script if self.run_as is RunAs.MODULE else self.script.resolve()

    def _check_script(self) -> None:
        name = str(self.script)
        if self.run_as is RunAs.MODULE:
            top = name.partition(".")[0]
            # Here (as `python -m` puts the working directory first) or wherever this
            # interpreter finds it (an editable install's finder is not on sys.path).
            here = top.isidentifier() and PathFinder.find_spec(top, [os.getcwd()]) is not None
            if not top.isidentifier() or not (here or importlib.util.find_spec(top) is not None):
                raise ConfigError(f"-m {name}: no module {top!r} here or on sys.path")
            return
        if not self.script.is_file():
            raise ConfigError(f"script {name!r} does not exist")
        if self.run_as is RunAs.PROGRAM:
            if not os.access(self.script, os.X_OK):
                raise ConfigError(f"--no-python {name}: not executable (chmod +x it)")
            if self.start_method is StartMethod.FORKSERVER:
                raise ConfigError(
                    "--no-python runs a program of its own: the fork server forks Python "
                    "scripts only; add --start-method exec"
                )

    def _check_nodes(self) -> None:
        if self.nnodes < 1:
            raise ConfigError(f"--nnodes must be at least 1, got {self.nnodes}")
        if self.spare_nodes < 0:
            raise ConfigError(f"--spare-nodes must be 0 or more, got {self.spare_nodes}")
        if not 0 <= self.node_wait_s <= MAX_NODE_WAIT_S:
            raise ConfigError(
                f"--node-wait must be within 0..{MAX_NODE_WAIT_S:.0f}s, got {self.node_wait_s}"
            )
        if self.rdzv_endpoint is None:
            if self.nnodes > 1 or self.spare_nodes or self.node_rank != 0 or self.control_plane:
                raise ConfigError(
                    "--nnodes, --spare-nodes, --node-rank and --control-plane need --rdzv-endpoint"
                )
            return
        nodes = self.nnodes + self.spare_nodes
        if self.node_rank is not None and not 0 <= self.node_rank < nodes:
            raise ConfigError(
                f"--node-rank {self.node_rank}: outside 0..{nodes - 1} (or 'auto', which a "
                "node joining later uses)"
            )
        if not self.store_secret or len(self.store_secret) < MIN_SECRET:
            raise ConfigError(
                "a multi-node job needs the same secret in every agent's environment: "
                "FLASHRECOVERY_STORE_PREFIX of at least 16 characters, e.g. "
                "`export FLASHRECOVERY_STORE_PREFIX=$(openssl rand -hex 16)` (docs/multinode.md)"
            )
        if self.metrics_port is not None and not self.starts_job:
            raise ConfigError("--metrics-port: node 0's agent serves the job's metrics")


def check_shared_log(url: str, endpoint: Endpoint | None) -> None:
    """Every node writes to the log: an embedded log is a file on one host, so it serves
    several agents on that host only (a loopback rendezvous), never a job across hosts."""
    if endpoint is None or endpoint.loopback or urlsplit(url).scheme != "sqlite":
        return
    raise ConfigError(
        f"--rdzv-endpoint {endpoint} spans hosts, but {url} is an embedded log on one host's "
        "disk that the other nodes cannot share: use a kafka:// log (docs/multinode.md)"
    )


def _check_log(url: str, job_id: str) -> None:
    """The log must be reachable, and the job id new in it (a job's records are its history)."""
    try:
        with open_log(url) as log:
            if log.read(Stream.EVENTS, job_id, limit=1):
                raise ConfigError(f"job id {job_id!r} already has records in {url}")
    except LogError as exc:
        raise ConfigError(str(exc)) from None
    except ModuleNotFoundError as exc:
        raise ConfigError(f"log URL {url!r} needs a backend that is not installed: {exc}") from None
