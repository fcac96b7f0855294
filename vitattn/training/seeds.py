"""Several seeds: the list a user gives (``--seeds 0-3,8``) and the figures over them.

    '0-3,8'                       -> parse_seeds       (0, 1, 2, 3, 8), bounded and checked before anything is built
    (0, 1, 2, 3, 8)               -> seeds_label       '0-3,8'
    the seeds' results            -> summarize         each figure's mean, and its mean, std, min, max and n

The models of a group are ``stack.SeedStack``.
"""

from __future__ import annotations

import itertools
import math
import re
from collections.abc import Sequence

from .errors import UsageError, preview

MAX_SEED = 2**32  # torch.manual_seed's range


MAX_GROUP = 256  # seeds in one process: a bound checked before any list is made


def parse_seeds(text: str) -> tuple[int, ...]:
    """``'0,1,2,3'``, ``'0-7'`` or a mix (``'0-3,8'``) -> the seeds, in the order given. Refuses an
    empty list, a negative or too large seed, a range that runs backwards, a seed named twice and
    more than ``MAX_GROUP`` seeds (counted from the ranges' ends, before any list is made)."""
    flag = f"--seeds {preview(text)}"
    parts = [p.strip() for p in str(text).split(",")]
    if not any(parts):
        raise UsageError(f"{flag}: expected seeds such as '0,1,2,3' or '0-7', got an empty list")
    ranges: list[tuple[int, int]] = []
    for part in parts:
        m = re.fullmatch(r"(-?\d+)(?:\s*-\s*(-?\d+))?", part)
        if m is None:
            raise UsageError(f"{flag}: expected whole numbers or ranges such as '0-7' separated by commas, got "
                             f"{part!r}")
        lo, hi = int(m[1]), int(m[2] if m[2] is not None else m[1])
        if lo < 0 or hi < 0:
            raise UsageError(f"{flag}: seeds must be >= 0, got {part!r}")
        if hi < lo:
            raise UsageError(f"{flag}: the range {part!r} runs backwards; write '{hi}-{lo}'")
        if hi >= MAX_SEED:
            raise UsageError(f"{flag}: seeds must be below 2**32, got {hi}")
        ranges.append((lo, hi))
    count = sum(hi - lo + 1 for lo, hi in ranges)
    if count > MAX_GROUP:
        raise UsageError(f"{flag}: {count} seeds; one process trains at most {MAX_GROUP} at once (memory "
                         "permitting): split them over several runs")
    seeds = [s for lo, hi in ranges for s in range(lo, hi + 1)]
    seen: set[int] = set()
    twice = sorted({s for s in seeds if s in seen or seen.add(s)})
    if twice:
        raise UsageError(f"{flag}: each seed once, got {', '.join(map(str, twice))} more than once")
    return tuple(seeds)


def group_seeds(seeds: Sequence[int]) -> list[tuple[int, ...]]:
    """Seeds in runs of consecutive numbers, for a short label: ``(0, 1, 2, 5) -> [(0, 1, 2), (5,)]``."""
    return [tuple(s for _, s in g) for _, g in itertools.groupby(enumerate(seeds), lambda t: t[1] - t[0])]


def seeds_label(seeds: Sequence[int]) -> str:
    """``(0, 1, 2, 3, 8) -> '0-3,8'``: the ``--seeds`` text that names them."""
    return ",".join(f"{g[0]}-{g[-1]}" if len(g) > 2 else ",".join(map(str, g)) for g in group_seeds(seeds))


def spread(values: Sequence[float]) -> dict[str, float | int]:
    """``mean``, ``std`` (over seeds: n - 1 in the denominator; 0 for one seed), ``min``, ``max``, ``n``."""
    vals = [float(v) for v in values]
    n = len(vals)
    mean = sum(vals) / n
    std = math.sqrt(sum((v - mean) ** 2 for v in vals) / (n - 1)) if n > 1 else 0.0
    return {"mean": mean, "std": std, "min": min(vals), "max": max(vals), "n": n}


def _numbers(d: dict, prefix: str = "") -> dict[str, float]:
    """The numeric leaves of a result, flattened: ``{'final_acc': .., 'erf_radius_px.0': ..}``."""
    out: dict[str, float] = {}
    for k, v in d.items():
        key = f"{prefix}{k}"
        if isinstance(v, bool) or v is None:
            continue
        if isinstance(v, (int, float)) and math.isfinite(v):
            out[key] = float(v)
        elif isinstance(v, dict) and k != "recipe":
            out.update(_numbers(v, f"{key}."))
        elif isinstance(v, (list, tuple)):
            out.update(_numbers(dict(enumerate(v)), f"{key}."))
    return out


def mean_tree(values: Sequence):
    """The mean of several results' values, leaf by leaf: numbers averaged, lists and dicts of the
    same shape averaged element by element, anything else (names, flags) taken from the first."""
    first = values[0]
    if isinstance(first, bool) or first is None or isinstance(first, str):
        return first
    if isinstance(first, (int, float)):
        nums = [v for v in values if isinstance(v, (int, float))]
        return sum(nums) / len(nums) if len(nums) == len(values) else first
    if isinstance(first, dict):
        return {k: mean_tree([v[k] for v in values]) if all(k in v for v in values) else first[k] for k in first}
    if isinstance(first, (list, tuple)) and all(isinstance(v, (list, tuple)) and len(v) == len(first)
                                                for v in values):
        return [mean_tree([v[i] for v in values]) for i in range(len(first))]
    return first


SAME_FOR_ALL = ("params", "steps", "batch_per_rank", "world_size", "flops_per_image", "recipe", "preset")


def summarize(per_seed: Sequence[dict], seeds: Sequence[int]) -> dict:
    """One result for a group: each figure the mean over the seeds, leaf by leaf (so code that reads
    ``result['final_acc']`` or ``result['erf_radius_px'][0]`` reads the mean), with ``seeds``,
    ``per_seed`` (each seed's own result) and ``spread`` (mean, std, min, max and n of every numeric
    figure, nested ones flattened to ``name.index``)."""
    flat = [_numbers(r) for r in per_seed]
    stats = {k: spread([f[k] for f in flat]) for k in flat[0] if k != "seed" and all(k in f for f in flat)}
    out = {k: per_seed[0][k] if k in SAME_FOR_ALL else mean_tree([r.get(k, v) for r in per_seed])
           for k, v in per_seed[0].items() if k != "seed"}  # the group has ``seeds``; a mean seed means nothing
    return {**out, "seeds": list(seeds), "per_seed": list(per_seed), "spread": stats}


def regroup(result: dict) -> dict:
    """A group's result with its means and spread made anew from ``per_seed`` (after figures were
    added to each seed's), keeping the group's own figures (its total rate)."""
    own = {k: result[k] for k in ("images_per_s", "images_per_s_per_seed", "ranks_agree") if k in result}
    return {**summarize(result["per_seed"], result["seeds"]), **own}
