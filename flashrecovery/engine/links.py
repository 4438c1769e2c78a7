"""Which node slows the job, scored from its agents' probes of each other (NodeHeartbeat.links).

A degraded link (packets dropped at random, bandwidth held down) shows on every probe that
crosses it, and a node's link is crossed by every probe to or from that node. So a node whose
links to all its measured peers lose or delay their probes, while some link between those peers
does not, is the cause. When every link is bad (the network as a whole) or a job has two nodes
(no third link to compare), no node is named. Pure: the book is fed by records, never a clock.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from itertools import combinations

from flashrecovery.records import LinkSample

WINDOW = 5  # samples per direction of a link: its last few heartbeat intervals
MIN_PROBES = 40  # a link scored on fewer probes (both directions) says nothing yet
BAD_RATIO = 0.05  # a node whose probes are late this often over its links slows the job
GOOD_RATIO = BAD_RATIO / 2  # a link (or node) late less often than this is good
HEARD_INTERVALS = 1.5  # a node unheard for longer is silent, not slow: its silence decides


@dataclass(frozen=True)
class Straggler:
    node: int
    late_ratio: float  # of the probes over its links, in the window
    peers: list[int]  # the peers whose links to it were scored


@dataclass
class LinkBook:
    """The last ``WINDOW`` samples of each direction of each probed link."""

    samples: dict[tuple[int, int], deque[tuple[int, int]]] = field(default_factory=dict)
    peers: dict[int, set[int]] = field(default_factory=dict)  # node -> nodes it shares a link with
    fed: bool = False  # a sample came since the last clear

    def add(self, node: int, sample: LinkSample) -> None:
        key = (node, sample.peer)
        if key not in self.samples:
            self.samples[key] = deque(maxlen=WINDOW)
            self.peers.setdefault(node, set()).add(sample.peer)
            self.peers.setdefault(sample.peer, set()).add(node)
        self.samples[key].append((sample.probes, sample.late))
        self.fed = True

    def clear(self) -> None:
        """Forget every sample (the links measured so far are kept, unmeasured until fed)."""
        if self.fed:
            for window in self.samples.values():
                window.clear()
            self.fed = False

    def tally(self, a: int, b: int) -> tuple[int, int]:
        """Probes and late probes over the window, both directions of the link a-b."""
        probes = late = 0
        for key in ((a, b), (b, a)):
            for sent, lost in self.samples.get(key, ()):
                probes, late = probes + sent, late + lost
        return probes, late

    def ratio(self, a: int, b: int) -> float | None:
        """The link's late share, or None while it has too few probes to say."""
        probes, late = self.tally(a, b)
        return late / probes if probes >= MIN_PROBES else None


def straggler(book: LinkBook, node: int, live: Callable[[int], bool]) -> Straggler | None:
    """``node`` if every link of it to a live peer is measured and none is good, its probes
    over them all are late at BAD_RATIO or more, and some measured link between two of those
    peers is good; else None. Pooled over its links, a node's share settles within a few
    intervals; one link alone would take many more to tell 10 % from 5 %."""
    scored = _live_peers(book, node, live)
    ratios = [book.ratio(node, p) for p in scored]
    if not scored or any(r is None or r < GOOD_RATIO for r in ratios):
        return None
    share = _share(book, node, scored)
    if share < BAD_RATIO:
        return None
    healthy_between = any(
        (r := book.ratio(a, b)) is not None and r < GOOD_RATIO for a, b in combinations(scored, 2)
    )
    if not healthy_between:
        return None  # the network as a whole, or no third link to tell by
    return Straggler(node, round(share, 4), scored)


def healed(book: LinkBook, node: int, live: Callable[[int], bool]) -> float | None:
    """Its probes' late share, if every link of it to a live peer is measured again and
    they are late at under GOOD_RATIO over them all; else None (still bad, or too few probes
    since the samples were last cleared to say)."""
    scored = _live_peers(book, node, live)
    if not scored or any(book.ratio(node, p) is None for p in scored):
        return None
    share = _share(book, node, scored)
    return share if share < GOOD_RATIO else None


def _live_peers(book: LinkBook, node: int, live: Callable[[int], bool]) -> list[int]:
    """The peers ``node`` shares a probed link with that are live (a few: the probe ring)."""
    return sorted(p for p in book.peers.get(node, ()) if p != node and live(p))


def _share(book: LinkBook, node: int, peers: list[int]) -> float:
    probes = late = 0
    for p in peers:
        sent, lost = book.tally(node, p)
        probes, late = probes + sent, late + lost
    return late / probes if probes else 0.0
