"""What the commit finds non-finite in a step (trainer_hooks/nonfinite.py): pure tensors."""

from __future__ import annotations

import math

import pytest
import torch

from flashrecovery.trainer_hooks import nonfinite


def gradients() -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(0)
    return [torch.randn(4, 3, generator=generator), torch.randn(5, generator=generator)]


def test_finite_steps_pass() -> None:
    assert nonfinite.found(0.25, gradients()) is None
    assert nonfinite.found(None, []) is None


@pytest.mark.parametrize("loss", [math.nan, math.inf, -math.inf])
def test_a_nonfinite_loss_is_found_first(loss: float) -> None:
    assert nonfinite.found(loss, gradients()) == f"loss {loss}"


@pytest.mark.parametrize("value", [math.nan, math.inf, -math.inf])
def test_one_nonfinite_element_of_any_gradient_is_found(value: float) -> None:
    grads = gradients()
    grads[1][3] = value
    assert nonfinite.found(0.25, grads) == "gradients"


def test_half_precision_gradients_are_summed_wide() -> None:
    """Their sum would overflow float16 (65504) while every element is finite."""
    big = torch.full((100,), 60000.0, dtype=torch.float16)
    assert big.sum().isinf()
    assert nonfinite.found(None, [big, torch.ones(3, dtype=torch.bfloat16)]) is None
    big[7] = math.nan
    assert nonfinite.found(None, [big]) == "gradients"


def test_the_nan_fault_poisons_the_first_gradient_that_has_elements() -> None:
    grads = [torch.zeros(0), torch.ones(2, 3).t(), torch.ones(4)]  # the second not contiguous
    nonfinite.poison(grads)
    assert math.isnan(grads[1][0, 0]) and grads[1].isnan().sum() == 1
    assert not grads[2].isnan().any()
    assert nonfinite.found(None, grads) == "gradients"


@pytest.mark.parametrize(("world", "shards"), [(1, 1), (2, 1), (4, 1), (4, 2), (6, 3), (8, 4)])
def test_reduced_gradients_are_looked_at_once_per_shard_and_step(world: int, shards: int) -> None:
    replicas = world // shards
    for step in range(3 * replicas):
        lookers = [r for r in range(world) if nonfinite.looks(step, r, world, shards, True)]
        assert sorted(r % shards for r in lookers) == list(range(shards)), (step, lookers)
    for rank in range(world):  # every replica takes its turn
        assert any(nonfinite.looks(step, rank, world, shards, True) for step in range(replicas))
        assert all(nonfinite.looks(step, rank, world, shards, False) for step in range(replicas))
