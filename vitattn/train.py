"""Recipes, the lr schedule, evaluation with test-time augmentation and cost counts; with the
helpers of their own modules re-exported (``optim``, ``checkpoint``, ``runtime``) so a training
loop finds everything it needs here.

``train_cifar.py`` is built from these; so can any other loop be.

References: Keller Jordan's airbench (``airbench94.py``: schedule, normalisation on the fly,
six-view test-time augmentation); nanoGPT (a pure ``get_lr``); DeiT (Touvron et al. 2021) for
the ViT recipe.
"""

from __future__ import annotations

import copy
import math
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

# The helpers of a training loop, by concept, re-exported so ``from vitattn.train import ...``
# finds them all.
from .checkpoint import (  # noqa: F401
    CheckpointError,
    append_jsonl,
    check_checkpoint,
    hold,
    load_checkpoint,
    read_jsonl,
    save_atomic,
    save_safetensors,
    write_text_atomic,
)
from .cli import UsageError, option
from .data import PADDING_MODES
from .optim import (  # noqa: F401
    OPTIMIZERS,
    ModelEma,
    Muon,
    OptimizerChain,
    build_optimizer,
    ema_decay_at,
    is_muon_param,
    model_ema,
    muon_lr_ratio,
    orthogonalize,
    param_groups,
    set_lr,
)
from .runtime import (  # noqa: F401
    AMP_DTYPES,
    STOP_SIGNALS,
    Dist,
    Signalled,
    StopFlag,
    all_reduce_,
    all_rng_states,
    autocast,
    average_buffers,
    configure_cuda,
    environment,
    native_bf16,
    pick_device,
    ranks_agree,
    rng_states,
    set_rng_states,
    setup_distributed,
)

# ---------------------------------------------------------------------------------------------
# Recipes: how each model family trains by default
# ---------------------------------------------------------------------------------------------



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
                               choices=PADDING_MODES)

    def __post_init__(self) -> None:
        for name in ("warmup_lr", "min_lr"):
            if getattr(self, name) > self.lr:
                raise UsageError(f"--{name.replace('_', '-')} must not exceed the peak --lr ({self.lr:g}), got "
                                 f"{getattr(self, name):g}")

    def check_data(self, family: str, size: tuple[int, int], num_train: int, world: int = 1) -> None:
        """Refuse a recipe that cannot train on ``num_train`` images of ``size`` over ``world`` processes."""
        for flag, pixels in (("--translate", self.translate), ("--cutout", self.cutout)):
            if pixels >= min(size):  # a shift or hole this large leaves blank images to train on
                raise UsageError(f"{flag} must be smaller than the {size[0]}x{size[1]} images, got {pixels}")
        if self.batch_size % world:
            raise UsageError(f"{family}: --batch-size is the global batch and must split evenly over the {world} "
                             f"processes, got {self.batch_size}; use a multiple of {world}")
        if num_train // world < self.batch_size // world:
            raise UsageError(f"{family}: a batch of {self.batch_size} over {world} process(es) needs at least that "
                             f"many training images, got {num_train}; lower --batch-size")

    def lr_at(self, progress: float) -> float:
        """The learning rate at ``progress`` in [0, 1] of the run (:func:`get_lr`)."""
        return get_lr(progress, self.lr, self.warmup, self.decay, self.warmup_lr, self.min_lr)


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
    "cifar10": {"vit": "vit_cifar10", "cnn": "cnn_cifar10"},
    "long-range": {"vit": "vit_longrange", "cnn": "cnn_longrange"},
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


def run_progress(step: int, total_steps: int | None, seconds: float, budget_s: float | None) -> float:
    """How far a run is, in [0, 1] when unfinished: by its steps or by its time budget (seconds
    of training steps), whichever is further along; the lr schedule runs on it."""
    by_steps = step / total_steps if total_steps else 0.0
    return max(by_steps, seconds / budget_s) if budget_s else by_steps



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


