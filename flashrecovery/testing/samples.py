"""One valid record of every type (a record type added to the schema shows up here by itself,
and a test fails until it has a sample): for the tests, and for the chaos command's forger,
which writes one of each into a running job's log (chaos/forge.py)."""

from __future__ import annotations

import typing
from typing import Any

from flashrecovery.records import DecisionRecord, Envelope, EventRecord

T0 = 1_800_000_000.0

# The members of the discriminated unions, so a new record type shows up here by itself.
EVENT_TYPES: list[type[Envelope]] = list(typing.get_args(typing.get_args(EventRecord)[0]))
DECISION_TYPES: list[type[Envelope]] = list(typing.get_args(typing.get_args(DecisionRecord)[0]))
RECORD_TYPES: list[type[Envelope]] = [*EVENT_TYPES, *DECISION_TYPES]

# The required fields of each type (beyond the envelope), with valid values.
SAMPLE_FIELDS: dict[str, dict[str, Any]] = {
    "job_started": {"world_size": 4, "spares": 1, "heartbeat_interval_s": 0.5},
    "node_joined": {"node": 0, "pid": 900, "host": "h", "ranks": 2, "spares": 1},
    "node_heartbeat": {"node": 0, "pid": 900},
    "node_missed": {"node": 1, "last_seen_ts": T0, "silent_s": 3.5},
    "agent_exited": {"node": 1, "pid": 4242, "observer": 0},
    "node_wait_expired": {"ranks": [2, 3], "waited_s": 30.0},
    "rank_joined": {"rank": 0, "pid": 1001, "host": "h"},
    "spare_ready": {"spare_id": 0, "pid": 2001, "host": "h"},
    "heartbeat": {"rank": 0, "step": 3, "pid": 1001, "host": "h"},
    "spare_heartbeat": {"spare_id": 0, "pid": 2001},
    "spare_missed": {"spare_id": 0, "last_seen_ts": T0, "silent_s": 1.5},
    "step_completed": {"rank": 0, "step": 3, "duration_s": 0.2, "loss": 0.5},
    "step_nonfinite": {
        "rank": 1,
        "step": 3,
        "found": "loss nan",
        "attempt": 1,
        "action": "recompute",
    },
    "step_retried": {"rank": 1, "step": 3, "attempt": 1, "waited_s": 3.0},
    "state_digest": {"rank": 1, "step": 3, "shard": 0, "digest": "91c667fc90dc98d2"},
    "restore_rejected": {
        "rank": 1,
        "step": 3,
        "donors": [0],
        "tensors": 1,
        "error": "1 of the 4 tensors received differ from what the donors sent",
    },
    "rank_exited": {"rank": 0, "pid": 1001, "signal": 9},
    "collective_error": {"rank": 1, "step": 3, "error": "peer vanished"},
    "heartbeat_missed": {"rank": 0, "last_seen_ts": T0, "silent_s": 1.5},
    "stall_suspected": {"rank": 0, "last_step": 2, "stalled_s": 6.0, "window_s": 5.0},
    "health_report": {"rank": 0, "ok": False, "detail": "ecc"},
    "spare_activated": {"spare_id": 0, "rank": 0, "pid": 2001},
    "replacement_spawned": {"rank": 0, "pid": 3001},
    "rank_regrouped": {"rank": 0, "committed_step": 3, "pid": 1001},
    "state_transferred": {"rank": 0, "donor": 1, "bytes": 4096, "ms": 3.0},
    "checkpoint_saved": {"step": 4, "path": "/ckpt/step-00000004-g0"},
    "checkpoint_loaded": {"rank": 0, "step": 4, "ms": 12.0},
    "rank_finished": {"rank": 0, "step": 9},
    "job_finished": {"status": "completed"},
    "engine_lease": {"engine_id": "e1", "expires_ts": T0 + 10},
    "isolate_rank": {"caused_by": 7, "rank": 0, "pid": 1001, "reason": "exited"},
    "isolate_node": {"caused_by": 7, "node": 1, "pid": 900, "ranks": [2, 3], "reason": "lost"},
    "assign_spare": {"caused_by": 7, "rank": 0, "spare_id": 0},
    "await_node": {"caused_by": 7, "ranks": [2], "node_wait_s": 30.0},
    "spawn_replacement": {"caused_by": 7, "rank": 0},
    "regroup_planned": {"caused_by": 7, "members": [0, 1], "replaced": [0]},
    "resume_planned": {"caused_by": 9, "resume_step": 3, "donors": {0: 1}, "recipients": [0]},
    "fallback_to_checkpoint": {"caused_by": 9, "reason": "no replica", "shards": [0]},
    "retire_spare": {"caused_by": 9, "spare_id": 0, "pid": 2001, "reason": "exited"},
    "straggler_found": {
        "caused_by": 9,
        "node": 1,
        "ranks": [2, 3],
        "late_ratio": 0.1,
        "peers": [0, 2],
        "replaced": False,
        "reason": "its links lose probes",
    },
    "straggler_cleared": {
        "caused_by": 9,
        "node": 1,
        "late_ratio": 0.01,
        "reason": "its links lose few probes again",
    },
    "fail_job": {
        "caused_by": 9,
        "rank": 0,
        "step": 3,
        "failures": 3,
        "last_error": "ValueError('bad batch')",
        "reason": "rank 0 failed 3 times at committed step 3",
    },
    "record_rejected": {
        "caused_by": 4,
        "rejected_type": "health_report",
        "claimed_source": "rank:2",
        "reason": "unsigned health_report claiming source 'rank:2'",
    },
    "incident_closed": {
        "caused_by": 12,
        "failed_rank": 0,
        "rto_s": 0.3,
        "rpo_steps": 0,
        "recomputed_steps": 1,
        "phases": {"detected": 0.0, "isolated": 0.01},
    },
}


def type_name(cls: type[Envelope]) -> str:
    name: str = cls.model_fields["type"].default
    return name


TYPES_BY_NAME: dict[str, type[Envelope]] = {type_name(cls): cls for cls in RECORD_TYPES}
