"""Asynchronous sharded checkpoints with torch.distributed.checkpoint (DCP), and their load in a
fallback (docs/protocol.md, "Checkpoint fallback").

Each rank writes its own part of a step's checkpoint (its DTensor local shards, its optimizer
state, extras, random state: what the session would send a replacement, taken as the next
step begins) with DCP into ``<dir>/step-<step>-g<generation>/rank-<r>``. A part holds the
DTensors' local tensors (a rank loads only its own part, into the same sharding): plain
tensors stage, write and load several times faster than DTensors here, whose every operation
goes through their dispatch. The step path only stages a copy of the state;
a background thread writes it. The write takes part in no collective: one in the background
on the user's groups would race the training thread's collectives and be torn by every
regroup, and a part needs nothing from the peers. DCP's file writer fsyncs what it writes; the
rank then says so in the rendezvous store, and rank 0 waits for every rank's word, writes the
``COMPLETE`` marker (atomically) and reports the checkpoint, which only then counts; a part
whose rank was replaced before it was written never comes, and rank 0 stops waiting for it.
A generation's parts live apart from another's, so a marker never covers a part written later.
"""

from __future__ import annotations

import datetime
import json
import os
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import _init_optim_state
from torch.utils._pytree import tree_map

from flashrecovery.errors import ProtocolError
from flashrecovery.trainer_hooks.dtensors import local

MARKER = "COMPLETE"
# How long rank 0 waits for the other ranks' parts of one checkpoint: a rank lost meanwhile
# never reports its part, and that checkpoint never counts. It looks every COMPLETION_SLICE
# whether a rank whose part is missing was replaced since (then it stops at once).
COMPLETION_TIMEOUT = datetime.timedelta(seconds=120)
COMPLETION_SLICE = datetime.timedelta(seconds=1)


def step_dir(root: Path, step: int, generation: int) -> Path:
    return root / f"step-{step:08d}-g{generation}"


def part_dir(path: Path, rank: int) -> Path:
    return path / f"rank-{rank:05d}"


def stage(state: dict[str, Any]) -> dict[str, Any]:
    """A copy of the state (DTensors as their local tensors) that training no longer changes."""
    with torch.no_grad():
        copied: dict[str, Any] = tree_map(
            lambda v: local(v).clone() if isinstance(v, torch.Tensor) else v, state
        )
    return copied


def prepare_optimizer(optimizer: torch.optim.Optimizer) -> None:
    """Give an optimizer that never stepped (a spare's) the state entries a load fills in."""
    _init_optim_state(optimizer)


def load(path: Path, rank: int, state: dict[str, Any]) -> dict[str, Any]:
    """The rank's part of the complete checkpoint at ``path``, loaded in place into the
    tensors of ``state`` (the rank's state as the session builds it: its own tensors); the
    other values come from the checkpoint."""
    if not (path / MARKER).is_file():
        raise ProtocolError(f"{path} has no {MARKER} marker: not a complete checkpoint")
    with torch.no_grad():
        template: dict[str, Any] = tree_map(local, state)  # views of the same storage
        dcp.load(template, checkpoint_id=str(part_dir(path, rank)), no_dist=True)
    loaded: dict[str, Any] = tree_map(
        lambda held, read: held if isinstance(held, torch.Tensor) else read, state, template
    )
    return loaded


class Checkpointer:
    """One rank's checkpoint writer: at most one part in flight; rank 0 also completes each
    checkpoint once every rank's part is durable (``completed(step, path)``). ``replaced(g)``:
    the ranks replaced in a generation after ``g`` (their processes of ``g`` are gone)."""

    def __init__(
        self,
        root: Path,
        every: int,
        store: Callable[[], dist.Store],
        completed: Callable[[int, str], object],
        replaced: Callable[[int], set[int]] = lambda generation: set(),
    ) -> None:
        self.root, self.every = root, every
        self._store = store  # a new client per writer thread: a store client is not shared
        self._completed = completed
        self._replaced = replaced
        self._written = threading.Event()
        self._written.set()
        self._finishers: list[threading.Thread] = []
        self.due_next = False  # the step just committed is saved as the next one begins

    def due(self, step: int) -> bool:
        return (step + 1) % self.every == 0

    def save(
        self, step: int, generation: int, rank: int, world_size: int, state: dict[str, Any]
    ) -> None:
        """Stage a copy of ``state`` now and write it in the background; wait first for this
        rank's previous part, so that a slow disk slows the steps down instead of piling copies
        up."""
        self.drain()
        state = stage(state)
        self._written.clear()
        path = step_dir(self.root, step, generation)
        thread = threading.Thread(
            target=self._write,
            args=(path, step, generation, rank, world_size, state),
            name=f"flashrecovery-checkpoint-{step}",
            daemon=True,
        )
        self._finishers = [t for t in self._finishers if t.is_alive()] + [thread]
        thread.start()

    def drain(self) -> None:
        """Wait until this rank's part in flight, if any, is written."""
        self._written.wait()

    def prepare_load(self, optimizer: torch.optim.Optimizer) -> None:
        """Before a fallback's load: this rank's own part in flight is not half-written, and
        the optimizer has the state entries the load fills in."""
        self.drain()
        prepare_optimizer(optimizer)

    def load(self, path: Path, rank: int, state: dict[str, Any]) -> dict[str, Any]:
        return load(path, rank, state)

    def close(self, timeout: float) -> None:
        """At the end of training: let the last checkpoint complete (bounded)."""
        for thread in self._finishers:
            thread.join(timeout)

    def _write(
        self,
        path: Path,
        step: int,
        generation: int,
        rank: int,
        world_size: int,
        state: dict[str, Any],
    ) -> None:
        try:
            dcp.save(state, checkpoint_id=str(part_dir(path, rank)), no_dist=True)
            store = self._store()
            store.set(_key(generation, step, rank), "1")
        finally:
            self._written.set()
        if rank == 0 and self._parts_written(store, step, generation, world_size):
            _write_marker(path, {"step": step, "generation": generation, "world_size": world_size})
            self._completed(step, str(path))

    def _parts_written(self, store: dist.Store, step: int, generation: int, size: int) -> bool:
        """Wait until every rank's part is durable: False once a rank whose part is missing
        was replaced (it was lost before writing it: this checkpoint never counts), or after
        ``COMPLETION_TIMEOUT``."""
        keys = {r: _key(generation, step, r) for r in range(size)}
        deadline = time.monotonic() + COMPLETION_TIMEOUT.total_seconds()
        while True:
            try:
                store.wait(list(keys.values()), COMPLETION_SLICE)
                return True
            except dist.DistStoreError:
                missing = {r for r, key in keys.items() if not store.check([key])}
                if missing & self._replaced(generation) or time.monotonic() > deadline:
                    return False


def _key(generation: int, step: int, rank: int) -> str:
    return f"checkpoint/{generation}/{step}/{rank}"


def _write_marker(path: Path, content: dict[str, int]) -> None:
    """The marker appears whole or not at all, and survives a crash once written."""
    temporary = path / f".{MARKER}.tmp"
    with open(temporary, "w") as out:
        json.dump(content, out)
        out.flush()
        os.fsync(out.fileno())
    os.replace(temporary, path / MARKER)
    directory = os.open(path, os.O_RDONLY)
    try:
        os.fsync(directory)
    finally:
        os.close(directory)
