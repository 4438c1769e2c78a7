"""Replicas vouch for each other (docs/hook.md, "Replicas vouch for each other"): the members'
state digests of one step, compared shard by shard. Pure."""

from __future__ import annotations

from collections import Counter, defaultdict
from dataclasses import dataclass


@dataclass(frozen=True)
class Comparison:
    odd: list[
        int
    ]  # ranks to replace: a majority's minority, or every replica of an undecided shard
    undecided: list[int]  # shards whose replicas have no majority digest
    reason: str  # what differs, naming ranks, digests and the step ("" when nothing does)


def compare(reports: dict[int, tuple[int, str]], step: int) -> Comparison:
    """``reports``: rank -> (shard, digest) of every member at ``step``."""
    by_shard: dict[int, dict[int, str]] = defaultdict(dict)
    for rank, (shard, digest) in reports.items():
        by_shard[shard][rank] = digest
    odd: list[int] = []
    undecided: list[int] = []
    said: list[str] = []
    for shard, held in sorted(by_shard.items()):
        counts = Counter(held.values())
        top, votes = counts.most_common(1)[0]
        if len(counts) == 1:
            continue
        if 2 * votes > len(held):
            minority = sorted(r for r, d in held.items() if d != top)
            odd += minority
            named = ", ".join(f"rank {r} {held[r]}" for r in minority)
            said.append(f"shard {shard}: {named} against {top} of the other {votes}")
        else:
            undecided.append(shard)
            odd += sorted(held)
            named = ", ".join(f"rank {r} {d}" for r, d in sorted(held.items()))
            said.append(f"shard {shard}: {named}, no majority")
    reason = f"replicas' states differ at step {step} ({'; '.join(said)})" if said else ""
    return Comparison(sorted(odd), undecided, reason)
