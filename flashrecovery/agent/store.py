"""What a job opens to the network: the store and gloo (on loopback only for a single-node job,
or for loopback "nodes"), and every store key under a secret of the job.

torch's store server binds every interface whatever host it is given; it takes a listening
socket instead, so the agent binds one to loopback itself. Gloo listens on the interface
GLOO_SOCKET_IFNAME names (by default, the one the hostname resolves to): the ranks are told the
loopback interface. Every store key lives under a random prefix that only the job's processes
know (FLASHRECOVERY_STORE_PREFIX in their environment, never logged, never in a record or an
argv; trainer_hooks/groups.py ``job_keys``): a client that reaches the port without it cannot
cast a vote, pass a barrier or hand a spare a rank, since it writes keys nobody reads.

A multi-node job's store listens on the rendezvous endpoint node 0's agent is given; every agent
must then know the secret beforehand (FLASHRECOVERY_STORE_PREFIX in its environment,
docs/multinode.md), and the other agents connect to the store as clients.
"""

from __future__ import annotations

import datetime
import secrets
import socket
from dataclasses import dataclass, field

import psutil
import torch.distributed as dist

from flashrecovery.agent.config import LOOPBACK, is_loopback
from flashrecovery.errors import ConfigError
from flashrecovery.trainer_hooks.env import SECRET
from flashrecovery.trainer_hooks.groups import job_keys

BACKLOG = 128  # pending connections: every rank and spare connects two clients at start


@dataclass(frozen=True)
class JobStore:
    """The agent's side of the store: ``keys`` is the secret-prefixed view every key goes
    through (it keeps the listening server alive)."""

    host: str
    port: int
    prefix: str = field(repr=False)
    keys: dist.Store = field(repr=False)

    @classmethod
    def open(
        cls,
        timeout: datetime.timedelta,
        host: str = LOOPBACK,
        port: int = 0,
        prefix: str | None = None,
    ) -> JobStore:
        """Host the store on ``host:port`` (a free port when 0) under ``prefix`` (new when
        None)."""
        try:
            listener = socket.create_server((host, port), backlog=BACKLOG)
        except OSError as exc:
            raise ConfigError(
                f"cannot listen on {host}:{port} for the job's store: {exc}"
            ) from None
        port = listener.getsockname()[1]
        try:
            server = dist.TCPStore(
                host,
                port,
                is_master=True,
                wait_for_workers=False,
                timeout=timeout,
                master_listen_fd=listener.fileno(),
                use_libuv=True,
            )
        except BaseException:
            listener.close()
            raise
        listener.detach()  # the store owns (and closes) the descriptor now
        prefix = prefix or secrets.token_hex(16)
        return cls(host, port, prefix, job_keys(prefix, server))

    @classmethod
    def connect(cls, host: str, port: int, prefix: str, timeout: datetime.timedelta) -> JobStore:
        """Another node's agent: a client of the store node 0 hosts (waits up to ``timeout``
        for it to listen)."""
        try:
            client = dist.TCPStore(host, port, is_master=False, timeout=timeout)
        except RuntimeError as exc:
            raise ConfigError(f"no job store at {host}:{port} within {timeout}: {exc}") from None
        return cls(host, port, prefix, job_keys(prefix, client))

    @property
    def endpoint(self) -> str:
        return f"{self.host}:{self.port}"

    def environment(self) -> dict[str, str]:
        """How a rank reaches the store and its peers: gloo listens and connects on the
        interface that holds the store's address (this node's own, or loopback)."""
        return {
            "MASTER_ADDR": self.host,
            "MASTER_PORT": str(self.port),
            SECRET: self.prefix,
            "GLOO_SOCKET_IFNAME": interface_of(LOOPBACK if is_loopback(self.host) else self.host),
        }


def interface_of(address: str) -> str:
    """The name of the interface that holds ``address`` ("lo" for loopback on Linux)."""
    for name, addresses in psutil.net_if_addrs().items():
        if any(a.family == socket.AF_INET and a.address == address for a in addresses):
            return name
    raise ConfigError(f"no network interface holds {address}: the job's peers can't meet on it")


def local_address(toward: str, port: int) -> str:
    """The address this host reaches ``toward`` from (no packet is sent: a UDP socket is only
    connected, which picks the route)."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
        probe.connect((toward, port))
        address: str = probe.getsockname()[0]
        return address
