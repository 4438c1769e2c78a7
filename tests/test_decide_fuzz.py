"""Garbage never crashes the decide step: undecodable entries and valid records that
make no sense now are counted in ``state.rejected`` with a reason (or fenced), produce no
decision, and the same records always yield the same decisions (replay depends on it)."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass

from factories import JOB, RECORD_TYPES, feed, valid_records
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from flashrecovery.connectors.memory import MemoryLog
from flashrecovery.engine.decide import decide
from flashrecovery.engine.ingest import ingest
from flashrecovery.engine.loop import EngineLoop
from flashrecovery.engine.state import EngineState
from flashrecovery.records import Decision, Envelope, Stream, decision_id, dump_record, parse_record
from flashrecovery.testing.simworld import SimulatedWorld, drive

FUZZ = settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def world() -> SimulatedWorld:
    return SimulatedWorld(JOB, world_size=4, spares=1)


def start_records() -> list[Envelope]:
    return world().start()


def recovery_events() -> list[Envelope]:
    """The events of a scripted job with two recoveries (a spare, then a fresh process)."""
    sim, log = world(), MemoryLog()
    engine = EngineLoop(log, JOB)
    drive(log, engine, sim, sim.start())
    drive(log, engine, sim, sim.train(3))
    drive(log, engine, sim, [sim.kill(2)])
    drive(log, engine, sim, sim.train(2))
    drive(log, engine, sim, [sim.raise_in(0)])
    drive(log, engine, sim, [*sim.train(2), *sim.finish()])
    records = [entry.record for entry in log.read(Stream.EVENTS, JOB)]
    assert all(record is not None for record in records)
    return [record for record in records if record is not None]


START = start_records()
SCRIPT = recovery_events()
KNOWN_PIDS = sorted({pid for r in SCRIPT if isinstance(pid := getattr(r, "pid", None), int)})
RANDOM_RECORDS = valid_records(RECORD_TYPES, world_size=4, pids=KNOWN_PIDS)


@dataclass
class Outcome:
    decisions: list[list[Decision]]
    rejected: Counter[str]
    fenced: int
    generation: int
    job_state: str


def run_checked(records: list[Envelope]) -> Outcome:
    """Feed records one by one, checking that each applies, is fenced or is rejected with a
    reason, and that every decision is a well-formed record caused by its event."""
    state = EngineState(JOB)
    out: list[list[Decision]] = []
    for position, record in enumerate(records):
        rejected_before, fenced_before = Counter(state.rejected), state.fenced
        decisions = decide(state, position, record)
        new_reasons = state.rejected - rejected_before
        if new_reasons or state.fenced > fenced_before:
            assert decisions == []
        assert sum(new_reasons.values()) <= 1
        # Bad input is the record's fault, rejected with a reason; never the engine's own.
        assert not state.engine_faults, state.engine_faults
        for reason in new_reasons:
            assert reason.startswith(f"{record.type}: ") and len(reason) > len(record.type) + 2
        for index, decision in enumerate(decisions):
            assert decision.record_id == decision_id(JOB, position, index)
            assert (decision.caused_by, decision.job_id, decision.ts) == (position, JOB, record.ts)
            assert parse_record(dump_record(decision), Stream.DECISIONS) == decision
        out.append(decisions)
    return Outcome(out, state.rejected, state.fenced, state.generation, state.job.state)


def assert_deterministic(records: list[Envelope]) -> Outcome:
    first = run_checked(records)
    assert run_checked(records) == first
    return first


# ------------------------------------------------------------------ undecodable entries


@given(st.lists(st.binary(max_size=64), min_size=1, max_size=10))
@example([b"[" * 100_000, b'{"rank": ' + b"9" * 5000 + b"}", b'{"schema_version": true}'])
@FUZZ
def test_random_bytes_are_counted_with_an_explanation(blobs: list[bytes]) -> None:
    log = MemoryLog()
    for record in START:
        log.append(Stream.EVENTS, record)
    for blob in blobs:
        log.append_raw(Stream.EVENTS, JOB, blob)
    state = EngineState(JOB)

    for entry in log.read(Stream.EVENTS, JOB):
        decisions = ingest(state, entry)
        if entry.position < len(START):
            assert entry.record is not None and decisions == []
            continue
        assert entry.record is None and entry.error
        assert decisions == []
        assert state.rejected[f"malformed: {entry.error}"] >= 1

    assert sum(state.rejected.values()) == len(blobs)
    assert state.position == len(START) + len(blobs) - 1
    assert (state.job.state, state.generation, state.fenced) == ("running", 0, 0)
    assert {view.machine.state for view in state.ranks.values()} == {"healthy"}


# ------------------------------------------------------------------ valid but random records


@given(st.lists(RANDOM_RECORDS, max_size=30))
@FUZZ
def test_random_records_after_a_start_never_crash(records: list[Envelope]) -> None:
    outcome = assert_deterministic([*START, *records])
    assert all(decisions == [] for decisions in outcome.decisions[: len(START)])


# Random records, each to go in at a position of the recovery script.
SPLICES = st.lists(st.tuples(st.integers(0, len(SCRIPT)), RANDOM_RECORDS), max_size=12)


def spliced(insertions: list[tuple[int, Envelope]]) -> list[Envelope]:
    """The recovery script with ``insertions`` (from SPLICES) put in."""
    records = list(SCRIPT)
    for index, record in sorted(insertions, key=lambda pair: -pair[0]):
        records.insert(index, record)
    return records


@given(SPLICES)
@FUZZ
def test_random_records_spliced_into_a_recovery_never_crash(
    insertions: list[tuple[int, Envelope]],
) -> None:
    assert_deterministic(spliced(insertions))


def test_the_unspoilt_script_recovers_twice_without_rejections() -> None:
    """The baseline the spliced cases perturb: a clean run of the script decides both
    recoveries and ends completed, so the fuzzing above does reach the recovery paths."""
    outcome = assert_deterministic(SCRIPT)
    kinds = [d.type for decisions in outcome.decisions for d in decisions]
    assert kinds.count("isolate_rank") == 2 and kinds.count("incident_closed") == 2
    replacements = [k for k in kinds if k in ("assign_spare", "spawn_replacement")]
    assert replacements == ["assign_spare", "spawn_replacement"]
    assert (outcome.rejected, outcome.job_state, outcome.generation) == (Counter(), "completed", 2)


def test_feed_matches_checked_run() -> None:
    """The shared ``feed`` helper decides exactly what the checked run does."""
    state = EngineState(JOB)
    flat = [d for decisions in run_checked(SCRIPT).decisions for d in decisions]
    assert feed(state, SCRIPT, 0) == flat
