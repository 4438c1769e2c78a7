"""Where an epoch's batches come from, started at the data position.

A plain loader is iterated from the epoch's start and read past the batches already committed.
A loader with a state of its own (torchdata's ``StatefulDataLoader``) resumes from that state:
after each committed batch its state is kept in the data position, and it travels with the
rank's training state, so a replacement (or a checkpoint fallback) loads it and continues at
the next batch without reading past any. Its state holds counts and seeds, nothing of the
rank's own (a ``DistributedSampler`` keeps its rank in itself), so the donor's suits the
replacement.

``adopt`` makes a registered loader's own ``for batch in loader`` go through the session (each
batch until its step is committed), so a script keeps its loop.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterable, Iterator
from typing import Any, TypeVar

from flashrecovery.errors import ScriptError
from flashrecovery.trainer_hooks.position import DataPosition
from flashrecovery.trainer_hooks.training_state import Stateful

T = TypeVar("T")
_BATCHES = "_flashrecovery_batches"  # an adopted loader's session iteration, on the instance
_ADOPTED: dict[type, type] = {}  # a loader class -> its adopted subclass


class BatchSource:
    """An epoch's batches for the session: ``start`` iterates from the data position on,
    ``committed`` notes a batch committed. ``iterate`` is the loader's own iteration (an
    adopted loader's class's, not the session's)."""

    def __init__(self, loader: Iterable[Any], iterate: Callable[[], Iterator[Any]] | None = None):
        self.loader = loader
        self.stateful = isinstance(loader, Stateful)
        self._iterate = iterate or (lambda: iter(loader))

    def start(self, position: DataPosition) -> Iterator[Any]:
        if not self.stateful:
            return itertools.islice(self._iterate(), position.batch, None)
        if position.loader is not None:  # resume: after a restore, a fallback
            self.loader.load_state_dict(position.loader)  # type: ignore[attr-defined]
        return self._iterate()

    def committed(self, position: DataPosition) -> None:
        """The batch is committed: a stateful loader's state (after it, before the next) is
        where the data position resumes."""
        if self.stateful:
            position.loader = self.loader.state_dict()  # type: ignore[attr-defined]


def adopt(loader: Iterable[T], batches: Callable[[BatchSource], Iterator[T]]) -> None:
    """Make ``for batch in loader`` yield ``batches(source)`` (the session's steps): the
    loader's class becomes a subclass of its own whose ``__iter__`` does that."""
    if adopted(loader):
        raise ScriptError("this loader is registered already (with another session?)")
    cls = type(loader)
    if cls not in _ADOPTED:
        _ADOPTED[cls] = type(
            cls.__name__,
            (cls,),
            {"__iter__": _session_iter, "__module__": cls.__module__, "__doc__": cls.__doc__},
        )
    own = BatchSource(loader, lambda: cls.__iter__(loader))  # bound now: before the swap
    vars(loader)[_BATCHES] = lambda: batches(own)
    loader.__class__ = _ADOPTED[cls]


def adopted(loader: object) -> bool:
    return _BATCHES in getattr(loader, "__dict__", {})


def _session_iter(self: Any) -> Iterator[Any]:
    batches: Iterator[Any] = vars(self)[_BATCHES]()
    return batches
