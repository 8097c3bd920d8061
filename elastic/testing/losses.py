"""Two runs' losses, compared step by step."""

from __future__ import annotations


def max_relative_difference(a: list[float], b: list[float]) -> float:
    assert len(a) == len(b), (len(a), len(b))
    return max(abs(x - y) / max(abs(y), 1e-12) for x, y in zip(a, b))
