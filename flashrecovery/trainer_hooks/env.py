"""The launch environment `flashrecovery run` gives each process (docs/protocol.md)."""

from __future__ import annotations

import functools
import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from enum import StrEnum
from pathlib import Path
from typing import TypeVar

from flashrecovery.connectors.signing import SECRET  # the job's secret, where it may be shown
from flashrecovery.errors import LaunchError
from flashrecovery.records import NonFinitePolicy
from flashrecovery.trainer_hooks import final_state
from flashrecovery.trainer_hooks.probe import FaultPlan

CHECKPOINT_DIR = "FLASHRECOVERY_CHECKPOINT_DIR"
CHECKPOINT_EVERY = "FLASHRECOVERY_CHECKPOINT_EVERY"
GROUP_REBUILD = "FLASHRECOVERY_GROUP_REBUILD"
NONFINITE_POLICY = "FLASHRECOVERY_NONFINITE_POLICY"
VERIFY_EVERY = "FLASHRECOVERY_VERIFY_EVERY"
NODE_STORE = "FLASHRECOVERY_NODE_STORE"
SECRET_FD = "FLASHRECOVERY_STORE_PREFIX_FD"  # else a pipe that holds it (agent/supervisor.py)
E = TypeVar("E", bound=StrEnum)


class Role(StrEnum):
    """What the agent started a process as."""

    RANK = "rank"
    SPARE = "spare"  # a hot spare: it has no rank until one is assigned


class GroupRebuild(StrEnum):
    """How the user's stable groups change generation (trainer_hooks/stable_group.py)."""

    FRESH = "fresh"  # a new backend per generation
    RECONFIGURE = "reconfigure"  # one backend per group, reconfigured in place


def choice(kind: type[E], value: str, name: str) -> E:
    """``value`` as a member of ``kind``; a LaunchError naming ``name`` and the choices if not."""
    try:
        return kind(value)
    except ValueError:
        raise LaunchError(f"{name}={value!r}: expected one of {', '.join(kind)}") from None


@dataclass(frozen=True)
class LaunchEnv:
    job_id: str
    master_addr: str
    master_port: int
    store_prefix: str = field(repr=False)  # the job's secret (agent/store.py): never shown
    world_size: int
    heartbeat_interval_s: float
    role: Role
    rank: int | None  # None for a spare until it is assigned
    spare_id: int | None
    generation: int
    replacement: bool
    fault_plan: FaultPlan  # tests only (trainer_hooks/probe.py)
    final_state_dir: Path | None  # where finish() leaves the final state (final_state.py)
    agent_socket: str  # where heartbeats go, never the log (agent/relay.py)
    agent_link: str  # where the other records go, and decisions come from (agent/links.py)
    # "host:port" of the store its own node's agent hosts: where a spare waits for its rank
    # (a multi-node job's generations may meet on another node's store; agent/job.py)
    node_store: str = ""
    shards: int = 1  # rank r holds model shard r % shards
    node: int = 0  # the node whose agent started it (FLASHRECOVERY_NODE)
    checkpoint_dir: Path | None = None  # where checkpoints go (trainer_hooks/checkpoint.py)
    checkpoint_every: int = 0  # save after every this many committed steps
    group_rebuild: GroupRebuild = GroupRebuild.FRESH
    nonfinite_policy: NonFinitePolicy = NonFinitePolicy.FAIL
    verify_every: int = 0  # the replicas compare their states every this many steps

    @property
    def launch_store(self) -> str:
        """The store generation 0 (or the generation it was started for) meets on."""
        return f"{self.master_addr}:{self.master_port}"

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

        role = choice(Role, need("FLASHRECOVERY_ROLE"), "FLASHRECOVERY_ROLE")
        group_rebuild = choice(GroupRebuild, env.get(GROUP_REBUILD, "fresh"), GROUP_REBUILD)
        nonfinite_policy = choice(
            NonFinitePolicy, env.get(NONFINITE_POLICY, "fail"), NONFINITE_POLICY
        )
        try:
            return cls(
                job_id=need("FLASHRECOVERY_JOB_ID"),
                master_addr=need("MASTER_ADDR"),
                master_port=int(need("MASTER_PORT")),
                store_prefix=(
                    _read_secret(int(env[SECRET_FD])) if SECRET_FD in env else need(SECRET)
                ),
                world_size=int(need("WORLD_SIZE")),
                heartbeat_interval_s=float(need("FLASHRECOVERY_HEARTBEAT_INTERVAL")),
                role=role,
                rank=int(need("RANK")) if role is Role.RANK else None,
                spare_id=int(need("FLASHRECOVERY_SPARE_ID")) if role is Role.SPARE else None,
                generation=int(env.get("FLASHRECOVERY_GENERATION", "0")),
                replacement=env.get("FLASHRECOVERY_REPLACEMENT") == "1",
                shards=int(env.get("FLASHRECOVERY_SHARDS", "1")),
                fault_plan=FaultPlan.from_environ(env),
                final_state_dir=Path(env[final_state.ENV]) if env.get(final_state.ENV) else None,
                node=int(env.get("FLASHRECOVERY_NODE", "0")),
                agent_socket=need("FLASHRECOVERY_AGENT_SOCKET"),
                checkpoint_dir=Path(env[CHECKPOINT_DIR]) if env.get(CHECKPOINT_DIR) else None,
                checkpoint_every=int(env.get(CHECKPOINT_EVERY, "0")),
                agent_link=need("FLASHRECOVERY_AGENT_LINK"),
                node_store=env.get(NODE_STORE) or f"{need('MASTER_ADDR')}:{need('MASTER_PORT')}",
                group_rebuild=group_rebuild,
                nonfinite_policy=nonfinite_policy,
                verify_every=int(env.get(VERIFY_EVERY, "0")),
            )
        except ValueError as exc:
            raise LaunchError(f"bad launch environment: {exc}") from None


@functools.cache
def _read_secret(fd: int) -> str:
    """The job's secret from the pipe the agent handed a new interpreter (read once: the pipe
    is closed after it)."""
    with os.fdopen(fd, "rb") as pipe:
        return pipe.read().decode()
