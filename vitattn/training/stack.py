"""Several seeds of one model trained at once, in one process, as one model.

    S models, one per seed        -> SeedStack         every tensor stacked: (S, *shape), names kept (module.*)
    S batches, seed s's for s     -> SeedStack(x)      (S, B, classes): batch s through copy s
    a group's memory              -> saved_bytes, free_bytes: measured on one model before a group is built

Each copy is the model its solo run (``--seed k``) would have built, and it sees that run's batches
and draws its dropout from that run's stream; the optimiser steps the stacked tensors at once
(AdamW and SGD work element by element, Muon orthogonalises each seed's matrix alone; gradient
clipping per seed is ``optim.clip_grad_norm_``), so seed k of a group trains as its solo run
(tests/training/test_seeds.py). Two ways run the copies' forward passes, with the same numbers
(tested):

- ``'loop'``: each copy in turn on its slice of the stacked tensors (``torch.func.functional_call``).
  On a CPU each copy's products are already large at its batch, and batched products and grouped
  convolutions ran slower there than one copy after another (docs/performance.md).
- ``'vmap'``: all copies in one call of each layer (``torch.func.vmap``): S times the work per launch,
  what a GPU that a small model leaves idle needs. torch has no vmap rule for the CPU's fused
  attention kernel, so attention takes the readable path under it; and vmap draws every copy's
  random numbers from one stream, so a model with dropout or drop path is refused there.

References: ``torch.func.stack_module_state`` and the model-ensembling tutorial of torch.func.
"""

from __future__ import annotations

import copy
from collections.abc import Sequence

import torch
from torch import nn
from torch.func import functional_call, vmap

from . import runtime

MODES = ("loop", "vmap")


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
