"""Hosts with a network of their own on one machine: a bridge, and for each host a network
namespace joined to it by a veth pair, with an address of its own. A host can then be cut off
the network while its processes run, lose one direction of its traffic, flap, or get a
degraded link — what a real cluster's network does and loopback never does.

Needs root and Debian's iproute2 (and nftables for dropped traffic); ``unavailable()`` says why
it can't be made here. Everything a ``Network`` makes carries its own name prefix and is removed
by ``close()`` (also when a test fails); a network left by a process that died is removed by the
next ``sweep()``.
"""

from __future__ import annotations

import contextlib
import ipaddress
import os
import random
import secrets
import shutil
import subprocess
from dataclasses import dataclass
from enum import StrEnum
from pathlib import Path
from types import TracebackType

from flashrecovery.errors import ConfigError

PREFIX = "fr"  # every namespace, bridge and veth this module makes starts with it
MARKERS = Path("/run/flashrecovery-netns")  # <id>.pid: who made the network <id>
NFT_TABLE = "flashrecovery"  # the table a host's traffic rules live in, in its own namespace
NETNS_ETC = Path("/etc/netns")  # `ip netns exec` mounts <netns>/resolv.conf over /etc's
# No name server is reachable from a namespace: lookups must fail at once, not after the
# resolver's timeouts (torch's store client looks its own address up as it connects).
RESOLV_CONF = "nameserver 127.0.0.1\noptions timeout:1 attempts:1\n"


class Direction(StrEnum):
    """Which of a host's traffic a rule drops."""

    IN = "in"  # the host does not hear (it is heard)
    OUT = "out"  # the host is not heard (it hears)
    BOTH = "both"


def _run(*args: str) -> str:
    done = subprocess.run(args, capture_output=True, text=True, check=False, timeout=30)
    if done.returncode != 0:
        raise ConfigError(f"`{' '.join(args)}` failed: {done.stderr.strip() or done.stdout}")
    return done.stdout


def unavailable() -> str | None:
    """Why hosts with networks of their own cannot be made here (None: they can)."""
    if os.geteuid() != 0:
        return "network namespaces need root"
    for tool in ("ip", "nft", "tc"):
        if shutil.which(tool) is None:
            return f"`{tool}` is not installed (iproute2, nftables)"
    probe = f"{PREFIX}probe{secrets.token_hex(2)}"
    try:
        _run("ip", "netns", "add", probe)
    except ConfigError as exc:
        return f"cannot make a network namespace: {exc}"
    _run("ip", "netns", "del", probe)
    return None


@dataclass(frozen=True)
class Host:
    name: str
    netns: str
    address: str
    outer: str  # its veth's end on the bridge, in the root namespace
    inner: str  # its veth's end in its namespace

    def command(self, argv: list[str]) -> list[str]:
        """``argv`` run inside the host's namespace."""
        return ["ip", "netns", "exec", self.netns, *argv]


class Network:
    """``Network(["n0", "n1", "broker1"])``: the hosts, each with an address of the bridge's
    subnet; the root namespace holds the bridge's own address, so it reaches every host."""

    def __init__(self, names: list[str]) -> None:
        why = unavailable()
        if why is not None:
            raise ConfigError(why)
        sweep()
        self.id = secrets.token_hex(2)
        self.bridge = f"{PREFIX}{self.id}br"
        self.subnet = _free_subnet()
        addresses = list(self.subnet.hosts())
        self.gateway = str(addresses[0])
        self.hosts: dict[str, Host] = {}
        MARKERS.mkdir(parents=True, exist_ok=True)
        (MARKERS / f"{self.id}.pid").write_text(str(os.getpid()))
        try:
            _run("ip", "link", "add", self.bridge, "type", "bridge")
            _run("ip", "addr", "add", f"{self.gateway}/{self.subnet.prefixlen}", "dev", self.bridge)
            _run("ip", "link", "set", self.bridge, "up")
            for index, name in enumerate(names):
                self.hosts[name] = self._add(index, name, str(addresses[10 + index]))
        except BaseException:
            self.close()
            raise

    def _add(self, index: int, name: str, address: str) -> Host:
        host = Host(
            name, f"{PREFIX}{self.id}-{name}", address, f"{PREFIX}{self.id}o{index}",
            f"{PREFIX}{self.id}i{index}",
        )  # fmt: skip
        _run("ip", "netns", "add", host.netns)
        etc = NETNS_ETC / host.netns
        etc.mkdir(parents=True, exist_ok=True)
        (etc / "resolv.conf").write_text(RESOLV_CONF)
        _run("ip", "link", "add", host.outer, "type", "veth", "peer", "name", host.inner)
        _run("ip", "link", "set", host.outer, "master", self.bridge)
        _run("ip", "link", "set", host.outer, "up")
        _run("ip", "link", "set", host.inner, "netns", host.netns)
        inside = ("ip", "-n", host.netns)
        _run(*inside, "addr", "add", f"{address}/{self.subnet.prefixlen}", "dev", host.inner)
        _run(*inside, "link", "set", host.inner, "up")
        _run(*inside, "link", "set", "lo", "up")
        _run(*inside, "route", "add", "default", "via", self.gateway)
        return host

    # ------------------------------------------------------------------ faults

    def cut(self, name: str) -> None:
        """Cut the host off both ways (its processes run on); ``heal`` brings it back."""
        _run("ip", "link", "set", self.hosts[name].outer, "down")

    def heal(self, name: str) -> None:
        """Bring the host's link back and drop every rule on its traffic."""
        host = self.hosts[name]
        _run("ip", "link", "set", host.outer, "up")
        with contextlib.suppress(ConfigError):
            _run(*host.command(["nft", "delete", "table", "inet", NFT_TABLE]))
        with contextlib.suppress(ConfigError):
            _run("ip", "-n", host.netns, "qdisc", "del", "dev", host.inner, "root")

    def drop(self, name: str, direction: Direction, percent: int = 100) -> None:
        """Drop ``percent`` % of the host's traffic in ``direction``, at random below 100
        (nftables in its namespace; its loopback is left alone)."""
        host = self.hosts[name]
        nft = host.command(["nft"])
        _run(*nft, "add", "table", "inet", NFT_TABLE)
        hooks = {Direction.IN: ["input"], Direction.OUT: ["output"]}.get(
            direction, ["input", "output"]
        )
        for hook in hooks:
            _run(*nft, "add", "chain", "inet", NFT_TABLE, hook,
                 f"{{ type filter hook {hook} priority 0; }}")  # fmt: skip
            where = "iifname" if hook == "input" else "oifname"
            chance = [] if percent >= 100 else ["numgen", "random", "mod", "100", "<", str(percent)]
            _run(*nft, "add", "rule", "inet", NFT_TABLE, hook, where, "!=", "lo", *chance, "drop")

    def limit(self, name: str, rate: str = "1mbit") -> None:
        """Hold the host's outgoing bandwidth to ``rate`` (a token bucket, ``tc tbf``)."""
        host = self.hosts[name]
        _run("ip", "netns", "exec", host.netns, "tc", "qdisc", "add", "dev", host.inner,
             "root", "tbf", "rate", rate, "burst", "32kbit", "latency", "400ms")  # fmt: skip

    # ------------------------------------------------------------------ teardown

    def close(self) -> None:
        """Remove every namespace (its veth goes with it) and the bridge."""
        for host in self.hosts.values():
            with contextlib.suppress(ConfigError):
                _run("ip", "netns", "del", host.netns)
        _remove(self.id)
        self.hosts = {}

    def __enter__(self) -> Network:
        return self

    def __exit__(
        self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()


def _remove(network_id: str) -> None:
    """Whatever is left of network ``network_id``: its namespaces, veths, bridge, marker."""
    for netns in _run("ip", "netns", "list").split():
        if netns.startswith(f"{PREFIX}{network_id}-"):
            with contextlib.suppress(ConfigError):
                _run("ip", "netns", "del", netns)
    for etc in NETNS_ETC.glob(f"{PREFIX}{network_id}-*"):
        shutil.rmtree(etc, ignore_errors=True)
    for line in _run("ip", "-o", "link", "show").splitlines():
        link = line.split(":")[1].strip().split("@")[0]
        if link.startswith(f"{PREFIX}{network_id}"):
            with contextlib.suppress(ConfigError):
                _run("ip", "link", "del", link)
    (MARKERS / f"{network_id}.pid").unlink(missing_ok=True)


def sweep() -> list[str]:
    """Remove the networks whose maker has died (a test killed mid-way); their ids."""
    if not MARKERS.is_dir():
        return []
    gone = []
    for marker in MARKERS.glob("*.pid"):
        try:
            os.kill(int(marker.read_text()), 0)
        except (ProcessLookupError, ValueError):
            _remove(marker.stem)
            gone.append(marker.stem)
        except PermissionError:
            pass  # alive, another user's
    return gone


def leftovers() -> list[str]:
    """Namespaces and links of this module's still on the machine (none once closed)."""
    names = [n for n in _run("ip", "netns", "list").split() if n.startswith(PREFIX)]
    for line in _run("ip", "-o", "link", "show").splitlines():
        link = line.split(":")[1].strip().split("@")[0]
        if link.startswith(PREFIX):
            names.append(link)
    return names


def _free_subnet() -> ipaddress.IPv4Network:
    """A /24 of 10.231.0.0/16 that no route of this machine overlaps."""
    taken = [
        ipaddress.ip_network(line.split()[0], strict=False)
        for line in _run("ip", "-4", "route", "show", "table", "all").splitlines()
        if line and line.split()[0][0].isdigit()
    ]
    choices = list(range(256))
    random.shuffle(choices)
    for third in choices:
        subnet = ipaddress.IPv4Network(f"10.231.{third}.0/24")
        if not any(subnet.overlaps(route) for route in taken):
            return subnet
    raise ConfigError("no free /24 in 10.231.0.0/16 for a test network")
