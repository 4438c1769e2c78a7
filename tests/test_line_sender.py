"""Lines to a local peer never make the sender wait, and arrive whole and in order
(flashrecovery/line_sender.py): a rank's records to its agent, the agent's answers back."""

from __future__ import annotations

import socket
import threading

from flashrecovery.line_sender import LineSender


def _read_all(sock: socket.socket, size: int) -> bytes:
    data = b""
    while len(data) < size:
        chunk = sock.recv(1 << 16)
        assert chunk, "the sender's end closed early"
        data += chunk
    return data


def test_a_line_the_kernel_takes_at_once_needs_no_thread() -> None:
    mine, peer = socket.socketpair()
    with mine, peer:
        sender = LineSender(mine, "test-out")
        sender.send(b"one\n")
        sender.send(b"two\n")
        assert sender._thread is None
        assert _read_all(peer, 8) == b"one\ntwo\n"


def test_a_peer_that_reads_nothing_never_holds_the_sender_up_and_loses_nothing() -> None:
    mine, peer = socket.socketpair()
    mine.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 4096)
    lines = [f"{i:06d}".encode() * 200 + b"\n" for i in range(300)]  # far beyond the buffers
    with mine, peer:
        sender = LineSender(mine, "test-out")
        sending = threading.Thread(target=lambda: [sender.send(line) for line in lines])
        sending.start()
        sending.join(30)
        assert not sending.is_alive(), "a send waited for the peer"
        assert sender._thread is not None  # the rest went to the thread, in order
        expected = b"".join(lines)
        assert _read_all(peer, len(expected)) == expected
        sender.close(5)


def test_a_peer_that_is_gone_is_not_the_senders_error() -> None:
    mine, peer = socket.socketpair()
    peer.close()
    with mine:
        LineSender(mine, "test-out").send(b"into the void\n")
