"""The learning-rate schedule: a pure function of how far the run is (nanoGPT's ``get_lr``), and
that progress measured by steps or by a time budget."""

from __future__ import annotations

import math


def get_lr(progress: float, peak: float, warmup: float, decay: str, warmup_lr: float = 0.0,
           min_lr: float = 0.0) -> float:
    """Learning rate at ``progress`` in [0, 1] of the run: linear warmup from ``warmup_lr`` to
    ``peak``, then cosine / linear to ``min_lr`` (airbench's triangle is 0.2 -> 1 -> 0.07 of its peak)."""
    progress = min(max(progress, 0.0), 1.0)
    if progress < warmup:
        return warmup_lr + (peak - warmup_lr) * progress / warmup
    t = (progress - warmup) / max(1.0 - warmup, 1e-12)
    if decay == "cosine":
        return min_lr + (peak - min_lr) * 0.5 * (1.0 + math.cos(math.pi * t))
    if decay == "linear":
        return min_lr + (peak - min_lr) * (1.0 - t)
    raise ValueError(f"decay must be 'cosine' or 'linear', got {decay!r}")


def run_progress(step: int, total_steps: int | None, seconds: float, budget_s: float | None) -> float:
    """How far a run is, in [0, 1] when unfinished: by its steps or by its time budget (seconds
    of training steps), whichever is further along; the lr schedule runs on it."""
    by_steps = step / total_steps if total_steps else 0.0
    return max(by_steps, seconds / budget_s) if budget_s else by_steps
