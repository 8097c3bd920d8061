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

Streaming DiLoCo (``fragments`` > 1) cuts the model into fragments (``fragment_of``) and syncs
one at a time: fragment ``f`` after the round's step ``(f + 1) * every // fragments``, so each
fragment still syncs once a round but the bytes of one outer step are a fragment's. A fragment
just synced is the global one while the others still hold each learner's own progress, so the
learners differ between outer steps. Every ``fragments`` rounds (``aligned_every``) the last
outer step syncs every fragment at once: the learners are alike there, and that is where the
run's state is read (the boundaries above are those), a lost learner's work redone from.

With ``delay`` (``sync.sync_delay``) a fragment's outer step is merged ``delay`` inner steps
after its turn, the exchange crossing meanwhile, behind the inner steps' compute; each learner
then takes ``alpha`` of its own weights of the fragment and the rest of the global ones
(streaming DiLoCo's overlap and mixing). A turn's merge comes before the next fragment's turn,
and the outer step where the learners align is never delayed.
"""

from __future__ import annotations

import re
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
    fragments: int = 1  # streaming DiLoCo: the model's fragments, synced in turn
    # a fragment's outer step merged this many inner steps after its turn, its exchange meanwhile
    # on a channel of its own (never at the steps where the learners align)
    delay: int = 0
    # a learner's share of a fragment's weights as it takes the outer step's (0: the global ones)
    alpha: float = 0.0

    @property
    def aligned_every(self) -> int:
        """Steps between the points where every learner holds the same state."""
        return self.every * self.fragments

    def syncs_after(self, step: int) -> tuple[int, ...]:
        """The fragments whose outer step follows ``step``: its round's turn, or at the end of
        ``aligned_every`` steps every fragment."""
        if self.ends_at(step):
            return tuple(range(self.fragments))
        into_round = (step + 1) % self.every or self.every
        return tuple(fragment for fragment in range(self.fragments) if self.turn_of(fragment) == into_round)

    def turn_of(self, fragment: int) -> int:
        """How many of a round's inner steps precede ``fragment``'s turn."""
        return (fragment + 1) * self.every // self.fragments

    def delayed_at(self, step: int) -> bool:
        """Whether the turns after ``step`` merge ``delay`` steps later (not where the learners align)."""
        return self.delay > 0 and not self.ends_at(step)

    def ends_at(self, step: int) -> bool:
        """Whether the learners are alike after ``step``: every fragment's outer step follows it."""
        return (step + 1) % self.aligned_every == 0

    def at_boundary(self, step: int) -> bool:
        """Whether a run standing at ``step`` (its next step) is where the learners are alike."""
        return step % self.aligned_every == 0

    def start_of(self, step: int) -> int:
        """The last step at or before ``step`` where the learners were alike."""
        return step - step % self.aligned_every


def fragment_of(names: list[str], fragments: int) -> list[int]:
    """Each parameter's fragment, by name in the model's order: the parameters before the first
    transformer block (the embeddings) fragment 0's, block ``i``'s fragment ``(i + 1) %
    fragments``'s (strided, as streaming DiLoCo's paper found best), the ones after a block (the
    final norm, the output) the last fragment's. A pipeline stage's names keep their blocks'
    numbers, so every stage and every learner cuts alike, and a model of ``n`` blocks has
    ``n + 2`` parts to cut."""
    placed, after_a_block = [], False
    for name in names:
        block = re.search(r"(?:^|\.)layers\.(\d+)\.", name)
        after_a_block |= block is not None
        placed.append((int(block.group(1)) + 1) % fragments if block else (fragments - 1 if after_a_block else 0))
    return placed


def whole_rounds(interval: int, every: int) -> int:
    """``interval`` steps rounded up to whole rounds of ``every`` (0 stays 0: off)."""
    return -(-interval // every) * every
