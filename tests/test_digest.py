"""The replicas' state digest (trainer_hooks/digest.py): equal for equal states, different for
a state with any one bit flipped, over every dtype a state holds."""

from __future__ import annotations

import copy

import pytest
import torch

from flashrecovery.trainer_hooks import digest


def trained(seed: int = 0) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(6, 5), torch.nn.BatchNorm1d(5))
    optimizer = torch.optim.AdamW(model.parameters())
    model(torch.randn(4, 6)).sum().backward()
    optimizer.step()
    return model, optimizer


def copied(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> tuple[
    torch.nn.Module, torch.optim.Optimizer
]:  # fmt: skip
    twin, _ = trained(seed=1)
    twin.load_state_dict(model.state_dict())
    twin_optimizer = torch.optim.AdamW(twin.parameters())
    twin_optimizer.load_state_dict(copy.deepcopy(optimizer.state_dict()))  # not its tensors
    return twin, twin_optimizer


def test_replicas_alike_have_one_digest_another_state_another() -> None:
    model, optimizer = trained()
    assert digest.state_digest(model, optimizer) == digest.state_digest(*copied(model, optimizer))
    assert digest.state_digest(model, optimizer) != digest.state_digest(*trained(seed=2))
    assert len(digest.state_digest(model, optimizer)) == digest.DIGEST_CHARS


@pytest.mark.parametrize("bit", [0, 1, 11, 22, 23, 30])
def test_any_one_bit_flipped_in_a_parameter_changes_the_digest(bit: int) -> None:
    model, optimizer = trained()
    twin, twin_optimizer = copied(model, optimizer)
    digest.flip_bit(twin, bit)
    assert not torch.equal(model[0].weight, twin[0].weight)
    assert digest.state_digest(model, optimizer) != digest.state_digest(twin, twin_optimizer)


def test_a_bit_flipped_in_the_optimizer_state_changes_it_too() -> None:
    model, optimizer = trained()
    twin, twin_optimizer = copied(model, optimizer)
    moment = next(iter(twin_optimizer.state.values()))["exp_avg_sq"]
    moment.view(torch.int32).view(-1)[3] ^= 1 << 5
    assert digest.state_digest(model, optimizer) != digest.state_digest(twin, twin_optimizer)


@pytest.mark.parametrize(
    "dtype", [torch.float16, torch.bfloat16, torch.float64, torch.int64, torch.bool]
)
def test_each_dtype_is_summed_as_integers_of_its_size(dtype: torch.dtype) -> None:
    tensor = (torch.arange(40) % 3).to(dtype)
    before = digest.bit_sum(tensor)
    as_int = tensor.view(torch.uint8)
    as_int[1] ^= 1 << 1
    assert digest.bit_sum(tensor) != before
