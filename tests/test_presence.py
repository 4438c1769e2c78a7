"""Agents watching each other (agent/presence.py), with real processes and real sockets: a peer
SIGKILLed is reported gone at once, one that ends with the job (``done``) is not, and one that
only stops (SIGSTOP) is left to the heartbeats' silence limit."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator

import pytest

from flashrecovery.agent.presence import Presence

pytestmark = pytest.mark.timeout(60)
PEER = """
import sys, threading
from flashrecovery.agent.presence import Presence
p = Presence(1, 4242, "127.0.0.1", lambda node, pid: None)
print(p.endpoint, flush=True)
if sys.stdin.readline().strip() == "close":
    p.close()
    print("closed", flush=True)
threading.Event().wait()
"""


def connected(presence: Presence, node: int) -> None:
    deadline = time.monotonic() + 10
    while not presence.connected(node):
        assert time.monotonic() < deadline, "the watch never connected"
        time.sleep(0.01)


class Watcher:
    def __init__(self) -> None:
        self.gone: list[tuple[int, int, float]] = []
        self.reported = threading.Event()
        self.presence = Presence(0, os.getpid(), "127.0.0.1", self._gone)

    def _gone(self, node: int, pid: int) -> None:
        self.gone.append((node, pid, time.monotonic()))
        self.reported.set()


@pytest.fixture
def peer() -> Iterator[tuple[subprocess.Popen[str], str]]:
    process = subprocess.Popen(
        [sys.executable, "-c", PEER], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    )
    assert process.stdout is not None
    endpoint = process.stdout.readline().strip()
    try:
        yield process, endpoint
    finally:
        os.kill(process.pid, signal.SIGCONT)
        process.kill()
        process.wait()


def test_a_peer_killed_is_reported_gone_at_once(peer: tuple[subprocess.Popen[str], str]) -> None:
    process, endpoint = peer
    watcher = Watcher()
    try:
        watcher.presence.watch(1, 4242, endpoint)
        connected(watcher.presence, 1)
        killed = time.monotonic()
        process.kill()
        assert watcher.reported.wait(10)
        [(node, pid, at)] = watcher.gone
        assert (node, pid) == (1, 4242)
        assert at - killed < 2.0
    finally:
        watcher.presence.close()


def test_a_peer_that_ends_with_the_job_is_no_loss(peer: tuple[subprocess.Popen[str], str]) -> None:
    process, endpoint = peer
    watcher = Watcher()
    try:
        watcher.presence.watch(1, 4242, endpoint)
        connected(watcher.presence, 1)
        assert process.stdin is not None and process.stdout is not None
        process.stdin.write("close\n")
        process.stdin.flush()
        assert process.stdout.readline().strip() == "closed"
        process.kill()
        assert not watcher.reported.wait(2.0)
    finally:
        watcher.presence.close()


def test_a_stopped_peer_is_left_to_its_silence(peer: tuple[subprocess.Popen[str], str]) -> None:
    process, endpoint = peer
    watcher = Watcher()
    try:
        watcher.presence.watch(1, 4242, endpoint)
        connected(watcher.presence, 1)
        os.kill(process.pid, signal.SIGSTOP)
        assert not watcher.reported.wait(2.0)
    finally:
        watcher.presence.close()
