"""Several seeds of one model trained at once, in one process, as one model.

    S models, one per seed        -> SeedStack         every tensor stacked: (S, *shape), names kept (module.*)
    S batches, seed s's for s     -> SeedStack(x)      (S, B, classes): batch s through copy s
    the stacked gradients         -> clip_grad_norm_   each seed's norm alone, as its solo run clips
    the seeds' results            -> spread            mean, std, min, max and n of every figure

Each copy is the model its solo run (``--seed k``) would have built, and it sees that run's batches;
the optimiser steps the stacked tensors at once (AdamW and SGD work element by element, Muon
orthogonalises each seed's matrix alone), so seed k of a group trains as its solo run, up to float
rounding (tests/training/test_seeds.py). Two ways run the copies' forward passes, with the same
numbers (tested):

- ``'loop'``: each copy in turn on its slice of the stacked tensors (``torch.func.functional_call``).
  On a CPU each copy's products are already large at its batch, and batched products and grouped
  convolutions ran slower there than one copy after another (docs/performance.md).
- ``'vmap'``: all copies in one call of each layer (``torch.func.vmap``): S times the work per launch,
  what a GPU that a small model leaves idle needs. torch has no vmap rule for the CPU's fused
  attention kernel, so attention takes the readable path under it.

References: ``torch.func.stack_module_state`` and the model-ensembling tutorial of torch.func.
"""

from __future__ import annotations

import copy
import itertools
import math
import re
from collections.abc import Sequence

import torch
from torch import nn
from torch.func import functional_call, vmap

from . import runtime
from .errors import UsageError, preview

MODES = ("loop", "vmap")
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


def stacked_like(tensors: Sequence[torch.Tensor]) -> torch.Tensor:
    """``S`` tensors of one shape -> ``(S, *shape)``, each slice in the memory layout of its source
    (a channels-last kernel stays channels-last, so a copy's convolutions run as its solo run's)."""
    t = tensors[0]
    layout = torch.empty_like(t).stride()  # the source's strides where it is dense, else contiguous ones
    out = torch.empty_strided((len(tensors), *t.shape), (max(t.numel(), 1), *layout), dtype=t.dtype, device=t.device)
    with torch.no_grad():
        for dst, src in zip(out, tensors):
            dst.copy_(src)
    return out


class SeedStack(nn.Module):
    """``S`` copies of one model as one module: ``(S, B, ...) -> (S, B, ...)``.

    ``self.module`` holds the copies' parameters and buffers stacked, ``(S, *shape)``, under the
    model's own names (what the optimiser, the EMA, DDP and checkpoints see); a tensorless copy of
    the model (``template``, on the meta device) runs them. ``forward`` takes the seeds' inputs as
    one ``(S, B, ...)`` tensor or a list of ``S`` tensors and returns the outputs stacked (a tuple
    of stacked tensors for a model that returns a tuple). :meth:`unstack` gives back seed ``s``'s
    model, a plain module with its weights."""

    def __init__(self, models: Sequence[nn.Module], seeds: Sequence[int], mode: str = "loop") -> None:
        super().__init__()
        if mode not in MODES:
            raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
        if len(models) != len(seeds) or len(models) < 2:
            raise ValueError(f"expected one model per seed, at least two; got {len(models)} models for seeds {seeds}")
        first = models[0]
        names = [n for n, _ in first.named_parameters()], [n for n, _ in first.named_buffers()]
        for m in models[1:]:
            if ([n for n, _ in m.named_parameters()], [n for n, _ in m.named_buffers()]) != names or any(
                    a.shape != b.shape for a, b in zip(first.state_dict().values(), m.state_dict().values())):
                raise ValueError("the models of a SeedStack must have the same parameters and buffers")
        if mode == "vmap" and stochastic(first):
            raise ValueError("under vmap every seed's dropout and drop path draw from one random stream, so no seed "
                             "would train as its solo run; run the seeds in turn (mode 'loop')")
        self.seeds, self.mode = tuple(seeds), mode
        self.__dict__["streams"] = None  # each seed's random state in training (start_streams), or the process's
        self.draws = stochastic(first)  # only then are the streams swapped in (a compiled step breaks its graph there)
        # each seed's own data config (a long-range seed's images have their own statistics)
        self.__dict__["member_cfgs"] = [copy.deepcopy(getattr(m, "pretrained_cfg", None)) for m in models]
        self.module = copy.deepcopy(first)
        for name, p in first.named_parameters():
            owner, attr = self._owner(name)
            setattr(owner, attr, nn.Parameter(stacked_like([m.get_parameter(name) for m in models]),
                                              requires_grad=p.requires_grad))
        for name, _ in first.named_buffers():
            owner, attr = self._owner(name)
            owner._buffers[attr] = stacked_like([m.get_buffer(name) for m in models])
        # the model without tensors (meta), out of the module tree: unstack copies it; the runner
        # runs the stacked tensors (the same, but under vmap, where torch has no rule for the CPU's
        # fused attention kernel: the readable path there)
        self.__dict__["template"] = copy.deepcopy(first).to("meta")
        self.__dict__["runner"] = self.template if mode == "loop" else copy.deepcopy(self.template)
        for m in self.runner.modules() if mode == "vmap" else ():
            if hasattr(m, "fused"):
                m.fused = False

    def start_streams(self, seeds: Sequence[int], device: torch.device) -> None:
        """Give seed ``s`` its own random stream, started from ``seeds[s]`` as its solo run starts the
        process's (``torch.manual_seed``): in training each copy's forward draws its dropout and drop
        path from it alone. The process's own state is left as it was."""
        device = torch.device(device)
        with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
            states = []
            for k in seeds:
                torch.manual_seed(k)
                states.append(runtime.rng_states(device))
        self.streams = states

    def _owner(self, name: str) -> tuple[nn.Module, str]:
        path, _, attr = name.rpartition(".")
        return (self.module.get_submodule(path) if path else self.module), attr

    @property
    def num_seeds(self) -> int:
        return len(self.seeds)

    def train(self, mode: bool = True) -> SeedStack:
        self.template.train(mode)  # the modules that run and unstack, though not children
        self.runner.train(mode)
        return super().train(mode)

    def tensors(self) -> dict[str, torch.Tensor]:
        return {**dict(self.module.named_parameters()), **dict(self.module.named_buffers())}

    def forward(self, x: torch.Tensor | Sequence[torch.Tensor]):
        if len(x) != self.num_seeds:
            raise ValueError(f"expected the inputs of {self.num_seeds} seeds (a leading axis of {self.num_seeds}), "
                             f"got {len(x)}")
        tensors = self.tensors()
        if self.mode == "vmap":
            x = torch.stack(list(x)) if not isinstance(x, torch.Tensor) else x
            return vmap(lambda t, xs: functional_call(self.runner, t, (xs,)), randomness="different")(tensors, x)
        # unbind once: the backward then stacks each tensor's S gradients in one copy
        slices = {k: v.unbind(0) if v.requires_grad else v for k, v in tensors.items()}
        streams = self.streams if self.training and self.draws else None
        device = next(iter(tensors.values())).device
        outer = runtime.rng_states(device) if streams else None
        outs = []
        for s in range(self.num_seeds):
            if streams:  # seed s draws from its own stream, as its solo run draws from the process's
                runtime.set_rng_states(streams[s], device)
            outs.append(functional_call(self.runner, {k: v[s] for k, v in slices.items()}, (x[s],)))
            if streams:
                streams[s] = runtime.rng_states(device)
        if outer:
            runtime.set_rng_states(outer, device)
        if isinstance(outs[0], tuple):
            return tuple(torch.stack(o) for o in zip(*outs))
        return torch.stack(outs)

    @torch.no_grad()
    def unstack(self, s: int) -> nn.Module:
        """Seed ``s``'s model (index ``s`` of ``seeds``): a plain module, its own copy of the weights."""
        tensors = self.tensors()
        device = next(iter(tensors.values())).device
        m = copy.deepcopy(self.template).to_empty(device=device)
        if self.member_cfgs[s] is not None:
            m.pretrained_cfg = copy.deepcopy(self.member_cfgs[s])
        for name, t in tensors.items():
            (m.get_parameter(name) if name in dict(m.named_parameters()) else m.get_buffer(name)).copy_(t[s])
        return m.train(self.training)


def stochastic(model: nn.Module) -> bool:
    """Whether ``model`` draws random numbers in training: a dropout or a drop path above 0."""
    return any((isinstance(m, nn.modules.dropout._DropoutNd) and m.p > 0) or getattr(m, "drop_prob", 0) > 0
               for m in model.modules())


def members(model: nn.Module) -> list[nn.Module]:
    """The models a module holds, one per seed: a stack's copies, or the module itself."""
    return [model.unstack(s) for s in range(model.num_seeds)] if isinstance(model, SeedStack) else [model]


def lead_dims(model: nn.Module) -> int:
    """How many leading axes each parameter has before the model's own shape: 1 for a stack, else 0."""
    return 1 if isinstance(model, SeedStack) else 0


@torch.no_grad()
def clip_grad_norm_(params, max_norm: float, lead: int = 0) -> torch.Tensor:
    """``nn.utils.clip_grad_norm_`` for each index of the first ``lead`` axes alone (``lead=1``:
    each seed's gradients scaled by its own norm, as its solo run scales them); ``lead=0`` is torch's.
    Returns the norms, one per seed."""
    params = [p for p in params if p.grad is not None]
    if lead == 0:
        return nn.utils.clip_grad_norm_(params, max_norm)
    if lead != 1:
        raise ValueError(f"lead must be 0 or 1, got {lead}")
    norms = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(p.grad.flatten(1), dim=1)
                                                  for p in params]), dim=0)
    coef = (max_norm / (norms + 1e-6)).clamp(max=1.0)  # torch's rule, per seed
    for p in params:
        p.grad.mul_(coef.view(-1, *[1] * (p.grad.ndim - 1)).to(p.grad.dtype))
    return norms


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


def group_seeds(seeds: Sequence[int]) -> list[tuple[int, ...]]:
    """Seeds in runs of consecutive numbers, for a short label: ``(0, 1, 2, 5) -> [(0, 1, 2), (5,)]``."""
    return [tuple(s for _, s in g) for _, g in itertools.groupby(enumerate(seeds), lambda t: t[1] - t[0])]


def seeds_label(seeds: Sequence[int]) -> str:
    """``(0, 1, 2, 3, 8) -> '0-3,8'``: the ``--seeds`` text that names them."""
    return ",".join(f"{g[0]}-{g[-1]}" if len(g) > 2 else ",".join(map(str, g)) for g in group_seeds(seeds))


def saved_bytes(model: nn.Module, x: torch.Tensor) -> int:
    """Bytes that autograd keeps for the backward of ``model(x)`` (each storage once): the
    activations of a training step on ``x``. Runs ``model`` in training mode on a copy of the
    random states, so the caller's streams do not move (a BatchNorm's statistics do: pass a copy)."""
    seen: dict[tuple, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        storage = t.untyped_storage()
        seen[(storage.data_ptr(), t.device)] = storage.nbytes()
        return t

    devices = [x.device] if x.device.type == "cuda" else []
    with torch.random.fork_rng(devices=devices), torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = model.train()(x)
    del out
    return sum(seen.values())


def free_bytes(device: torch.device) -> int:
    """Memory free for a run on ``device``: a GPU's free memory, or the host's available memory."""
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[0]
    try:
        with open("/proc/meminfo") as f:
            info = dict(line.split(":", 1) for line in f)
        return int(info["MemAvailable"].split()[0]) * 1024
    except (OSError, KeyError, ValueError):
        import os

        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


def regroup(result: dict) -> dict:
    """A group's result with its means and spread made anew from ``per_seed`` (after figures were
    added to each seed's), keeping the group's own figures (its total rate)."""
    own = {k: result[k] for k in ("images_per_s", "images_per_s_per_seed", "ranks_agree") if k in result}
    return {**summarize(result["per_seed"], result["seeds"]), **own}
