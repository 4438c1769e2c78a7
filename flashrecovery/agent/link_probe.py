"""Agents probing their links to each other: what lets the engine name a node whose link
degrades (engine/links.py), where the heartbeats only tell that it is alive.

Every agent of a multi-node job answers probes on a UDP socket of its node's address and sends
one to each of a few peers every ``PROBE_S``. A probe answered within ``LATE_S`` is on time; one
answered later, or never (dropped, or queued behind a link held down), is late. Datagrams, not
the presence watch's TCP connections: TCP would hide a lost packet behind its retransmission
and hold every later probe behind it. The counts of each heartbeat interval ride in the node's
heartbeat record (``take``), so they reach the engine as records and replay alike.
"""

from __future__ import annotations

import contextlib
import selectors
import socket
import struct
import threading
import time
from dataclasses import dataclass, field

from flashrecovery.records import LinkSample

PROBE_S = 0.1  # a probe to each peer this often
# Answered later than this, a probe is late; a lost one never is. Longer than the pauses a busy
# host gives an agent's thread, which must not make its node look slow.
LATE_S = 0.5
PEERS = 4  # each node probes the next few nodes in ring order, so probes grow with nodes, not
# with their square; every link between near neighbours is measured from both ends
_PROBE, _ANSWER = b"p", b"a"
_MESSAGE = struct.Struct("!cQd")  # kind, sequence number, the prober's send time


def ring_peers(node: int, nodes: list[int], count: int = PEERS) -> list[int]:
    """The ``count`` nodes after ``node`` in the ring of ``nodes`` (sorted, itself excluded)."""
    ring = sorted(set(nodes) | {node})
    at = ring.index(node)
    after = ring[at + 1 :] + ring[:at]
    return after[:count]


@dataclass
class _Peer:
    address: tuple[str, int]
    probes: int = 0
    late: int = 0
    outstanding: dict[int, float] = field(default_factory=dict)  # sequence number -> sent at


class LinkProbe:
    """``LinkProbe(host)``: answer probes at ``endpoint``; ``probe({node: endpoint})`` sets the
    peers to probe; ``take()`` returns each peer's counts since the last call."""

    def __init__(self, host: str) -> None:
        self._sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        self._sock.bind((host, 0))
        self._sock.setblocking(False)
        self.endpoint = f"{host}:{self._sock.getsockname()[1]}"
        self._peers: dict[int, _Peer] = {}
        self._seq = 0
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._selector = selectors.DefaultSelector()
        self._selector.register(self._sock, selectors.EVENT_READ)
        self._thread = threading.Thread(target=self._run, name="flashrecovery-probe", daemon=True)
        self._thread.start()

    def probe(self, endpoints: dict[int, str]) -> None:
        """Probe exactly these peers from now on (a peer left out is forgotten)."""
        with self._lock:
            for node in list(self._peers):
                if node not in endpoints:
                    del self._peers[node]
            for node, endpoint in endpoints.items():
                if node not in self._peers:
                    host, _, port = endpoint.rpartition(":")
                    self._peers[node] = _Peer((host, int(port)))

    def take(self) -> list[LinkSample]:
        """Each probed peer's probes settled since the last call, and how many were late."""
        with self._lock:
            samples = [
                LinkSample(peer=node, probes=peer.probes, late=peer.late)
                for node, peer in sorted(self._peers.items())
                if peer.probes
            ]
            for peer in self._peers.values():
                peer.probes = peer.late = 0
        return samples

    def close(self) -> None:
        self._stop.set()
        self._thread.join(PROBE_S * 10)
        self._selector.close()
        self._sock.close()

    def _run(self) -> None:
        due = time.monotonic()
        while not self._stop.is_set():
            for _ in self._selector.select(max(0.0, due - time.monotonic())):
                self._receive()
            now = time.monotonic()
            if now >= due:
                self._send(now)
                due = now + PROBE_S

    def _send(self, now: float) -> None:
        with self._lock:
            for peer in self._peers.values():
                for seq, sent in list(peer.outstanding.items()):
                    if now - sent > LATE_S:  # never answered in time: late, whatever comes
                        del peer.outstanding[seq]
                        peer.probes, peer.late = peer.probes + 1, peer.late + 1
                self._seq += 1
                peer.outstanding[self._seq] = now
                with contextlib.suppress(OSError):  # a peer's host unreachable: late anyway
                    self._sock.sendto(_MESSAGE.pack(_PROBE, self._seq, now), peer.address)

    def _receive(self) -> None:
        while True:
            try:
                data, sender = self._sock.recvfrom(64)
            except (BlockingIOError, InterruptedError):
                return
            except OSError:  # an ICMP error of an earlier send: nothing more to read now
                return
            if len(data) != _MESSAGE.size:
                continue  # not ours
            kind, seq, sent = _MESSAGE.unpack(data)
            if kind == _PROBE:
                with contextlib.suppress(OSError):
                    self._sock.sendto(_MESSAGE.pack(_ANSWER, seq, sent), sender)
            elif kind == _ANSWER:
                self._answered(seq, sent)

    def _answered(self, seq: int, sent: float) -> None:
        late = time.monotonic() - sent > LATE_S
        with self._lock:
            for peer in self._peers.values():
                if peer.outstanding.pop(seq, None) is not None:
                    peer.probes, peer.late = peer.probes + 1, peer.late + int(late)
                    return
