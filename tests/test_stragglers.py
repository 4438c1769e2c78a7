"""A node whose link degrades is named from its agents' probes (engine/links.py), pure: the
node every bad link shares while its peers' link between them is good; never the network as
a whole, never with two nodes, never a node already silent; replaced only by policy and only
when spares of other nodes can take all its ranks."""

from __future__ import annotations

from typing import Any

import pytest
from factories import JOB, T0, feed

from flashrecovery.engine import links
from flashrecovery.engine.state import EngineState
from flashrecovery.records import (
    Decision,
    Envelope,
    JobStarted,
    LinkSample,
    NodeHeartbeat,
    NodeJoined,
    RankJoined,
    SpareHeartbeat,
    SpareReady,
    StragglerCleared,
    StragglerFound,
    StragglerPolicy,
)

AGENTS = {0: 900, 1: 901, 2: 902, 3: 903}
PROBES = 10  # per link per interval from each end, as PROBE_S = 0.1 gives at 1 s


def envelope(ts: float) -> dict[str, Any]:
    return {"job_id": JOB, "generation": 0, "source": "test", "ts": ts}


def job(
    nodes: int = 3, spare_node: bool = True, policy: StragglerPolicy = StragglerPolicy.REPORT
) -> tuple[EngineState, int]:
    """``nodes`` training nodes of 2 ranks, plus a spare node of 2 spares; running."""
    every = nodes + int(spare_node)
    records: list[Envelope] = [
        JobStarted(
            **envelope(T0),
            world_size=2 * nodes,
            spares=0,
            heartbeat_interval_s=1.0,
            nodes=nodes,
            straggler_policy=policy,
        ),
        *(
            NodeJoined(
                **envelope(T0), node=n, pid=AGENTS[n], host="h", ranks=2 * (n < nodes), spares=0
            )
            for n in range(every)
        ),
        *(RankJoined(**envelope(T0 + 1), rank=r, pid=1000 + r, host="h") for r in range(2 * nodes)),
        *(
            SpareReady(**envelope(T0 + 2), spare_id=s, pid=2000 + s, host="h", node=nodes)
            for s in range(2 * spare_node)
        ),
    ]
    state = EngineState(JOB)
    feed(state, records, 0)
    return state, len(records)


def beat(node: int, ts: float, late: dict[int, int], peers: list[int]) -> NodeHeartbeat:
    """Node ``node``'s heartbeat with its link samples; the spare node's carries its spares'."""
    samples = [LinkSample(peer=p, probes=PROBES, late=late.get(p, 0)) for p in peers if p != node]
    spares = [
        SpareHeartbeat(**envelope(ts), spare_id=s, pid=2000 + s) for s in range(2) if node == 3
    ]
    return NodeHeartbeat(**envelope(ts), node=node, pid=AGENTS[node], beats=spares, links=samples)


def intervals(
    state: EngineState, position: int, count: int, bad: int | None, nodes: list[int]
) -> list[Decision]:
    """``count`` heartbeat intervals in which every probe over ``bad``'s links has 2 in 10
    late (about what 5 % loss each way, a probe and its answer, gives, with margin)."""
    decisions: list[Decision] = []
    for i in range(count):
        for node in nodes:
            late = {p: 2 for p in nodes if bad in (node, p) and p != node}
            record = beat(node, T0 + 3 + i + 0.01 * node, late, nodes)
            decisions += feed(state, [record], position)
            position += 1
    return decisions


def found(decisions: list[Decision]) -> list[StragglerFound]:
    return [d for d in decisions if isinstance(d, StragglerFound)]


def cleared_of(decisions: list[Decision]) -> list[StragglerCleared]:
    return [d for d in decisions if isinstance(d, StragglerCleared)]


def test_the_node_every_bad_link_shares_is_named_once_and_kept_by_default() -> None:
    state, position = job()
    decisions = intervals(state, position, 4, bad=1, nodes=[0, 1, 2, 3])
    [straggler] = found(decisions)
    assert (straggler.node, straggler.ranks, straggler.peers) == (1, [2, 3], [0, 2, 3])
    assert straggler.late_ratio == pytest.approx(0.2)
    assert not straggler.replaced and "--straggler-policy report" in straggler.reason
    assert [d.type for d in decisions] == ["straggler_found"]  # no incident
    assert state.incidents == []


def test_with_the_replace_policy_its_ranks_go_to_spares_in_one_incident() -> None:
    state, position = job(policy=StragglerPolicy.REPLACE)
    decisions = intervals(state, position, 4, bad=1, nodes=[0, 1, 2, 3])
    assert [d.type for d in decisions][:3] == ["straggler_found", "isolate_node", "isolate_rank"]
    assert found(decisions)[0].replaced
    [incident] = state.incidents
    assert (incident.failed_node, incident.failed_ranks) == (1, [2, 3])
    assert sorted(d.spare_id for d in decisions if d.type == "assign_spare") == [0, 1]


def test_replace_without_spares_for_all_its_ranks_only_names_it() -> None:
    state, position = job(spare_node=False, policy=StragglerPolicy.REPLACE)
    [straggler] = found(intervals(state, position, 4, bad=1, nodes=[0, 1, 2]))
    assert not straggler.replaced and "0 spare(s) free for its 2 rank(s)" in straggler.reason
    assert state.incidents == []


def test_every_link_bad_is_the_network_not_a_node_and_two_nodes_cannot_tell() -> None:
    state, position = job()
    everywhere = intervals(state, position, 4, bad=None, nodes=[0, 1, 2, 3])
    assert found(everywhere) == []
    for node in (0, 1, 2, 3):  # every link late: no third link is good
        for peer in (0, 1, 2, 3):
            if peer != node:
                state.links.add(node, LinkSample(peer=peer, probes=10, late=5))
    assert links.straggler(state.links, 1, lambda node: True) is None
    two, at = job(nodes=2, spare_node=False)
    assert found(intervals(two, at, 4, bad=1, nodes=[0, 1])) == []


def test_too_few_probes_say_nothing_and_a_healed_node_is_named_again_later() -> None:
    state, position = job()
    assert found(intervals(state, position, 1, bad=1, nodes=[0, 1, 2, 3])) == []  # one interval
    assert len(found(intervals(state, position + 4, 3, bad=1, nodes=[0, 1, 2, 3]))) == 1
    assert state.stragglers == {1}
    healed = intervals(state, position + 16, links.WINDOW, bad=None, nodes=[0, 1, 2, 3])
    assert found(healed) == [] and state.stragglers == set()
    [cleared] = cleared_of(healed)
    assert cleared.node == 1 and cleared.late_ratio < links.GOOD_RATIO
    again = intervals(state, position + 36, 4, bad=1, nodes=[0, 1, 2, 3])
    assert [s.node for s in found(again)] == [1]


def test_a_named_node_is_cleared_only_on_links_measured_good_again() -> None:
    state, position = job()
    [named] = found(intervals(state, position, 4, bad=1, nodes=[0, 1, 2, 3]))
    still_bad = intervals(state, position + 16, 3, bad=1, nodes=[0, 1, 2, 3])
    assert found(still_bad) == cleared_of(still_bad) == []  # named once, kept while bad
    state.links.clear()  # as a recovery does: no sample says the links are good yet
    one = intervals(state, position + 28, 1, bad=None, nodes=[0, 1, 2, 3])
    assert cleared_of(one) == [] and state.stragglers == {named.node}  # 20 probes a link
    [cleared] = cleared_of(intervals(state, position + 32, 1, bad=None, nodes=[0, 1, 2, 3]))
    assert cleared.node == 1 and cleared.late_ratio == 0.0


def test_a_silent_node_is_left_to_its_silence_not_named_slow() -> None:
    state, position = job()
    decisions: list[Decision] = []
    for i in range(4):  # node 1 is cut off: its own records stop, its peers' probes of it fail
        for node in (0, 2, 3):
            late = {1: PROBES}
            decisions += feed(state, [beat(node, T0 + 3 + i, late, [0, 1, 2, 3])], position)
            position += 1
    assert found(decisions) == []


def test_link_samples_are_checked_and_old_heartbeats_still_parse() -> None:
    with pytest.raises(ValueError, match="late 3 is more than the 2 probes"):
        LinkSample(peer=1, probes=2, late=3)
    old = NodeHeartbeat.model_validate(
        {**envelope(T0), "type": "node_heartbeat", "node": 0, "pid": 900, "beats": []}
    )
    assert old.links == []
    started = JobStarted(**envelope(T0), world_size=1, spares=0, heartbeat_interval_s=1.0)
    assert started.straggler_policy is StragglerPolicy.REPORT
