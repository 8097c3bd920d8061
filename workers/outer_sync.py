"""DiLoCo's outer step on one rank (``elastic.core.outer_rounds``): the round's start kept,
the pseudo-gradient summed with this position's rank in every other group, Nesterov SGD on the
global weights, and the inner optimizer's state zeroed; under streaming DiLoCo, each of these
for one fragment of the model's parameters at a time.

The outer momentum lives in the inner optimizer's state, one tensor per parameter beside its
own (``OUTER_MOMENTUM``), laid out like the parameter: a checkpoint, the memory tier and a heal
carry it with no code of their own, and a resume at another layout reshards it as DCP reshards
any optimizer state. The round's start weights are not state: at a round boundary they are the
weights, and each rank takes its copy as the round's first step begins (``begin_round``), after
whatever placed it there (a heal, a restore, the round before).

The pseudo-gradients travel in the gradients' own buffers: in fp32 or bf16 bucket by bucket,
through the cross-group sum the every-step mode uses for gradients (``workers.gradient_sum``);
in fp8 or int4 codes with a scale a block (``workers.quantized_sum``). A delayed outer step's
(``sync.sync_delay``) travel in buffers of their own, on a thread, over a channel of their own
(``World.outer_cross_group``), while the inner steps go on; a failure of it fails the step that
merges it.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from typing import NamedTuple

import torch
from torch.distributed.checkpoint.state_dict import _init_optim_state
from torch.distributed.tensor import DTensor
from torch.optim.sgd import sgd

from elastic.core.outer_rounds import OuterRounds, fragment_of
from workers.failures import OuterStepFailed
from workers.gradient_sum import GradientSum, SumTimes, local_gradient
from workers.quantized_sum import CODES, QuantizedSum

OUTER_MOMENTUM = "outer_momentum"


def _local(tensor: torch.Tensor) -> torch.Tensor:
    return tensor._local_tensor if isinstance(tensor, DTensor) else tensor


class _Delayed(NamedTuple):
    """A fragment's outer step sent at its turn, merged after the inner update of ``merge_after``."""

    fragment: int
    merge_after: int
    values: dict[int, torch.Tensor]  # by parameter id: the weighted pseudo-gradients, then their sum
    summed: Future  # the exchange on its thread: its seconds, or what it raised


class _Exchanged:
    """A delayed outer step's exchange seen as a collective's work, for the step's wait."""

    def __init__(self, summed: Future):
        self.summed = summed

    def is_completed(self) -> bool:
        return self.summed.done()

    def wait(self) -> None:
        error = self.summed.exception()
        if error is not None:
            raise error if isinstance(error, RuntimeError) else RuntimeError(str(error)) from error


class OuterSync:
    def __init__(self, rounds: OuterRounds, model: torch.nn.Module, optimizer: torch.optim.Optimizer,
                 whole_model: bool = True):
        """``whole_model``: the rank holds every block (no pipeline stages), so each fragment has
        some of its parameters."""
        self.rounds = rounds
        self.optimizer = optimizer
        named = [(name, param) for name, param in model.named_parameters() if param.requires_grad]
        self.trained = [param for _, param in named]
        # per fragment, its parameters' indices into ``trained`` (none, for a pipeline stage
        # without a block of it: every learner's rank at this position has none alike)
        placed = fragment_of([name for name, _ in named], rounds.fragments)
        self.fragments = [[index for index, fragment in enumerate(placed) if fragment == number]
                          for number in range(rounds.fragments)]
        if not all(self.fragments) and whole_model:
            raise ValueError(
                f"sync.fragments={rounds.fragments}: the model's parameters fall in "
                f"{sum(map(bool, self.fragments))} of them, which are cut by the transformer blocks' names "
                "(layers.<i>.); name the model's blocks so, or lower sync.fragments")
        self.exchanges = [self._exchange(self._params(fragment)) for fragment in range(rounds.fragments)]
        self.round_start: list[torch.Tensor] | None = None  # this rank's shards of the global weights
        # per fragment, the targets this learner counted since its last turn: they weigh its
        # pseudo-gradient
        self.own_tokens = [0] * rounds.fragments
        self.delayed: _Delayed | None = None  # a fragment's outer step in flight (``sync.sync_delay``)
        self._device = _local(self.trained[0]).device  # where the collectives' tensors are

    def _params(self, fragment: int) -> list[torch.nn.Parameter]:
        return [self.trained[index] for index in self.fragments[fragment]]

    def _exchange(self, params: list[torch.nn.Parameter], values=local_gradient) -> GradientSum | QuantizedSum:
        precision = self.rounds.precision
        if precision in CODES:
            return QuantizedSum(params, precision, values=values)
        return GradientSum(params, torch.bfloat16 if precision == "bf16" else torch.float32, overlap=False,
                           values=values)

    def begin_round(self) -> None:
        """The learners are alike (``OuterRounds.at_boundary``), or this learner joins the round in
        progress from the round's start (``sync.lost_learner = "drop"``): the weights now are the
        global ones."""
        with torch.no_grad():
            self.round_start = [_local(param).detach().clone() for param in self.trained]
        self.own_tokens = [0] * self.rounds.fragments
        # An outer step still in flight belongs to a state this one replaces (a restore, a
        # heal): given up, its thread left to end as its channel is closed. A step discarded
        # and tried again from the same state keeps it: its merge is still due.
        self.delayed = None

    def committed(self, own_tokens: int) -> None:
        """An inner step committed, counting ``own_tokens`` of this learner's."""
        self.own_tokens = [tokens + own_tokens for tokens in self.own_tokens]

    def handed_bytes(self, step: int, ranks: int) -> int:
        """What the outer steps after ``step`` hand a replicate group of ``ranks``."""
        return sum(self.exchanges[fragment].handed_bytes(ranks) for fragment in self.rounds.syncs_after(step)
                   if self.fragments[fragment])

    def after_update(self, step: int, replicate_group, outer_group, wait: Callable[[object], None]) -> SumTimes:
        """After ``step``'s inner update: the delayed outer step due now merged, then each fragment
        whose turn follows the step synced, or sent over ``outer_group`` to merge ``delay`` steps
        on. A sync: the learners' pseudo-gradients summed, each weighted by its share of the
        tokens since the fragment's last turn; the outer step on the fragment's global weights,
        which every learner takes (or mixes with its own, ``alpha``); the fragment's inner
        optimizer state zeroed. Raises ``OuterStepFailed`` from what a sum raised (``wait``:
        the step's deadline and the driver's abort), the rank then holding a state of no
        committed step: its group builds again. Returns the exchanges' seconds, and those the
        step waited for."""
        if self.round_start is None:
            raise RuntimeError("an outer step without the round's start: the round began before this rank held it")
        total, exposed = 0.0, 0.0
        if self.delayed is not None and self.delayed.merge_after == step:
            total, exposed = self._merge(wait)
        aligns = self.rounds.ends_at(step)
        for fragment in self.rounds.syncs_after(step):
            if not self.fragments[fragment]:
                continue
            if self.rounds.delayed_at(step):
                self._send(fragment, step, outer_group)
                continue
            try:
                times = self._sum_pseudo_gradients(fragment, replicate_group, wait)
            except Exception as error:
                raise OuterStepFailed(f"the outer step of fragment {fragment} failed: {error}") from error
            total, exposed = total + times.total_s, exposed + times.total_s
            self._take_outer_step(fragment, [local_gradient(param) for param in self._params(fragment)],
                                  0.0 if aligns else self.rounds.alpha)
        self.optimizer.zero_grad(set_to_none=False)
        if aligns:
            self.round_start = None  # the learners are alike: the next step begins a round
        return SumTimes(total, exposed)

    def _take_outer_step(self, fragment: int, summed: list[torch.Tensor], alpha: float) -> None:
        """Nesterov SGD on the fragment's global weights by the learners' summed pseudo-gradients;
        the learner takes them (``alpha`` of its own mixed in), its inner state of them zeroed."""
        params = self._params(fragment)
        starts = [self.round_start[index] for index in self.fragments[fragment]]
        momenta = [_local(self._momentum(param)) for param in params]
        with torch.no_grad():
            sgd(starts, summed, momenta, foreach=False, weight_decay=0.0, momentum=self.rounds.momentum,
                lr=self.rounds.lr, dampening=0.0, nesterov=True, maximize=False)
            for param, global_weights in zip(params, starts):
                if alpha:
                    _local(param).mul_(alpha).add_(global_weights, alpha=1.0 - alpha)
                else:
                    _local(param).copy_(global_weights)
        self._zero_inner_state(params)

    def _weighted_pseudo_gradients(self, fragment: int, into: list[torch.Tensor], weight: float | None) -> None:
        """The fragment's pseudo-gradients written into ``into``, times ``weight`` (None: the
        caller weighs them later, once the learners' tokens are summed)."""
        indices = self.fragments[fragment]
        with torch.no_grad():
            torch._foreach_copy_(into, [self.round_start[index] for index in indices])
            torch._foreach_sub_(into, [_local(self.trained[index]) for index in indices])
            if weight is not None:
                torch._foreach_mul_(into, weight)

    def _sum_pseudo_gradients(self, fragment: int, replicate_group, wait: Callable[[object], None]) -> SumTimes:
        """Every learner's pseudo-gradient of ``fragment`` weighted by its share of the tokens
        (summed first: a learner dropped from the round counts none), summed into the gradients."""
        own, self.own_tokens[fragment] = self.own_tokens[fragment], 0
        weight = _weight(own, replicate_group, wait, self._device)
        self._weighted_pseudo_gradients(fragment, [local_gradient(param) for param in self._params(fragment)], weight)
        if replicate_group is None:
            return SumTimes(0.0, 0.0)
        exchange = self.exchanges[fragment]
        exchange.start(replicate_group)
        return exchange.finish(wait)

    def _send(self, fragment: int, step: int, outer_group) -> None:
        """The fragment's pseudo-gradients, in buffers of their own (the inner steps go on in the
        gradients'), summed on a thread over the outer channel: its own connections, so the
        later steps' collectives do not queue behind it, and the only user of them, so every
        rank issues its collectives in one order. Weighted as a synced fragment's are."""
        if self.delayed is not None:
            raise RuntimeError(f"fragment {fragment}'s outer step sent before fragment {self.delayed.fragment}'s merged")
        own, self.own_tokens[fragment] = self.own_tokens[fragment], 0
        params = self._params(fragment)
        values = {id(param): torch.empty_like(_local(param)) for param in params}
        self._weighted_pseudo_gradients(fragment, [values[id(param)] for param in params], None)
        exchange = self._exchange(params, values=lambda param: values[id(param)])
        summed: Future = Future()

        def exchange_on_thread() -> None:
            try:
                started = time.perf_counter()
                weight = _weight(own, outer_group, lambda work: work.wait(), self._device)
                with torch.no_grad():
                    torch._foreach_mul_(list(values.values()), weight)
                if outer_group is not None:
                    exchange.start(outer_group)
                    exchange.finish(lambda work: work.wait())
                summed.set_result(time.perf_counter() - started)
            except BaseException as error:  # noqa: BLE001 - the merge raises it
                summed.set_exception(error)

        threading.Thread(target=exchange_on_thread, name=f"outer-step-{step}-fragment-{fragment}", daemon=True).start()
        self.delayed = _Delayed(fragment, step + self.rounds.delay, values, summed)

    def _merge(self, wait: Callable[[object], None]) -> tuple[float, float]:
        """The delayed outer step due now: its exchange awaited, then taken as a synced one is."""
        delayed, self.delayed = self.delayed, None
        waiting = time.perf_counter()
        try:
            wait(_Exchanged(delayed.summed))
        except Exception as error:
            raise OuterStepFailed(f"the outer step of fragment {delayed.fragment} failed: {error}") from error
        exposed = time.perf_counter() - waiting
        self._take_outer_step(delayed.fragment, [delayed.values[id(param)] for param in self._params(delayed.fragment)],
                              self.rounds.alpha)
        return delayed.summed.result(), exposed

    def hold_momentum(self) -> None:
        """Before a checkpoint loads: DCP loads the optimizer state the optimizer holds places
        for, so a model just built gets its inner optimizer's (DCP's own step with zero
        gradients at lr 0 makes them) and the outer momentum's."""
        _init_optim_state(self.optimizer)
        for param in self.trained:
            self._momentum(param)

    def _momentum(self, param: torch.Tensor) -> torch.Tensor:
        state = self.optimizer.state[param]
        if OUTER_MOMENTUM not in state:
            state[OUTER_MOMENTUM] = torch.zeros_like(param)
        return state[OUTER_MOMENTUM]

    def _zero_inner_state(self, params: list[torch.nn.Parameter]) -> None:
        """Every learner goes on from an outer step with the same inner state of its parameters:
        zeros (for Adam's family, its state as new), the step count included."""
        with torch.no_grad():
            for param in params:
                for key, value in self.optimizer.state[param].items():
                    if key != OUTER_MOMENTUM and torch.is_tensor(value):
                        value.zero_()


def _weight(own_tokens: int, replicate_group, wait: Callable[[object], None], device: torch.device) -> float:
    """This learner's share of the tokens every learner counted (one, with no other group)."""
    tokens = torch.tensor([float(own_tokens)], dtype=torch.float64, device=device)
    if replicate_group is not None:
        wait(replicate_group.allreduce([tokens]))
    return own_tokens / tokens.item() if tokens.item() else 0.0
