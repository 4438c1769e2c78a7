"""The overhead bench's share of the agent's CPU per steady step (pure): read from the agent's
CPU time sampled while the job ran, between the ends of the ranks' first and last steady
steps."""

from __future__ import annotations

import pytest

from bench.lib.sampling import ms_per_step

# The agent used 10 ms of CPU per second, sampled every 0.5 s from t = 100 s.
SAMPLES = [(100.0 + i / 2, 0.010 * i / 2) for i in range(21)]


def test_the_agents_cpu_between_the_window_ends_is_shared_by_its_steps() -> None:
    # 4 steps ending 2.25 s after the window opened: 22.5 ms of agent CPU, 5.625 ms a step
    ended = [101.2, 101.9, 102.4, 103.0, 103.45]
    assert ms_per_step(SAMPLES, ended) == pytest.approx(22.5 / 4)


def test_a_window_past_the_samples_counts_only_what_was_sampled() -> None:
    # sampling stopped at t = 110 s (the agent exited): nothing is made up after it
    assert ms_per_step(SAMPLES, [108.0, 112.0]) == pytest.approx(20.0)


def test_no_agent_or_no_steady_steps_is_no_share() -> None:
    assert ms_per_step([], [1.0, 2.0]) == 0.0
    assert ms_per_step(SAMPLES, [101.0]) == 0.0
