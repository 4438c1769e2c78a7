"""Hosts with networks of their own (agent/netns.py): each host reaches the others over the
bridge, a cut host reaches nobody while its processes run, one direction of its traffic can be
dropped, and nothing the network made outlives it, also when the test fails."""

from __future__ import annotations

import subprocess
import sys

import pytest

from flashrecovery.agent import netns

WHY = netns.unavailable()
pytestmark = pytest.mark.skipif(WHY is not None, reason=f"no network namespaces here: {WHY}")

# A listener in one host answers one line; a client in another host connects with a bound wait.
SERVE = """
import socket, sys
with socket.create_server((sys.argv[1], 7000)) as server:
    print("listening", flush=True)
    server.settimeout(20)
    while True:
        try:
            conn, _ = server.accept()
        except TimeoutError:
            break
        with conn:
            conn.sendall(b"hello")
"""
ASK = """
import socket, sys
try:
    with socket.create_connection((sys.argv[1], 7000), timeout=1.5) as conn:
        conn.settimeout(1.5)
        print(conn.recv(5).decode())
except OSError as exc:
    print(type(exc).__name__)
"""


def ask(network: netns.Network, client: str, server: str) -> str:
    argv = network.hosts[client].command([sys.executable, "-c", ASK, network.hosts[server].address])
    return subprocess.run(argv, capture_output=True, text=True, timeout=30).stdout.strip()


def test_hosts_meet_over_the_bridge_and_a_cut_or_deaf_host_does_not() -> None:
    with netns.Network(["a", "b"]) as network:
        b = network.hosts["b"]
        server = subprocess.Popen(
            b.command([sys.executable, "-c", SERVE, b.address]), stdout=subprocess.PIPE, text=True
        )
        try:
            assert server.stdout is not None and server.stdout.readline().strip() == "listening"
            assert ask(network, "a", "b") == "hello"
            network.cut("b")
            assert ask(network, "a", "b") != "hello"
            assert server.poll() is None  # its processes run on while it is cut off
            network.heal("b")
            assert ask(network, "a", "b") == "hello"
            network.drop("b", netns.Direction.OUT)  # b hears, is not heard
            assert ask(network, "a", "b") != "hello"
            network.heal("b")
            network.drop("a", netns.Direction.IN)  # a does not hear
            assert ask(network, "a", "b") != "hello"
            network.heal("a")
            assert ask(network, "a", "b") == "hello"
        finally:
            server.kill()
            server.wait()
        made = network.id
    assert not [name for name in netns.leftovers() if made in name]


def test_a_network_is_removed_when_the_test_using_it_fails() -> None:
    with pytest.raises(RuntimeError, match="the test failed"), netns.Network(["x"]) as network:
        made = network.id
        assert [n for n in netns.leftovers() if made in n]
        raise RuntimeError("the test failed")
    assert not [name for name in netns.leftovers() if made in name]
