"""Shared builders for the pure-logic tests: one valid record per type, record strategies, and
an engine state driven to a running job by a scripted world."""

from __future__ import annotations

import os
from collections.abc import Iterable
from typing import Any

from hypothesis import strategies as st

from flashrecovery.connectors.base import LogConnector
from flashrecovery.connectors.signing import SECRET, Keyring
from flashrecovery.engine.decide import decide
from flashrecovery.engine.state import EngineState
from flashrecovery.records import Decision, Envelope, RankExited

# re-exported: the tests take their samples from here
from flashrecovery.testing.samples import DECISION_TYPES as DECISION_TYPES
from flashrecovery.testing.samples import EVENT_TYPES as EVENT_TYPES
from flashrecovery.testing.samples import RECORD_TYPES as RECORD_TYPES
from flashrecovery.testing.samples import SAMPLE_FIELDS, T0, type_name
from flashrecovery.testing.samples import TYPES_BY_NAME as TYPES_BY_NAME
from flashrecovery.testing.simworld import SimulatedWorld

JOB = "job-1"
# The secret of the scripted jobs whose engines are services of their own: the records the
# tests append are signed with it (signed), and the services are given it (engine_env).
JOB_SECRET = "tests-job-secret-0123456789abcdef"


def signed(log: LogConnector) -> LogConnector:
    """``log``, signing what it appends as the job's writers would."""
    log.sign_with(Keyring(JOB_SECRET))
    return log


def engine_env() -> dict[str, str]:
    """The environment of a `flashrecovery engine` service of a scripted job."""
    return {**os.environ, SECRET: JOB_SECRET}


def make(cls: type[Envelope], **overrides: Any) -> Envelope:
    """A valid record of ``cls`` with fixed envelope values; ``overrides`` replace any field."""
    fields: dict[str, Any] = {
        "record_id": "r-1",
        "job_id": JOB,
        "generation": 0,
        "source": "agent" if cls is RankExited else "test",  # the engine believes no other
        "ts": T0,
        **SAMPLE_FIELDS[type_name(cls)],
        **overrides,
    }
    return cls(**fields)


def valid_records(
    types: list[type[Envelope]], world_size: int, pids: list[int]
) -> st.SearchStrategy[Envelope]:
    """Valid records of the given types whose ids, generations and pids are drawn near the
    values a job of ``world_size`` uses (sometimes just outside it, to exercise rejection)."""
    small = st.integers(min_value=0, max_value=3)
    step = st.integers(min_value=-1, max_value=8)
    fields: dict[str, st.SearchStrategy[Any]] = {
        "job_id": st.sampled_from([JOB, JOB, JOB, "other-job"]),
        "generation": small,
        "ts": st.floats(min_value=T0, max_value=T0 + 60, allow_nan=False),
        "rank": st.integers(min_value=0, max_value=world_size),
        "donor": st.integers(min_value=0, max_value=world_size),
        "pid": st.sampled_from(pids) | st.integers(min_value=1, max_value=5000),
        "spare_id": small,
        "step": st.integers(min_value=0, max_value=8),
        "committed_step": step,
        "last_step": step,
        "shard": st.integers(min_value=0, max_value=1),
        "ok": st.booleans(),
        "status": st.sampled_from(["completed", "failed"]),
        "exit_code": st.integers(min_value=-1, max_value=2),
        "signal": st.none() | st.sampled_from([9, 15]),
        "last_seen_ts": st.floats(min_value=T0 - 10, max_value=T0 + 60, allow_nan=False),
        "silent_s": st.floats(min_value=0, max_value=30, allow_nan=False),
        "stalled_s": st.floats(min_value=0, max_value=30, allow_nan=False),
        "window_s": st.floats(min_value=0.1, max_value=30, allow_nan=False),
        "waiting": st.booleans(),
        "duration_s": st.floats(min_value=0, max_value=5, allow_nan=False),
    }

    def of(cls: type[Envelope]) -> st.SearchStrategy[Envelope]:
        drawn = {name: s for name, s in fields.items() if name in cls.model_fields}
        return st.builds(make, st.just(cls), **drawn)

    return st.sampled_from(types).flatmap(of)


def feed(state: EngineState, records: Iterable[Envelope], first_position: int) -> list[Decision]:
    """Decide each record at consecutive positions; returns every decision made."""
    out: list[Decision] = []
    for position, record in enumerate(records, start=first_position):
        out.extend(decide(state, position, record))
    return out


def running_job(world: SimulatedWorld, steps: int = 0) -> EngineState:
    """An engine state that has seen the world start (every rank joined) and train ``steps``."""
    state = EngineState(world.job_id)
    records = [*world.start(), *world.train(steps)]
    assert feed(state, records, 0) == []
    assert state.job.state == "running" and not state.rejected
    return state
