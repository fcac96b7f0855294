"""A bag-of-local-features control: what a model can do without relating distant regions.

Two 3x3 convolutions see 5x5 neighbourhoods; a global mean and max pool then throw away where
each feature was, and a small MLP reads the pooled bag. Whatever this model solves, a task can be
solved by *which local appearances are present* (and how often), without bringing two distant
regions together. A long-range task that means what it says keeps this control near chance.

References: Brendel & Bethge 2019, "Approximating CNNs with Bag-of-local-Features models works
surprisingly well on ImageNet" (BagNet).
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import asdict, dataclass
from typing import Any

import torch
from torch import nn

from .cnn import check_images, conv_bn, stage_intermediates
from .contract import TimmModel, resolve_config
from .helpers import check_int, feature_take_indices

torch.fx.wrap("check_images")  # a call in a torch.fx trace: it reads shapes, which are proxies there


@dataclass(frozen=True)
class BagOfFeaturesConfig:
    in_chans: int = 3  # image channels
    num_classes: int = 2  # classifier outputs; 0 for the head's hidden features
    width: int = 64  # channels of both convolutions
    hidden: int = 64  # width of the MLP head's hidden layer
    global_pool: str = "avgmax"  # the bag: [mean, max] over positions; '' (with num_classes=0) keeps the map

    def __post_init__(self) -> None:
        for name in ("in_chans", "width", "hidden"):
            check_int(name, getattr(self, name))
        check_int("num_classes", self.num_classes, low=0)
        check_pool(self.global_pool, self.num_classes)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def check_pool(global_pool: str, num_classes: int) -> None:
    if global_pool not in ("avgmax", ""):
        raise ValueError(f"global_pool must be 'avgmax' (the bag) or '' (no pooling), got {global_pool!r}")
    if global_pool == "" and num_classes > 0:
        raise ValueError(f"global_pool='' returns the unpooled map, which has no classifier: use num_classes=0, got "
                         f"{num_classes}")


class BagOfLocalFeatures(TimmModel, nn.Module):
    """``(B, C, H, W) -> (B, num_classes)``: conv3x3-BN-GELU twice (stride 1), then
    ``[mean, max]`` over positions ``(B, 2 * width)``, then Linear-GELU-Linear. The CNN's
    interface (``stages``, ``forward_intermediates``), so the context measures apply, and timm's
    (``num_features`` is the maps' width, ``head_hidden_size`` the MLP's, the classifier
    ``head.fc``)."""

    def __init__(self, config: BagOfFeaturesConfig | None = None, **overrides: Any) -> None:
        super().__init__()
        self.config = c = resolve_config(BagOfFeaturesConfig, config, overrides)
        self.num_classes = c.num_classes
        self.global_pool = c.global_pool
        self.num_features, self.head_hidden_size = c.width, c.hidden
        self.pretrained_cfg = dict(input_size=(c.in_chans, 32, 32), mean=(0.5,) * 3, std=(0.5,) * 3,
                                   num_classes=c.num_classes, interpolation="bilinear", crop_pct=1.0,
                                   pool_size=(32, 32), first_conv="stages.0.0", classifier="head.fc")
        self.stages = nn.ModuleList([conv_bn(c.in_chans, c.width), conv_bn(c.width, c.width)])
        self.feature_info = [dict(module=f"stages.{i}", num_chs=c.width, reduction=1) for i in range(2)]
        self.head = nn.Sequential(OrderedDict(pre=nn.Linear(2 * c.width, c.hidden), act=nn.GELU(),
                                              fc=self._classifier(c.num_classes)))

    def _classifier(self, num_classes: int) -> nn.Module:
        return nn.Linear(self.config.hidden, num_classes) if num_classes > 0 else nn.Identity()

    def forward_features(self, x: torch.Tensor) -> torch.Tensor:
        """``(B, C, H, W) -> (B, width, H, W)``: local features, each from a 5x5 neighbourhood."""
        check_images(x, self.config.in_chans)
        for stage in self.stages:
            x = stage(x)
        return x

    def forward_head(self, x: torch.Tensor, pre_logits: bool = False) -> torch.Tensor:
        """``(B, width, h, w) -> (B, num_classes)``: the pooled bag, position discarded, through
        the MLP (``pre_logits``: its hidden features); with ``global_pool=''`` the map itself."""
        if self.global_pool == "":
            return x
        bag = torch.cat([x.mean(dim=(2, 3)), x.amax(dim=(2, 3))], dim=1)
        hidden = self.head.act(self.head.pre(bag))
        return hidden if pre_logits else self.head.fc(hidden)

    def forward_intermediates(self, x: torch.Tensor, indices: int | list[int] | None = None, norm: bool = False,
                              stop_early: bool = False, output_fmt: str = "NCHW", intermediates_only: bool = False):
        """The map after each convolution ``(B, width, H, W)``; ``indices`` as in the ViT; timm's
        signature (``norm`` has nothing to apply)."""
        take = feature_take_indices(len(self.stages), indices)
        check_images(x, self.config.in_chans)
        return stage_intermediates(self.stages, x, take, intermediates_only, output_fmt, stop_early)

    # -- timm's hooks beyond TimmModel's ----------------------------------------------------
    def group_matcher(self, coarse: bool = False) -> dict[str, Any]:
        return dict(stem=r"^stages\.0", blocks=r"^stages\.(\d+)")

    def set_grad_checkpointing(self, enable: bool = True) -> None:
        if enable:
            raise RuntimeError("the bag of local features has two layers: nothing to checkpoint")

    def check_global_pool(self, global_pool: str, num_classes: int) -> None:
        check_pool(global_pool, num_classes)

    def new_classifier(self, num_classes: int) -> None:  # num_classes=0 leaves the MLP's hidden features
        self.head.fc = self._classifier(num_classes)
