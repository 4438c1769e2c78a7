"""`python -m bench.overhead --phases`: two jobs take turns at gates (bench/overhead/turns.py,
real FIFOs, ranks played by threads), and the paired overhead of neighbouring phases (pure),
with what the waiting hook job takes from the baseline charged against the hook."""

from __future__ import annotations

import os
import threading
from pathlib import Path
from typing import Any

import pytest

from bench.overhead.sides import PARTS, WARMUP
from bench.overhead.summary import summarize_turns
from bench.overhead.turns import Gates, Turns

pytestmark = pytest.mark.timeout(60)
WAIT_S = 10.0


def test_two_jobs_never_step_at_the_same_time(tmp_path: Path) -> None:
    world, every, phases = 2, 3, 4
    steps = 1 + phases * every + 1  # first gate at 1; the last gate lets both through
    events: list[tuple[str, int]] = []  # (job, step), in the order steps ran
    lock = threading.Lock()
    turns = {job: Turns(tmp_path / job, world) for job in ("a", "b")}

    def rank(job: str, r: int) -> None:
        gate = Gates(str(tmp_path / job), 1, every).open(r)
        for step in range(steps):
            gate.passes(step)
            with lock:
                events.append((job, step))

    threads = [
        threading.Thread(target=rank, args=(job, r), daemon=True) for job in turns for r in range(2)
    ]
    for t in threads:
        t.start()
    for job in turns:  # both stand at their first gate, step 0 behind them
        turns[job].wait_at(1, WAIT_S, lambda: True)
    order = []
    for phase in range(phases):
        for job in ("a", "b") if phase % 2 == 0 else ("b", "a"):
            begun = len(events)
            turns[job].let_through()
            turns[job].wait_at(1 + (phase + 1) * every, WAIT_S, lambda: True)
            ran = events[begun:]
            # only this job stepped, each of its ranks through exactly this phase's steps
            assert sorted(ran) == sorted(
                (job, s) for s in range(1 + phase * every, 1 + (phase + 1) * every) for _ in "xy"
            )
            order.append(job)
    for job in turns:
        turns[job].let_through()
    for t in threads:
        t.join(WAIT_S)
    assert order == ["a", "b", "b", "a", "a", "b", "b", "a"]
    assert not any(t.is_alive() for t in threads)
    for job in turns:
        turns[job].close()


def test_a_job_that_ends_before_its_gate_is_reported_not_waited_for(tmp_path: Path) -> None:
    turns = Turns(tmp_path, 2)
    with pytest.raises(RuntimeError, match="0 of 2 ranks reached gate 5"):
        turns.wait_at(5, WAIT_S, lambda: False)
    turns.close()
    assert sorted(os.listdir(tmp_path)) == ["grant0", "grant1", "reached"]


def _ranks(ms_per_phase: list[float], every: int) -> list[dict[str, Any]]:
    """Two ranks whose every step of phase k took ``ms_per_phase[k]`` (warm-up steps: 1 s)."""
    steps = list(range(WARMUP + len(ms_per_phase) * every))
    seconds = [1.0 if s < WARMUP else ms_per_phase[(s - WARMUP) // every] / 1000 for s in steps]
    rank = {part: seconds for part in PARTS} | {"step": steps, "params_sha256": "same"}
    return [rank, rank]


def _phases(side: str, n: int, waiting_cpu_s: float) -> list[dict[str, Any]]:
    return [
        {
            "side": side,
            "phase": k,
            "seconds": 1.0,
            "job_cpu_s": 0.5,
            "agent_cpu_s": 0.0,
            "waiting_cpu_s": waiting_cpu_s,
            "load_1m": 1.0,
        }
        for k in range(n)
    ]


def test_neighbouring_phases_pair_and_the_waiting_hook_is_charged() -> None:
    every, n = 6, 5
    base = [50.0, 60.0, 55.0, 70.0, 52.0]  # the machine's noise moves both sides alike
    hook = [b * 1.02 for b in base]  # the hook: 2 % a step
    cores = os.cpu_count() or 1
    result = {
        "turns": {"phases": n, "steps_per_phase": every, "skipped_per_phase": 2},
        # while the baseline ran, the waiting hook job took 40 ms of CPU a second; the waiting
        # baseline 10 ms: 30 ms a second more of the machine's cores
        "phases": _phases("ddp", n, 0.040) + _phases("hook-ddp", n, 0.010),
        "ranks": {"ddp": _ranks(base, every), "hook-ddp": _ranks(hook, every)},
    }
    sides = summarize_turns(result)
    bias = 30 / (10 * cores)
    hook_side = sides["hook-ddp"]
    assert hook_side["waiting_bias_pct"] == pytest.approx(bias)
    assert hook_side["overhead_pct_per_repeat"] == pytest.approx([2.0 + bias] * n)
    assert hook_side["overhead_pct"] == pytest.approx(2.0 + bias)
    assert hook_side["overhead_pct_interval"]["coverage"] == pytest.approx(0.9375)
    assert hook_side["within_goal"] == ("yes" if 2.0 + bias <= 5.0 else "undecided")
    assert sides["ddp"]["run_medians_ms"] == pytest.approx(base)
    assert hook_side["bitwise_equal_to_baseline"]
