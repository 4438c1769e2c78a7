"""A seeded schedule of faults: which kind lands on which rank at which step.

Pure: the same seed, world and kinds give the same schedule. Faults land at distinct steps
spaced ``gap`` apart, so two faults on one rank never land at the same step, and a recovery
has room to finish before the next fault. In-process faults (raise, stall, and the kills that
land inside a recovery) become the job's fault plan (trainer_hooks/probe.py); the others are
carried out from outside by the chaos command (signals to a rank, the engine or the broker).
"""

from __future__ import annotations

import random
import signal
from dataclasses import dataclass

# kind -> what it does; the first rank named fails at the fault's step.
KINDS: dict[str, str] = {
    "sigkill": "SIGKILL a rank from outside",
    "sigstop": "SIGSTOP a rank from outside (found by its missing heartbeats)",
    "raise": "an exception escapes a rank's training loop",
    "committed": (
        "a rank dies once its step's vote committed, before it hands the step's record over "
        "(the step is the job's: its replacement is restored to it, nothing is recomputed)"
    ),
    "stall": "a rank stuck in its own code, heartbeats going on (found by the stall detector)",
    "nan": "a NaN in one rank's gradients (found by the commit: no rank steps, it is recomputed)",
    "slow": (
        "a rank's steps take 3x their compute time for a while (named a straggler from its "
        "compute times against its peers'; replaced under --straggler-policy replace)"
    ),
    "bitflip": (
        "one bit of a rank's parameters flipped in its memory (found when the replicas compare "
        "their state digests; the odd one is replaced and restored from the others)"
    ),
    "forge": (
        "a process with log access and no key writes a record of every type about a live "
        "rank (each rejected by the engine or ignored by the agents; nothing acted on)"
    ),
    "donor": "a rank dies, then its donor dies mid-transfer (another replica donates)",
    "replacement": "a rank dies, then its replacement dies before its first commit",
    "regroup": "a rank dies, then a second one dies as the members regroup",
    "group_build": "a rank dies, then a second one dies while the new group forms",
    "engine_kill": "a rank is SIGKILLed, then the deciding engine mid-incident (--external-engine)",
    "broker_restart": "a rank is SIGKILLed, then the Kafka broker restarts mid-incident",
    "spare_kill": "SIGKILL an idle hot spare (it must be retired and replaced, never used)",
    "spare_stop": "SIGSTOP an idle hot spare (found by its missing heartbeats, then replaced)",
    # with --nodes N (and --netns for the network's): a whole node, or its link
    "node_kill": "SIGKILL a node's agent with its processes (its peers' connections close)",
    "node0_kill": "SIGKILL node 0's agent: the meeting store's host, and the deciding engine's",
    "partition": "cut a node off the network both ways while its processes run, then heal it",
    "node0_partition": "cut node 0 off both ways: the meeting store's and the engine's host",
    "oneway": "drop one direction of a node's traffic (it hears and is not heard, or the reverse)",
    "flap": "a node's link down and up, each time for less than the silence limit",
    "degraded": "5 % of a node's packets dropped at random for a while",
    "broker_kill": "SIGKILL the Kafka broker leading the job's events (3 brokers, min ISR 2)",
    "broker_partition": "cut the broker leading the job's events off the network, then heal it",
    "node_kill_leader_cut": (
        "SIGKILL a node's agent, and at once cut the events' leader broker off, then heal it "
        "(the node is lost while the writers are held up)"
    ),
}
NODE_KILLS = ("node_kill", "node0_kill", "node_kill_leader_cut")  # the killer SIGKILLs a node
NODE_LOST = (*NODE_KILLS, "partition", "node0_partition", "oneway")  # given up on
CUT = ("partition", "node0_partition")  # a node cut off both ways
# A killed broker stays down: 3 brokers with min.insync.replicas 2 store a write with one of
# them lost, none with two (by design: a record is acknowledged on 2 brokers at least).
BROKERS_TOLERATED = 1
BROKER = ("broker_kill", "broker_partition")  # the events' leader broker, on its own host
LEADER_CUT = ("broker_partition", "node_kill_leader_cut")  # the events' leader cut off
# A node's link made slow or unsteady, not cut: the straggler policy may replace the node.
SLOWED = ("flap", "degraded")
NETWORK = (*CUT, "oneway", *SLOWED, "broker_kill", *LEADER_CUT)  # need --netns
# Kinds that lose a second member during the recovery: they need a replica left to donate.
TWO_FAILURES = ("donor", "replacement", "regroup", "group_build")
OUTSIDE_SIGNAL = {"sigkill": signal.SIGKILL, "sigstop": signal.SIGSTOP}
MID_INCIDENT = ("engine_kill", "broker_restart")  # a rank SIGKILLed, then this
IDLE_SPARE_SIGNAL = {"spare_kill": signal.SIGKILL, "spare_stop": signal.SIGSTOP}
NO_INCIDENT = ("nan",)  # a fault of the values, not of a process: found, and no rank replaced
STRAGGLING = ("slow",)  # a rank slow, not failed: named; replaced only by the straggler policy
VERIFIED = ("bitflip",)  # found by the replicas' state digests (a majority needs 3 replicas)
FORGED = ("forge",)  # records written by a process with no key: rejected, no incident


@dataclass(frozen=True)
class PlannedFault:
    index: int
    kind: str
    step: int  # the step the first failure lands at (every member committed step - 1)
    rank: int  # the rank that fails first (a node's first rank, for the node kinds)
    second: int | None = None  # the member lost during the recovery, for TWO_FAILURES
    node: int | None = None  # the node a node kind acts on
    ranks: tuple[int, ...] = ()  # that node's ranks

    @property
    def plan(self) -> list[str]:
        """Its entries of the job's fault plan (``RANK:POINT@STEP``); none for outside kinds."""
        first = f"{self.rank}:before_reduce@{self.step}"
        during = self.step - 1  # the members' committed step while they recover
        return {
            "raise": [f"{self.rank}:raise@{self.step}"],
            "committed": [f"{self.rank}:committed@{self.step}"],
            "stall": [f"{self.rank}:stall@{self.step}"],
            "nan": [f"{self.rank}:nan@{self.step}"],
            "bitflip": [f"{self.rank}:bitflip@{self.step}"],
            "slow": [f"{self.rank}:slow@{self.step}"],
            "donor": [first, f"{self.second}:donor_send@{during}"],
            "replacement": [first, first],
            "regroup": [first, f"{self.second}:regroup@{during}"],
            "group_build": [first, f"{self.second}:group_build@{during}"],
        }.get(self.kind, [])

    @property
    def failed_ranks(self) -> list[int]:
        """The ranks it makes fail, in order (one incident each)."""
        if self.kind in IDLE_SPARE_SIGNAL or self.kind in (
            *SLOWED,
            *STRAGGLING,
            *BROKER,
            *NO_INCIDENT,
            *FORGED,
        ):
            return []  # a spare holds no rank, the others must cost no incident (but a policy)
        if self.kind in NODE_LOST:
            return list(self.ranks[:1])  # one incident for the whole node, named by its first
        if self.kind == "replacement":
            return [self.rank, self.rank]
        return [self.rank] if self.second is None else [self.rank, self.second]

    @property
    def direction(self) -> str:
        """A one-way fault's lost direction: the node's outgoing traffic or its incoming."""
        return "out" if self.index % 2 == 0 else "in"

    @property
    def traffic(self) -> str:
        """The traffic a one-way fault loses, in words."""
        return "outgoing traffic" if self.direction == "out" else "incoming traffic"

    def describe(self) -> str:
        if self.kind in IDLE_SPARE_SIGNAL:
            return f"an idle spare at step {self.step}"
        if self.kind in BROKER:
            return f"the events' leader broker at step {self.step}"
        if self.node is not None:
            direction = f" ({self.traffic} lost)" if self.kind == "oneway" else ""
            return f"node {self.node}{direction} at step {self.step}"
        if self.kind in ("donor", "regroup", "group_build"):
            return f"rank {self.rank} at step {self.step}, then rank {self.second}"
        return f"rank {self.rank} at step {self.step}"


def available_kinds(
    nproc: int,
    external_engine: bool,
    broker: bool,
    spares: int = 0,
    nodes: int = 1,
    netns: bool = False,
) -> list[str]:
    """The kinds this job can take: two failures in one recovery need three ranks (one
    replica must survive to donate); the spare, engine and broker kinds need those to exist;
    the node kinds several nodes, the network's nodes with networks of their own."""
    kinds = ["sigkill", "sigstop", "raise", "committed", "stall", "nan", "slow", *FORGED]
    if nodes > 1:
        kinds += ["node_kill", "node0_kill"]
    if nodes > 1 and netns:
        kinds += list(NETWORK)
    if nproc >= 3:
        kinds += [*TWO_FAILURES, *VERIFIED]
    if spares:
        kinds += list(IDLE_SPARE_SIGNAL)
    if external_engine:
        kinds.append("engine_kill")
    if broker:
        kinds.append("broker_restart")
    return kinds


def draw(
    faults: int,
    seed: int,
    nproc: int,
    kinds: list[str],
    first_step: int,
    gap: int,
    nodes: int = 1,
) -> list[PlannedFault]:
    """``faults`` faults at steps first_step, first_step + gap, …; kinds are dealt from a
    shuffled deck (so a short schedule still covers many kinds), ranks at random. A node kind
    takes a node still in the job (never the spare node, which holds the ranks that moved):
    node 0 for ``node0_kill`` and ``node0_partition``, another at random else; a node given up
    on is not taken again (a kind that needs one is passed over). ValueError when the faults
    would take more nodes than there are."""
    rng = random.Random(seed)
    deck: list[str] = []
    out = []
    alive = list(range(nodes))
    per_node = nproc // nodes
    brokers_killed = 0
    for index in range(faults):
        broker_left = brokers_killed < BROKERS_TOLERATED
        # A slowed link is named only among 3 nodes or more (the spare node counted), so it
        # needs 2 of the job's nodes; a loss that leaves one is dealt only where what follows
        # needs none. A second broker lost, killed or cut off (however briefly), would stop
        # every write and the controllers' quorum (BROKERS_TOLERATED).
        after = faults - index - 1
        nodeless = int(broker_left and "broker_kill" in kinds)
        may_lose = len(alive) > 2 or (len(alive) == 2 and after <= nodeless) or nodes == 1
        may_slow = len(alive) >= 2 or nodes < 2
        kind = _deal(deck, kinds, alive, rng, (may_lose, may_slow, broker_left))
        brokers_killed += kind == "broker_kill"
        if kind in NODE_LOST or kind in SLOWED:
            node = _node_for(kind, alive, rng)
            if kind in NODE_LOST:
                alive.remove(node)
            ranks = tuple(range(node * per_node, (node + 1) * per_node))
            step = first_step + index * gap
            out.append(PlannedFault(index, kind, step, ranks[0], node=node, ranks=ranks))
            continue
        rank = rng.randrange(nproc)
        others = [r for r in range(nproc) if r != rank]
        second = None
        if kind == "donor":
            second = min(others)  # the planner's donor: the lowest survivor
        elif kind in ("regroup", "group_build"):
            second = rng.choice(others)
        out.append(PlannedFault(index, kind, first_step + index * gap, rank, second))
    return out


NODE0 = ("node0_kill", "node0_partition")
NODE_KINDS = (*NODE_LOST, *SLOWED)  # they act on a node still in the job


def _deal(
    deck: list[str],
    kinds: list[str],
    alive: list[int],
    rng: random.Random,
    may: tuple[bool, bool, bool],
) -> str:
    """The next card of the deck (refilled and shuffled when empty) that the job can take:
    node 0's kinds once node 0 is given up, a node kind once every node is, and what ``may``
    (lose a node, slow a link, kill a broker; see draw) bars are passed over. ValueError when
    no kind asked for can be dealt any more."""
    may_lose, may_slow, broker_left = may
    for _ in range(2 * len(kinds) + 1):
        if not deck:
            deck.extend(kinds)
            rng.shuffle(deck)
        kind = deck.pop()
        if (kind in NODE0 and 0 not in alive) or (kind in NODE_KINDS and not alive):
            continue
        barred = (kind in NODE_LOST and not may_lose) or (kind in SLOWED and not may_slow)
        if barred or (kind in ("broker_kill", *LEADER_CUT) and not broker_left):
            continue
        return kind
    raise ValueError(
        f"the faults asked for take more nodes or brokers than the job has (every one of "
        f"{kinds} needs a node still in it, or a broker the cluster can lose): give more "
        "--nodes, other --kinds or fewer --faults"
    )


def _node_for(kind: str, alive: list[int], rng: random.Random) -> int:
    if kind in NODE0:
        return 0
    others = [node for node in alive if node != 0] or alive
    return rng.choice(others)
