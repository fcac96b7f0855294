"""Small helpers shared by the layers, models and measures: one copy of each.

References: timm ``layers/helpers.py`` (``to_2tuple``) and ``layers/_fx.py`` / ``feature_take_indices``.
"""

from __future__ import annotations

from collections.abc import Sequence

Size2 = tuple[int, int]


def to_2tuple(x: int | Sequence[int]) -> Size2:
    """``4 -> (4, 4)``; a pair passes through (as a tuple of ints)."""
    if isinstance(x, int):
        return (x, x)
    x = tuple(int(v) for v in x)
    if len(x) != 2:
        raise ValueError(f"expected an int or a pair of ints, got {x}")
    return x  # type: ignore[return-value]


def feature_take_indices(num_features: int, indices: int | Sequence[int] | None = None) -> list[int]:
    """Which of ``num_features`` layers to return, timm's rule: ``None`` for all, an int ``n`` for
    the last ``n``, or a list of indices where a negative one counts from the end. Raises a
    ``ValueError`` naming the indices and the range when one is out of it."""
    if indices is None:
        return list(range(num_features))
    if isinstance(indices, int):
        if not 0 < indices <= num_features:
            raise ValueError(f"indices={indices}: expected 1..{num_features} last layers")
        return list(range(num_features - indices, num_features))
    idx = [int(i) for i in indices]
    if any(not -num_features <= i < num_features for i in idx):
        raise ValueError(f"layer indices {idx} out of range for {num_features} layers "
                         f"(expected {-num_features}..{num_features - 1})")
    return [i % num_features for i in idx]
