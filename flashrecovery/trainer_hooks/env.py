"""The launch environment `flashrecovery run` gives each process (docs/protocol.md)."""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

from flashrecovery.errors import LaunchError
from flashrecovery.trainer_hooks import final_state
from flashrecovery.trainer_hooks.faults import Fault, FaultPlan

CHECKPOINT_DIR = "FLASHRECOVERY_CHECKPOINT_DIR"
CHECKPOINT_EVERY = "FLASHRECOVERY_CHECKPOINT_EVERY"
GROUP_REBUILD = "FLASHRECOVERY_GROUP_REBUILD"
GROUP_REBUILDS = ("fresh", "reconfigure")


@dataclass(frozen=True)
class LaunchEnv:
    job_id: str
    master_addr: str
    master_port: int
    store_prefix: str = field(repr=False)  # the job's secret (agent/store.py): never shown
    world_size: int
    heartbeat_interval_s: float
    role: str  # "rank" or "spare"
    rank: int | None  # None for a spare until it is assigned
    spare_id: int | None
    generation: int
    replacement: bool
    fault: Fault | None
    fault_plan: FaultPlan
    final_state_dir: Path | None  # where finish() leaves the final state (final_state.py)
    agent_socket: str  # where heartbeats go, never the log (agent/relay.py)
    agent_link: str  # where the other records go, and decisions come from (agent/links.py)
    shards: int = 1  # rank r holds model shard r % shards
    node: int = 0  # the node whose agent started it (FLASHRECOVERY_NODE)
    checkpoint_dir: Path | None = None  # where checkpoints go (trainer_hooks/checkpoint.py)
    checkpoint_every: int = 0  # save after every this many committed steps
    group_rebuild: str = "fresh"  # or "reconfigure": how stable groups change generation

    @classmethod
    def from_environ(cls, environ: Mapping[str, str] | None = None) -> LaunchEnv:
        env = os.environ if environ is None else environ

        def need(name: str) -> str:
            value = env.get(name)
            if not value:
                raise LaunchError(
                    f"{name} is not set: start this script with `flashrecovery run "
                    "--nproc-per-node N script.py`"
                )
            return value

        role = need("FLASHRECOVERY_ROLE")
        if role not in ("rank", "spare"):
            raise LaunchError(f"FLASHRECOVERY_ROLE={role!r}: expected 'rank' or 'spare'")
        group_rebuild = env.get(GROUP_REBUILD, "fresh")
        if group_rebuild not in GROUP_REBUILDS:
            raise LaunchError(
                f"{GROUP_REBUILD}={group_rebuild!r}: expected one of {GROUP_REBUILDS}"
            )
        try:
            return cls(
                job_id=need("FLASHRECOVERY_JOB_ID"),
                master_addr=need("MASTER_ADDR"),
                master_port=int(need("MASTER_PORT")),
                store_prefix=need("FLASHRECOVERY_STORE_PREFIX"),
                world_size=int(need("WORLD_SIZE")),
                heartbeat_interval_s=float(need("FLASHRECOVERY_HEARTBEAT_INTERVAL")),
                role=role,
                rank=int(need("RANK")) if role == "rank" else None,
                spare_id=int(need("FLASHRECOVERY_SPARE_ID")) if role == "spare" else None,
                generation=int(env.get("FLASHRECOVERY_GENERATION", "0")),
                replacement=env.get("FLASHRECOVERY_REPLACEMENT") == "1",
                shards=int(env.get("FLASHRECOVERY_SHARDS", "1")),
                fault=Fault.parse(env["FLASHRECOVERY_FAULT"])
                if env.get("FLASHRECOVERY_FAULT")
                else None,
                fault_plan=FaultPlan.parse(env.get("FLASHRECOVERY_FAULT_PLAN", "")),
                final_state_dir=Path(env[final_state.ENV]) if env.get(final_state.ENV) else None,
                node=int(env.get("FLASHRECOVERY_NODE", "0")),
                agent_socket=need("FLASHRECOVERY_AGENT_SOCKET"),
                checkpoint_dir=Path(env[CHECKPOINT_DIR]) if env.get(CHECKPOINT_DIR) else None,
                checkpoint_every=int(env.get(CHECKPOINT_EVERY, "0")),
                agent_link=need("FLASHRECOVERY_AGENT_LINK"),
                group_rebuild=group_rebuild,
            )
        except ValueError as exc:
            raise LaunchError(f"bad launch environment: {exc}") from None
