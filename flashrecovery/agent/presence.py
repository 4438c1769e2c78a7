"""Agents watching each other over TCP: a node whose agent dies is found as fast as a rank's
exit, not after three heartbeat intervals.

Every agent of a multi-node job listens on its node's address, and keeps one connection to the
listener of every other node it knows. When a connection closes, the agent tries the peer's
address once more: refused means the host answers but nothing listens, so the peer's agent is
gone, and ``gone(node, pid)`` is called (the agent writes an AgentExited record). A connection
back means it was the network, and the watch goes on; no answer at all (a host cut off, a
stopped agent) is left to the heartbeats' silence limit, which is the only sign such a node
gives. An agent that ends with the job says ``done`` on every connection first, so its end is
no loss.
"""

from __future__ import annotations

import contextlib
import errno
import selectors
import socket
import threading
from collections.abc import Callable
from dataclasses import dataclass, field

import structlog

log = structlog.get_logger("flashrecovery.agent")
RECONNECT_TIMEOUT_S = 0.5  # a peer that neither answers nor refuses within this is left alone
LOOK_S = 0.2  # how often the watch looks for peers it was told of meanwhile
DONE = b"done"  # what an agent that ends with the job says before it closes


@dataclass
class Peer:
    node: int
    pid: int
    host: str
    port: int
    sock: socket.socket | None = field(default=None, repr=False)
    done: bool = False  # it said it ends with the job


class Presence:
    """``Presence(node, pid, host, gone)``: listen, then ``watch(node, pid, host, port)`` each
    peer; ``gone`` runs on the watch's thread, once per peer."""

    def __init__(self, node: int, pid: int, host: str, gone: Callable[[int, int], None]) -> None:
        self.node, self.pid = node, pid
        self._gone = gone
        self._listener = socket.create_server((host, 0))
        self._listener.setblocking(False)
        self.endpoint = f"{host}:{self._listener.getsockname()[1]}"
        self._peers: dict[int, Peer] = {}
        self._pending: list[Peer] = []
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._selector = selectors.DefaultSelector()
        self._selector.register(self._listener, selectors.EVENT_READ, None)
        self._thread = threading.Thread(
            target=self._run, name="flashrecovery-presence", daemon=True
        )
        self._thread.start()

    def watch(self, node: int, pid: int, endpoint: str) -> None:
        """Watch the agent ``pid`` of ``node`` at ``endpoint`` (once; again is a no-op)."""
        host, _, port = endpoint.rpartition(":")
        with self._lock:
            if node != self.node and node not in self._peers:
                peer = Peer(node, pid, host, int(port))
                self._peers[node] = peer
                self._pending.append(peer)

    def connected(self, node: int) -> bool:
        """Whether the watch holds a connection to ``node``'s agent now."""
        with self._lock:
            peer = self._peers.get(node)
            return peer is not None and peer.sock is not None

    def close(self) -> None:
        """End the watch; every peer is told this agent ends with the job, not lost."""
        self._stop.set()
        self._thread.join(LOOK_S * 5)
        for key in list(self._selector.get_map().values()):
            conn: socket.socket = key.fileobj  # type: ignore[assignment]
            with contextlib.suppress(OSError):
                if key.data is not None:
                    conn.send(DONE)
                conn.close()
        self._selector.close()

    def _run(self) -> None:
        while not self._stop.is_set():
            with self._lock:
                pending, self._pending = self._pending, []
            for peer in pending:
                self._connect(peer)
            for key, _ in self._selector.select(LOOK_S):
                if key.data is None:
                    self._accept()
                elif key.data == "accepted":
                    self._drain(key.fileobj)  # type: ignore[arg-type]
                else:
                    self._lost_connection(key.data)

    def _accept(self) -> None:
        """A peer watching us: its connection is kept (so it sees ours close) and read only to
        notice its end."""
        with contextlib.suppress(BlockingIOError, OSError):
            conn, _ = self._listener.accept()
            conn.setblocking(False)
            self._selector.register(conn, selectors.EVENT_READ, "accepted")

    def _drain(self, conn: socket.socket) -> None:
        try:
            if conn.recv(4096):
                return
        except BlockingIOError:
            return
        except OSError:
            pass
        self._selector.unregister(conn)
        conn.close()

    def _connect(self, peer: Peer) -> bool:
        """Connect to the peer; on a refusal (the host says nothing listens) report it gone.
        True when connected."""
        try:
            sock = socket.create_connection((peer.host, peer.port), timeout=RECONNECT_TIMEOUT_S)
        except ConnectionRefusedError:
            log.warning("peer agent gone", node=peer.node, pid=peer.pid)
            self._gone(peer.node, peer.pid)
            return False
        except OSError as exc:  # no answer: cut off, or stopped; its silence will tell
            why = errno.errorcode.get(exc.errno or 0, str(exc))
            log.info("peer agent unreachable", node=peer.node, error=why)
            with self._lock:
                self._pending.append(peer)  # try again next look
            return False
        sock.setblocking(False)
        peer.sock = sock
        self._selector.register(sock, selectors.EVENT_READ, peer)
        return True

    def _lost_connection(self, peer: Peer) -> None:
        sock = peer.sock
        assert sock is not None
        try:
            data = sock.recv(4096)
            if data:
                peer.done = peer.done or DONE in data
                return
        except BlockingIOError:
            return
        except OSError:
            pass
        self._selector.unregister(sock)
        sock.close()
        peer.sock = None
        if not peer.done:
            self._connect(peer)
