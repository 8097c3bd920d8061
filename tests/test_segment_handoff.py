"""The next segment as one write to the run's store (``workers.segment_handoff``,
``elastic.fleet.waiting_ranks``): the driver's side over plain data, the ranks' side on a real
loopback store, and a real run whose survivors of a failure get their next segment without a
call of their own."""

from __future__ import annotations

import pickle
import threading
from dataclasses import replace

import pytest
import torch.distributed as dist

from elastic import ElasticTrainer
from elastic.core.events import EventKind
from elastic.core.protocol import NextSegment, ReleaseWaiting
from elastic.fleet.rendezvous import Rendezvous
from elastic.fleet.waiting_ranks import WaitingRanks
from elastic.testing.losses import max_relative_difference
from tests.reference import reference_run
from tests.test_segment_loop import segment_spec
from tests.test_step_transaction import rank_spec
from tests.tiny import FAST_DETECTION, tiny_config
from workers.keyed_store import KeyedStore
from workers.segment_handoff import SegmentHandoff, encode, next_segment_key
from workers.world import connect_store

SHARD = 2  # ranks per group in the driver's side's cases


class Written:
    """The words the driver wrote, by key, as the ranks would read them."""

    def __init__(self):
        self.words: dict[tuple[int, int], object] = {}

    def __call__(self, attempt: int, release: int, word: bytes) -> None:
        assert (attempt, release) not in self.words, "a word is written once"
        self.words[attempt, release] = pickle.loads(word)


def waiting(ranks: int, attempt: int = 7) -> tuple[WaitingRanks, Written]:
    written = Written()
    ranks_waiting = WaitingRanks(written, lambda rank: rank // SHARD)
    for rank in range(ranks):
        ranks_waiting.add(rank, attempt, f"stream{rank}")
    return ranks_waiting, written


def test_the_next_segment_reaches_every_waiting_rank_in_one_write_and_the_left_out_groups_return():
    ranks, written = waiting(8)
    spec = replace(segment_spec(groups=4), group_weights={0: 1.0, 1: 1.0, 2: 1.0})  # group 3 broke
    specs = dict.fromkeys(range(6), spec)
    streams = ranks.hand_on(specs)
    assert streams == {rank: f"stream{rank}" for rank in range(6)}
    assert list(written.words) == [(7, 0)]
    assert written.words[7, 0] == NextSegment(spec, {})
    assert not ranks.streams


def test_a_rank_with_a_spec_of_its_own_gets_it_in_the_same_write():
    ranks, written = waiting(4)
    spec = segment_spec(groups=2)
    faulted = replace(spec, deadline_s=99.0)
    streams = ranks.hand_on({0: spec, 1: spec, 2: faulted, 3: spec})
    assert sorted(streams) == [0, 1, 2, 3]
    assert written.words[7, 0] == NextSegment(spec, {2: faulted})


def test_a_call_releases_its_ranks_groups_and_the_others_wait_on_for_the_next_word():
    ranks, written = waiting(6)
    ranks.release([4])  # a build for group 2
    assert written.words[7, 0] == ReleaseWaiting(frozenset({2}))
    assert sorted(ranks.streams) == [0, 1, 2, 3]
    ranks.release([5])  # that group is released already: nothing to write
    assert len(written.words) == 1
    spec = segment_spec(groups=3)
    streams = ranks.hand_on(dict.fromkeys(range(6), spec))
    assert sorted(streams) == [0, 1, 2, 3]  # group 2's ranks get a call each
    assert written.words[7, 1] == NextSegment(spec, {})


def test_ranks_a_segment_leaves_out_of_its_own_groups_are_released_before_it_is_handed_on():
    ranks, written = waiting(4)
    spec = segment_spec(groups=2)
    streams = ranks.hand_on({0: spec, 1: spec, 2: spec})  # rank 3 left out: its group is called
    assert sorted(streams) == [0, 1]
    assert written.words[7, 0] == ReleaseWaiting(frozenset({1}))
    assert written.words[7, 1] == NextSegment(spec, {})


def test_a_rank_ended_forgotten_and_waiting_ranks_of_an_older_attempt_released():
    ranks, written = waiting(4, attempt=7)
    ranks.forget(3)
    ranks.add(3, 8, "stream3 again")  # a rank of attempt 8 arrives while 7's still wait
    assert written.words[7, 0] == ReleaseWaiting(None)
    assert ranks.streams == {3: "stream3 again"} and ranks.attempt == 8
    streams = ranks.hand_on({0: segment_spec(groups=2)})  # no waiting rank is in it
    assert streams == {}
    assert written.words[8, 0] == ReleaseWaiting(None)


# the ranks' side, on a real store


@pytest.fixture
def rendezvous() -> Rendezvous:
    return Rendezvous.start("127.0.0.1")


def rank_waits(rendezvous: Rendezvous, global_rank: int, group: int, attempt: int) -> dict:
    """A rank's wait after ``attempt``, on a thread, connecting as a rank does; its answer lands in the dict."""
    spec = replace(rank_spec(global_rank, group=group, group_rank=0, shard=1, port=rendezvous.port),
                   store_secret=rendezvous.secret)
    handoff = SegmentHandoff(connect_store(spec))
    answer: dict = {}

    def wait() -> None:
        try:
            answer["spec"] = handoff.next_spec(attempt, global_rank, group)
        except Exception as error:  # noqa: BLE001 - the test reads it
            answer["error"] = error

    answer["thread"] = thread = threading.Thread(target=wait, daemon=True)
    thread.start()
    return answer


def answered(answer: dict, seconds: float = 5.0) -> dict:
    answer["thread"].join(seconds)
    assert not answer["thread"].is_alive(), "the rank still waits"
    return answer


def test_ranks_read_their_next_segment_or_return_from_the_drivers_words(rendezvous):
    stays, released, broken = (rank_waits(rendezvous, rank, group, 5) for rank, group in ((0, 0), (1, 1), (2, 2)))
    rendezvous.hand_off(5, 0, encode(ReleaseWaiting(frozenset({1}))))
    assert answered(released)["spec"] is None
    assert stays["thread"].is_alive() and broken["thread"].is_alive()
    spec = segment_spec(groups=2)
    own = replace(spec, deadline_s=1.5)
    rendezvous.hand_off(5, 1, encode(NextSegment(spec, {0: own})))
    assert answered(stays)["spec"] == own
    assert answered(broken)["spec"] is None  # group 2 is not in the segment


def test_a_word_without_the_runs_secret_is_refused_and_the_rank_leaves_its_stream(rendezvous, caplog):
    """A client that reaches the store without the secret cannot hand a rank a segment: under the
    key's plain name nothing is read, and a value it plants under the run's key is refused; the
    rank leaves its stream (the driver reads that as the rank gone, and replaces it), and says why."""
    answer = rank_waits(rendezvous, 0, 0, 5)
    dist.TCPStore("127.0.0.1", rendezvous.port, is_master=False, wait_for_workers=False).set(
        next_segment_key(5, 0), encode(NextSegment(segment_spec(groups=1))))
    answer["thread"].join(0.3)
    assert answer["thread"].is_alive(), "a foreign key under the plain name is not the run's"
    hashed = KeyedStore(rendezvous.store, rendezvous.secret)._key(next_segment_key(5, 0))
    rendezvous.store.set(hashed, encode(NextSegment(segment_spec(groups=1))) + bytes(32))
    assert answered(answer) == {"spec": None, "thread": answer["thread"]}
    assert "was not written by this run" in caplog.text


# a real run


def test_the_survivors_of_a_failure_step_on_in_their_streams_without_a_call_each(ray_cluster, tmp_path, monkeypatch):
    """Three groups, a rank of the last killed: the next segment reaches the four surviving
    ranks in one write to the store (as after a planned pause it reaches all six), the killed
    group's survivor returns (a build that follows reaches it: tests/test_faults.py's runs wait
    for their groups to come back), and the losses stay a single process's."""
    handed: list[tuple[int, list[int]]] = []
    hand_on = WaitingRanks.hand_on

    def recorded(self, specs):
        streams = hand_on(self, specs)
        handed.append((next(iter(specs.values())).first_step, sorted(streams)))
        return streams

    monkeypatch.setattr(WaitingRanks, "hand_on", recorded)
    steps = 10
    config = tiny_config(tmp_path, groups=3, min_groups=1, shard=2, steps=steps, global_batch=12,
                         fault_tolerance__inject="kill:rank=4,step=4", checkpoint__every=0, **FAST_DETECTION)
    result = ElasticTrainer(config).fit()
    assert result.ok, result.exit
    events = result.summary["events"]
    [discarded] = [e for e in events if e["kind"] == EventKind.STEP_DISCARDED]
    assert discarded["step"] == 4
    # step 4 begins two segments: one at the boundary the injected fault plans (all six ranks
    # go on from the pause), and one after the failure (the four surviving ranks)
    assert [ranks for first_step, ranks in handed if first_step == 4] == [list(range(6)), [0, 1, 2, 3]], handed
    reference, _ = reference_run(config, steps)
    assert max_relative_difference(result.losses, reference) <= 1e-5
