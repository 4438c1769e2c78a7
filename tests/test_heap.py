"""flashrecovery/heap.py: one collection, then what is left is frozen out of later ones."""

from __future__ import annotations

import gc
import weakref
from collections.abc import Iterator

import pytest

from flashrecovery import heap


class Node:
    """An object that can sit in a reference cycle (collectable only by the cycle collector)."""

    def __init__(self) -> None:
        self.other: Node | None = None


@pytest.fixture
def unfrozen() -> Iterator[None]:
    """This test freezes the test process's heap: give it back afterwards."""
    yield
    gc.unfreeze()


def test_settle_collects_garbage_first_and_freezes_what_is_left(unfrozen: None) -> None:
    a, b = Node(), Node()
    a.other, b.other = b, a  # a cycle: reference counting alone never frees it
    garbage = weakref.ref(a)
    del a, b
    kept = Node()
    before = gc.get_freeze_count()

    heap.settle()

    assert garbage() is None  # collected, not frozen
    assert gc.get_freeze_count() > before
    assert not any(obj is kept for obj in gc.get_objects())  # frozen: out of the generations
    made_later = Node()
    assert any(obj is made_later for obj in gc.get_objects())  # later objects are collected
