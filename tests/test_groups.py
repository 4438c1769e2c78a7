"""Forming a generation's group (real processes over gloo, real SIGKILLs): a rank waits for its
ring neighbours only, never for the whole world, and gives up on a neighbour that never arrives
once a newer generation is planned; a neighbour lost after it arrived fails the connection
within the connect timeout; collectives keep the long timeout; and dropping a group whose peer
died neither waits for that peer nor stops this process's other threads."""

from __future__ import annotations

import datetime
import json
import os
import signal
import threading
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from flashrecovery.trainer_hooks import groups

TIMEOUT = datetime.timedelta(seconds=30)
SHORT_CONNECT = datetime.timedelta(seconds=1)  # the children's connect timeout
HEARTBEAT_S = 1.0  # the default heartbeat interval: no thread may be kept from running longer


def _client(port: int) -> dist.Store:
    torch.set_num_threads(1)
    groups.CONNECT_TIMEOUT = SHORT_CONNECT
    return dist.TCPStore("127.0.0.1", port, is_master=False, timeout=TIMEOUT)


def _spawn(target: object, args: tuple[object, ...], nprocs: int) -> mp.ProcessContext:
    return mp.start_processes(target, args=args, nprocs=nprocs, join=False, start_method="spawn")


def _join(context: mp.ProcessContext) -> list[int | None]:
    for process in context.processes:
        process.join(60)
        if process.is_alive():
            process.kill()
    return [process.exitcode for process in context.processes]


def _member(index: int, members: list[int], size: int, port: int, out: str) -> None:
    rank = members[index]
    store = _client(port)
    flag = Path(out, "superseded")  # the test plans a newer generation by creating it
    try:
        groups.build(store, 1, rank, size, flag.exists)
        Path(out, f"formed.{rank}").write_text("formed")
        store.set(f"formed/{rank}", "1")
    except RuntimeError as exc:
        Path(out, f"gave_up.{rank}").write_text(str(exc))


def test_a_rank_waits_for_its_neighbours_only_and_gives_up_on_a_lost_one(
    tmp_path: Path,
) -> None:
    """4 members, rank 2 never comes: rank 0 (neighbours 1 and 3) forms without it; 1 and 3
    (neighbours of 2) wait until a newer generation is planned, then give up."""
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    members = [0, 1, 3]
    context = _spawn(_member, (members, 4, store.port, str(tmp_path)), len(members))
    store.wait(["formed/0"], TIMEOUT)  # rank 0 formed while rank 2 is missing
    assert not list(tmp_path.glob("gave_up.*")), "a neighbour of rank 2 gave up unasked"
    (tmp_path / "superseded").write_text("generation 2")
    assert _join(context) == [0, 0, 0]
    assert sorted(p.name for p in tmp_path.glob("formed.*")) == ["formed.0"]
    for rank in (1, 3):
        said = (tmp_path / f"gave_up.{rank}").read_text()
        assert "generation 1 was superseded while its group formed" in said


class _Ticker(threading.Thread):
    """The longest gap between 5 ms sleeps of a Python thread (as a heartbeat thread): it runs
    only while nobody holds the GIL."""

    def __init__(self) -> None:
        super().__init__(daemon=True)
        self.gap = 0.0

    def run(self) -> None:
        last = time.monotonic()
        while True:
            time.sleep(0.005)
            now = time.monotonic()
            self.gap, last = max(self.gap, now - last), now


def _lost_after_arrival(rank: int, port: int, out: str) -> None:
    """Rank 2 arrives (its address and arrival published) and dies before connecting; its
    neighbours 0 and 1 fail to connect within the connect timeout, other threads running."""
    store = _client(port)
    if rank == 2:
        group = groups.LazyGloo(dist.PrefixStore("gen/1/", store), rank, 3)
        dist.PrefixStore("gen/1/", store).set("arrived/2", "1")
        store.wait(["watching/0", "watching/1"])
        os.kill(os.getpid(), signal.SIGKILL)
        del group
    ticker = _Ticker()
    ticker.start()
    started = time.monotonic()
    store.set(f"watching/{rank}", "1")
    result: dict[str, object] = {}
    try:
        groups.build(store, 1, rank, 3, lambda: False)
        result["formed"] = True
    except RuntimeError as exc:
        result["error"] = str(exc)
    result["seconds"] = time.monotonic() - started
    result["gap"] = ticker.gap
    Path(out, f"rank{rank}.json").write_text(json.dumps(result))


def test_a_neighbour_lost_after_it_arrived_fails_the_connection_in_bounded_time(
    tmp_path: Path,
) -> None:
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    exits = _join(_spawn(_lost_after_arrival, (store.port, str(tmp_path)), 3))
    assert exits[:2] == [0, 0] and exits[2] == -signal.SIGKILL
    for rank in (0, 1):
        result = json.loads((tmp_path / f"rank{rank}.json").read_text())
        assert "formed" not in result, f"rank {rank} formed with a dead neighbour"
        # The connect timeout, not gloo's five-fold first-connect wait nor the collective's.
        assert result["seconds"] < 4 * SHORT_CONNECT.total_seconds()
        # The wait released the GIL: heartbeats (every second) would have gone on.
        assert result["gap"] < HEARTBEAT_S


def _slow_peer(rank: int, port: int, out: str) -> None:
    """Rank 1 enters the all-reduce 3 s late (longer than the connect timeout)."""
    store = _client(port)
    group = groups.build(store, 1, rank, 2, lambda: False)
    if rank == 1:
        time.sleep(3 * SHORT_CONNECT.total_seconds())
    summed = torch.tensor([float(rank + 1)])
    group.allreduce([summed]).wait()
    Path(out, f"sum{rank}").write_text(str(summed.item()))
    groups.drop(group)


def test_collectives_keep_the_collective_timeout(tmp_path: Path) -> None:
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    assert _join(_spawn(_slow_peer, (store.port, str(tmp_path)), 2)) == [0, 0]
    assert [(tmp_path / f"sum{r}").read_text() for r in (0, 1)] == ["3.0", "3.0"]


def _dropped_after_death(rank: int, port: int, out: str) -> None:
    """Three ranks train a step; rank 2 dies; 0 and 1 see the all-reduce fail and drop the
    group: the drop is quick and the other threads keep running through it."""
    store = _client(port)
    group = groups.build(store, 1, rank, 3, lambda: False)
    group.allreduce([torch.ones(4)]).wait()
    store.add("stepped", 1)
    if rank == 2:
        store.wait(["watching/0", "watching/1"])
        os.kill(os.getpid(), signal.SIGKILL)
    ticker = _Ticker()
    ticker.start()
    store.set(f"watching/{rank}", "1")
    result: dict[str, object] = {}
    try:
        group.allreduce([torch.ones(4)]).wait()
    except RuntimeError as exc:
        result["error"] = str(exc)[:200]
    started = time.monotonic()
    groups.drop(group)
    del group
    result["drop_seconds"] = time.monotonic() - started
    time.sleep(0.05)
    result["gap"] = ticker.gap
    Path(out, f"rank{rank}.json").write_text(json.dumps(result))


def test_dropping_a_group_whose_peer_died_waits_for_nobody(tmp_path: Path) -> None:
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    exits = _join(_spawn(_dropped_after_death, (store.port, str(tmp_path)), 3))
    assert exits[:2] == [0, 0] and exits[2] == -signal.SIGKILL
    for rank in (0, 1):
        result = json.loads((tmp_path / f"rank{rank}.json").read_text())
        assert "error" in result, f"rank {rank}'s all-reduce passed without rank 2"
        # Not the connect timeout, nor a peer's: the drop waits for nothing.
        assert result["drop_seconds"] < SHORT_CONNECT.total_seconds()
        assert result["gap"] < HEARTBEAT_S


def _abandoned_receive(rank: int, port: int, out: str) -> None:
    """Rank 1 posts a receive and lets its buffer go (as a collective that failed on another
    pair does); rank 0's message then arrives for a buffer that no longer exists, which gloo
    leaves unread: the pair's socket stays ready. Dropping the group must still be quick."""
    store = _client(port)
    group = groups.build(store, 1, rank, 2, lambda: False)  # connects the pair
    if rank == 0:
        store.wait(["posted"])
        sent = group.send([torch.ones(1 << 20)], 1, 5)
        store.set("sent", "1")
        store.wait(["dropped"])
        del sent
        return
    posted = group.recv([torch.zeros(1 << 20)], 0, 5)
    del posted  # its buffer is gone while the receive is still posted
    store.set("posted", "1")
    store.wait(["sent"])
    # The message has arrived once the pair's socket holds unread bytes.
    deadline = time.monotonic() + TIMEOUT.total_seconds()
    while _unread_bytes() == 0 and time.monotonic() < deadline:
        time.sleep(0.01)
    started = time.monotonic()
    del group
    Path(out, "drop_seconds").write_text(str(time.monotonic() - started))
    store.set("dropped", "1")


def _unread_bytes() -> int:
    """Bytes waiting in this process's TCP receive queues (the kernel's /proc/net/tcp)."""
    sockets = set()
    for name in os.listdir("/proc/self/fd"):
        try:
            link = os.readlink(f"/proc/self/fd/{name}")
        except OSError:
            continue
        if link.startswith("socket:["):
            sockets.add(link[len("socket:[") : -1])
    unread = 0
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        for line in Path(table).read_text().splitlines()[1:]:
            fields = line.split()
            if fields[9] in sockets:
                unread += int(fields[4].split(":")[1], 16)
    return unread


def test_dropping_a_group_with_a_message_left_unread_is_quick(tmp_path: Path) -> None:
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    assert _join(_spawn(_abandoned_receive, (store.port, str(tmp_path)), 2)) == [0, 0]
    # Without taking its sockets out of gloo's loop first, the drop never returns (the join
    # above would time out and kill rank 1).
    assert float((tmp_path / "drop_seconds").read_text()) < SHORT_CONNECT.total_seconds()
