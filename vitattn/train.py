"""What a training script needs besides the model: recipes, the lr schedule, optimiser groups,
evaluation with test-time augmentation, checkpoints that survive a crash, a
Ctrl-C flag, the distributed helpers, cost counts and the run's environment.

``train_cifar.py`` is built from these; so can any other loop be.

References: Keller Jordan's airbench (``airbench94.py``: schedule, normalisation on the fly,
six-view test-time augmentation); nanoGPT (a pure ``get_lr``); DeiT (Touvron et al. 2021) for
the ViT recipe.
"""

from __future__ import annotations

import contextlib
import copy
import json
import math
import os
import platform
import signal
import subprocess
import sys
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any

try:
    import fcntl  # the run folder's lock; POSIX only
except ImportError:  # pragma: no cover
    fcntl = None

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from .cli import Signalled, option

# ---------------------------------------------------------------------------------------------
# Recipes: how each model family trains by default
# ---------------------------------------------------------------------------------------------

OPTIMIZERS = ("adamw", "sgd", "muon")


@dataclass
class Recipe:
    """How one model family trains. Each field is also a ``train_cifar.py`` option (its help text
    is here, declared once); a value given there overrides the family's recipe."""

    optimizer: str = option(help="'adamw', 'sgd' (Nesterov) or 'muon' (Muon on the ViT blocks' matrices, AdamW "
                                 "on the rest)", choices=OPTIMIZERS)
    batch_size: int = option(help="images per step, global: split evenly over the processes of a torchrun")
    lr: float = option(help="peak learning rate")
    weight_decay: float = option(help="weight decay (decoupled for AdamW, L2 for SGD; not on biases, norms, "
                                      "position tables)")
    warmup: float = option(help="fraction of the run spent warming up the lr, in [0, 1)")
    decay: str = option(help="the lr's decay after the warmup", choices=("cosine", "linear"))
    label_smoothing: float = option(help="cross-entropy target smoothing, in [0, 1)")
    grad_clip: float = option(help="max gradient norm; 0 = off", aliases=("--clip-grad",))
    translate: int = option(help="augmentation: max shift in pixels")
    cutout: int = option(help="augmentation: zeroed square side in pixels; 0 = off")
    epochs: float = option(help="passes over the training set when neither epochs nor a time budget is given")
    momentum: float = option(0.9, "SGD's (Nesterov) momentum, or AdamW's beta1, in [0, 1)")
    beta2: float = option(0.999, "AdamW's beta2, in [0, 1)")
    bias_lr_scale: float = option(1.0, "lr multiplier for biases and other parameters without weight decay "
                                       "(airbench's bias_scaler)")
    model_ema_decay: float = option(0.0, "keep and report an exponential moving average of the weights with this "
                                         "decay (timm's --model-ema-decay), in [0, 1); 0 = off")
    warmup_lr: float = option(0.0, "lr at the start of the warmup (timm's --warmup-lr)")
    min_lr: float = option(0.0, "lr at the end of the decay (timm's --min-lr)")
    padding_mode: str = option("constant", "augmentation: what a shift brings in at the border, zeros "
                                           "('constant') or the mirrored image ('reflect')",
                               choices=("constant", "reflect"))
    lookahead_decay: float = option(0.0, "airbench's lookahead (Lookahead): pull the weights back to a slow "
                                         "average every 5 steps from 30%% of the run on, with this base decay "
                                         "(airbench: 0.95), in [0, 1); 0 = off")


RECIPES: dict[str, Recipe] = {
    # Muon on the blocks' matrices (AdamW on the rest) learns far more per epoch than AdamW alone,
    # and batch 128 more than 256 (twice the steps; docs/training.md); DeiT's cosine, label
    # smoothing and clipping with little regularisation, as a ViT trained for minutes under-fits
    # (Touvron et al. 2021); for the same reason shifts of 2 px, not 4.
    "vit": Recipe(optimizer="muon", batch_size=128, lr=2e-3, weight_decay=0.05, warmup=0.05, decay="cosine",
                  label_smoothing=0.1, grad_clip=1.0, translate=2, cutout=0, epochs=30, beta2=0.99),
    # airbench's recipe in plain PyTorch: Nesterov SGD, a linear ramp up and down, label smoothing
    # 0.2, flip + 2-px translate; the high lr is stable thanks to the CNN presets' airbench details.
    "cnn": Recipe(optimizer="sgd", batch_size=512, lr=0.8, weight_decay=5e-4, warmup=0.1, decay="linear",
                  label_smoothing=0.2, grad_clip=5.0, translate=2, cutout=0, epochs=10),
}

# Per-dataset changes: the long-range task's 20,000 images give too few steps at CIFAR's batch
# sizes. The CNN solves it in its first of three epochs; the ViT leaves chance after a
# seed-dependent number of steps, so it gets six (docs/context.md).
# Its labels are exact and a shift can push a mark out of the frame: no shifts, no smoothing for
# either family. The ViT learns it with AdamW at 1e-3 and not with Muon (docs/context.md).
DATASET_RECIPES: dict[str, dict[str, dict[str, Any]]] = {
    "long-range": {"cnn": dict(batch_size=64, lr=0.1, epochs=3, translate=0, label_smoothing=0.0),
                   "vit": dict(batch_size=64, epochs=6, translate=0, label_smoothing=0.0, optimizer="adamw", lr=1e-3)},
}

# CIFAR-10: cheap models, which see many epochs in a CPU budget; the ViT's 4x MLP and eight
# blocks cost 1.4x the FLOPs each and learn more in ten epochs than the 2x MLP and six blocks
# (docs/training.md). Long-range: both read out by a mean over places, so a label about two
# places needs a layer that sees both; the ViT has two blocks, as six do not leave chance in
# three epochs there, and rotary codes beside its sin-cos table, without which some seeds stay
# at chance (docs/context.md).
DEFAULT_PRESETS: dict[str, dict[str, str]] = {
    "cifar10": {"vit": "vit_cifar_small_patch4_mlp4_depth8", "cnn": "cnn_cifar_whiten"},
    "long-range": {"vit": "vit_cifar_shallow_patch4_rope_gap_sincos", "cnn": "cnn_cifar_gap"},
}


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


def param_groups(model: nn.Module, weight_decay: float, no_decay_lr_scale: float = 1.0) -> list[dict]:
    """Decay matrices and kernels; leave biases, norm scales, tokens and position tables alone.

    Each group carries timm's ``lr_scale``: the loop sets a group's lr to the scheduled lr times it,
    so ``no_decay_lr_scale`` speeds up the biases alone (airbench trains BatchNorm shifts 64x faster).
    """
    decay, no_decay = [], []
    for name, p in model.named_parameters():
        if not p.requires_grad:
            continue
        skip = p.ndim <= 1 or name.endswith(("pos_embed", "cls_token"))
        (no_decay if skip else decay).append(p)
    return [{"params": decay, "weight_decay": weight_decay, "lr_scale": 1.0},
            {"params": no_decay, "weight_decay": 0.0, "lr_scale": no_decay_lr_scale}]


def set_lr(optimizer: torch.optim.Optimizer | OptimizerChain, lr: float) -> None:
    """Set every group's lr to ``lr`` times its ``lr_scale`` (1 when absent)."""
    for g in optimizer.param_groups:
        g["lr"] = lr * g.get("lr_scale", 1.0)




def orthogonalize(g: torch.Tensor, coefficients: tuple[float, float, float], steps: int, eps: float,
                  dtype: torch.dtype) -> torch.Tensor:
    """Muon's quintic Newton-Schulz iteration, run in ``dtype``: pushes the singular values of the
    2-D ``g`` towards 1 (to roughly 0.5-1.5), keeping its singular vectors (Jordan et al. 2024)."""
    x = g.to(dtype)
    tall = g.size(0) > g.size(1)
    if tall:  # iterate on the wide side: the Gram matrix is the smaller one
        x = x.T
    x = x / x.norm().clamp(min=eps)  # Frobenius norm >= spectral norm: singular values <= 1
    a, b, c = coefficients
    for _ in range(steps):
        gram = x @ x.T
        x = torch.addmm(x, torch.addmm(gram, gram, gram, beta=b, alpha=c), x, beta=a)
    return x.T if tall else x


def muon_lr_ratio(adjust_lr_fn: str | None, shape: torch.Size) -> float:
    """``torch.optim.Muon``'s per-matrix lr factor; ``'match_rms_adamw'`` gives updates AdamW's RMS."""
    fan_out, fan_in = shape[:2]
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
    equal torch's bit for bit (tests/test_train.py). Our own class rather than a subclass of
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
                if p.ndim != 2:
                    raise ValueError(f"Muon steps 2-D weights only, got one of shape {tuple(p.shape)}")
        self.ns_dtype = ns_dtype

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            lr, momentum = group["lr"], group["momentum"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                buf = self.state[p].setdefault("momentum_buffer", torch.zeros_like(p.grad))
                buf.lerp_(p.grad, 1 - momentum)
                update = p.grad.lerp(buf, momentum) if group["nesterov"] else buf
                dtype = self.ns_dtype or (torch.bfloat16 if p.is_cuda else torch.float32)
                update = orthogonalize(update, group["ns_coefficients"], group["ns_steps"], group["eps"], dtype)
                p.mul_(1 - lr * group["weight_decay"])
                p.add_(update, alpha=-lr * muon_lr_ratio(group["adjust_lr_fn"], p.shape))
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


def is_muon_param(name: str, p: torch.Tensor) -> bool:
    """Muon orthogonalises matrix updates: the blocks' linear weights. Embeddings, the patch
    projection, norms, biases and the head keep AdamW (Jordan et al. 2024)."""
    return p.ndim == 2 and name.startswith("blocks.")


def build_optimizer(model: nn.Module, r: Recipe) -> torch.optim.Optimizer | OptimizerChain:
    """``'adamw'``, Nesterov ``'sgd'``, or ``'muon'``: ``Muon`` (``torch.optim.Muon``, Nesterov momentum
    0.95, its update rescaled to AdamW's RMS so one lr serves both) on ``is_muon_param`` weights
    and AdamW on the rest."""
    if r.optimizer not in OPTIMIZERS:
        raise ValueError(f"optimizer must be one of {OPTIMIZERS}, got {r.optimizer!r}")
    if r.optimizer == "sgd":
        return torch.optim.SGD(param_groups(model, r.weight_decay, r.bias_lr_scale), lr=r.lr, momentum=r.momentum,
                               nesterov=True)
    if r.optimizer == "adamw":
        return torch.optim.AdamW(param_groups(model, r.weight_decay, r.bias_lr_scale), lr=r.lr,
                                 betas=(r.momentum, r.beta2))
    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    matrices = [p for n, p in named if is_muon_param(n, p)]
    if not matrices:
        raise ValueError(f"optimizer 'muon' needs 2-D weights in blocks.*; {type(model).__name__} has none")
    muon = Muon(matrices, lr=r.lr, weight_decay=r.weight_decay, momentum=0.95, adjust_lr_fn="match_rms_adamw")
    keep = {id(p) for p in matrices}
    rest = [{**g, "params": [p for p in g["params"] if id(p) not in keep]}
            for g in param_groups(model, r.weight_decay, r.bias_lr_scale)]
    return OptimizerChain(muon, torch.optim.AdamW(rest, lr=r.lr, betas=(r.momentum, r.beta2)))


def ema_decay_at(decay: float, n: int) -> float:
    """The EMA's decay at its ``n``-th update: ``min(decay, (1 + n) / (10 + n))``, so the first
    updates move fast and the random start does not linger (TensorFlow's ``num_updates`` rule)."""
    return min(decay, (1 + n) / (10 + n))


def model_ema(model: nn.Module, decay: float) -> torch.optim.swa_utils.AveragedModel:
    """An exponential moving average of ``model``'s weights and buffers (timm's ``--model-ema``).

    ``ema.update_parameters(model)`` after each optimiser step moves every floating tensor
    towards the model's by ``1 - ema_decay_at(decay, n)`` and copies integer buffers; ``ema.module``
    is the averaged model, ``ema.state_dict()`` holds it and ``n``.
    """
    if not 0.0 < decay < 1.0:
        raise ValueError(f"the EMA decay must be in (0, 1), got {decay}")

    @torch.no_grad()
    def update(averaged: list[torch.Tensor], current: list[torch.Tensor], n: torch.Tensor) -> None:
        if averaged[0].is_floating_point():  # AveragedModel groups tensors by dtype
            torch._foreach_lerp_(averaged, current, 1.0 - ema_decay_at(decay, int(n)))
        else:
            torch._foreach_copy_(averaged, current)

    return torch.optim.swa_utils.AveragedModel(model, multi_avg_fn=update, use_buffers=True)


class Lookahead:
    """airbench's lookahead: slow weights the fast (optimised) ones are pulled back to.

    From ``start`` of the run on, every ``every`` steps: ``slow <- rho * slow + (1 - rho) * fast``,
    then ``fast <- slow``, for every floating tensor of the state dict (BatchNorm statistics
    too), with ``rho = (decay ** every) * progress ** power``, so it barely holds the weights back
    early and averages strongly at the end (Zhang et al. 2019's Lookahead with a growing step;
    Jordan 2024). Unlike an EMA that only reads the weights, training continues from the average.
    """

    def __init__(self, model: nn.Module, decay: float, every: int = 5, power: float = 3.0, start: float = 0.3) -> None:
        if not 0.0 < decay < 1.0:
            raise ValueError(f"the lookahead decay must be in (0, 1), got {decay}")
        self.model, self.decay, self.every, self.power, self.start = model, decay, every, power, start
        self.slow: dict[str, torch.Tensor] | None = None  # made at the first sync after ``start``

    def _floats(self) -> dict[str, torch.Tensor]:
        return {k: v for k, v in self.model.state_dict().items() if v.is_floating_point()}

    @torch.no_grad()
    def step(self, global_step: int, progress: float) -> None:
        """Call after each optimiser step with the steps taken and the run's progress in [0, 1]."""
        if progress < self.start or global_step % self.every:
            return
        fast = self._floats()
        if self.slow is None:
            self.slow = {k: v.detach().clone() for k, v in fast.items()}
            return
        rho = self.decay ** self.every * min(progress, 1.0) ** self.power
        for k, v in fast.items():
            self.slow[k].lerp_(v, 1.0 - rho)
            v.copy_(self.slow[k])

    @torch.no_grad()
    def sync(self) -> None:
        """``fast <- slow`` (airbench does it after every epoch, so the model tested is the average)."""
        if self.slow is not None:
            for k, v in self._floats().items():
                v.copy_(self.slow[k])

    def state_dict(self) -> dict:
        return {"slow": self.slow}

    def load_state_dict(self, state: dict) -> None:
        slow, fast = state["slow"], self._floats()  # onto the model's device: checkpoints load on the CPU
        self.slow = None if slow is None else {k: v.to(fast[k].device) for k, v in slow.items()}


# ---------------------------------------------------------------------------------------------
# Cost
# ---------------------------------------------------------------------------------------------


def count_params(model: nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())


def flops_per_image(model: nn.Module, img_size: tuple[int, int], in_chans: int = 3) -> int:
    """Forward FLOPs of one image (``torch.utils.flop_counter``; a multiply-add counts 2).

    Counted on a copy on the ``meta`` device: no arithmetic is done, and the layers take their
    plain PyTorch path there, whose matrix products the counter sees.
    """
    from torch.utils.flop_counter import FlopCounterMode

    ghost = copy.deepcopy(model).to("meta").eval()
    with torch.no_grad(), FlopCounterMode(display=False) as counter:
        ghost(torch.zeros(1, in_chans, *img_size, device="meta"))
    return int(counter.get_total_flops())


# ---------------------------------------------------------------------------------------------
# Evaluation
# ---------------------------------------------------------------------------------------------


@dataclass
class Dist:
    """This process's place in a distributed run (a single process by default)."""

    rank: int = 0
    world: int = 1
    local_rank: int = 0

    @property
    def main(self) -> bool:
        return self.rank == 0


def all_reduce_(t: torch.Tensor, dd: Dist, op=None) -> torch.Tensor:
    """Sum (or ``op``) ``t`` over ranks in place; a no-op in a single process."""
    if dd.world > 1:
        dist.all_reduce(t, op=op or dist.ReduceOp.SUM)
    return t


def _tta_probs(model: nn.Module, xb: torch.Tensor, logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """airbench's views: the image and its mirror (``pair``), and both shifted one pixel up-left
    and down-right with reflect padding, each with its mirror (``four``)."""
    pair = (logits.softmax(1) + model(xb.flip(3)).float().softmax(1)) / 2
    padded = F.pad(xb, (1, 1, 1, 1), mode="reflect")
    shifted = torch.cat([padded[..., :-2, :-2], padded[..., 2:, 2:]])
    four = model(torch.cat([shifted, shifted.flip(3)])).float().softmax(1).view(4, len(xb), -1).mean(0)
    return pair, four


@torch.no_grad()
def evaluate(model: nn.Module, norm: nn.Module, x: torch.Tensor, y: torch.Tensor, *, batch_size: int = 500,
             device: torch.device | str = "cpu", dd: Dist | None = None, channels_last: bool = False,
             tta: bool = False, amp_dtype: torch.dtype | None = None) -> dict:
    """Test loss, accuracy and the per-image hits of uint8 images ``x`` (ranks split them and sum).

    With ``tta`` also ``acc_tta`` (softmax averaged over each image and its mirror) and
    ``acc_tta_shift`` (airbench's six views, its ``tta_level=2``: half weight on that pair, half
    on the two one-pixel shifts and their mirrors). ``acc`` is always the plain accuracy.
    ``amp_dtype`` runs the model under autocast. Sums stay on ``device`` (what NCCL reduces) and
    are read once at the end, so a GPU is not stalled after every batch.
    """
    dd = dd or Dist()
    device = torch.device(device)
    was_training = model.training
    model.eval()
    idx = torch.arange(dd.rank, len(x), dd.world, device=x.device)
    sums = torch.zeros(5, dtype=torch.float64, device=device)  # loss, correct, flip-TTA, 6-view, count
    hits = torch.zeros(len(x), dtype=torch.int32, device=device)
    for j in idx.split(batch_size):
        xb = norm(x[j].to(device))
        if channels_last:
            xb = xb.contiguous(memory_format=torch.channels_last)
        yb = y[j].to(device)
        with autocast(device, amp_dtype):
            logits = model(xb).float()
        ok = logits.argmax(1) == yb
        sums[0] += F.cross_entropy(logits, yb, reduction="sum")
        sums[1] += ok.sum()
        sums[4] += len(j)
        hits[j.to(device)] = ok.int()
        if tta:
            with autocast(device, amp_dtype):
                pair, four = _tta_probs(model, xb, logits)
            sums[2] += (pair.argmax(1) == yb).sum()
            sums[3] += ((pair + four).argmax(1) == yb).sum()
    model.train(was_training)
    all_reduce_(sums, dd)
    all_reduce_(hits, dd)
    loss, correct, flip, views, count = (sums / sums[4]).tolist()
    out = {"loss": loss, "acc": correct, "hits": hits.bool().cpu()}
    if tta:
        out["acc_tta"], out["acc_tta_shift"] = flip, views
    return out


# ---------------------------------------------------------------------------------------------
# Files that survive a crash
# ---------------------------------------------------------------------------------------------


class CheckpointError(RuntimeError):
    """A checkpoint that cannot be read; the message names it, and the file is left as it is."""


def save_atomic(obj: Any, path: Path) -> None:
    """``torch.save`` to a temp file, then rename: a crash never leaves half a checkpoint."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    torch.save(obj, tmp)
    os.replace(tmp, path)


def write_text_atomic(path: Path, text: str) -> None:
    path = Path(path)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


def load_checkpoint(path: Path) -> dict:
    """``torch.load(weights_only=True)`` onto the CPU, whatever device saved it: ``load_state_dict``
    moves weights and optimiser state to the model's device, and random states must stay CPU
    tensors. An unreadable file raises a ``CheckpointError`` naming it."""
    try:
        ck = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as e:  # a damaged file surfaces as zip, pickle, EOF or OS errors, depending on where
        raise CheckpointError(f"checkpoint {path} is unreadable ({type(e).__name__}: {str(e).splitlines()[0]}); "
                              "it was left untouched. Move it away to train that model afresh.") from e
    if not isinstance(ck, dict) or not {"model", "optimizer", "state"} <= set(ck):
        raise CheckpointError(f"checkpoint {path} is not a training checkpoint (expected model, optimizer and "
                              "state entries); it was left untouched.")
    return ck


@contextlib.contextmanager
def hold(out: Path, main_rank: bool):
    """Hold the run folder for this process (a lock on the folder itself: nothing is written), so
    a second ``--resume`` of it is refused while this one runs; the lock ends with the process."""
    if not main_rank or fcntl is None:
        yield
        return
    fd = os.open(out, os.O_RDONLY)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise CheckpointError(f"{out} is in use by another process running it; wait for it to end or stop "
                                  "it first") from None
        yield
    finally:
        os.close(fd)


def check_checkpoint(ck: dict, model: nn.Module, family: str, path: Path) -> None:
    """A checkpoint must hold this run's model: same family, same weights' names and shapes."""
    ours, theirs = model.state_dict(), ck["model"]
    wrong = [k for k in ours if k not in theirs or tuple(theirs[k].shape) != tuple(ours[k].shape)]
    wrong += [k for k in theirs if k not in ours]
    if ck.get("family", family) != family or wrong:
        raise CheckpointError(f"checkpoint {path} does not hold this run's {family} model (a {ck.get('family')} "
                              f"checkpoint; {len(wrong)} weights differ in name or shape, e.g. {wrong[:3]}); it was "
                              "left untouched")


def save_safetensors(model: nn.Module, path: Path) -> None:
    """The model's weights as a ``.safetensors`` file (atomic), for loading without pickle."""
    from safetensors.torch import save_file

    tmp = Path(path).with_name(Path(path).name + ".tmp")
    save_file({k: v.detach().contiguous().cpu() for k, v in model.state_dict().items()}, str(tmp))
    os.replace(tmp, path)


def append_jsonl(path: Path, row: dict) -> None:
    with open(path, "a") as f:
        f.write(json.dumps(row) + "\n")


def read_jsonl(path: Path) -> list[dict]:
    """The rows of a JSON-lines file; an unterminated last line (a crash mid-write) is left out."""
    text = Path(path).read_text()
    lines = text.splitlines()
    if lines and not text.endswith("\n"):
        try:
            json.loads(lines[-1])
        except json.JSONDecodeError:
            lines.pop()
    return [json.loads(s) for s in lines if s.strip()]


# ---------------------------------------------------------------------------------------------
# Ctrl-C, devices, processes
# ---------------------------------------------------------------------------------------------


STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM)  # Ctrl-C, and what kill, schedulers and containers send


class StopFlag:
    """SIGINT or SIGTERM sets a flag that the loop checks between steps (``signum`` says which came);
    a second one raises ``Signalled`` at once."""

    def __init__(self) -> None:
        self.signum: int | None = None
        self._old: dict[int, Any] = {}

    @property
    def set(self) -> bool:
        return self.signum is not None

    def __enter__(self) -> StopFlag:
        if threading.current_thread() is threading.main_thread():
            for s in STOP_SIGNALS:
                if signal.getsignal(s) is not None:
                    self._old[s] = signal.signal(s, self._handle)
        return self

    def _handle(self, signum, frame) -> None:
        if self.set:
            raise Signalled(signum)
        self.signum = signum
        print(f"\n{signal.Signals(signum).name}: saving a resumable checkpoint after this step (send it again to "
              "abort)", file=sys.stderr, flush=True)

    def __exit__(self, *exc) -> None:
        for s, old in self._old.items():
            signal.signal(s, old)


def pick_device(name: str, local_rank: int = 0) -> torch.device:
    """``'auto'`` is CUDA (this rank's GPU) when present, else the CPU; other names as torch reads them.
    Raises a ``ValueError`` for a name torch does not know or a CUDA device that is not there."""
    if name == "auto":
        return torch.device(f"cuda:{local_rank}") if torch.cuda.is_available() else torch.device("cpu")
    try:
        dev = torch.device(name)
    except RuntimeError as e:
        raise ValueError(f"device {name!r} is not a device torch knows (expected auto, cpu, cuda, cuda:N)") from e
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"device {name!r} asked for, but this machine has no CUDA device; use --device cpu")
    return dev


def rng_states(device: torch.device) -> dict[str, torch.Tensor]:
    """The random states a training step draws from: the CPU's, and ``device``'s when it is a GPU
    (dropout and drop-path draw there)."""
    states = {"cpu": torch.get_rng_state()}
    if device.type == "cuda":
        states["cuda"] = torch.cuda.get_rng_state(device)
    return states


def set_rng_states(states: dict[str, torch.Tensor], device: torch.device) -> None:
    """Restore ``rng_states``; a checkpoint written on the CPU resumed on a GPU keeps the GPU's seed."""
    torch.set_rng_state(states["cpu"].cpu())
    if device.type == "cuda" and "cuda" in states:
        torch.cuda.set_rng_state(states["cuda"].cpu(), device)


AMP_DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16}


def native_bf16(device: torch.device | str) -> bool:
    """Whether ``device`` multiplies bf16 in hardware: a CUDA GPU that says so, or a CPU with the
    ``avx512_bf16`` or ``amx_bf16`` flags (Linux). Elsewhere bf16 products are emulated, many
    times slower than fp32 (docs/performance.md)."""
    device = torch.device(device)
    if device.type == "cuda":
        return torch.cuda.is_bf16_supported()
    if device.type != "cpu":
        return False
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                return bool({"avx512_bf16", "amx_bf16"} & set(line.split(":", 1)[1].split()))
    return False


def autocast(device: torch.device | str, dtype: torch.dtype | None) -> contextlib.AbstractContextManager:
    """``torch.autocast`` in ``dtype`` on ``device``, or nothing for ``None`` (fp32)."""
    if dtype is None:
        return contextlib.nullcontext()
    return torch.autocast(torch.device(device).type, dtype=dtype)


def setup_distributed(device: torch.device) -> Dist:
    """Join the process group that ``torchrun`` describes in the environment (gloo on CPU,
    nccl on CUDA); a single process when there is none."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world <= 1:
        return Dist()
    if not dist.is_initialized():
        dist.init_process_group("nccl" if device.type == "cuda" else "gloo")
    return Dist(dist.get_rank(), dist.get_world_size(), int(os.environ.get("LOCAL_RANK", "0")))


def average_buffers(model: nn.Module, dd: Dist) -> None:
    """Average floating buffers (BatchNorm statistics) over ranks, so that every rank evaluates
    and saves one and the same model."""
    if dd.world == 1:
        return
    for b in model.buffers():
        if b.is_floating_point():
            dist.all_reduce(b)
            b /= dd.world


def environment(device: torch.device, repo: Path | None = None) -> dict:
    """What ran this: device, CPU, library versions, and the git commit of ``repo`` (by default
    the folder holding the package, i.e. the checkout of an editable install)."""
    from . import __version__

    env = {"device": str(device), "python": platform.python_version(), "torch": torch.__version__,
           "vitattn": __version__, "platform": platform.platform(), "threads": torch.get_num_threads(),
           "cpu_count": os.cpu_count()}
    if device.type == "cuda":
        env["gpu"] = torch.cuda.get_device_name(device)
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                env["cpu"] = line.split(":", 1)[1].strip()
                break
    for mod in ("torchvision", "timm", "einops", "matplotlib"):
        with contextlib.suppress(ImportError):
            env[mod] = __import__(mod).__version__
    try:
        git = ["git", "-C", str(repo or Path(__file__).resolve().parents[1])]
        env["git_commit"] = subprocess.run([*git, "rev-parse", "HEAD"], capture_output=True, text=True,
                                           timeout=10).stdout.strip() or None
        env["git_dirty"] = bool(subprocess.run([*git, "status", "--porcelain", "--untracked-files=no"],
                                               capture_output=True, text=True, timeout=10).stdout.strip())
    except (OSError, subprocess.SubprocessError):
        env["git_commit"] = None
    return env
