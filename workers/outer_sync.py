"""DiLoCo's outer step on one rank (``elastic.core.outer_rounds``): the round's start kept,
the pseudo-gradient summed with this position's rank in every other group, Nesterov SGD on the
global weights, and the inner optimizer's state zeroed.

The outer momentum lives in the inner optimizer's state, one tensor per parameter beside its
own (``OUTER_MOMENTUM``), laid out like the parameter: a checkpoint, the memory tier and a heal
carry it with no code of their own, and a resume at another layout reshards it as DCP reshards
any optimizer state. The round's start weights are not state: at a round boundary they are the
weights, and each rank takes its copy as the round's first step begins (``begin_round``), after
whatever placed it there (a heal, a restore, the round before).

The pseudo-gradients travel in the gradients' own buffers: in fp32 or bf16 bucket by bucket,
through the cross-group sum the every-step mode uses for gradients (``workers.gradient_sum``);
in fp8 or int4 codes with a scale a block (``workers.quantized_sum``).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch.distributed.checkpoint.state_dict import _init_optim_state
from torch.distributed.tensor import DTensor
from torch.optim.sgd import sgd

from elastic.core.outer_rounds import OuterRounds
from workers.failures import OuterStepFailed
from workers.gradient_sum import GradientSum, SumTimes, local_gradient
from workers.quantized_sum import CODES, QuantizedSum

OUTER_MOMENTUM = "outer_momentum"


def _local(tensor: torch.Tensor) -> torch.Tensor:
    return tensor._local_tensor if isinstance(tensor, DTensor) else tensor


class OuterSync:
    def __init__(self, rounds: OuterRounds, model: torch.nn.Module, optimizer: torch.optim.Optimizer):
        self.rounds = rounds
        self.optimizer = optimizer
        self.trained = [param for param in model.parameters() if param.requires_grad]
        self.exchange = (QuantizedSum(self.trained, rounds.precision) if rounds.precision in CODES else
                         GradientSum(model, torch.bfloat16 if rounds.precision == "bf16" else torch.float32,
                                     overlap=False))
        self.round_start: list[torch.Tensor] | None = None  # this rank's shards of the global weights
        self.own_tokens = 0  # the round's targets this learner counted: they weigh its pseudo-gradient

    def begin_round(self) -> None:
        """The round's first step begins, or this learner's first in a round it joined (from the
        round's start, ``sync.lost_learner = "drop"``): the weights now are the round's global ones."""
        with torch.no_grad():
            self.round_start = [_local(param).detach().clone() for param in self.trained]
        self.own_tokens = 0

    def committed(self, own_tokens: int) -> None:
        """An inner step committed, counting ``own_tokens`` of this learner's."""
        self.own_tokens += own_tokens

    def outer_step(self, replicate_group, wait: Callable[[object], None]) -> SumTimes:
        """After the round's last inner step is applied: the learners' pseudo-gradients summed,
        each weighted by its share of the round's tokens, then the outer step on the global
        weights, which every learner takes; the inner optimizer's state zeroed. Raises
        ``OuterStepFailed`` from what the sum raised (``wait``: the step's deadline and the
        driver's abort), the rank then holding its round's last inner update, of no committed
        step: its group builds again."""
        if self.round_start is None:
            raise RuntimeError("an outer step without the round's start: the round began before this rank held it")
        try:
            times = self._sum_pseudo_gradients(replicate_group, wait)
        except Exception as error:
            raise OuterStepFailed(f"the round's outer step failed: {error}") from error
        momenta = [_local(self._momentum(param)) for param in self.trained]
        with torch.no_grad():
            sgd(self.round_start, [local_gradient(param) for param in self.trained], momenta, foreach=False, weight_decay=0.0, momentum=self.rounds.momentum,
                lr=self.rounds.lr, dampening=0.0, nesterov=True, maximize=False)
            for param, global_weights in zip(self.trained, self.round_start):
                _local(param).copy_(global_weights)
        self._zero_inner_state()
        self.optimizer.zero_grad(set_to_none=False)
        self.round_start = None
        return times

    def _sum_pseudo_gradients(self, replicate_group, wait: Callable[[object], None]) -> SumTimes:
        """Every learner's pseudo-gradient weighted by its share of the round's tokens (summed
        first: a learner dropped from the round counts none), summed into the gradients."""
        tokens = torch.tensor([float(self.own_tokens)], dtype=torch.float64)
        if replicate_group is not None:
            wait(replicate_group.allreduce([tokens]))
        weight = self.own_tokens / tokens.item() if tokens.item() else 0.0
        pseudo = [local_gradient(param) for param in self.trained]
        with torch.no_grad():
            torch._foreach_copy_(pseudo, self.round_start)
            torch._foreach_sub_(pseudo, [_local(param) for param in self.trained])
            torch._foreach_mul_(pseudo, weight)
        if replicate_group is None:
            return SumTimes(0.0, 0.0)
        self.exchange.start(replicate_group)
        return self.exchange.finish(wait)

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

    def _zero_inner_state(self) -> None:
        """Every learner begins the round with the same inner state: zeros (for Adam's family,
        its state as new), the step count included."""
        with torch.no_grad():
            for param in self.trained:
                for key, value in self.optimizer.state[param].items():
                    if key != OUTER_MOMENTUM and torch.is_tensor(value):
                        value.zero_()
