"""The overhead bench's verdict on the 5 % goal (pure): an interval for the median of the
repeats' paired overheads from their order statistics, and whether it decides the goal."""

from __future__ import annotations

import pytest

from bench.lib.stats import median_interval as interval_at
from bench.overhead.summary import CONFIDENCE, pool, verdict


def median_interval(values: list[float]) -> tuple[float, float, float]:
    return interval_at(values, CONFIDENCE)


@pytest.mark.parametrize(
    ("repeats", "coverage"),
    [(3, 0.75), (5, 0.9375), (7, 1 - 2 / 128)],  # up to 7: the range, and what it covers
)
def test_few_repeats_give_their_range(repeats: int, coverage: float) -> None:
    values = [float(v) for v in range(repeats, 0, -1)]  # unsorted on purpose
    assert median_interval(values) == (1.0, float(repeats), pytest.approx(coverage))


def test_more_repeats_leave_out_their_extremes() -> None:
    # 9 repeats: the 2nd smallest and 2nd largest cover the median with 96 %, the 3rd only 82 %
    values = [40.0, -30.0, 1.0, 2.0, 3.0, 4.0, 5.0, 6.0, 7.0]
    low, high, coverage = median_interval(values)
    assert (low, high) == (1.0, 7.0)
    assert coverage == pytest.approx(1 - 2 * 10 / 512)


def test_the_goal_is_decided_only_when_the_whole_interval_is_on_one_side() -> None:
    assert verdict(-2.0, 4.9, 0.94) == "yes"
    assert verdict(5.1, 12.0, 0.94) == "no"
    assert verdict(1.0, 7.0, 0.94) == "undecided"


def test_an_interval_that_covers_too_little_decides_nothing() -> None:
    assert verdict(-2.0, 4.9, 0.75) == "too few repeats"  # 3 repeats: their range, 75 %


def _run(cells: dict[tuple[str, int], list[float]]) -> dict[str, object]:
    """A run's JSON after summarizing: each cell's baseline, and its hook side's pairs."""
    return {
        "results": [
            {
                "model": model,
                "world_size": world,
                "sides": {
                    "ddp": {"median_ms": 50.0},
                    "hook-ddp": {"overhead_pct_per_repeat": pairs},
                },
            }
            for (model, world), pairs in cells.items()
        ]
    }


def test_pooling_runs_joins_each_cells_pairs_and_decides_on_all_of_them() -> None:
    first = [4.0, 5.5, 3.0, 6.0, 2.0]  # alone: the range, 2…6, undecided
    second = [1.0, 4.5, 3.5, 2.5, 0.5, 4.0]
    cells = pool([_run({("mlp", 2): first}), _run({("mlp", 2): second, ("gpt", 4): [1.0] * 5})])
    assert [(c["model"], c["world_size"], c["side"], c["runs"]) for c in cells] == [
        ("mlp", 2, "hook-ddp", 2),
        ("gpt", 4, "hook-ddp", 1),
    ]
    mlp = cells[0]
    assert mlp["pairs"] == first + second
    low, high, coverage = median_interval(first + second)
    assert mlp["overhead_pct_interval"] == {"low": low, "high": high, "coverage": coverage}
    assert mlp["overhead_pct"] == 3.5
    assert (low, high) == (2.0, 4.5)  # 11 pairs leave out the extremes that 5 could not
    assert mlp["within_goal"] == verdict(low, high, coverage) == "yes"
