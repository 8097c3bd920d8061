"""The Ray edge of the driver: the calls it makes to rank actors.

Every Ray call of the driver lives here or in ``elastic.fleet.rank_processes`` (placement, starting
and killing ranks and spares): starting a segment and reading its stream, pausing, probing and
aborting, evaluations, copying state, the memory tier, checkpoint calls. A rank's run is a
streaming generator that goes on from segment to segment: the next segment reaches the ranks
that wait in theirs as one write to the run's store (``waiting_ranks``), and only a rank
without one (new, rebuilt, or released for a call) gets a call; its steps make no call at all.
The controller and the checkpoint coordinator speak to ranks only through these methods, in
plain data (ranks, requests, reports), so a fake fleet drives them in tests without Ray.
Failures come back as the two exceptions of ``elastic.fleet.api``, which names the interface
the controller uses. Every control call has a deadline: ``collective_timeout_s`` plus a
margin for the quick ones (the cross-group rebuild), ``state_timeout_s`` for those that move the state (heal, save, restore).
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Iterable

import ray
from ray import ObjectRefGenerator
from ray.exceptions import GetTimeoutError, RayActorError, RayError, RayTaskError

from checkpointing.manifest import UnloadableCheckpoint
from elastic.fleet.api import CallFailed, HealCopy, Pending, RanksLost, SegmentStream
from elastic.core.memory_tier import Holdings, MemoryRestore
from elastic.core.protocol import (
    EvalRequest,
    Failure,
    HookFailed,
    RECORD_MESSAGES,
    RankActivity,
    RankOutcome,
    SegmentEnd,
    SegmentMessage,
    SegmentSpec,
    describe_error,
)
from elastic.fleet.rank_processes import RankProcesses, start_error
from elastic.fleet.waiting_ranks import WaitingRanks

# A quick control call (the cross-group rebuild) gets the collective timeout plus this margin.
CONTROL_MARGIN_S = 30.0
# A live rank answers what its memory tier holds on its control thread, in milliseconds.
HOLDINGS_TIMEOUT_S = 2.0
# Each heal's number, in the prefix of its pair groups on the run's store: unique while the
# driver's process (and with it the store) lives.
HEALS = itertools.count()


class Fleet(RankProcesses):
    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        # the rendezvous looked up at each write: a fleet built without one (a placement test) writes nothing
        self.waiting = WaitingRanks(lambda attempt, release, word: self.rendezvous.hand_off(attempt, release, word),
                                    self.topology.group_of)

    def kill(self, global_rank: int) -> None:
        self.waiting.forget(global_rank)
        super().kill(global_rank)

    def build(self, ranks, world_build: int) -> Pending:
        return self._call(ranks, "build", world_build)

    def alive(self, rank: int, timeout: float = 5.0) -> bool:
        return rank in self.responsive([rank], timeout)

    def responsive(self, ranks, timeout: float = 5.0) -> set[int]:
        """The ranks whose processes answer within ``timeout``, asked all at once."""
        return set(self._answers(ranks, "node", timeout))

    def _answers(self, ranks, method: str, timeout: float) -> dict[int, object]:
        """What the ranks that answer ``method`` within ``timeout`` answered, asked all at once."""
        refs = {getattr(self.actors[rank], method).remote(): rank for rank in ranks if rank in self.actors}
        ready, _ = ray.wait(list(refs), num_returns=len(refs), timeout=timeout) if refs else ([], [])
        answered = {}
        for ref in ready:
            try:
                answered[refs[ref]] = ray.get(ref, timeout=0)
            except RayError:
                continue
        return answered

    # calls in flight

    def _training_threads(self, ranks: Iterable[int]) -> dict[int, ray.actor.ActorHandle]:
        """The actors of ``ranks``, for calls on their training threads: each released first,
        with its group, from a wait for its next segment, which such a call would queue behind.
        Every training-thread call but a segment's ``run`` takes its actors from here."""
        ranks = list(ranks)
        self.waiting.release(ranks)
        return {rank: self.actors[rank] for rank in ranks}

    def _call(self, ranks, method: str, *args) -> Pending:
        """``method`` on the training thread of each of ``ranks``."""
        actors = self._training_threads(ranks)
        return Pending({rank: getattr(actor, method).remote(*args) for rank, actor in actors.items()})

    def done(self, pending: Pending, timeout: float = 0.0) -> bool:
        refs = list(pending.refs.values())
        ready, _ = ray.wait(refs, num_returns=len(refs), timeout=timeout)
        return len(ready) == len(refs)

    def answered(self, pending: Pending) -> int:
        """How many of the calls have returned, now: a start's progress, rank by rank."""
        refs = list(pending.refs.values())
        ready, _ = ray.wait(refs, num_returns=len(refs), timeout=0)
        return len(ready)

    def results(self, pending: Pending, timeout: float | None = None, call: str = "") -> dict[int, object]:
        """Every rank's result, waited for together until ``timeout``; ``RanksLost`` names
        every rank whose process is gone, and ``CallFailed`` every living rank that raised or
        did not answer in time. Any Ray error counts: a task error, out of memory, a timeout."""
        refs = list(pending.refs.values())
        ready, _ = ray.wait(refs, num_returns=len(refs), timeout=timeout)
        ready = set(ready)
        results, lost, failed, own_errors, unloadable = {}, {}, {}, {}, {}
        for rank, ref in pending.refs.items():
            if ref not in ready:
                failed[rank] = f"no answer within {timeout:.0f}s"
                continue
            try:
                results[rank] = ray.get(ref, timeout=0)
            except RayActorError as error:
                if raised := start_error(error):
                    failed[rank] = own_errors[rank] = raised
                else:
                    lost[rank] = describe_error(error, 300)
            except RayTaskError as error:
                if isinstance(error.cause, HookFailed):  # its own one line, not Ray's traceback
                    failed[rank] = own_errors[rank] = str(error.cause)
                elif isinstance(error.cause, UnloadableCheckpoint):
                    failed[rank] = unloadable[rank] = str(error.cause)
                else:
                    failed[rank] = describe_error(error, 500)
            except (RayError, GetTimeoutError) as error:
                failed[rank] = describe_error(error, 500)
        if lost:
            raise RanksLost(list(lost), "; ".join(f"rank {r}: {e}" for r, e in sorted(lost.items())), call)
        if failed:
            raise CallFailed(list(failed), "; ".join(f"rank {r}: {e}" for r, e in sorted(failed.items())), call,
                             own_errors, unloadable)
        return results

    # runs

    def start_segment(self, specs: dict[int, SegmentSpec]) -> SegmentStream:
        """Start a segment on every rank: one write for the ranks that wait in their streams,
        a call to each other rank (a spec shared by ranks is sent once)."""
        shared: dict[int, ray.ObjectRef] = {}

        def run(rank: int) -> ObjectRefGenerator:
            ref = shared.setdefault(id(specs[rank]), ray.put(specs[rank]))
            return self.actors[rank].run.options(num_returns="streaming").remote(ref)

        # the calls first: should one raise, no waiting rank has started a segment nobody watches
        generators = {rank: run(rank) for rank in specs if rank not in self.waiting.streams}
        generators |= self.waiting.hand_on(specs)
        generators |= {rank: run(rank) for rank in specs if rank not in generators}  # released by hand_on
        return SegmentStream(next(iter(specs.values())).attempt, dict(sorted(generators.items())))

    def next_messages(self, stream: SegmentStream, timeout: float,
                      ranks: Iterable[int] | None = None) -> list[tuple[int, SegmentMessage | None]]:
        """The messages that arrive within ``timeout`` (at least one unless it passes), one
        per rank at most, from ``ranks`` (default: every rank still in the stream); ``None``
        for a rank whose process is gone. A rank leaves the stream with its ``SegmentEnd``."""
        watched = stream.generators if ranks is None else {
            rank: stream.generators[rank] for rank in ranks if rank in stream.generators}
        generators = list(watched.values())
        if not generators:
            return []
        ready, rest = ray.wait(generators, num_returns=1, timeout=max(0.0, timeout))
        if ready and rest:
            ready += ray.wait(rest, num_returns=len(rest), timeout=0)[0]
        rank_of = {id(generator): rank for rank, generator in watched.items()}
        arrived = []
        for generator in ready:
            rank = rank_of[id(generator)]
            message = self._next_message(rank, generator)
            if not isinstance(message, RECORD_MESSAGES):
                del stream.generators[rank]
                if isinstance(message, SegmentEnd) and message.waits_for_next:
                    self.waiting.add(rank, stream.attempt, generator)
            arrived.append((rank, message))
        return arrived

    @staticmethod
    def _next_message(rank: int, generator: ObjectRefGenerator) -> SegmentMessage | None:
        try:
            return ray.get(next(generator))
        except (StopIteration, RayActorError):
            return None
        except RayError as error:  # the segment itself raised: a defect, reported as the rank's failure
            return SegmentEnd(rank, -1, RankOutcome(rank, -1, error=describe_error(error), failure=Failure.OWN_COMPUTE,
                                                    group_broken=True))

    def request_pause(self, ranks, attempt: int) -> None:
        for rank in ranks:
            if rank in self.actors:
                self.actors[rank].request_pause.remote(attempt)

    # evaluations

    def evaluate(self, requests: dict[int, EvalRequest]) -> Pending:
        actors = self._training_threads(requests)
        return Pending({rank: actors[rank].evaluate.remote(request) for rank, request in requests.items()})

    def next_outcomes(self, pending: Pending, timeout: float) -> list[tuple[int, RankOutcome | None]]:
        """Reports that arrive within ``timeout`` (at least one unless it passes), taken out
        of ``pending``; ``None`` for a rank whose process is gone."""
        rank_of = {ref: rank for rank, ref in pending.refs.items()}
        ready, _ = ray.wait(list(rank_of), num_returns=1, timeout=max(0.0, timeout))
        arrived = []
        for ref in ready:
            rank = rank_of[ref]
            del pending.refs[rank]
            try:
                arrived.append((rank, ray.get(ref)))
            except RayError:
                arrived.append((rank, None))
        return arrived

    def end_attempt(self, attempt: int) -> None:
        """One key in the run's store, whatever the number of ranks (``workers.attempt_watch``)."""
        self.rendezvous.end_attempt(attempt)

    def release_step(self, ranks, attempt: int) -> None:
        for rank in ranks:
            if rank in self.actors:
                self.actors[rank].release_step.remote(attempt)

    def probe(self, ranks, timeout: float) -> dict[int, RankActivity]:
        refs = {rank: self.actors[rank].probe.remote() for rank in ranks if rank in self.actors}
        activity = {}
        for rank, ref in refs.items():
            try:
                activity[rank] = ray.get(ref, timeout=timeout)
            except (GetTimeoutError, RayError):
                continue
        return activity

    # state

    @property
    def quick_call_s(self) -> float:
        return self.config.fault_tolerance.collective_timeout_s + CONTROL_MARGIN_S

    @property
    def state_call_s(self) -> float:
        return self.config.fault_tolerance.state_timeout_s

    def copy_state(self, pairs: list[tuple[int, int]]) -> list[HealCopy]:
        """Copy each source rank's committed state into its target rank, rank to rank: each
        source streams it to all its targets at once (``RankWorker.send_state`` and
        ``receive_state``, called together). A pair whose transfer failed on either side
        (raised, as a checksum that did not match does, or did not answer in time) is copied
        through the object store instead (``export_state`` → ``import_state``), and its
        ``HealCopy.fallback`` says why. A rank whose process is gone leaves its pairs no road:
        ``RanksLost``, as any state call."""
        heal = next(HEALS)
        actors = self._training_threads(rank for pair in pairs for rank in pair)
        targets: dict[int, list[int]] = {}
        for source, target in pairs:
            targets.setdefault(source, []).append(target)
        sends = {source: actors[source].send_state.remote(heal, ranks) for source, ranks in targets.items()}
        receives = {target: actors[target].receive_state.remote(heal, source) for source, target in pairs}
        deadline = time.monotonic() + self.state_call_s
        copies: dict[int, HealCopy] = {}
        failed: dict[int, tuple[int, str]] = {}
        lost: dict[int, str] = {}
        for source, target in pairs:
            calls = Pending({source: sends[source], target: receives[target]})
            try:
                received = self.results(calls, max(0.0, deadline - time.monotonic()), "receive_state")
                copies[target] = HealCopy(source, target, received[target])
            except RanksLost as error:
                lost.update(dict.fromkeys(error.ranks, str(error)))
            except CallFailed as error:
                failed[target] = (source, str(error))
        if lost:
            raise RanksLost(list(lost), "; ".join(dict.fromkeys(lost.values())), "receive_state")
        imported = self.results(Pending({
            target: actors[target].import_state.remote(actors[source].export_state.remote())
            for target, (source, _) in failed.items()
        }), self.state_call_s, "import_state") if failed else {}
        for target, (source, reason) in failed.items():
            copies[target] = HealCopy(source, target, imported[target], fallback=reason)
        return [copies[target] for _, target in pairs]

    def local_parameters(self, ranks) -> dict[int, list]:
        return self.results(self._call(ranks, "local_parameters"), self.state_call_s, "local_parameters")

    # the memory tier

    def set_buddies(self, buddies: dict[int, int | None]) -> None:
        """Tell each rank which rank keeps the copies of its state in memory (None: none)."""
        self.results(Pending({
            rank: self.actors[rank].set_buddy.remote(None if buddy is None else self.actors[buddy])
            for rank, buddy in buddies.items()
        }), self.quick_call_s, "set_buddy")

    def memory_holdings(self, ranks) -> dict[int, Holdings]:
        """What each rank holds in host memory; a rank that is gone, or still starting (a fresh
        process holds nothing), does not answer in time and is left out."""
        return self._answers(ranks, "memory_holdings", HOLDINGS_TIMEOUT_S)

    def restore_memory(self, plan: MemoryRestore) -> None:
        """Every rank of ``plan`` back at its step: from its own copy, or a holder's copy of its state."""
        actors = self._training_threads([*plan.own, *(owner for _, owner in plan.transfers)])
        own = {rank: actors[rank].restore_memory.remote(plan.step) for rank in plan.own}
        transfers = {owner: actors[owner].import_held.remote(self.actors[holder].export_held.remote(
            owner, plan.step)) for holder, owner in plan.transfers}
        self.results(Pending(own | transfers), self.state_call_s, "restore_memory")

    # checkpoints

    def save(self, ranks, url: str) -> None:
        """Stage the ranks' committed state for an upload to ``url`` (the training stall)."""
        self.results(self._call(ranks, "save_checkpoint", url), self.state_call_s, "save_checkpoint")

    def finish_saves(self, ranks) -> Pending:
        # on the rank's checkpoint thread: it does not wait behind the training thread
        return Pending({rank: self.actors[rank].finish_checkpoint.remote() for rank in ranks})

    def abandon_saves(self, ranks) -> None:
        """End the ranks' uploads of a save given up on: each kills its upload process."""
        self.results(Pending({
            rank: self.actors[rank].abandon_checkpoint.remote() for rank in ranks if rank in self.actors
        }), self.quick_call_s, "abandon_checkpoint")

    def restore(self, ranks, url: str, step: int, generators: dict[int, dict[str, bytes] | None]) -> None:
        """Load the checkpoint at ``url`` (of ``step``) into the ranks, each with its saved
        generator states (``None``: restart its stream from the seed and ``step``)."""
        actors = self._training_threads(ranks)
        self.results(Pending({
            rank: actors[rank].load_checkpoint.remote(url, step, generators[rank]) for rank in actors
        }), self.state_call_s, "load_checkpoint")

