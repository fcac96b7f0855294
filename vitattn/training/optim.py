"""Optimisers and what steps beside them: parameter groups without weight decay for biases,
norms and position tables (timm's ``lr_scale`` per group), our own Muon (``torch.optim.Muon``'s
steps with its Newton-Schulz in fp32 on a CPU), the chain that steps Muon and AdamW as one, the
learning-rate schedule (a pure function of how far the run is, nanoGPT's ``get_lr``), the
backward-and-step of a training loop, an EMA of the weights, and ``--compile``'s ``Update``
(clipping, optimiser and EMA compiled as one function at a tensor lr).

References: Jordan et al. 2024 (Muon); airbench94 (bias lr scale); timm
(``param_groups_weight_decay``, ``ModelEmaV3``); torch's "compiled optimizer with an LR
scheduler" recipe (the lr as a tensor).
"""

from __future__ import annotations

import copy
import math

import torch
from torch import nn
from torch.profiler import record_function

OPTIMIZERS = ("adamw", "sgd", "muon")


def param_groups(model: nn.Module, weight_decay: float, no_decay_lr_scale: float = 1.0, lead: int = 0) -> list[dict]:
    """Decay matrices and kernels; leave biases, norm scales, tokens and position tables alone.

    Each group carries timm's ``lr_scale``: the loop sets a group's lr to the scheduled lr times it,
    so ``no_decay_lr_scale`` speeds up the biases alone (airbench trains BatchNorm shifts 64x faster).
    ``lead``: axes before each parameter's own shape (1 for the stacked seeds of ``stack.SeedStack``).
    """
    decay, no_decay = [], []
    named = no_decay_names(model)
    for name, p in model.named_parameters():
        if not p.requires_grad:
            continue
        skip = p.ndim - lead <= 1 or name in named
        (no_decay if skip else decay).append(p)
    return [{"params": decay, "weight_decay": weight_decay, "lr_scale": 1.0},
            {"params": no_decay, "weight_decay": 0.0, "lr_scale": no_decay_lr_scale}]


def no_decay_names(model: nn.Module) -> set[str]:
    """The parameters each part of ``model`` keeps out of weight decay by timm's contract
    (its ``no_weight_decay()``: a ViT's position table and tokens), by their full names."""
    return {f"{prefix}.{n}" if prefix else n for prefix, m in model.named_modules()
            if callable(getattr(m, "no_weight_decay", None)) for n in m.no_weight_decay()}


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


def set_lr(optimizer: torch.optim.Optimizer | OptimizerChain, lr: float) -> None:
    """Set every group's lr to ``lr`` times its ``lr_scale`` (1 when absent)."""
    for g in optimizer.param_groups:
        g["lr"] = lr * g.get("lr_scale", 1.0)


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


def backward_step(loss: torch.Tensor, opt: torch.optim.Optimizer | OptimizerChain, scaler: torch.amp.GradScaler,
                  params, grad_clip: float = 0.0, lead: int = 0) -> None:
    """Backward and one optimiser step: gradients clipped to ``grad_clip`` (0 = off) after fp16's
    loss scale is taken off them, so the clip sees the true gradients (each seed's alone with
    ``lead=1``: ``seeds.clip_grad_norm_``); ``scaler`` disabled is a pass-through."""
    opt.zero_grad(set_to_none=True)
    with record_function("backward"):
        scaler.scale(loss).backward()
    with record_function("optimizer"):
        if grad_clip > 0:
            scaler.unscale_(opt)
            clip_grad_norm_(params, grad_clip, lead)
        scaler.step(opt)
        scaler.update()


def orthogonalize(g: torch.Tensor, coefficients: tuple[float, float, float], steps: int, eps: float,
                  dtype: torch.dtype) -> torch.Tensor:
    """Muon's quintic Newton-Schulz iteration, run in ``dtype``: pushes the singular values of
    ``g`` towards 1 (to roughly 0.5-1.5), keeping its singular vectors (Jordan et al. 2024).
    ``g`` is one matrix ``(m, n)`` or a stack of them ``(..., m, n)``, each orthogonalised alone."""
    if g.ndim > 3:
        return orthogonalize(g.flatten(0, -3), coefficients, steps, eps, dtype).view(g.shape)
    x = g.to(dtype)
    tall = g.size(-2) > g.size(-1)
    if tall:  # iterate on the wide side: the Gram matrix is the smaller one
        x = x.mT
    x = x / x.norm(dim=(-2, -1), keepdim=True).clamp(min=eps)  # Frobenius >= spectral norm: singular values <= 1
    a, b, c = coefficients
    mul_add = torch.addmm if x.ndim == 2 else torch.baddbmm  # beta * input + alpha * (m1 @ m2)
    for _ in range(steps):
        gram = x @ x.mT
        x = mul_add(x, mul_add(gram, gram, gram, beta=b, alpha=c), x, beta=a)
    return x.mT if tall else x


def muon_lr_ratio(adjust_lr_fn: str | None, shape: torch.Size) -> float:
    """``torch.optim.Muon``'s per-matrix lr factor (of the last two axes: a stack's matrices are
    each one); ``'match_rms_adamw'`` gives updates AdamW's RMS."""
    fan_out, fan_in = shape[-2:]
    if adjust_lr_fn in (None, "original"):
        return math.sqrt(max(1.0, fan_out / fan_in))
    if adjust_lr_fn == "match_rms_adamw":
        return 0.2 * math.sqrt(max(fan_out, fan_in))
    if adjust_lr_fn == "spectral_unclamped":
        return math.sqrt(fan_out / fan_in)
    return 1.0


class Muon(torch.optim.Optimizer):
    """Muon (Jordan et al. 2024) with ``torch.optim.Muon``'s arguments, defaults, state and
    checkpoints, and its Newton-Schulz iteration run in ``ns_dtype``.

    torch runs the iteration in bfloat16, which is fast on GPUs and on CPUs with native bf16 matrix
    products and many times slower than fp32 on CPUs without them (docs/training.md).
    ``ns_dtype=None`` picks bfloat16 on CUDA and fp32 elsewhere; with ``torch.bfloat16`` the steps
    equal torch's bit for bit (tests/training/test_optim.py). A weight of ``(S, m, n)`` (seeds
    stacked, ``stack.SeedStack``) is S matrices, each orthogonalised alone. Our own class rather than a subclass of
    ``torch.optim.Muon``, so that the package imports on torch releases older than Muon (2.9).
    """

    def __init__(self, params, lr: float = 1e-3, weight_decay: float = 0.1, momentum: float = 0.95,
                 nesterov: bool = True, ns_coefficients: tuple[float, float, float] = (3.4445, -4.7750, 2.0315),
                 eps: float = 1e-7, ns_steps: int = 5, adjust_lr_fn: str | None = None, *,
                 ns_dtype: torch.dtype | None = None) -> None:
        for name, v in (("lr", lr), ("momentum", momentum), ("weight_decay", weight_decay)):
            if not v >= 0:
                raise ValueError(f"Muon's {name} must be >= 0, got {v}")
        if adjust_lr_fn not in (None, "original", "match_rms_adamw", "spectral_unclamped"):
            raise ValueError(f"adjust_lr_fn must be None, 'original', 'match_rms_adamw' or 'spectral_unclamped', "
                             f"got {adjust_lr_fn!r}")
        super().__init__(params, dict(lr=lr, weight_decay=weight_decay, momentum=momentum, nesterov=nesterov,
                                      ns_coefficients=ns_coefficients, eps=eps, ns_steps=ns_steps,
                                      adjust_lr_fn=adjust_lr_fn))
        for group in self.param_groups:
            for p in group["params"]:
                if p.ndim < 2:
                    raise ValueError(f"Muon steps matrices (or stacks of them), got a weight of shape {tuple(p.shape)}")
        self.ns_dtype = ns_dtype

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            lr, momentum = group["lr"], group["momentum"]
            params = [p for p in group["params"] if p.grad is not None]
            for p in params:
                if "momentum_buffer" not in self.state[p]:
                    self.state[p]["momentum_buffer"] = torch.zeros_like(p)
            bufs = [self.state[p]["momentum_buffer"] for p in params]
            grads = [p.grad for p in params]
            torch._foreach_lerp_(bufs, grads, 1 - momentum)
            updates = torch._foreach_lerp(grads, bufs, momentum) if group["nesterov"] else bufs
            by_shape: dict[tuple, list[int]] = {}
            for i, p in enumerate(params):
                by_shape.setdefault((tuple(p.shape), p.device, p.dtype), []).append(i)
            for (shape, device, _), idx in by_shape.items():  # one batched iteration per shape, not per matrix
                dtype = self.ns_dtype or (torch.bfloat16 if device.type == "cuda" else torch.float32)
                stack = updates[idx[0]] if len(idx) == 1 else torch.stack([updates[i] for i in idx])
                ortho = orthogonalize(stack, group["ns_coefficients"], group["ns_steps"], group["eps"], dtype)
                ortho = ortho[None] if len(idx) == 1 else ortho
                scale = -lr * muon_lr_ratio(group["adjust_lr_fn"], torch.Size(shape))
                ps = [params[i] for i in idx]
                steps = [u.to(ps[0].dtype) for u in ortho.unbind(0)]
                torch._foreach_mul_(ps, 1 - lr * group["weight_decay"])
                if torch.is_tensor(lr):  # the compiled update's lr (``Update``): a tensor cannot be an alpha
                    steps = torch._foreach_mul(steps, scale)
                    scale = 1.0
                torch._foreach_add_(ps, steps, alpha=scale)
        return loss


class OptimizerChain:
    """Several optimisers stepped as one, each over its own parameters: what a training loop
    needs of an optimiser (``param_groups``, ``zero_grad``, ``step``, ``state_dict``)."""

    def __init__(self, *optimizers: torch.optim.Optimizer) -> None:
        self.optimizers = optimizers

    @property
    def param_groups(self) -> list[dict]:
        return [g for o in self.optimizers for g in o.param_groups]

    def zero_grad(self, set_to_none: bool = True) -> None:
        for o in self.optimizers:
            o.zero_grad(set_to_none=set_to_none)

    def step(self) -> None:
        for o in self.optimizers:
            o.step()

    def state_dict(self) -> dict:
        return {"chain": [o.state_dict() for o in self.optimizers]}

    def load_state_dict(self, state: dict) -> None:
        if len(state.get("chain", ())) != len(self.optimizers):
            raise ValueError(f"expected the state of {len(self.optimizers)} chained optimisers, got "
                             f"{len(state.get('chain', ()))}")
        for o, sd in zip(self.optimizers, state["chain"]):
            o.load_state_dict(sd)


def is_muon_param(name: str, p: torch.Tensor, lead: int = 0) -> bool:
    """Muon orthogonalises matrix updates: the blocks' linear weights. Embeddings, the patch
    projection, norms, biases and the head keep AdamW (Jordan et al. 2024)."""
    return p.ndim - lead == 2 and name.startswith("blocks.")


def create_optimizer(model: nn.Module, opt: str, lr: float, weight_decay: float, momentum: float = 0.9,
                     beta2: float = 0.999, bias_lr_scale: float = 1.0, lead: int = 0
                     ) -> torch.optim.Optimizer | OptimizerChain:
    """An optimiser by name, as timm's ``create_optimizer_v2``: ``'adamw'`` (betas ``(momentum,
    beta2)``), Nesterov ``'sgd'``, or ``'muon'``: ``Muon`` (``torch.optim.Muon``, Nesterov momentum
    0.95, its update rescaled to AdamW's RMS so one lr serves both) on ``is_muon_param`` weights
    and AdamW on the rest. Biases, norms and position tables get no weight decay and
    ``bias_lr_scale`` times the lr (:func:`param_groups`). ``lead=1`` takes each parameter of
    ``model`` as a stack of seeds (``stack.SeedStack``'s ``module``): every rule reads the shape
    after the first axis."""
    if opt not in OPTIMIZERS:
        raise ValueError(f"optimizer must be one of {OPTIMIZERS}, got {opt!r}")
    # CUDA: one fused kernel for all parameters (and a GradScaler that need not read found_inf on the
    # host); the CPU keeps the foreach path our measurements and exact-resume tests were made on
    fused = {"fused": True} if next(model.parameters()).is_cuda else {}
    groups = param_groups(model, weight_decay, bias_lr_scale, lead)
    if opt == "sgd":
        return torch.optim.SGD(groups, lr=lr, momentum=momentum, nesterov=True, **fused)
    if opt == "adamw":
        return torch.optim.AdamW(groups, lr=lr, betas=(momentum, beta2), **fused)
    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    matrices = [p for n, p in named if is_muon_param(n, p, lead)]
    if not matrices:
        raise ValueError(f"optimizer 'muon' needs 2-D weights in blocks.*; {type(model).__name__} has none")
    muon = Muon(matrices, lr=lr, weight_decay=weight_decay, momentum=0.95, adjust_lr_fn="match_rms_adamw")
    keep = {id(p) for p in matrices}
    rest = [{**g, "params": [p for p in g["params"] if id(p) not in keep]} for g in groups]
    return OptimizerChain(muon, torch.optim.AdamW(rest, lr=lr, betas=(momentum, beta2), **fused))


def ema_decay_at(decay: float, n: int) -> float:
    """The EMA's decay at its ``n``-th update: ``min(decay, (1 + n) / (10 + n))``, so the first
    updates move fast and the random start does not linger (TensorFlow's ``num_updates`` rule)."""
    return min(decay, (1 + n) / (10 + n))


class ModelEma(nn.Module):
    """An exponential moving average of a model's weights and buffers (timm's ``--model-ema``,
    ``ModelEmaV3``'s warm-up): ``update_parameters(model)`` after each optimiser step moves every
    floating tensor of ``module`` towards the model's by ``1 - ema_decay_at(decay, n)`` and copies
    integer buffers; the first update copies everything. The count ``n`` lives on the host (saved
    in the state dict): torch's ``AveragedModel`` keeps it on the device, and reading it there
    each step would make the host wait for the GPU."""

    def __init__(self, model: nn.Module, decay: float) -> None:
        super().__init__()
        if not 0.0 < decay < 1.0:
            raise ValueError(f"the EMA decay must be in (0, 1), got {decay}")
        self.module = copy.deepcopy(model).requires_grad_(False)
        self.decay, self.updates = decay, 0

    def pairs(self, model: nn.Module) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Each averaged tensor (parameters, then buffers) with the model's it follows."""
        return list(zip([*self.module.parameters(), *self.module.buffers()],
                        [t.detach() for t in (*model.parameters(), *model.buffers())]))

    @torch.no_grad()
    def update_parameters(self, model: nn.Module) -> None:
        by_dtype: dict[torch.dtype, tuple[list, list]] = {}
        for averaged, current in self.pairs(model):
            group = by_dtype.setdefault(averaged.dtype, ([], []))
            group[0].append(averaged)
            group[1].append(current)
        weight = self.next_weight()
        for dtype, (averaged, current) in by_dtype.items():
            if dtype.is_floating_point and weight < 1.0:
                torch._foreach_lerp_(averaged, current, weight)
            else:
                torch._foreach_copy_(averaged, current)

    def next_weight(self) -> float:
        """How far the next update moves the average towards the model (1: the first, a copy); counts it."""
        weight = 1.0 - ema_decay_at(self.decay, self.updates) if self.updates > 0 else 1.0
        self.updates += 1
        return weight

    def get_extra_state(self) -> dict:
        return {"updates": self.updates}

    def set_extra_state(self, state: dict) -> None:
        self.updates = int(state["updates"])


class Update:
    """What a training step does after its backward pass, as one compiled function (``torch.compile``):
    gradient clipping, the optimiser's step (Muon's Newton-Schulz batched by shape) and the EMA's
    update (torch's optimisers split it into a few graphs at their ``step``, on purpose). The lr
    and the EMA's weight are device tensors the host writes each step, so a new lr neither
    recompiles a graph (a float would be a constant of it) nor waits for a GPU.

    The same update as ``backward_step``'s second half and ``ModelEma.update_parameters`` (tested
    equal, tests/training/test_optim.py); not for fp16, whose loss scaler decides on the host
    whether to step. Call it with the step's lr after ``loss.backward()``.
    """

    def __init__(self, opt: torch.optim.Optimizer | OptimizerChain, model: nn.Module, ema: ModelEma | None = None,
                 grad_clip: float = 0.0, lead: int = 0) -> None:
        device = next(model.parameters()).device
        self.opt, self.ema, self.grad_clip, self.lead = opt, ema, grad_clip, lead
        self.params = [p for p in model.parameters() if p.requires_grad]
        self.lr, self.ema_weight = torch.zeros((), device=device), torch.ones((), device=device)
        for g in opt.param_groups:  # each group's lr a tensor too: the graph reads it, the host never
            g["lr"] = torch.tensor(float(g["lr"]), device=device)
        for o in getattr(opt, "optimizers", (opt,)):  # the momentum a first step would make: one state to trace
            if isinstance(o, (Muon, torch.optim.SGD)):  # (AdamW's is made as torch.compile traces it)
                for p in (p for g in o.param_groups if g["momentum"] > 0 for p in g["params"]):
                    o.state[p].setdefault("momentum_buffer", torch.zeros_like(p))  # 0 * momentum + grad: the same
        self.pairs = [] if ema is None else ema.pairs(model)
        # static shapes, which never change here: a second update in one process (--model both) would
        # recompile with symbolic ones, and dynamo fails on those ("sources must not be empty for symbol")
        self.step = torch.compile(self._update, dynamic=False)

    @torch.no_grad()
    def _update(self) -> None:
        for g in self.opt.param_groups:
            g["lr"].copy_(self.lr * g.get("lr_scale", 1.0))
        if self.grad_clip > 0:
            clip_grad_norm_(self.params, self.grad_clip, self.lead)
        self.opt.step()
        for averaged, current in self.pairs:  # lerp by 1 is an exact copy: the first update needs no branch
            if averaged.is_floating_point():
                averaged.lerp_(current, self.ema_weight)
            else:
                averaged.copy_(current)

    def __call__(self, lr: float) -> None:
        # a warmup's lr 0 gives torch's compiled AdamW NaNs where a gradient is 0 (pytorch#126514); a
        # smallest normal float moves no weight (zeros by 1e-38 at most)
        self.lr.fill_(max(lr, torch.finfo(torch.float32).tiny))
        if self.ema is not None:
            self.ema_weight.fill_(self.ema.next_weight())
        self.step()
