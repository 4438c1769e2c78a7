"""A checkpoint counts only once every rank's part is written: the writers of two ranks in one
process, on a real store and real files (trainer_hooks/checkpoint.py)."""

from __future__ import annotations

import datetime
import threading
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from flashrecovery.errors import ProtocolError
from flashrecovery.trainer_hooks import checkpoint


@pytest.fixture
def store() -> dist.Store:
    return dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)


def client(master: dist.Store) -> dist.Store:
    assert isinstance(master, dist.TCPStore)
    return dist.TCPStore("127.0.0.1", master.port, is_master=False, wait_for_workers=False)


def test_marker_only_once_every_part_is_written(store: dist.Store, tmp_path: Path) -> None:
    completed: list[tuple[int, str]] = []
    done = threading.Event()

    def report(step: int, path: str) -> None:
        completed.append((step, path))
        done.set()

    writers = [
        checkpoint.Checkpointer(tmp_path, 2, lambda: client(store), report) for _ in range(2)
    ]
    states = [{"w": torch.full((3,), float(r)), "committed_step": 5} for r in range(2)]
    path = checkpoint.step_dir(tmp_path, 5, 1)
    writers[0].save(5, 1, 0, 2, states[0])
    writers[0].drain()
    assert not done.wait(0.2)  # rank 1's part is missing: no marker, nothing reported
    assert not (path / checkpoint.MARKER).exists()
    with pytest.raises(ProtocolError, match="not a complete checkpoint"):
        checkpoint.load(path, 0, {"w": torch.zeros(3), "committed_step": -1})
    writers[1].save(5, 1, 1, 2, states[1])
    assert done.wait(30)
    writers[0].close(30)
    assert completed == [(5, str(path))]
    for rank in range(2):
        held = torch.zeros(3)
        loaded = checkpoint.load(path, rank, {"w": held, "committed_step": -1})
        assert loaded["w"] is held and torch.equal(held, states[rank]["w"])
        assert loaded["committed_step"] == 5


def test_a_part_whose_rank_was_replaced_is_not_waited_for(
    store: dist.Store, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Rank 1 was lost before writing its part of generation 1's checkpoint: once a plan has
    replaced it, rank 0 stops waiting for that part (a job's end waits for rank 0's finisher,
    and would have waited the whole COMPLETION_TIMEOUT)."""
    monkeypatch.setattr(checkpoint, "COMPLETION_SLICE", datetime.timedelta(milliseconds=50))
    replaced: set[int] = set()
    completed: list[int] = []
    writer = checkpoint.Checkpointer(
        tmp_path,
        2,
        lambda: client(store),
        lambda step, path: completed.append(step),
        lambda generation: replaced if generation < 2 else set(),
    )
    writer.save(5, 1, 0, 2, {"w": torch.ones(3), "committed_step": 5})
    [finisher] = writer._finishers
    finisher.join(0.3)
    assert finisher.is_alive(), "rank 1, not replaced, may still write its part"
    replaced.add(1)  # generation 2's plan replaced rank 1
    finisher.join(30)
    assert not finisher.is_alive()
    assert completed == []
    assert not (checkpoint.step_dir(tmp_path, 5, 1) / checkpoint.MARKER).exists()


def test_staged_copy_is_not_changed_by_training() -> None:
    weights = torch.zeros(2)
    staged = checkpoint.stage({"model": {"w": weights}, "step": 3})
    weights.add_(1.0)
    assert torch.equal(staged["model"]["w"], torch.zeros(2)) and staged["step"] == 3
