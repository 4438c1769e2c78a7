"""Where an epoch's batches come from (trainer_hooks/loader.py): a plain loader read past the
committed batches, a StatefulDataLoader resumed from its own state (reading nothing twice),
and a registered loader whose own loop yields the session's steps."""

from __future__ import annotations

import itertools
from collections.abc import Iterator
from typing import Any

import pytest
import torch
from torch.utils.data import DataLoader, Dataset
from torchdata.stateful_dataloader import StatefulDataLoader

from flashrecovery.errors import ScriptError
from flashrecovery.trainer_hooks.loader import BatchSource, adopt, adopted
from flashrecovery.trainer_hooks.position import DataPosition


class Counted(Dataset[int]):
    def __init__(self) -> None:
        self.read = 0

    def __len__(self) -> int:
        return 20

    def __getitem__(self, index: int) -> int:
        self.read += 1
        return index


def shuffled(data: Counted) -> StatefulDataLoader:
    return StatefulDataLoader(data, batch_size=4, shuffle=True, generator=torch.Generator())


def test_a_plain_loader_is_read_past_the_committed_batches() -> None:
    data = Counted()
    batches = list(BatchSource(DataLoader(data, batch_size=4)).start(DataPosition(0, 3)))
    assert [b.tolist() for b in batches] == [[12, 13, 14, 15], [16, 17, 18, 19]]
    assert data.read == 20  # the three committed batches were read too


def test_a_stateful_loader_resumes_from_the_state_of_its_committed_batches() -> None:
    torch.manual_seed(7)
    donor_data = Counted()
    donor = BatchSource(shuffled(donor_data))
    position = DataPosition()
    seen = []
    for batch in donor.start(position):
        seen.append(batch.tolist())
        position.batch += 1  # committed
        donor.committed(position)
        if position.batch == 3:
            break
    assert position.loader is not None
    rest = [b.tolist() for b in donor.start(DataPosition(0, 3, position.loader))]

    # A replacement builds its loader anew (another seed drawn), then takes the donor's state.
    torch.manual_seed(99)
    data = Counted()
    resumed = BatchSource(shuffled(data))
    state = DataPosition()
    state.load_state_dict(position.state_dict())
    assert [b.tolist() for b in resumed.start(state)] == rest
    assert sorted(itertools.chain(*seen, *rest)) == list(range(20))
    assert data.read == 8  # the two batches it trained on, nothing before them


def test_the_next_epoch_starts_the_loader_afresh() -> None:
    position = DataPosition(2, 5, {"_num_yielded": 5})
    position.next_epoch()
    assert (position.epoch, position.batch, position.loader) == (3, 0, None)
    assert DataPosition(**{"epoch": 1, "batch": 2}).state_dict()["loader"] is None
    old = DataPosition()
    old.load_state_dict({"epoch": 1, "batch": 2})  # a checkpoint of an earlier version
    assert (old.epoch, old.batch, old.loader) == (1, 2, None)


def test_a_registered_loader_yields_the_session_s_batches_in_its_own_loop() -> None:
    loader = shuffled(Counted())
    sources: list[BatchSource] = []

    def session_batches(source: BatchSource) -> Iterator[Any]:
        sources.append(source)
        for batch in source.start(DataPosition()):
            yield ("step", batch.tolist())

    adopt(loader, session_batches)
    assert adopted(loader) and isinstance(loader, StatefulDataLoader)
    steps = list(loader)
    assert len(steps) == 5 and all(kind == "step" for kind, _ in steps)
    assert sorted(itertools.chain(*(b for _, b in steps))) == list(range(20))
    assert sources[0].stateful and len(loader) == 5
    with pytest.raises(ScriptError, match="registered already"):
        adopt(loader, session_batches)
    assert not adopted(DataLoader(Counted()))
