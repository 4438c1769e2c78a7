"""Every record that crosses the log: one pydantic model per type, one shared envelope.

Two streams carry them (docs/protocol.md): *events* (ranks, agents and detectors tell what happened)
and *decisions* (the engine tells what to do). Values are plain JSON so that any Kafka tool can
read them. A decision names the log position of the event that caused it (``caused_by``) and
gets a deterministic id and timestamp from that event, so replaying the events reproduces every
decision byte for byte.
"""

from __future__ import annotations

import json
import time
import typing
import uuid
from enum import StrEnum
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, TypeAdapter, ValidationError, model_validator

from flashrecovery.errors import RecordError

SCHEMA_VERSION = 1

JobId = Annotated[str, Field(min_length=1, max_length=200, pattern=r"^[A-Za-z0-9_.\-]+$")]
RankId = Annotated[int, Field(ge=0)]
NodeId = Annotated[int, Field(ge=0)]  # an agent's node rank: 0.. for the job's nodes
Step = Annotated[int, Field(ge=-1)]  # -1: nothing committed yet


class Stream(StrEnum):
    """The two streams of a job's log."""

    EVENTS = "events"
    DECISIONS = "decisions"


def new_record_id() -> str:
    return uuid.uuid4().hex


class ChainLink(BaseModel):
    """A record's place in its writer's hash chain (connectors/chain.py)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    writer: str = Field(min_length=1)  # "<source>/<token>": one log handle's records of a source
    seq: int = Field(ge=0)  # 0, 1, 2 … within the writer's chain
    prev: str  # SHA-256 (hex) of the writer's previous record as stored; "" for its first
    # HMAC-SHA256 (hex) under its source's key (connectors/signing.py); "" when unsigned
    mac: str = Field(default="", pattern=r"^(?:[0-9a-f]{64})?$")


class Envelope(BaseModel):
    """Fields every record carries. Two records are equal when they say the same thing: the
    chain link says where a record sits in its writer's chain, not what it says."""

    # A NaN loss is news, not noise: write it as the JSON string "NaN" (plain JSON, and it
    # parses back to a float NaN) rather than pydantic's default null.
    model_config = ConfigDict(extra="forbid", frozen=True, ser_json_inf_nan="strings")

    # Strict and exactly 1: parse_record's fast path must refuse what its careful path refuses
    # (true and 1.0 are not 1 here).
    schema_version: int = Field(default=1, strict=True, ge=1, le=1)
    record_id: str = Field(default_factory=new_record_id, min_length=1)
    job_id: JobId
    generation: int = Field(ge=0)
    source: str = Field(min_length=1)  # "rank:3", "spare:1", "agent", "detector", "engine"
    ts: float = Field(default_factory=time.time, ge=0)  # unix seconds, stamped at the edge
    type: str  # each record type narrows this to its own literal name
    chain: ChainLink | None = None  # stamped by the log handle on append; absent in old logs

    def _content(self) -> dict[str, Any]:
        return {k: v for k, v in self.__dict__.items() if k != "chain"}

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, Envelope):
            return NotImplemented
        return type(self) is type(other) and self._content() == other._content()

    def __hash__(self) -> int:
        return hash((type(self), *self._content().items()))


# ---------------------------------------------------------------- events


class StragglerPolicy(StrEnum):
    """What the engine does with a node it finds slowing the job (its link degraded) or a rank
    (its steps steadily slower than its peers'): name it in the log, or also replace its ranks
    when spares can take them all."""

    REPORT = "report"
    REPLACE = "replace"


class NonFinitePolicy(StrEnum):
    """What the job does with a step whose loss or gradients are NaN or infinite again when it
    is recomputed: fail, naming the rank and step, or skip its batch on every rank."""

    FAIL = "fail"
    SKIP = "skip"


class JobStarted(Envelope):
    """The agent opened the job: the configuration the engine and detectors work with."""

    type: Literal["job_started"] = "job_started"
    world_size: int = Field(ge=1)
    spares: int = Field(ge=0)
    heartbeat_interval_s: float = Field(gt=0)
    missed_heartbeats: int = Field(default=3, ge=1)  # heartbeat missed after N x interval
    stall_factor: float = Field(default=10.0, gt=0)  # stall after max(k x median step, floor)
    stall_floor_s: float = Field(default=5.0, gt=0)
    startup_grace_s: float = Field(default=120.0, gt=0)  # a new process's time to first beat
    shards: int = Field(default=1, ge=1)  # distinct model shards; ranks of one shard are replicas
    # Crash-loop guard: the same rank failing this often at the same committed step fails the
    # job, and so does an incident past the first max_incidents (None: no bound).
    max_replacements: int = Field(default=3, ge=1)
    max_incidents: int | None = Field(default=None, ge=1)
    # Nodes: ranks are laid out node by node, world_size / nodes per node (docs/multinode.md).
    # A lost node's ranks find no spare: they wait node_wait_s for one, then the job fails.
    nodes: int = Field(default=1, ge=1)
    node_wait_s: float = Field(default=30.0, ge=0)
    # Where generation 0 meets: the rendezvous endpoint's store (a multi-node job's; absent
    # in old logs and single-node jobs, whose processes meet where they were launched).
    store: str | None = None
    straggler_policy: StragglerPolicy = StragglerPolicy.REPORT  # absent in old logs: report
    # How long the log may hold a writer's appends without failing them (Kafka: its request
    # timeout, as a broker cut off is waited out): a node its peers still hear over their own
    # links may be silent in the log this much longer before it is lost (absent in old logs: 0).
    log_hold_s: float = Field(default=0.0, ge=0)
    nonfinite_policy: NonFinitePolicy = NonFinitePolicy.FAIL  # absent in old logs: fail
    verify_every: int = Field(default=0, ge=0)  # replicas compare state digests (0: never)
    # A rank whose median slowdown (its compute time over its peers' median) over its last
    # straggler_steps scored steps reaches straggler_ratio is a straggler (engine/stragglers.py).
    straggler_ratio: float = Field(default=2.0, gt=1)
    straggler_steps: int = Field(default=20, ge=2)

    @property
    def nproc_per_node(self) -> int:
        return self.world_size // self.nodes

    @property
    def silence_limit_s(self) -> float:
        """How long a process (rank, spare, agent) may be unheard before it counts as silent."""
        return self.missed_heartbeats * self.heartbeat_interval_s

    @model_validator(mode="after")
    def _whole_nodes(self) -> JobStarted:
        if self.world_size % self.nodes:
            raise ValueError(
                f"world_size {self.world_size} is not a multiple of {self.nodes} nodes"
            )
        return self


class NodeJoined(Envelope):
    """An agent joined the job for its node: ``ranks`` training ranks (none on a spare node)
    and ``spares`` hot spares of its own."""

    type: Literal["node_joined"] = "node_joined"
    node: NodeId
    pid: int = Field(ge=1)  # the agent's
    host: str
    ranks: int = Field(ge=0)
    spares: int = Field(ge=0)
    # A multi-node job's agents each host a store, any of which can hold a generation's
    # (RegroupPlanned.store); absent in old logs and in a single-node job.
    store: str | None = None  # "host:port"
    presence: str | None = None  # "host:port" its agent watches the others from (presence.py)
    probe: str | None = None  # "host:port" (UDP) its agent answers link probes at (link_probe.py)


class RankJoined(Envelope):
    """A rank built its generation-0 groups and is about to train."""

    type: Literal["rank_joined"] = "rank_joined"
    rank: RankId
    pid: int = Field(ge=1)
    host: str
    shard: int = Field(default=0, ge=0)


class SpareReady(Envelope):
    """A hot spare has paid every first-time cost and waits for an assignment."""

    type: Literal["spare_ready"] = "spare_ready"
    spare_id: int = Field(ge=0)
    pid: int = Field(ge=1)
    host: str
    node: NodeId = 0


class Heartbeat(Envelope):
    """Proof of life from a rank's own thread; ``step`` is its last committed step and
    ``waiting`` says it is inside commit(), waiting on its peers (the stall detector's clue)."""

    type: Literal["heartbeat"] = "heartbeat"
    rank: RankId
    step: Step
    pid: int = Field(ge=1)
    host: str
    waiting: bool = False


class SpareHeartbeat(Envelope):
    """Proof of life from an idle hot spare: a spare that stops beating is dropped, not used."""

    type: Literal["spare_heartbeat"] = "spare_heartbeat"
    spare_id: int = Field(ge=0)
    pid: int = Field(ge=1)


class LinkSample(BaseModel):
    """What an agent's probes of one peer's agent saw over one heartbeat interval: how many it
    sent and how many came back late (lost, or queued behind a slow link; agent/link_probe.py)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    peer: NodeId
    probes: int = Field(ge=0)
    late: int = Field(ge=0)

    @model_validator(mode="after")
    def _late_of_probes(self) -> LinkSample:
        if self.late > self.probes:
            raise ValueError(f"late {self.late} is more than the {self.probes} probes sent")
        return self


class NodeHeartbeat(Envelope):
    """Proof of life from a node's agent, one per interval: its silence loses the whole node.
    ``beats`` are the node's processes' own heartbeats of that interval (the newest of each),
    which they hand to their agent instead of writing them to the log: one record per node per
    interval, whatever the number of ranks; the engine applies each as if it came alone."""

    type: Literal["node_heartbeat"] = "node_heartbeat"
    node: NodeId
    pid: int = Field(ge=1)
    beats: list[Annotated[Heartbeat | SpareHeartbeat, Field(discriminator="type")]] = Field(
        default_factory=list
    )
    # Its links to the other agents over the interval (a multi-node job's; absent in old logs):
    # the engine scores them to name a node whose link degrades (engine/links.py).
    links: list[LinkSample] = Field(default_factory=list)


class StepCompleted(Envelope):
    """A step was committed by this rank (after the vote, after the optimizer step)."""

    type: Literal["step_completed"] = "step_completed"
    rank: RankId
    step: int = Field(ge=0)
    duration_s: float = Field(ge=0)
    # Of the step up to its vote, the time this rank did not wait on its peers' collectives:
    # its own work (trainer_hooks/waits.py), scored against its peers' (absent in old logs).
    compute_s: float | None = Field(default=None, ge=0)
    loss: float | None = None
    # The step's batch was skipped: it was non-finite twice and the job's policy is skip (no
    # optimizer step; the step and the data position move on as for a commit).
    skipped: bool = False


class StepNonFinite(Envelope):
    """A rank found its step's loss or gradients NaN or infinite; by the vote, no rank stepped.
    ``action`` is what the job does: recompute the step (its first time), or after the
    recompute, the job's policy."""

    type: Literal["step_nonfinite"] = "step_nonfinite"
    rank: RankId
    step: int = Field(ge=0)
    found: str = Field(min_length=1)  # "loss nan", "gradients"
    attempt: int = Field(ge=1, le=2)
    action: Literal["recompute", "skip", "fail"]


class StepRetried(Envelope):
    """The step's vote was aborted and no newer generation was planned within ``waited_s``:
    no failure was behind it that the engine acts on (a close by mistake, or by someone with
    the store's keys), so the members vote on the step again (``attempt``: its votes so far in
    this generation), never waiting on a plan that does not come."""

    type: Literal["step_retried"] = "step_retried"
    rank: RankId
    step: int = Field(ge=0)
    attempt: int = Field(ge=1)
    waited_s: float = Field(ge=0)


class StateDigest(Envelope):
    """A rank's digest of its model and optimizer state as it began ``step`` (its committed
    state; trainer_hooks/digest.py), sent when the step's vote found two replicas of a shard
    holding different ones: the engine compares every member's and replaces the minority."""

    type: Literal["state_digest"] = "state_digest"
    rank: RankId
    step: int = Field(ge=0)
    shard: int = Field(ge=0)
    digest: str = Field(min_length=1, max_length=64)


class RankExited(Envelope):
    """The agent saw a child process end (reported the moment it happens)."""

    type: Literal["rank_exited"] = "rank_exited"
    rank: RankId | None = None  # None for a spare that was never assigned
    spare_id: int | None = None
    pid: int = Field(ge=1)
    exit_code: int | None = None
    signal: int | None = None
    error: str | None = None  # the exception that ended it, its last line, if it raised one
    fatal: bool = False  # that exception says the script cannot run (ScriptError): fail the job
    node: NodeId = 0  # the agent that saw it (pids are per host)


class CollectiveError(Envelope):
    """A collective failed inside a rank (a peer vanished, a timeout)."""

    type: Literal["collective_error"] = "collective_error"
    rank: RankId
    step: Step
    error: str


class HeartbeatMissed(Envelope):
    """A detector saw no heartbeat from a rank for N x interval; time enters the log here."""

    type: Literal["heartbeat_missed"] = "heartbeat_missed"
    rank: RankId
    last_seen_ts: float
    silent_s: float = Field(ge=0)


class NodeMissed(Envelope):
    """A detector saw no heartbeat from a node's agent for N x interval: the node is lost."""

    type: Literal["node_missed"] = "node_missed"
    node: NodeId
    last_seen_ts: float
    silent_s: float = Field(ge=0)


class AgentExited(Envelope):
    """A node's agent is gone: its connection to the agent of node ``observer`` closed, and its
    address refused a new one (the host answers, the agent does not). Found as fast as a rank's
    exit; a node that is cut off answers nothing and is found by its silence (NodeMissed)."""

    type: Literal["agent_exited"] = "agent_exited"
    node: NodeId
    pid: int = Field(ge=1)  # the agent's, as it said when it joined
    observer: NodeId


class NodeWaitExpired(Envelope):
    """A detector saw ranks of a lost node wait ``node_wait_s`` for a spare none brought."""

    type: Literal["node_wait_expired"] = "node_wait_expired"
    ranks: list[RankId]
    waited_s: float = Field(ge=0)


class SpareMissed(Envelope):
    """A detector saw no heartbeat from an idle spare for N x interval."""

    type: Literal["spare_missed"] = "spare_missed"
    spare_id: int = Field(ge=0)
    last_seen_ts: float
    silent_s: float = Field(ge=0)


class StallSuspected(Envelope):
    """A detector saw a rank alive but not progressing while its peers wait."""

    type: Literal["stall_suspected"] = "stall_suspected"
    rank: RankId
    last_step: Step
    stalled_s: float = Field(ge=0)
    window_s: float = Field(gt=0)  # no progress for this long is a stall


class HealthReport(Envelope):
    type: Literal["health_report"] = "health_report"
    rank: RankId
    ok: bool
    detail: str = ""


class SpareActivated(Envelope):
    """The agent handed a spare its rank id."""

    type: Literal["spare_activated"] = "spare_activated"
    spare_id: int = Field(ge=0)
    rank: RankId
    pid: int = Field(ge=1)


class ReplacementSpawned(Envelope):
    """The agent started a fresh process for a rank (no spare was left)."""

    type: Literal["replacement_spawned"] = "replacement_spawned"
    rank: RankId
    pid: int = Field(ge=1)


class RankRegrouped(Envelope):
    """A member built the groups of a new generation; says which step it has committed."""

    type: Literal["rank_regrouped"] = "rank_regrouped"
    rank: RankId
    committed_step: Step
    shard: int = Field(default=0, ge=0)
    pid: int = Field(ge=1)


class StateTransferred(Envelope):
    """A recipient received its state from a donor."""

    type: Literal["state_transferred"] = "state_transferred"
    rank: RankId
    donor: RankId
    bytes: int = Field(ge=0)
    ms: float = Field(ge=0)
    donor_bytes: dict[RankId, int] = Field(default_factory=dict)  # per donor of a striped one


class RestoreRejected(Envelope):
    """A recipient's check of the state it received failed: the bit sums of some tensors differ
    from those its lead donor sent with it (trainer_hooks/transfer.py). Nothing of it was loaded;
    the engine replaces the recipient, and ``donors`` (who sent the tensors that differ) give
    no state again while another replica of their shard can."""

    type: Literal["restore_rejected"] = "restore_rejected"
    rank: RankId
    step: int = Field(ge=-1)  # the resume step it was to receive
    donors: list[RankId] = Field(min_length=1)
    tensors: int = Field(ge=1)  # how many differ
    error: str = Field(max_length=500)


class CheckpointSaved(Envelope):
    """Every rank's part of the checkpoint of ``step`` is durable and its completion marker is
    written (trainer_hooks/checkpoint.py): the job can fall back to it."""

    type: Literal["checkpoint_saved"] = "checkpoint_saved"
    step: int = Field(ge=0)
    path: str = Field(min_length=1)


class CheckpointLoaded(Envelope):
    """A member loaded its part of the checkpoint a fallback named (FallbackToCheckpoint)."""

    type: Literal["checkpoint_loaded"] = "checkpoint_loaded"
    rank: RankId
    step: int = Field(ge=0)
    ms: float = Field(ge=0)


class RankFinished(Envelope):
    type: Literal["rank_finished"] = "rank_finished"
    rank: RankId
    step: Step


class ChainHead(BaseModel):
    """A writer's last record on a stream when the job ended."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    stream: Literal["events", "decisions"]
    writer: str
    seq: int = Field(ge=0)
    hash: str


class CommitRun(BaseModel):
    """Steps first_step..last_step were each committed by exactly these ranks."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    first_step: int = Field(ge=0)
    last_step: int = Field(ge=0)
    ranks: list[RankId]


class JobOutcome(StrEnum):
    """How a job ended."""

    COMPLETED = "completed"
    FAILED = "failed"


class JobFinished(Envelope):
    """The agent ends the job; the record seals the log (connectors/chain.py)."""

    type: Literal["job_finished"] = "job_finished"
    status: JobOutcome
    exit_code: int = 0
    detail: str = ""
    chain_heads: list[ChainHead] = Field(default_factory=list)
    committed: list[CommitRun] = Field(default_factory=list)


class EngineLease(Envelope):
    """An engine claims (or renews) the right to decide for a job until ``expires_ts``."""

    type: Literal["engine_lease"] = "engine_lease"
    engine_id: str = Field(min_length=1)
    expires_ts: float
    node: NodeId | None = None  # whose agent runs it: its AgentExited ends the lease at once


# ------------------------------------------------------------- decisions


class Decision(Envelope):
    """Common to decisions: the events-stream position that caused it and its incident."""

    caused_by: int = Field(ge=0)
    incident_id: str | None = None


class IsolateRank(Decision):
    """Fence the rank's generation and kill its process if it is still alive."""

    type: Literal["isolate_rank"] = "isolate_rank"
    rank: RankId
    pid: int | None = None
    reason: str
    kill: bool = True
    node: NodeId = 0  # whose agent kills it


class IsolateNode(Decision):
    """The node is lost: its ranks are isolated (IsolateRank each) and replaced elsewhere; its
    agent, if it still runs, tears its processes down and ends."""

    type: Literal["isolate_node"] = "isolate_node"
    node: NodeId
    pid: int | None = None  # the agent's
    ranks: list[RankId]
    reason: str


class AssignSpare(Decision):
    type: Literal["assign_spare"] = "assign_spare"
    rank: RankId
    spare_id: int = Field(ge=0)
    node: NodeId = 0  # the spare's: its agent hands it the rank
    store: str | None = None  # where its generation meets (a multi-node job's; agent/meeting.py)


class AwaitNode(Decision):
    """No spare and no node to hold these ranks: they wait up to ``node_wait_s`` for a node
    to join (its spares take them), then the job fails."""

    type: Literal["await_node"] = "await_node"
    ranks: list[RankId]
    node_wait_s: float = Field(ge=0)


class SpawnReplacement(Decision):
    type: Literal["spawn_replacement"] = "spawn_replacement"
    rank: RankId
    node: NodeId = 0  # whose agent starts the process
    store: str | None = None  # where its generation meets (a multi-node job's; agent/meeting.py)


class RegroupPlanned(Decision):
    """Every member builds the groups of ``generation`` (the envelope's) with these ranks."""

    type: Literal["regroup_planned"] = "regroup_planned"
    members: list[RankId]
    replaced: list[RankId]
    # Where this generation's store is, when it moved (the node holding the previous one was
    # lost); None: where the previous generation's was.
    store: str | None = None


class ResumePlanned(Decision):
    """Donors send state to recipients; everyone resumes after ``resume_step``."""

    type: Literal["resume_planned"] = "resume_planned"
    resume_step: Step
    donors: dict[int, RankId]  # shard -> donor rank (the lead of its stripes)
    recipients: list[RankId]
    # shard -> the donors that share its transfer, lead first (absent: its donor alone)
    stripes: dict[int, list[RankId]] = Field(default_factory=dict)

    def donors_of(self, shard: int) -> list[int]:
        """The ranks that send ``shard``'s state, each a stripe, the lead first."""
        return self.stripes.get(shard) or [self.donors[shard]]


class FallbackToCheckpoint(Decision):
    """No healthy replica holds some shard: every member loads the latest complete checkpoint
    (``step``, at ``path``) and the job resumes after it; with none (``step`` None) it fails."""

    type: Literal["fallback_to_checkpoint"] = "fallback_to_checkpoint"
    reason: str
    shards: list[int]
    step: int | None = Field(default=None, ge=0)
    path: str | None = None


class RetireSpare(Decision):
    """Drop a spare from the pool (it died or went silent): kill it if it lives, and start
    another in its place when ``refill``."""

    type: Literal["retire_spare"] = "retire_spare"
    spare_id: int = Field(ge=0)
    pid: int | None = None
    reason: str
    refill: bool = True
    node: NodeId = 0  # the spare's


class StragglerFound(Decision):
    """Something slows the job. ``cause`` "link": a node whose links to its peers lose or delay
    their probes while the links between its peers do not (so it is the node, not the network
    as a whole). "step_time": a rank whose steps are steadily slower than its peers' (its
    median slowdown over the job's window, engine/stragglers.py). ``replaced``: the job's
    straggler policy replaced its ranks (an IsolateNode or IsolateRank follows); else it is
    named only."""

    type: Literal["straggler_found"] = "straggler_found"
    node: NodeId
    ranks: list[RankId]
    cause: Literal["link", "step_time"] = "link"
    late_ratio: float | None = Field(default=None, ge=0, le=1)  # link: of its probes, late
    slowdown: float | None = Field(default=None, ge=0)  # step_time: its median slowdown
    peers: list[NodeId] = Field(default_factory=list)  # link: whose links to it were scored
    replaced: bool
    reason: str


class StragglerCleared(Decision):
    """A node or rank named by ``StragglerFound`` is no longer the cause: its links' probes are
    late at under half the naming ratio again, or the rank's median slowdown fell under halfway
    to the job's ratio. Until this record it is named once; after it, it may be named again."""

    type: Literal["straggler_cleared"] = "straggler_cleared"
    node: NodeId
    rank: RankId | None = None  # a rank straggler's
    late_ratio: float | None = Field(default=None, ge=0, le=1)  # link: of its probes, late
    slowdown: float | None = Field(default=None, ge=0)  # step_time: its median slowdown
    reason: str


class FailJob(Decision):
    """The job fails instead of recovering again: a crash loop, or too many incidents."""

    type: Literal["fail_job"] = "fail_job"
    rank: RankId
    step: Step  # the committed step at which it keeps failing (-1: before the first)
    failures: int = Field(ge=1)
    last_error: str
    reason: str


class RecordRejected(Decision):
    """An event the engine did not believe: unsigned, or not signed by the source it claims
    (connectors/signing.py). Recorded so a replay without the job's secret rebuilds the
    engine's view exactly; nothing else is ever decided from that event."""

    type: Literal["record_rejected"] = "record_rejected"
    rejected_type: str = Field(max_length=64)  # what it claimed to be
    claimed_source: str = Field(max_length=256)
    reason: str


class IncidentClosed(Decision):
    type: Literal["incident_closed"] = "incident_closed"
    failed_rank: RankId
    # A lost node's ranks, failed_rank first (empty when one rank failed: older logs replay).
    failed_ranks: list[RankId] = Field(default_factory=list)
    failed_node: NodeId | None = None  # set when a whole node was lost
    rto_s: float
    rpo_steps: int
    recomputed_steps: int
    phases: dict[str, float]  # phase name -> seconds since the previous phase


EventRecord = Annotated[
    JobStarted
    | NodeJoined
    | NodeHeartbeat
    | NodeMissed
    | AgentExited
    | NodeWaitExpired
    | RankJoined
    | SpareReady
    | Heartbeat
    | SpareHeartbeat
    | StepCompleted
    | StepNonFinite
    | StepRetried
    | StateDigest
    | RestoreRejected
    | RankExited
    | CollectiveError
    | HeartbeatMissed
    | SpareMissed
    | StallSuspected
    | HealthReport
    | SpareActivated
    | ReplacementSpawned
    | RankRegrouped
    | StateTransferred
    | CheckpointSaved
    | CheckpointLoaded
    | RankFinished
    | JobFinished
    | EngineLease,
    Field(discriminator="type"),
]
DecisionRecord = Annotated[
    IsolateRank
    | IsolateNode
    | AssignSpare
    | AwaitNode
    | SpawnReplacement
    | RegroupPlanned
    | ResumePlanned
    | FallbackToCheckpoint
    | RetireSpare
    | StragglerFound
    | StragglerCleared
    | FailJob
    | RecordRejected
    | IncidentClosed,
    Field(discriminator="type"),
]
Record = Annotated[EventRecord | DecisionRecord, Field(discriminator="type")]


def _type_names(union: Any) -> tuple[str, ...]:
    members = typing.get_args(typing.get_args(union)[0])
    return tuple(str(member.model_fields["type"].default) for member in members)


TYPE_NAMES = (*_type_names(EventRecord), *_type_names(DecisionRecord))  # every record's `type`

_EVENT = TypeAdapter[EventRecord](EventRecord)
_DECISION = TypeAdapter[DecisionRecord](DecisionRecord)
_ANY = TypeAdapter[Record](Record)
_ADAPTERS: dict[Stream | None, TypeAdapter[Any]] = {
    None: _ANY,
    Stream.EVENTS: _EVENT,
    Stream.DECISIONS: _DECISION,
}
_AS_DUMPED = b'{"schema_version":1,'  # how every record dump_record writes begins


def stream_of(record: Envelope) -> Stream:
    return Stream.DECISIONS if isinstance(record, Decision) else Stream.EVENTS


def _explain(exc: ValidationError) -> str:
    parts = []
    for err in exc.errors()[:5]:
        where = ".".join(str(p) for p in err["loc"]) or "<record>"
        parts.append(f"{where}: {err['msg']}")
    more = exc.error_count() - len(parts)
    return "; ".join(parts) + (f"; and {more} more" if more > 0 else "")


def parse_record(data: bytes | str | dict[str, Any], stream: Stream | None = None) -> Envelope:
    """Parse one record from JSON (or an already decoded dict); raise RecordError on bad input."""
    adapter = _ADAPTERS[stream]
    if isinstance(data, bytes) and data.startswith(_AS_DUMPED):
        # The fast path, for what dump_record wrote: pydantic parses the bytes itself, strictly
        # (several times faster than json.loads then validate_python). Whatever it refuses goes
        # the careful way below, which accepts what it accepts and says what is wrong.
        try:
            fast: Envelope = adapter.validate_json(data, strict=True)
            return fast
        except ValidationError:
            pass
    if isinstance(data, bytes | str):
        try:
            data = json.loads(data)
        except (ValueError, RecursionError) as exc:  # also bad UTF-8, huge ints, deep nesting
            raise RecordError(f"<record>: not JSON ({exc})") from None
    if not isinstance(data, dict):
        raise RecordError(f"<record>: expected a JSON object, got {type(data).__name__}")
    version = data.get("schema_version")
    if type(version) is not int or version != SCHEMA_VERSION:  # true == 1.0 == 1 in Python
        raise RecordError(
            f"schema_version: unsupported value {version!r} (this build reads {SCHEMA_VERSION})"
        )
    try:
        record: Envelope = adapter.validate_python(data)
    except ValidationError as exc:
        raise RecordError(_explain(exc)) from None
    return record


def dump_record(record: Envelope) -> bytes:
    """The record as compact JSON bytes (what every backend stores); no chain key when the
    record has no link, so unchained records read exactly as before."""
    return record.model_dump_json(exclude={"chain"} if record.chain is None else None).encode()


def decision_id(job_id: str, caused_by: int, index: int) -> str:
    """Deterministic id of the index-th decision caused by an event: replay and failover
    recognise an already written decision by it."""
    return f"{job_id}:{caused_by}:{index}"
