"""Records survive the log as plain JSON, and anything that is not a valid record is refused with
a RecordError that says which field is wrong and why (never another exception: the engine and
every reader rely on that to count bad records instead of crashing)."""

from __future__ import annotations

import json
import math
from collections.abc import Callable
from typing import Any

import pytest
from factories import (
    DECISION_TYPES,
    EVENT_TYPES,
    JOB,
    RECORD_TYPES,
    SAMPLE_FIELDS,
    make,
    type_name,
    valid_records,
)
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from flashrecovery.records import (
    Envelope,
    Heartbeat,
    IsolateRank,
    RecordError,
    StepCompleted,
    Stream,
    dump_record,
    parse_record,
    stream_of,
)

FUZZ = settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
TYPE_IDS = [type_name(cls) for cls in RECORD_TYPES]


def plain(record: Envelope) -> dict[str, Any]:
    decoded = json.loads(dump_record(record))
    assert isinstance(decoded, dict)
    return decoded


def test_the_factory_covers_every_record_type() -> None:
    assert sorted(SAMPLE_FIELDS) == sorted(TYPE_IDS)


@pytest.mark.parametrize("cls", RECORD_TYPES, ids=TYPE_IDS)
def test_every_type_round_trips_as_plain_json(cls: type[Envelope]) -> None:
    record = make(cls)
    raw = dump_record(record)

    assert parse_record(raw) == record
    assert parse_record(raw, stream_of(record)) == record
    assert parse_record(raw.decode()) == record
    decoded = plain(record)
    assert parse_record(decoded) == record
    assert decoded["type"] == type_name(cls)
    assert decoded["schema_version"] == 1
    assert decoded["job_id"] == JOB
    assert {"record_id", "generation", "source", "ts"} <= decoded.keys()


def test_envelope_defaults_give_fresh_ids_and_a_timestamp() -> None:
    fields = {"job_id": JOB, "generation": 0, "source": "rank:0", **SAMPLE_FIELDS["heartbeat"]}
    first, second = Heartbeat(**fields), Heartbeat(**fields)
    assert first.record_id != second.record_id
    assert first.ts > 1_600_000_000


@given(valid_records(RECORD_TYPES, world_size=4, pids=[1001, 1002]))
@FUZZ
def test_random_valid_records_round_trip(record: Envelope) -> None:
    assert parse_record(dump_record(record), stream_of(record)) == record


# ------------------------------------------------------------------ streams


@pytest.mark.parametrize("cls", DECISION_TYPES, ids=type_name)
def test_a_decision_is_not_an_event(cls: type[Envelope]) -> None:
    with pytest.raises(RecordError, match=f"'{type_name(cls)}'.*does not match"):
        parse_record(dump_record(make(cls)), Stream.EVENTS)


@pytest.mark.parametrize("cls", EVENT_TYPES, ids=type_name)
def test_an_event_is_not_a_decision(cls: type[Envelope]) -> None:
    with pytest.raises(RecordError, match=f"'{type_name(cls)}'.*does not match"):
        parse_record(dump_record(make(cls)), Stream.DECISIONS)


def test_stream_of_tells_events_from_decisions() -> None:
    assert {stream_of(make(cls)) for cls in EVENT_TYPES} == {Stream.EVENTS}
    assert {stream_of(make(cls)) for cls in DECISION_TYPES} == {Stream.DECISIONS}


# ------------------------------------------------------------------ malformed


def heartbeat_with(change: Callable[[dict[str, Any]], object]) -> dict[str, Any]:
    data = plain(make(Heartbeat))
    change(data)
    return data


MALFORMED: list[Any] = [
    pytest.param(
        heartbeat_with(lambda d: d.pop("rank")), ["heartbeat.rank", "Field required"], id="missing"
    ),
    pytest.param(
        heartbeat_with(lambda d: d.update(rank="three")),
        ["heartbeat.rank", "valid integer"],
        id="wrong-type",
    ),
    pytest.param(
        heartbeat_with(lambda d: d.update(pid=0)),
        ["heartbeat.pid", "greater than or equal to 1"],
        id="out-of-range",
    ),
    pytest.param(
        heartbeat_with(lambda d: d.update(job_id="a job")),
        ["heartbeat.job_id", "pattern"],
        id="bad-job-id",
    ),
    pytest.param(
        heartbeat_with(lambda d: d.update(type="heartbeet")),
        ["'heartbeet'", "type", "does not match"],
        id="unknown-type",
    ),
    pytest.param(heartbeat_with(lambda d: d.pop("type")), ["discriminator 'type'"], id="no-type"),
    pytest.param(
        heartbeat_with(lambda d: d.update(schema_version=2)),
        ["schema_version", "unsupported value 2"],
        id="future-version",
    ),
    pytest.param(
        heartbeat_with(lambda d: d.pop("schema_version")),
        ["schema_version", "unsupported value None"],
        id="no-version",
    ),
    pytest.param(
        heartbeat_with(lambda d: d.update(schema_version=True)),
        ["schema_version", "unsupported value True"],
        id="boolean-version",
    ),
    pytest.param(
        heartbeat_with(lambda d: d.update(colour="red")),
        ["heartbeat.colour", "Extra inputs are not permitted"],
        id="extra-field",
    ),
    pytest.param(b'{"type": "heartbeat"', ["<record>", "not JSON"], id="not-json"),
    pytest.param(b"\xff\xfe\x00garbage", ["<record>", "not JSON"], id="not-utf8"),
    pytest.param("[" * 100_000, ["<record>", "not JSON"], id="nested-too-deep"),
    pytest.param('{"rank": ' + "9" * 5000 + "}", ["<record>", "not JSON"], id="huge-int"),
    pytest.param(b"[1, 2]", ["<record>", "JSON object", "list"], id="array"),
    pytest.param(b'"heartbeat"', ["<record>", "JSON object", "str"], id="string"),
]


@pytest.mark.parametrize(("data", "fragments"), MALFORMED)
def test_malformed_records_are_explained(
    data: bytes | str | dict[str, Any], fragments: list[str]
) -> None:
    with pytest.raises(RecordError) as raised:
        parse_record(data)
    for fragment in fragments:
        assert fragment in raised.value.reason
    assert str(raised.value) == raised.value.reason


def test_many_errors_are_summarised() -> None:
    data = heartbeat_with(lambda d: d.update(rank=-1, step=-5, pid=0, host=1, generation=-1, ts=-1))
    with pytest.raises(RecordError, match=r"; and 1 more$"):
        parse_record(data)


# ------------------------------------------------------------------ garbage

JSON_VALUES = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=20),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner),
    max_leaves=20,
)


def parses_or_refuses(data: bytes | str | dict[str, Any]) -> None:
    """The only acceptable outcomes: a record, or a RecordError with a non-empty reason."""
    try:
        record = parse_record(data)
    except RecordError as exc:
        assert exc.reason
    else:
        assert isinstance(record, Envelope)


@given(st.binary(max_size=200))
@FUZZ
def test_random_bytes_only_raise_record_error(data: bytes) -> None:
    parses_or_refuses(data)


@given(JSON_VALUES)
@FUZZ
def test_arbitrary_json_values_only_raise_record_error(value: object) -> None:
    parses_or_refuses(json.dumps(value))
    if isinstance(value, dict):
        parses_or_refuses(value)


@st.composite
def typed_garbage(draw: st.DrawFn) -> dict[str, Any]:
    """A dict with a real type and version, each field either its valid value or garbage."""
    cls = draw(st.sampled_from(RECORD_TYPES))
    valid = plain(make(cls))
    data = {"type": valid["type"], "schema_version": 1}
    for name in cls.model_fields:
        if name in data or draw(st.integers(0, 9)) == 0:
            continue  # sometimes missing
        data[name] = draw(st.just(valid.get(name)) | JSON_VALUES)
    if draw(st.booleans()):
        data[draw(st.text(max_size=8))] = draw(JSON_VALUES)
    return data


@given(typed_garbage())
@FUZZ
def test_typed_dicts_with_random_fields_only_raise_record_error(data: dict[str, Any]) -> None:
    parses_or_refuses(data)
    parses_or_refuses(json.dumps(data))


def test_a_parsed_decision_keeps_its_cause() -> None:
    record = parse_record(dump_record(make(IsolateRank, caused_by=12)), Stream.DECISIONS)
    assert isinstance(record, IsolateRank) and record.caused_by == 12


def test_a_nan_loss_survives_the_round_trip_as_plain_json() -> None:
    record = make(StepCompleted, loss=float("nan"))
    raw = dump_record(record)
    assert json.loads(raw)["loss"] == "NaN"  # a string any JSON tool reads, not null
    parsed = parse_record(raw)
    assert isinstance(parsed, StepCompleted) and parsed.loss is not None and math.isnan(parsed.loss)
