"""A small CNN baseline with the ViT's interface.

Each stage is ``conv3x3 -> max-pool /2 -> BN -> GELU -> conv3x3 -> BN -> GELU``, after a
3x3 stem; a 32x32 image becomes a 4x4 map after three stages, then a global max-pool (or mean,
``global_pool='avg'``) and a linear head. A convolution sees only its 3x3 neighbourhood, so the
view of a unit widens layer by layer; ``vitattn.context`` measures how far.

Three details from airbench make the network take a high learning rate in a short run (the CIFAR
presets turn them on; docs/training.md has the ablation): logits scaled by 1/9 (``head_scale``),
BatchNorm learning only its shift (``bn_weight=False``), and each conv started as an identity on
its first input channels (``dirac_init``), an implicit residual that lets the signal through
every layer from the first step.

A fourth, ``stem='whiten'``, replaces the 3x3 stem with airbench's patch-whitening layer: a
2x2 convolution whose filters are the eigenvectors of the training images' 2x2-patch covariance,
scaled to unit variance, and their negatives (``whitening_filters``; set once from data by
``SmallCNN.init_stem``, then frozen; only its bias learns). Its outputs start decorrelated, so the
first trainable conv sees a well-conditioned input; it also works on a 31x31 map without
padding, which makes every later layer cheaper.

References: Keller Jordan's airbench (``airbench94.py``), whose network this follows in shape.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

import torch
from einops import rearrange
from torch import nn
from torch.utils.checkpoint import checkpoint

from .constants import CIFAR10_MEAN, CIFAR10_STD
from .contract import TimmModel, resolve_config
from .helpers import check_bool, check_float, check_input_dtype, check_int, feature_take_indices
from .init import whitening_basis


@dataclass(frozen=True)
class CNNConfig:
    in_chans: int = 3  # image channels
    num_classes: int = 10  # classifier outputs; 0 for features only
    stem_width: int = 32  # channels after the stem conv
    widths: tuple[int, ...] = field(default_factory=lambda: (64, 256, 256))  # channels per stage
    drop_rate: float = 0.0  # dropout before the head
    head_scale: float = 1.0  # logits are multiplied by this (airbench uses 1/9: a tempered head takes a high lr)
    bn_weight: bool = True  # learn BatchNorm's scale; False keeps it at 1 (airbench: only the shift is learned)
    bn_momentum: float = 0.1  # BatchNorm's running-statistics update, torch's convention (airbench: 0.4)
    bn_eps: float = 1e-5  # BatchNorm's epsilon (airbench: 1e-12)
    dirac_init: bool = False  # start each conv as an identity on its first in-channels (an implicit residual)
    stem: str = "conv"  # 'conv': conv3x3-BN-GELU; 'whiten': frozen 2x2 patch-whitening conv + GELU (airbench)
    global_pool: str = "max"  # 'max' (airbench) or 'avg' (a mean makes the logits a sum over places); '' no pooling

    def __post_init__(self) -> None:
        for name in ("in_chans", "stem_width"):
            check_int(name, getattr(self, name))
        check_int("num_classes", self.num_classes, low=0)
        if not isinstance(self.widths, (tuple, list)) or not self.widths:
            raise ValueError(f"widths must be a non-empty list of stage widths, got {self.widths!r}")
        for w in self.widths:
            check_int("widths", w)
        check_float("drop_rate", self.drop_rate, 0.0, 1.0)
        check_float("head_scale", self.head_scale, 0.0, low_open=True)
        for name in ("bn_weight", "dirac_init"):
            check_bool(name, getattr(self, name))
        object.__setattr__(self, "widths", tuple(self.widths))
        check_pool(self.global_pool, self.num_classes)
        if self.stem not in ("conv", "whiten"):
            raise ValueError(f"stem must be 'conv' or 'whiten', got {self.stem!r}")
        if not (0.0 <= self.bn_momentum <= 1.0 and self.bn_eps > 0):
            raise ValueError(f"bn_momentum must be in [0, 1] and bn_eps > 0, got {self.bn_momentum}, {self.bn_eps}")
        if self.stem == "whiten" and self.stem_width != 8 * self.in_chans:
            raise ValueError(f"a whitening stem has 2 x (in_chans * 2 * 2) = {8 * self.in_chans} channels "
                             f"(each patch direction and its negative), got stem_width={self.stem_width}")

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def check_images(x: torch.Tensor, in_chans: int, weight: torch.Tensor | None = None, min_size: int = 1) -> None:
    """Images ``(B, in_chans, H, W)`` of at least ``min_size`` pixels a side, floating point (in
    ``weight``'s dtype unless autocast)."""
    if x.ndim != 4 or x.shape[1] != in_chans:
        raise ValueError(f"expected images (B, {in_chans}, H, W), got {tuple(x.shape)}")
    if min(x.shape[-2:]) < min_size:
        raise ValueError(f"images of {x.shape[-2]}x{x.shape[-1]} are too small: each stage halves the map, so this "
                         f"network needs at least {min_size}x{min_size}")
    if weight is not None:
        check_input_dtype(x, weight)


torch.fx.wrap("check_images")  # a call in a torch.fx trace: it reads shapes, which are proxies there


def check_pool(global_pool: str, num_classes: int) -> None:
    if global_pool not in ("max", "avg", ""):
        raise ValueError(f"global_pool must be 'max', 'avg' or '' (no pooling), got {global_pool!r}")
    if global_pool == "" and num_classes > 0:
        raise ValueError(f"global_pool='' returns the unpooled map, which has no classifier: use num_classes=0, got "
                         f"{num_classes}")


def conv_bn(cin: int, cout: int, pool: bool = False, bn_weight: bool = True, dirac_init: bool = False,
            bn_momentum: float = 0.1, bn_eps: float = 1e-5) -> nn.Sequential:
    conv = nn.Conv2d(cin, cout, 3, padding=1, bias=False)
    if dirac_init:
        with torch.no_grad():  # out-channel i starts by copying in-channel i (plus the random rest)
            nn.init.dirac_(conv.weight[: min(cin, cout)])
    layers: list[nn.Module] = [conv]
    if pool:
        layers.append(nn.MaxPool2d(2))
    bn = nn.BatchNorm2d(cout, eps=bn_eps, momentum=bn_momentum)
    if not bn_weight:  # a scale fixed at 1 is a constant, not a parameter that never learns
        freeze(bn, "weight")
    layers += [bn, nn.GELU()]
    return nn.Sequential(*layers)


def freeze(module: nn.Module, name: str) -> None:
    """Turn ``module``'s parameter ``name`` into a buffer of the same name and value: it is saved
    and moved with the module, never trained, and no optimiser or gradient check sees it."""
    value = getattr(module, name).detach()
    delattr(module, name)
    module.register_buffer(name, value)


def whitening_filters(images: torch.Tensor, kernel_size: int = 2, eps: float = 5e-4) -> torch.Tensor:
    """Filters that whiten the ``kernel_size``-square patches of ``images``.

    ``images (B, C, H, W)`` (normalised as the network will see them) ->
    ``(2 * C * k * k, C, k, k)``: the eigenvectors of the patches' second-moment matrix, each
    divided by ``sqrt(eigenvalue + eps)``, largest eigenvalue first, followed by their negatives.
    A convolution with the first half maps patches to coordinates of variance
    ``eigenvalue / (eigenvalue + eps)``, i.e. about 1, and uncorrelated; the negatives let a
    following GELU keep both signs.
    """
    if images.ndim != 4:
        raise ValueError(f"expected images (B, C, H, W), got {tuple(images.shape)}")
    k = kernel_size
    c = images.shape[1]
    patches = images.unfold(2, k, 1).unfold(3, k, 1)  # (B, C, H-k+1, W-k+1, k, k)
    basis = whitening_basis(rearrange(patches, "b c h w kh kw -> (b h w) (c kh kw)"), eps)
    filters = rearrange(basis, "n (c kh kw) -> n c kh kw", c=c, kh=k)
    return torch.cat([filters, -filters]).to(images.dtype if images.is_floating_point() else torch.float32)


def stage_intermediates(stages: nn.ModuleList, x: torch.Tensor, take: list[int], intermediates_only: bool,
                        output_fmt: str = "NCHW", stop_early: bool = False):
    """Run ``stages`` in turn, keeping the maps of those in ``take``: ``(final, maps)`` or ``maps``
    (the stages after the last kept one are skipped for ``maps`` alone, or with ``stop_early``).
    Maps only come as ``'NCHW'`` (timm's argument, checked)."""
    if output_fmt != "NCHW":
        raise ValueError(f"a CNN's intermediates are maps: output_fmt must be 'NCHW', got {output_fmt!r}")
    out = []
    last = max(take) if intermediates_only or stop_early else len(stages) - 1
    for i, stage in enumerate(stages[:last + 1]):
        x = stage(x)
        if i in take:
            out.append(x)
    return out if intermediates_only else (x, out)


class SmallCNN(TimmModel, nn.Module):
    """``(B, C, H, W) -> (B, num_classes)``; stage ``i`` has stride ``2**(i+1)``; timm's contract
    from ``TimmModel``."""

    def __init__(self, config: CNNConfig | None = None, **overrides: Any) -> None:
        super().__init__()
        self.config = c = resolve_config(CNNConfig, config, overrides)
        self.num_classes = c.num_classes
        self.global_pool = c.global_pool
        self.num_features = self.head_hidden_size = c.widths[-1]
        side = 32 - (c.stem == "whiten")  # a 2x2 whitening conv without padding takes one pixel
        strides = [2 ** (i + 1) for i in range(len(c.widths))]
        self.min_size = strides[-1] + (c.stem == "whiten")  # the smallest image every stage can halve
        self.pretrained_cfg = dict(input_size=(c.in_chans, 32, 32), mean=CIFAR10_MEAN, std=CIFAR10_STD,
                                   num_classes=c.num_classes, interpolation="bilinear", crop_pct=1.0,
                                   pool_size=(side // strides[-1],) * 2, first_conv="stem.0", classifier="head")
        self.feature_info = [dict(module=f"stages.{i}", num_chs=w, reduction=r)
                             for i, (w, r) in enumerate(zip(c.widths, strides))]
        opts = dict(bn_weight=c.bn_weight, dirac_init=c.dirac_init, bn_momentum=c.bn_momentum, bn_eps=c.bn_eps)
        if c.stem == "whiten":  # set from data by init_stem; the weights stay fixed, the bias learns
            whiten = nn.Conv2d(c.in_chans, c.stem_width, 2, bias=True)
            freeze(whiten, "weight")
            self.stem = nn.Sequential(whiten, nn.GELU())
        else:
            self.stem = conv_bn(c.in_chans, c.stem_width, **opts)
        widths = (c.stem_width, *c.widths)
        self.stages = nn.ModuleList(
            nn.Sequential(conv_bn(widths[i], widths[i + 1], pool=True, **opts),
                          conv_bn(widths[i + 1], widths[i + 1], **opts))
            for i in range(len(c.widths))
        )
        self.head_drop = nn.Dropout(c.drop_rate)
        self.head = nn.Linear(self.num_features, c.num_classes, bias=False) if c.num_classes > 0 else nn.Identity()

    def init_stem(self, images: torch.Tensor, eps: float = 5e-4) -> None:
        """Set a whitening stem's filters from normalised training ``images (B, C, H, W)``
        (airbench uses 5,000) and zero its bias; a 3x3 conv stem is left as it is."""
        if self.config.stem != "whiten":
            return
        if images.ndim != 4 or images.shape[1] != self.config.in_chans:
            raise ValueError(f"expected images (B, {self.config.in_chans}, H, W), got {tuple(images.shape)}")
        conv = self.stem[0]
        with torch.no_grad():
            conv.weight.copy_(whitening_filters(images.to(conv.weight.device), conv.kernel_size[0], eps))
            conv.bias.zero_()

    def forward_features(self, x: torch.Tensor) -> torch.Tensor:
        """``(B, C, H, W) -> (B, num_features, H/2^S, W/2^S)``."""
        check_images(x, self.config.in_chans, self.stem[0].weight, self.min_size)
        x = self.stem(x)
        for stage in self.stages:
            x = checkpoint(stage, x, use_reentrant=False) if self.grad_checkpointing and torch.is_grad_enabled() \
                else stage(x)
        return x

    # -- timm's hooks beyond TimmModel's (biases and BatchNorm are 1-D: no weight decay by timm's rule) --
    def group_matcher(self, coarse: bool = False) -> dict[str, Any]:
        return dict(stem=r"^stem", blocks=r"^stages\.(\d+)" if coarse else r"^stages\.(\d+)\.(\d+)")

    def forward_head(self, x: torch.Tensor, pre_logits: bool = False) -> torch.Tensor:
        """``(B, C, h, w) -> (B, num_classes)``: global max- or average-pool, dropout, linear;
        with ``global_pool=''`` (and no classifier) the map itself."""
        if self.global_pool == "":
            return x
        x = self.head_drop(x.amax(dim=(2, 3)) if self.global_pool == "max" else x.mean(dim=(2, 3)))
        return x if pre_logits else self.head(x) * self.config.head_scale

    def forward_intermediates(self, x: torch.Tensor, indices: int | list[int] | None = None, norm: bool = False,
                              stop_early: bool = False, output_fmt: str = "NCHW", intermediates_only: bool = False):
        """Per-stage maps ``(B, C_i, H/2^(i+1), W/2^(i+1))``; ``indices`` as in the ViT; timm's
        signature (``norm`` has nothing to apply: the stages end in BatchNorm + GELU)."""
        take = feature_take_indices(len(self.stages), indices)
        check_images(x, self.config.in_chans, min_size=self.min_size)
        return stage_intermediates(self.stages, self.stem(x), take, intermediates_only, output_fmt, stop_early)

    def check_global_pool(self, global_pool: str, num_classes: int) -> None:
        check_pool(global_pool, num_classes)  # '' (the unpooled map) needs num_classes=0

    def new_classifier(self, num_classes: int) -> None:
        self.head = nn.Linear(self.num_features, num_classes, bias=False) if num_classes > 0 else nn.Identity()
