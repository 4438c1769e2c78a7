"""What the engine knows about one job, built only from the job's records.

Nothing here reads a clock or the log: the decide step updates it record by record, so the same
records always rebuild the same state (replay, engine restart, failover).
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

from flashrecovery.records import JobStarted
from flashrecovery.statemachines.base import Stamp
from flashrecovery.statemachines.incident import IncidentMachine
from flashrecovery.statemachines.job import JobMachine
from flashrecovery.statemachines.rank import RankMachine


@dataclass
class RankView:
    """A rank id and the process currently holding it."""

    machine: RankMachine
    pid: int | None = None
    host: str = ""
    shard: int = 0
    committed_step: int = -1  # highest step this rank reported committed
    last_heartbeat_ts: float | None = None
    grace_until_ts: float | None = None  # a starting process is not missed before this, or
    # before its first sign of life (heartbeat, join)
    waiting: bool = False  # inside commit(), waiting on peers, as its last heartbeat said
    last_step_ts: float | None = None
    step_durations: list[float] = field(default_factory=list)
    regrouped_step: int | None = None  # committed step reported for the current generation


@dataclass
class SpareView:
    spare_id: int
    pid: int
    host: str
    status: str = "ready"  # ready | assigned | gone


@dataclass
class Incident:
    incident_id: str
    failed_rank: int
    failure_ts: float  # best estimate of when the fault happened
    generation: int  # the generation that recovers from it
    machine: IncidentMachine
    committed_before: int  # highest step any rank had reported committed before the fault
    detected: Stamp  # the record that revealed the fault
    reason: str
    resume_step: int | None = None


@dataclass
class EngineState:
    job_id: str
    config: JobStarted | None = None
    job: JobMachine = field(default_factory=lambda: JobMachine("job"))
    generation: int = 0
    ranks: dict[int, RankView] = field(default_factory=dict)
    spares: dict[int, SpareView] = field(default_factory=dict)
    incidents: list[Incident] = field(default_factory=list)
    needs_state: set[int] = field(default_factory=set)  # replaced ranks not yet restored
    resume_planned: bool = False
    position: int = -1  # last events position applied
    rejected: Counter[str] = field(default_factory=Counter)  # reason -> count
    last_rejection: str = ""  # the newest reason, for the loop to report
    fenced: int = 0  # records of stale generations ignored

    @property
    def world_size(self) -> int:
        return self.config.world_size if self.config else 0

    def open_incidents(self) -> list[Incident]:
        return [i for i in self.incidents if i.machine.state not in ("closed", "fallback")]

    def ready_spares(self) -> list[SpareView]:
        return sorted(
            (s for s in self.spares.values() if s.status == "ready"), key=lambda s: s.spare_id
        )

    def max_committed(self) -> int:
        return max((r.committed_step for r in self.ranks.values()), default=-1)
