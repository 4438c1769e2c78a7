"""A job's Prometheus metrics, every one a view of its log.

``JobFold`` feeds the job's events through the engine's own decide step (the same code that made
the recorded decisions), so each value is read off the resulting ``EngineState`` or off the
records decide accepted and the decisions it returned: nothing is counted a second time by hand,
and a finished job's log yields the values its live job showed. ``families`` renders them at a
given ``now`` (heartbeat ages are the only values that depend on it).
"""

from __future__ import annotations

import bisect
from collections import Counter
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field

from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)

from flashrecovery.connectors.base import Entry
from flashrecovery.engine.detectors import BEATING
from flashrecovery.engine.ingest import ingest
from flashrecovery.engine.state import EngineState
from flashrecovery.records import IncidentClosed, StepCompleted
from flashrecovery.statemachines.job import JobState
from flashrecovery.statemachines.rank import RankState

PREFIX = "flashrecovery_"
PER_RANK_LIMIT = 64  # above this many ranks, heartbeat ages are per host (bounded cardinality)
STEP_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
RTO_BUCKETS = (0.1, 0.25, 0.5, 1.0, 2.0, 3.0, 5.0, 10.0, 20.0, 30.0, 60.0, 120.0, 300.0)
DETECTION_BUCKETS = (0.001, 0.01, 0.05, 0.1, 0.25, 0.5, 1.0, 2.0, 3.0, 5.0, 10.0, 30.0, 60.0)


@dataclass
class Buckets:
    """A histogram's cumulative counts, kept as observations arrive."""

    bounds: tuple[float, ...]
    counts: list[int] = field(default_factory=list)
    total: float = 0.0

    def __post_init__(self) -> None:
        self.counts = [0] * (len(self.bounds) + 1)  # the last one is +Inf

    def observe(self, value: float) -> None:
        self.counts[bisect.bisect_left(self.bounds, value)] += 1
        self.total += value

    def cumulative(self) -> list[tuple[str, float]]:
        out, running = [], 0
        for bound, count in zip([*map(str, self.bounds), "+Inf"], self.counts, strict=True):
            running += count
            out.append((bound, float(running)))
        return out


@dataclass
class JobFold:
    """One job's log folded through decide; apply events in log order."""

    job_id: str
    state: EngineState = field(init=False)
    step_seconds: Buckets = field(default_factory=lambda: Buckets(STEP_BUCKETS))
    rto_seconds: Buckets = field(default_factory=lambda: Buckets(RTO_BUCKETS))
    detection_seconds: Buckets = field(default_factory=lambda: Buckets(DETECTION_BUCKETS))
    closed: list[IncidentClosed] = field(default_factory=list)
    positions: list[int] = field(default_factory=list)  # events positions applied, in order
    top_step: int = -1  # highest step the job has committed (finished ranks leave the state's)

    def __post_init__(self) -> None:
        self.state = EngineState(self.job_id)

    def apply(self, entry: Entry) -> None:
        state = self.state
        before = (state.rejected.total(), state.fenced, len(state.incidents))
        decisions = ingest(state, entry)
        self.positions.append(entry.position)
        self.top_step = max(self.top_step, state.max_committed())
        accepted = (state.rejected.total(), state.fenced) == before[:2]
        if accepted and isinstance(entry.record, StepCompleted):
            self.step_seconds.observe(entry.record.duration_s)
        for incident in state.incidents[before[2] :]:
            self.detection_seconds.observe(max(0.0, incident.detected.ts - incident.failure_ts))
        for decision in decisions:
            if isinstance(decision, IncidentClosed):
                self.closed.append(decision)
                self.rto_seconds.observe(decision.rto_s)

    def behind(self, next_position: int) -> int:
        """Events this fold has seen at or after ``next_position`` (a reader's lag)."""
        return len(self.positions) - bisect.bisect_left(self.positions, next_position)


def _gauge(name: str, doc: str, labels: list[str]) -> GaugeMetricFamily:
    return GaugeMetricFamily(PREFIX + name, doc, labels=["job_id", *labels])


def _counter(name: str, doc: str, labels: list[str]) -> CounterMetricFamily:
    return CounterMetricFamily(PREFIX + name, doc, labels=["job_id", *labels])


def _histogram(name: str, doc: str, job_id: str, buckets: Buckets) -> HistogramMetricFamily:
    family = HistogramMetricFamily(PREFIX + name, doc, labels=["job_id"])
    family.add_metric([job_id], buckets.cumulative(), buckets.total)
    return family


def families(
    fold: JobFold,
    now: float,
    *,
    reader_position: int | None = None,
    per_rank_limit: int = PER_RANK_LIMIT,
) -> Iterator[Metric]:
    """Every metric of the job as the fold stands, heartbeat ages taken at ``now``.
    ``reader_position``: the next events position of the reader whose lag is reported (the
    engine's, where one runs in this process)."""
    state, job = fold.state, fold.job_id
    committed = _counter("steps_committed", "Steps of the job committed (highest + 1)", [])
    committed.add_metric([job], fold.top_step + 1)
    yield committed
    yield _histogram(
        "step_duration_seconds", "Step durations ranks reported", job, fold.step_seconds
    )
    yield _one_hot("job_state", "The job machine's state (1 for the current one)", job,
                   JobState, state.job.state)  # fmt: skip
    generation = _gauge("generation", "Current generation (membership) of the job", [])
    generation.add_metric([job], state.generation)
    yield generation
    ranks = _gauge("ranks", "Ranks by machine state", ["state"])
    by_state = Counter(view.machine.state for view in state.ranks.values())
    for name in RankState:
        ranks.add_metric([job, str(name)], by_state[name])
    yield ranks
    spares = _gauge("spares_ready", "Hot spares ready for an assignment", [])
    spares.add_metric([job], len(state.ready_spares()))
    yield spares
    incidents = _counter(
        "incidents", "Incidents opened, by the record that revealed them", ["cause"]
    )
    for cause, count in sorted(Counter(i.detected.cause for i in state.incidents).items()):
        incidents.add_metric([job, cause], count)
    yield incidents
    open_now = _gauge("incidents_open", "Incidents being recovered", [])
    open_now.add_metric([job], len(state.open_incidents()))
    yield open_now
    yield _histogram("rto_seconds", "Recovery time of closed incidents", job, fold.rto_seconds)
    yield _histogram("detection_seconds", "Fault to detection, per incident", job,
                     fold.detection_seconds)  # fmt: skip
    recomputed = _counter("steps_recomputed", "Steps computed again after recoveries", [])
    recomputed.add_metric([job], sum(c.recomputed_steps for c in fold.closed))
    yield recomputed
    lost = _counter("steps_lost", "Committed steps lost in recoveries (RPO)", [])
    lost.add_metric([job], sum(c.rpo_steps for c in fold.closed))
    yield lost
    nonfinite = _counter(
        "steps_nonfinite", "Ranks' reports of a non-finite step, by what followed", ["action"]
    )
    for action, count in sorted(state.nonfinite.items()):
        nonfinite.add_metric([job, action], count)
    yield nonfinite
    stragglers = _gauge(
        "stragglers", "Named as slowing the job now: nodes (link), ranks (step_time)", ["cause"]
    )
    stragglers.add_metric([job, "link"], len(state.stragglers))
    stragglers.add_metric([job, "step_time"], len(state.step_scores.named))
    yield stragglers
    rejected = _counter("records_rejected", "Records decide refused (malformed, nonsensical)", [])
    rejected.add_metric([job], state.rejected.total())
    yield rejected
    yield from _heartbeat_ages(fold, now, per_rank_limit)
    if reader_position is not None:
        lag = _gauge("log_lag_records", "Events in the log the engine has not applied yet", [])
        lag.add_metric([job], fold.behind(reader_position))
        yield lag


def _one_hot(
    name: str, doc: str, job: str, states: Iterable[str], current: str
) -> GaugeMetricFamily:
    family = _gauge(name, doc, ["state"])
    for state in states:
        family.add_metric([job, str(state)], 1.0 if state == current else 0.0)
    return family


def _heartbeat_ages(fold: JobFold, now: float, per_rank_limit: int) -> Iterator[Metric]:
    """Seconds since each beating rank's last sign of life; past ``per_rank_limit`` ranks, the
    oldest per host instead, so a 10,000-rank job stays at one series per node."""
    state = fold.state
    if state.config is None:
        return
    ages: dict[int, tuple[str, float]] = {}
    for rank, view in state.ranks.items():
        if view.machine.state in BEATING:
            last = view.last_heartbeat_ts if view.last_heartbeat_ts is not None else state.config.ts
            ages[rank] = (view.host or "unknown", max(0.0, now - last))
    if len(state.ranks) <= per_rank_limit:
        family = _gauge("rank_heartbeat_age_seconds", "Seconds since the rank's last heartbeat",
                        ["rank", "host"])  # fmt: skip
        for rank, (host, age) in sorted(ages.items()):
            family.add_metric([fold.job_id, str(rank), host], age)
        yield family
        return
    oldest: dict[str, float] = {}
    for host, age in ages.values():
        oldest[host] = max(age, oldest.get(host, 0.0))
    family = _gauge("host_heartbeat_age_seconds", "Oldest heartbeat age among the host's ranks",
                    ["host"])  # fmt: skip
    for host, age in sorted(oldest.items()):
        family.add_metric([fold.job_id, host], age)
    yield family
