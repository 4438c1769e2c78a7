"""Sampling what processes cost while a bench runs: CPU seconds, read with psutil."""

from __future__ import annotations

import bisect
import contextlib

import psutil

CpuSamples = list[tuple[float, float]]  # (unix time, a process's CPU seconds so far)


def cpu_seconds(processes: list[psutil.Process]) -> float:
    """The CPU seconds (user and system) the processes have used so far; one gone counts 0."""
    seconds = 0.0
    for process in processes:
        with contextlib.suppress(psutil.NoSuchProcess):
            cpu = process.cpu_times()
            seconds += cpu.user + cpu.system
    return seconds


def cpu_at(samples: CpuSamples, when: float) -> float:
    """The CPU time at ``when``, interpolated between the samples around it."""
    i = min(max(bisect.bisect_left(samples, (when,)), 1), len(samples) - 1)
    (t0, c0), (t1, c1) = samples[i - 1], samples[i]
    return c0 + (c1 - c0) * min(max((when - t0) / (t1 - t0), 0.0), 1.0) if t1 > t0 else c1


def ms_per_step(samples: CpuSamples, ended: list[float]) -> float:
    """CPU ms per step over steps whose ends are ``ended`` (the step before the first of them,
    then each one's end), from the samples around that window; 0 without samples."""
    if len(samples) < 2 or len(ended) < 2:
        return 0.0
    return (cpu_at(samples, ended[-1]) - cpu_at(samples, ended[0])) * 1000 / (len(ended) - 1)
