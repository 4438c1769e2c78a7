"""Nodes in the pure engine (no processes): a lost node is one incident for all its ranks,
replaced together by spares of other nodes; with no capacity its ranks wait for a node, then
the job fails; the detectors report a silent node once, and not its ranks one by one."""

from __future__ import annotations

from typing import Any

from factories import JOB, T0, feed

from flashrecovery.engine import detectors
from flashrecovery.engine.state import EngineState
from flashrecovery.records import (
    Decision,
    Envelope,
    Heartbeat,
    JobStarted,
    LinkSample,
    NodeHeartbeat,
    NodeJoined,
    NodeMissed,
    NodeWaitExpired,
    RankExited,
    RankJoined,
    SpareReady,
    StepCompleted,
)

INTERVAL = 1.0
AGENTS = {0: 900, 1: 901, 2: 902}  # node -> agent pid


def envelope(ts: float, source: str = "test") -> dict[str, Any]:
    return {"job_id": JOB, "generation": 0, "source": source, "ts": ts}


def two_nodes(
    spare_nodes: int = 0, node_wait_s: float = 30.0, log_hold_s: float = 0.0
) -> tuple[EngineState, int]:
    """2 nodes x 2 ranks, one spare on node 0, and ``spare_nodes`` nodes of 2 spares each,
    all joined and running; returns the state and the next log position."""
    nodes = 2 + spare_nodes
    records: list[Envelope] = [
        JobStarted(
            **envelope(T0),
            world_size=4,
            spares=1,
            heartbeat_interval_s=INTERVAL,
            nodes=2,
            node_wait_s=node_wait_s,
            log_hold_s=log_hold_s,
        ),
        *(
            NodeJoined(
                **envelope(T0), node=n, pid=AGENTS[n], host="h", ranks=2 if n < 2 else 0, spares=1
            )
            for n in range(nodes)
        ),
        *(RankJoined(**envelope(T0 + 1), rank=r, pid=1000 + r, host="h") for r in range(4)),
        SpareReady(**envelope(T0 + 8), spare_id=0, pid=2000, host="h", node=0),
        *(
            SpareReady(**envelope(T0 + 8), spare_id=s, pid=2000 + s, host="h", node=2)
            for s in range(1, 1 + 2 * spare_nodes)
        ),
    ]
    state = EngineState(JOB)
    feed(state, records, 0)
    assert state.job.state == "running"
    return state, len(records)


def essentials(decisions: list[Decision]) -> list[dict[str, Any]]:
    return [d.model_dump(include={"type", "rank", "ranks", "node", "spare_id"}) for d in decisions]


def lose_node_1(state: EngineState, position: int) -> list[Decision]:
    missed = NodeMissed(**envelope(T0 + 9, "detector"), node=1, last_seen_ts=T0 + 5, silent_s=4)
    return feed(state, [missed], position)


def test_a_lost_node_is_one_incident_its_ranks_replaced_together_on_the_spare_node() -> None:
    state, position = two_nodes(spare_nodes=1)
    decisions = lose_node_1(state, position)
    assert [d.type for d in decisions] == [
        "isolate_node",
        "isolate_rank",
        "isolate_rank",
        "assign_spare",
        "assign_spare",
        "regroup_planned",
    ]
    assigned = [d for d in decisions if d.type == "assign_spare"]
    assert essentials(assigned) == [
        {"type": "assign_spare", "rank": 2, "spare_id": 1, "node": 2},
        {"type": "assign_spare", "rank": 3, "spare_id": 2, "node": 2},
    ]
    assert {d.incident_id for d in decisions if d.type != "isolate_node"} == {f"{JOB}-incident-1"}
    [incident] = state.incidents
    assert (incident.failed_ranks, incident.failed_node) == ([2, 3], 1)
    assert state.spares[0].status == "ready"  # node 0's spare stays for the next failure
    assert lose_node_1(state, position + 1) == []  # reported twice: one incident all the same


def test_what_a_lost_nodes_agent_says_of_its_processes_exits_is_fenced() -> None:
    """Nodes 1 (two ranks) and 2 (two spares) given up on: their agents, cut off and back,
    report their old processes' exits (they end them on seeing they were given up). Fenced,
    like all a lost node writes: its ranks and spares were given up with it."""
    state, position = two_nodes(spare_nodes=1)
    lose_node_1(state, position)
    missed = NodeMissed(**envelope(T0 + 10, "detector"), node=2, last_seen_ts=T0 + 6, silent_s=4)
    feed(state, [missed], position + 1)
    before = ({r: state.ranks[r].machine.state for r in range(4)}, state.generation)
    fenced = state.fenced
    late = [
        *(
            RankExited(**envelope(T0 + 12, "agent:1"), rank=r, pid=1000 + r, signal=9, node=1)
            for r in (2, 3)
        ),
        *(
            RankExited(**envelope(T0 + 12, "agent:2"), spare_id=s, pid=2000 + s, signal=9, node=2)
            for s in (1, 2)
        ),
    ]
    assert feed(state, late, position + 2) == []
    assert state.fenced == fenced + 4
    assert ({r: state.ranks[r].machine.state for r in range(4)}, state.generation) == before


def test_with_one_spare_left_the_other_rank_waits_for_a_node_that_brings_one() -> None:
    state, position = two_nodes()
    decisions = lose_node_1(state, position)
    assert essentials([d for d in decisions if d.type in ("assign_spare", "await_node")]) == [
        {"type": "assign_spare", "rank": 2, "spare_id": 0, "node": 0},
        {"type": "await_node", "ranks": [3]},
    ]
    joined = NodeJoined(**envelope(T0 + 12), node=2, pid=AGENTS[2], host="h", ranks=0, spares=2)
    ready = SpareReady(**envelope(T0 + 15), spare_id=1, pid=2001, host="h", node=2)
    later = feed(state, [joined, ready], position + 1)
    assert essentials(later) == [{"type": "assign_spare", "rank": 3, "spare_id": 1, "node": 2}]
    assert state.awaiting_node == {} and state.awaiting_node_since is None


def test_no_node_within_node_wait_fails_the_job_clearly() -> None:
    state, position = two_nodes(node_wait_s=5.0)
    lose_node_1(state, position)
    assert detectors.node_wait_over(state, T0 + 9 + 5) == []  # not past the wait yet
    [expired] = detectors.node_wait_over(state, T0 + 9 + 6)
    assert isinstance(expired, NodeWaitExpired) and expired.ranks == [3]
    [fail] = feed(state, [expired], position + 1)
    assert fail.type == "fail_job" and "no capacity: rank(s) 3" in fail.reason  # type: ignore[attr-defined]
    assert "--node-wait" in fail.reason  # type: ignore[attr-defined]
    assert state.job.state == "failed"


def test_a_silent_node_is_found_once_and_its_ranks_silence_is_the_nodes() -> None:
    """Node 1's agent beat last at T0, its ranks at T0 + 4; node 0 and its ranks at T0 + 6."""
    state, position = two_nodes()
    beats: list[Envelope] = [
        NodeHeartbeat(**envelope(T0 + 6), node=0, pid=AGENTS[0]),
        *(
            Heartbeat(**envelope(T0 + (6 if r < 2 else 4)), rank=r, step=-1, pid=1000 + r, host="h")
            for r in range(4)
        ),
    ]
    feed(state, beats, position)
    now = T0 + 4 + 3 * INTERVAL + 0.5  # past ranks 2 and 3's limit too
    assert [m.node for m in detectors.silent_nodes(state, now)] == [1]
    assert detectors.silent_ranks(state, now) == []  # ranks 2, 3: their node's to report
    later = T0 + 6 + 3 * INTERVAL + 0.5
    assert [m.node for m in detectors.silent_nodes(state, later)] == [0, 1]


def test_the_same_pid_on_another_node_is_not_the_rank() -> None:
    state, position = two_nodes()
    elsewhere = RankExited(**envelope(T0 + 5), rank=None, pid=1000, signal=9, node=1)
    assert feed(state, [elsewhere], position) == []
    assert state.ranks[0].machine.state == "healthy"


def test_the_beats_a_node_heartbeat_carries_count_as_the_ranks_own() -> None:
    state, position = two_nodes()
    beat = Heartbeat(**envelope(T0 + 6, "rank:2"), rank=2, step=-1, pid=1002, host="h")
    stale = beat.model_copy(update={"rank": 3, "pid": 9999})  # not rank 3's process
    carried = NodeHeartbeat(**envelope(T0 + 6.5), node=1, pid=AGENTS[1], beats=[beat, stale])
    fenced = state.fenced
    assert feed(state, [carried], position) == []
    assert state.ranks[2].last_heartbeat_ts == T0 + 6.5  # when its agent vouched for it
    assert state.ranks[3].last_heartbeat_ts != T0 + 6.5
    assert state.fenced == fenced + 1
    other = NodeHeartbeat(**envelope(T0 + 7), node=1, pid=4242, beats=[beat])  # an old agent
    feed(state, [other], position + 1)
    assert state.fenced == fenced + 2


def peer_beat(ts: float, probes: int, late: int) -> NodeHeartbeat:
    """Node 0's heartbeat, with what its probes of node 1 saw over the interval."""
    sample = LinkSample(peer=1, probes=probes, late=late)
    return NodeHeartbeat(**envelope(ts), node=0, pid=AGENTS[0], links=[sample])


def test_a_node_its_peers_still_hear_gets_the_logs_hold_before_it_is_lost() -> None:
    """Node 1's writer held up by the log (a broker cut off) while node 0's probes of it come
    back: lost only past the silence limit and the hold; at once when probes fail too."""
    state, position = two_nodes(log_hold_s=11.0)
    node_1_last = T0 + 5
    feed(state, [NodeHeartbeat(**envelope(node_1_last), node=1, pid=AGENTS[1])], position)
    limit = 3 * INTERVAL
    feed(state, [peer_beat(T0 + 6, probes=10, late=0), peer_beat(T0 + 7, 0, 0)], position + 1)
    assert detectors.silent_nodes(state, node_1_last + limit + 0.5) == []
    assert 1 in [m.node for m in detectors.silent_nodes(state, node_1_last + limit + 11.5)]
    feed(state, [peer_beat(T0 + 7.5, probes=10, late=10)], position + 3)  # now unheard
    assert [m.node for m in detectors.silent_nodes(state, node_1_last + limit + 0.5)] == [1]


def test_without_a_hold_or_with_a_peer_heard_only_before_it_the_limit_stands() -> None:
    for hold, heard_at in ((0.0, T0 + 6), (11.0, T0 + 4)):
        state, position = two_nodes(log_hold_s=hold)
        feed(state, [peer_beat(heard_at, probes=10, late=1)], position)
        feed(state, [NodeHeartbeat(**envelope(T0 + 5), node=1, pid=AGENTS[1])], position + 1)
        assert 1 in [m.node for m in detectors.silent_nodes(state, T0 + 8.5)]


def test_a_quiet_nodes_ranks_are_not_suspected_of_stalling_their_peers() -> None:
    """Ranks 2, 3 behind at step 0 while node 0's are at 1: stragglers, unless their node has
    gone quiet (its records held up with its beats), whose silence is judged for them."""
    state, position = two_nodes()
    progress = T0 + 10
    steps: list[Envelope] = [
        *(StepCompleted(**envelope(T0 + 9), rank=r, step=0, duration_s=0.5) for r in range(4)),
        *(StepCompleted(**envelope(progress), rank=r, step=1, duration_s=0.5) for r in (0, 1)),
        NodeHeartbeat(**envelope(progress), node=0, pid=AGENTS[0]),
    ]
    feed(state, steps, position)
    stalled = progress + 6.0  # past the 5 s floor
    assert detectors.stalled_ranks(state, stalled) == []  # node 1 unheard since T0
    feed(state, [NodeHeartbeat(**envelope(stalled - 0.5), node=1, pid=AGENTS[1])], position + 7)
    assert [f.rank for f in detectors.stalled_ranks(state, stalled)] == [2, 3]
