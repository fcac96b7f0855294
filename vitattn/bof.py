"""A bag-of-local-features control: what a model can do without relating distant regions.

Two 3x3 convolutions see 5x5 neighbourhoods; a global mean and max pool then throw away where
each feature was, and a small MLP reads the pooled bag. Whatever this model solves, a task can be
solved by *which local appearances are present* (and how often), without bringing two distant
regions together. A long-range task that means what it says keeps this control near chance.

References: Brendel & Bethge 2019, "Approximating CNNs with Bag-of-local-Features models works
surprisingly well on ImageNet" (BagNet).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

import torch
from torch import nn

from .cnn import conv_bn, stage_intermediates
from .helpers import feature_take_indices


@dataclass
class BagOfFeaturesConfig:
    in_chans: int = 3  # image channels
    num_classes: int = 2  # classifier outputs
    width: int = 64  # channels of both convolutions
    hidden: int = 64  # width of the MLP head's hidden layer

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


class BagOfLocalFeatures(nn.Module):
    """``(B, C, H, W) -> (B, num_classes)``: conv3x3-BN-GELU twice (stride 1), then
    ``[mean, max]`` over positions ``(B, 2 * width)``, then Linear-GELU-Linear. The CNN's
    interface (``stages``, ``forward_intermediates``), so the context measures apply."""

    def __init__(self, config: BagOfFeaturesConfig | None = None, **overrides: Any) -> None:
        super().__init__()
        if config is None:
            config = BagOfFeaturesConfig(**overrides)
        elif overrides:
            config = BagOfFeaturesConfig(**{**config.to_dict(), **overrides})
        self.config = c = config
        self.num_classes = c.num_classes
        self.num_features = 2 * c.width
        self.stages = nn.ModuleList([conv_bn(c.in_chans, c.width), conv_bn(c.width, c.width)])
        self.head = nn.Sequential(nn.Linear(2 * c.width, c.hidden), nn.GELU(), nn.Linear(c.hidden, c.num_classes))

    def forward_features(self, x: torch.Tensor) -> torch.Tensor:
        """``(B, C, H, W) -> (B, width, H, W)``: local features, each from a 5x5 neighbourhood."""
        if x.ndim != 4 or x.shape[1] != self.config.in_chans:
            raise ValueError(f"expected images (B, {self.config.in_chans}, H, W), got {tuple(x.shape)}")
        for stage in self.stages:
            x = stage(x)
        return x

    def forward_head(self, x: torch.Tensor, pre_logits: bool = False) -> torch.Tensor:
        """``(B, width, h, w) -> (B, num_classes)``: the pooled bag, position discarded."""
        bag = torch.cat([x.mean(dim=(2, 3)), x.amax(dim=(2, 3))], dim=1)
        return bag if pre_logits else self.head(bag)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.forward_head(self.forward_features(x))

    def forward_intermediates(self, x: torch.Tensor, indices: int | list[int] | None = None,
                              intermediates_only: bool = False):
        """The map after each convolution ``(B, width, H, W)``; ``indices`` as in the ViT."""
        take = feature_take_indices(len(self.stages), indices)
        if x.ndim != 4 or x.shape[1] != self.config.in_chans:
            raise ValueError(f"expected images (B, {self.config.in_chans}, H, W), got {tuple(x.shape)}")
        return stage_intermediates(self.stages, x, take, intermediates_only)
