"""The hook's store vote and state transfer, on a real TCPStore and real gloo groups in one
process (two threads play two ranks)."""

from __future__ import annotations

import contextlib
import copy
import datetime
import os
import random
import threading
from typing import Any

import psutil
import pytest
import torch
import torch.distributed as dist

from flashrecovery.agent.store import JobStore
from flashrecovery.errors import ProtocolError, RestoreMismatch
from flashrecovery.trainer_hooks import barrier, groups, rng, transfer, vote

pytestmark = pytest.mark.timeout(60)
TIMEOUT = datetime.timedelta(seconds=10)


@pytest.fixture
def job_store() -> JobStore:
    return JobStore.open(TIMEOUT)


@pytest.fixture
def store(job_store: JobStore) -> dist.Store:
    """The job's keys, as the agent and the ranks see them."""
    return job_store.keys


def test_vote_commits_only_when_every_member_voted(store: dist.Store) -> None:
    key = vote.vote_key(0, 5)
    assert vote.cast(store, key, 3) is None
    assert vote.cast(store, key, 3) is None
    assert vote.cast(store, key, 3) is vote.Verdict.COMMITTED
    assert vote.close(store, key, 3) is vote.Verdict.COMMITTED  # a full vote can't be closed
    assert vote.close(store, key, 3) is vote.Verdict.COMMITTED  # nor by a second closer
    assert vote.wait(store, key, 3, lambda: False) is vote.Verdict.COMMITTED


def test_a_closed_vote_aborts_for_everyone(store: dist.Store) -> None:
    key = vote.vote_key(1, 5)
    assert vote.cast(store, key, 3) is None
    assert vote.close(store, key, 3) is vote.Verdict.ABORTED
    assert vote.cast(store, key, 3) is vote.Verdict.ABORTED  # can't vote on a closed vote
    assert vote.wait(store, key, 3, lambda: False) is vote.Verdict.ABORTED
    assert vote.close(store, key, 3) is vote.Verdict.ABORTED  # a second closer knows it
    assert vote.close(store, vote.vote_key(1, 6), 3) is vote.Verdict.ABORTED  # nobody voted yet


def test_a_vote_filled_after_its_close_still_aborts(store: dist.Store) -> None:
    """Every member's vote is counted, the last two after the close: a later closer, which
    cannot tell from the count, learns the verdict the first closer published."""
    key = vote.vote_key(2, 5)
    assert vote.cast(store, key, 3) is None
    assert vote.close(store, key, 3) is vote.Verdict.ABORTED
    assert vote.cast(store, key, 3) is vote.Verdict.ABORTED
    assert vote.cast(store, key, 3) is vote.Verdict.ABORTED
    assert vote.close(store, key, 3) is vote.Verdict.ABORTED


def test_one_nonfinite_ballot_makes_a_full_vote_nonfinite_for_everyone(store: dist.Store) -> None:
    key = vote.vote_key(4, 5)
    assert vote.cast(store, key, 3) is None
    assert vote.cast(store, key, 3, vote.Ballot("rank 1: loss nan")) is None
    assert vote.cast(store, key, 3) is vote.Verdict.NONFINITE
    assert vote.wait(store, key, 3, lambda: False) is vote.Verdict.NONFINITE
    assert vote.close(store, key, 3) is vote.Verdict.NONFINITE  # full before its close
    assert vote.nonfinite_found(store, key) == "rank 1: loss nan"


def test_a_recompute_that_is_nonfinite_again_is_known_by_every_member(store: dist.Store) -> None:
    """Only one member remembers the step's first attempt (the others are a replacement and a
    member that never saw it end): every member learns it is the second, and what was found."""
    key = vote.vote_key(5, 5)
    assert vote.cast(store, key, 3, vote.Ballot("rank 0: gradients")) is None
    assert vote.cast(store, key, 3, vote.Ballot(again=True)) is None
    assert vote.cast(store, key, 3, vote.Ballot("rank 2: loss inf")) is vote.Verdict.NONFINITE_AGAIN
    assert vote.wait(store, key, 3, lambda: False) is vote.Verdict.NONFINITE_AGAIN
    assert vote.nonfinite_found(store, key) == "rank 0: gradients; rank 2: loss inf"
    # A member that remembers a step which is finite now commits it like any other.
    again = vote.vote_key(5, 6)
    assert vote.cast(store, again, 2, vote.Ballot(again=True)) is None
    assert vote.cast(store, again, 2) is vote.Verdict.COMMITTED


def test_a_nonfinite_vote_closed_before_it_filled_aborts(store: dist.Store) -> None:
    """A failure beats a non-finite step: the vote aborts, the step is recomputed after the
    recovery; a closer of a full non-finite vote reports it as it is."""
    key = vote.vote_key(6, 5)
    assert vote.cast(store, key, 2, vote.Ballot("rank 0: loss nan")) is None
    assert vote.close(store, key, 2) is vote.Verdict.ABORTED
    assert vote.cast(store, key, 2) is vote.Verdict.ABORTED
    full = vote.vote_key(6, 6)
    assert vote.cast(store, full, 2, vote.Ballot("rank 0: loss nan")) is None
    assert vote.cast(store, full, 2, vote.Ballot("rank 1: loss nan")) is vote.Verdict.NONFINITE
    assert vote.close(store, full, 2) is vote.Verdict.NONFINITE


def test_replicas_whose_digests_differ_make_a_full_vote_diverged(store: dist.Store) -> None:
    """Two shards of two replicas: shard 1's differ. A closer of the full vote, which cannot
    know whether its members compared, looks and agrees."""
    key = vote.vote_key(7, 9)
    ballots = ["0:aaaa", "1:bbbb", "0:aaaa", "1:cccc"]
    verdicts = [vote.cast(store, key, 4, vote.Ballot(digest=d)) for d in ballots]
    assert verdicts == [None, None, None, vote.Verdict.DIVERGED]
    assert vote.close(store, key, 4) is vote.Verdict.DIVERGED
    alike = vote.vote_key(7, 10)
    verdicts = [vote.cast(store, alike, 4, vote.Ballot(digest=d)) for d in ["0:a", "1:b"] * 2]
    assert verdicts[-1] is vote.Verdict.COMMITTED
    assert not vote.diverged("0:a;1:b;0:a;1:b;") and vote.diverged("0:a; 0:b;")


def test_a_count_tells_votes_nonfinite_ballots_and_closes_apart() -> None:
    """The largest world and every member non-finite stay below a close; closes stay apart."""
    world = vote.NONFINITE - 1
    count = world * (1 + vote.NONFINITE)
    assert count < vote.CLOSED
    assert vote._tally(count) == (0, world, world)
    assert vote._tally(3 * vote.CLOSED + count) == (3, world, world)
    assert (2 * world + 1) * vote.CLOSED + count < 1 << 63  # int64, with a closer per member


@pytest.mark.parametrize("closer", [False, True])
def test_members_voting_at_once_agree(job_store: JobStore, closer: bool) -> None:
    """Four members (each on its own client, as ranks are) vote at the same moment, with or
    without a closer among them: exactly one verdict, the same for every one of them."""
    world = 4
    key = vote.vote_key(3, int(closer))
    start = threading.Barrier(world + int(closer))
    verdicts: list[vote.Verdict] = []

    def member(close: bool) -> None:
        client = groups.connect_store(f"127.0.0.1:{job_store.port}", job_store.prefix)
        start.wait()
        verdict = vote.close(client, key, world) if close else vote.cast(client, key, world)
        verdicts.append(
            verdict if verdict is not None else vote.wait(client, key, world, lambda: False)
        )

    threads = [
        threading.Thread(target=member, args=(i == world,)) for i in range(world + int(closer))
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert len(verdicts) == world + int(closer)
    assert len(set(verdicts)) == 1
    if not closer:
        assert verdicts[0] is vote.Verdict.COMMITTED


def test_a_superseded_generation_releases_its_barrier(store: dist.Store) -> None:
    timeout = datetime.timedelta(seconds=5)
    barrier.supersede(store, barrier.name(3, "members"))
    assert barrier.wait(store, barrier.name(3, "members"), 2, timeout) is False
    assert barrier.wait(store, barrier.name(4, "members"), 1, timeout) is True
    barrier.supersede(store, barrier.name(4, "members"))  # too late: it passed
    assert barrier.wait(store, barrier.name(4, "members"), 1, timeout) is True


def test_a_group_that_lost_a_member_while_forming_is_given_up_when_superseded(
    job_store: JobStore,
) -> None:
    """Rank 1 passed the barrier and died before joining the group: rank 0 waits in the
    rendezvous (other threads run meanwhile: the heartbeats go on) until a newer generation is
    planned, then gives up at once instead of after the collective timeout."""
    client = groups.connect_store(f"127.0.0.1:{job_store.port}", job_store.prefix)
    newer_plan = threading.Event()
    timer = threading.Timer(0.3, newer_plan.set)  # a Python thread: it needs the GIL to run
    timer.start()
    with pytest.raises(dist.DistStoreError, match="generation 7 was superseded"):
        groups.build(client, 7, 0, 2, newer_plan.is_set)
    timer.join()


def _ranks(job_store: JobStore, work: Any, world: int = 2) -> list[Any]:
    results: list[Any] = [None] * world

    def rank(r: int) -> None:
        # One blocking waiter per client.
        client = groups.connect_store(f"127.0.0.1:{job_store.port}", job_store.prefix)
        group = groups.build(client, 0, r, world, lambda: False)
        results[r] = work(r, group)
        groups.drop(group)

    threads = [threading.Thread(target=rank, args=(r,)) for r in range(world)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    return results


def _replicated() -> dict[str, Any]:
    """A model and optimizer state: tensors large enough to travel alone, and small ones."""
    return {
        "model": {
            "w": torch.randn(700, 600),  # 1.6 MB: in place
            "steps": torch.tensor(9),
            "mask": torch.ones(2) > 0,
        },
        "optimizer": {
            "state": {0: {"exp_avg": torch.randn(5, dtype=torch.float64)}},
            "param_groups": [{"lr": 0.1, "params": [0]}],
        },
    }


def _assert_same(got: Any, want: Any) -> None:
    for (path, g), (_, w) in zip(transfer.leaves(got), transfer.leaves(want), strict=True):
        assert g.dtype == w.dtype and torch.equal(g, w), path


def test_transfer_moves_tensors_and_structure_exactly(job_store: JobStore) -> None:
    random.seed(7)
    replicated = _replicated()
    own = {"rng": rng.capture(), "committed_step": 41}

    def work(r: int, group: groups.Group) -> Any:
        if r == 0:
            return transfer.send(group, 1, replicated, own)
        return transfer.recv(group, [0])

    sent, received = _ranks(job_store, work)
    assert received.bytes == {0: sent} and sent > replicated["model"]["w"].nbytes
    assert received.own["committed_step"] == 41
    assert received.replicated["optimizer"]["param_groups"] == [{"lr": 0.1, "params": [0]}]
    _assert_same(received.replicated, replicated)
    assert torch.equal(received.own["rng"]["torch"], own["rng"]["torch"])
    assert received.own["rng"]["python"] == own["rng"]["python"]


def test_a_striped_transfer_lands_in_the_recipients_own_tensors(job_store: JobStore) -> None:
    """Two donors holding the same replica each send half; the recipient's tensors of the same
    form receive in place, those it lacks (here its optimizer state) are made."""
    replicated = _replicated()
    mine = _replicated()
    mine["optimizer"]["state"] = {}  # a fresh optimizer has no state yet
    weight = mine["model"]["w"]

    def work(r: int, group: groups.Group) -> Any:
        if r < 2:
            own = {"from": r} if r == 0 else None
            return transfer.send(group, 2, replicated, own, transfer.Stripe(r, 2))
        return transfer.recv(group, [0, 1], like=mine)

    first, second, received = _ranks(job_store, work, world=3)
    assert received.bytes == {0: first, 1: second}
    assert 0 < first - second < 1000  # halves, and the lead also sends the structure
    assert received.own == {"from": 0}
    _assert_same(received.replicated, replicated)
    assert received.replicated["model"]["w"].data_ptr() == weight.data_ptr()  # in place
    assert torch.equal(weight, replicated["model"]["w"])


def test_donors_of_different_states_are_refused(job_store: JobStore) -> None:
    other = _replicated()
    other["model"]["w"] = torch.randn(10)

    def work(r: int, group: groups.Group) -> Any:
        if r < 2:
            state = _replicated() if r == 0 else other
            with contextlib.suppress(RuntimeError):  # the recipient gives up on it
                transfer.send(group, 2, state, None, transfer.Stripe(r, 2))
            return None
        with pytest.raises(ProtocolError, match="states of different sizes"):
            transfer.recv(group, [0, 1])
        return None

    _ranks(job_store, work, world=3)


@pytest.mark.parametrize("garbler", [0, 1])
def test_a_bit_flipped_on_the_way_is_found_and_names_its_donor(
    job_store: JobStore, garbler: int
) -> None:
    """The ``garble`` fault: one donor flips a bit of what it sends (in a copy: its own state
    stays as it was); the recipient's sums differ from the lead's in that donor's stripe."""
    replicated = _replicated()
    before = copy.deepcopy(replicated)

    def work(r: int, group: groups.Group) -> Any:
        if r < 2:
            stripe = transfer.Stripe(r, 2)
            return transfer.send(group, 2, replicated, None, stripe, lambda: r == garbler)
        with pytest.raises(RestoreMismatch) as raised:
            transfer.recv(group, [0, 1], like=_replicated())
        return raised.value

    *_, mismatch = _ranks(job_store, work, world=3)
    assert mismatch.donors == [garbler] and mismatch.tensors == 1
    _assert_same(replicated, before)


def test_a_donor_whose_replica_differs_from_the_leads_is_named(job_store: JobStore) -> None:
    """Donor 1's state differs from the lead's in one element, the sizes alike: what it sends
    does not add up to the sums the lead sent."""
    replicated = _replicated()
    other = copy.deepcopy(replicated)
    other["model"]["w"][-1, -1] += 1.0  # the last bytes: donor 1's stripe

    def work(r: int, group: groups.Group) -> Any:
        if r < 2:
            state = replicated if r == 0 else other
            return transfer.send(group, 2, state, None, transfer.Stripe(r, 2))
        with pytest.raises(RestoreMismatch, match=r"sent by donor\(s\) \[1\]"):
            transfer.recv(group, [0, 1])
        return None

    _ranks(job_store, work, world=3)


@pytest.mark.parametrize("count", [1, 2, 3, 7])
def test_stripes_cover_every_byte_once(count: int) -> None:
    sizes = [5, 0, 3 << 20, 1, 17, 2 << 20]
    covered = [bytearray(size) for size in sizes]
    shares = []
    for index in range(count):
        pieces = transfer.stripe_pieces(sizes, transfer.Stripe(index, count))
        assert sorted(p for m in transfer.messages(pieces) for p in m) == pieces
        shares.append(sum(end - first for _, first, end in pieces))
        for tensor, first, end in pieces:
            covered[tensor][first:end] = bytes([1]) * (end - first)
    assert all(all(c) for c in covered)
    assert sum(shares) == sum(sizes) and max(shares) - min(shares) <= 1


def test_small_pieces_share_a_message_and_large_ones_travel_alone() -> None:
    big, small = transfer.BUCKET_BYTES, 100
    pieces = transfer.stripe_pieces([small, small, big, small], transfer.Stripe())
    assert transfer.messages(pieces) == [
        [(2, 0, big)],
        [(0, 0, small), (1, 0, small), (3, 0, small)],
    ]


def test_a_stripe_must_exist() -> None:
    with pytest.raises(ValueError, match="stripe 2 of 2 does not exist"):
        transfer.Stripe(2, 2)


def listening(pid: int) -> set[tuple[str, int]]:
    return {
        (c.laddr.ip, c.laddr.port)
        for c in psutil.Process(pid).net_connections("inet")
        if c.status == psutil.CONN_LISTEN
    }


def test_the_job_store_and_gloo_listen_on_loopback_only(
    job_store: JobStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    before = listening(os.getpid())
    assert ("127.0.0.1", job_store.port) in before  # torch alone would bind every address
    for name, value in job_store.environment().items():
        monkeypatch.setenv(name, value)
    opened = _ranks(job_store, lambda r, group: listening(os.getpid()))
    gloo = set().union(*opened) - before
    assert gloo and {ip for ip, _ in gloo} <= {"127.0.0.1", "::1"}


def test_a_client_without_the_job_secret_cannot_vote(job_store: JobStore) -> None:
    """It reaches the port, writes a full vote and its verdict under the public key names:
    the job's vote does not see them."""
    intruder = dist.TCPStore("127.0.0.1", job_store.port, is_master=False, timeout=TIMEOUT)
    key = vote.vote_key(0, 5)
    intruder.set(key, "3")
    intruder.set(f"{key}/verdict", vote.Verdict.COMMITTED.value)
    assert vote.cast(job_store.keys, key, 3) is None  # still waiting for two more
    assert vote.close(job_store.keys, key, 3) is vote.Verdict.ABORTED
