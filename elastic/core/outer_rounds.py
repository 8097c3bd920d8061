"""Semi-synchronous training (DiLoCo): the run's steps in *outer rounds* of ``every`` inner steps.

Within a round each replica group is a *learner*: it steps its own copy of the model on its
own share of each step's batch, and no gradient crosses groups (the step's small row still
does: the loss, the vote's agreement, the experts' routed tokens, so every group commits the
same steps and moves the routing bias alike). At a round's last step every learner sends its
*pseudo-gradient* (the round's start weights minus its own, weighted by its share of the
round's tokens) over the cross-group groups; their sum is the outer optimizer's gradient
(Nesterov SGD on the global weights), every learner takes the new global weights, and its inner
optimizer's state is zeroed. So at every round boundary all learners hold the same state: the
global weights, the outer momentum, the inner state zeroed. That is what a checkpoint, the
memory tier, the integrity check, an evaluation and a heal see, so each of them happens at a
round boundary only (``at_boundary``: their intervals are whole rounds, ``whole_rounds``).

A learner lost inside a round is redone (``sync.lost_learner = "redo"``): the run goes back to
the round's start, which the memory tier holds for every rank, and the round trains again
with the same data, so every committed step equals a clean run's. Or it is dropped (``"drop"``):
the learners going on finish the round without it, its samples of the round go back into the
data plan (``DataCursor.returned``), and the outer step merges the learners that finished, by
their tokens.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class OuterRounds:
    every: int  # inner steps per round (H)
    lr: float  # the outer optimizer's (Nesterov SGD's) learning rate
    momentum: float
    precision: str = "fp32"  # the pseudo-gradients across groups: fp32, bf16, fp8 or int4
    # a learner lost inside a round: its part dropped and its samples returned to the plan
    # (``sync.lost_learner = "drop"``), else the round redone
    drops: bool = False

    def ends_at(self, step: int) -> bool:
        """Whether ``step`` is its round's last inner step: the outer step follows it."""
        return (step + 1) % self.every == 0

    def at_boundary(self, step: int) -> bool:
        """Whether a run standing at ``step`` (its next step) is between rounds."""
        return step % self.every == 0

    def start_of(self, step: int) -> int:
        """The first step of ``step``'s round."""
        return step - step % self.every


def whole_rounds(interval: int, every: int) -> int:
    """``interval`` steps rounded up to whole rounds of ``every`` (0 stays 0: off)."""
    return -(-interval // every) * every
