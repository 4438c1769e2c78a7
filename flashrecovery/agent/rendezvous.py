"""Where an agent finds its job and its node (docs/multinode.md).

Node 0's agent hosts the job's store on the rendezvous endpoint, starts the job (JobStarted) and
publishes its id there; every other agent connects, reads the job id and claims a node rank: its
own (``--node-rank K``, refused if another agent holds it) or the lowest free one (``auto``).
Node ranks below ``--nnodes`` train (ranks laid out node by node, as torchrun does); the others
are spare nodes, each keeping ``--nproc-per-node`` hot spares for the whole job. Every other
agent also hosts a store of its own on its node's address, where its spares wait for their
rank and where a later generation may meet (agent/meeting.py). With a control plane
(``--control-plane``) the endpoint's store is the control plane's and node 0's agent hosts one
of its own like the others; generation 0 meets on node 0's either way (MEETING_KEY), so the
control plane holds nothing the ranks need. A single-node job is node 0 with a store of its own
on a free loopback port, as it always was.
"""

from __future__ import annotations

import datetime
import os
import socket
from collections.abc import Callable
from dataclasses import dataclass

from flashrecovery.agent.config import AgentConfig
from flashrecovery.agent.store import JobStore, local_address
from flashrecovery.errors import ConfigError

STORE_TIMEOUT = datetime.timedelta(seconds=60)
JOIN_TIMEOUT = datetime.timedelta(seconds=60)  # a node waits this long for node 0's store and job
MAX_NODES = 4096  # node ranks an `auto` agent tries

# Store keys (under the job's secret prefix, like every key).
JOB_KEY = "rdzv/job"  # the job id, once node 0 has started the job
MEETING_KEY = "rdzv/meeting"  # where generation 0 meets: the store node 0's agent hosts
AGENTS_KEY = "rdzv/agents"  # agents that joined
AGENTS_DONE_KEY = "rdzv/agents-done"  # agents that saw the job complete
SPARE_IDS = 100_000  # node k's spares are numbered from k * SPARE_IDS: unique job-wide


@dataclass
class Membership:
    """One agent's place in the job: the rendezvous store (node 0's) and its own."""

    store: JobStore  # the rendezvous endpoint's: node 0's own, or a control plane's
    own: JobStore  # the store this agent hosts (the same one on node 0 without a control plane)
    meeting: str  # where generation 0 meets: node 0's own store
    job_id: str
    node: int
    ranks: list[int]  # the global ranks it starts
    spares: int  # the hot spares it keeps
    _spares_made: int = 0

    def next_spare_id(self) -> int:
        """A spare id no other node uses (each node numbers its own: no store is asked)."""
        self._spares_made += 1
        return self.node * SPARE_IDS + self._spares_made - 1


def join(config: AgentConfig, start_job: Callable[[JobStore], None]) -> Membership:
    """Open or reach the job's store and take this agent's node; ``start_job`` (node 0's
    agent) is given its own store (where generation 0 meets, and the job's secret) and appends
    JobStarted before any other node can see the job."""
    endpoint = config.rdzv_endpoint
    if endpoint is None:  # one node: the secret given (FLASHRECOVERY_STORE_PREFIX), or a new one
        store = own = JobStore.open(STORE_TIMEOUT, prefix=config.store_secret)
    elif config.hosts_store:
        store = own = JobStore.open(
            STORE_TIMEOUT, endpoint.host, endpoint.port, config.store_secret
        )
    else:
        assert config.store_secret is not None
        store = JobStore.connect(endpoint.host, endpoint.port, config.store_secret, JOIN_TIMEOUT)
        here = local_address(endpoint.host, endpoint.port)
        own = JobStore.open(STORE_TIMEOUT, here, 0, config.store_secret)
    if config.starts_job:
        assert config.job_id is not None
        start_job(own)
        store.keys.set(MEETING_KEY, own.endpoint)
        store.keys.set(JOB_KEY, config.job_id)
        job_id, meeting = config.job_id, own.endpoint
    else:
        try:
            job_id = store.keys.get(JOB_KEY).decode()
            meeting = store.keys.get(MEETING_KEY).decode()
        except RuntimeError:
            raise ConfigError(
                f"the store at {endpoint} answered but started no job within {JOIN_TIMEOUT} "
                "(is FLASHRECOVERY_STORE_PREFIX the same on every node?)"
            ) from None
        if config.job_id is not None and config.job_id != job_id:
            raise ConfigError(f"--job-id {config.job_id!r}, but node 0 runs job {job_id!r}")
    node = _claim(store, config.node_rank)
    store.keys.add(AGENTS_KEY, 1)
    if node < config.nnodes:
        ranks = list(range(node * config.nproc, (node + 1) * config.nproc))
        return Membership(store, own, meeting, job_id, node, ranks, config.spares)
    return Membership(store, own, meeting, job_id, node, [], config.nproc)  # a spare node


def _claim(store: JobStore, wanted: int | None) -> int:
    token = f"{socket.gethostname()}:{os.getpid()}"
    holder = ""
    for node in [wanted] if wanted is not None else range(MAX_NODES):
        holder = store.keys.compare_set(f"rdzv/node/{node}", "", token).decode()
        if holder == token:
            return node
    if wanted is not None:
        raise ConfigError(f"node rank {wanted} is taken by the agent {holder}")
    raise ConfigError(f"no free node rank below {MAX_NODES}")
