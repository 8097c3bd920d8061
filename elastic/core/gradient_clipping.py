"""Gradient clipping by the global norm, decided by every rank from its group's vote.

After the cross-group sum every replica group holds the same gradients, so one group's
ranks describe the whole: each puts its part of the squared norm (every element counted on
exactly one rank, see ``workers.train_step.squared_gradient_norm``) in its ballot, and every
rank of the group adds the parts in rank order. The norm is then the same whatever the number
of live groups, and every rank computes the same clipping factor with ``clip_coefficient``.
"""

from __future__ import annotations

import math
from collections.abc import Mapping


def global_norm(squared_parts: Mapping[int, float]) -> float:
    """The L2 norm from one group's per-rank squared parts, summed in rank order."""
    return math.sqrt(sum(squared_parts[rank] for rank in sorted(squared_parts)))


def clip_coefficient(norm: float, max_norm: float | None) -> float:
    """The factor that brings gradients of global norm ``norm`` down to ``max_norm`` (torch's
    ``clip_grad_norm_`` formula); 1.0 without clipping."""
    if max_norm is None:
        return 1.0
    if math.isnan(norm):  # min() would return 1.0: no factor makes NaN gradients fine
        return math.nan
    return min(1.0, max_norm / (norm + 1e-6))
