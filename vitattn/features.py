"""``features_only=True``: a backbone that returns feature maps, with timm's ``feature_info``.

References: timm ``_features.py`` (``FeatureInfo``: channels, reduction and module per level).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn

from .helpers import feature_take_indices


class FeatureInfo(list):
    """One dict per returned level: ``num_chs``, ``reduction`` (stride in pixels), ``module``."""

    def channels(self) -> list[int]:
        return [f["num_chs"] for f in self]

    def reduction(self) -> list[int]:
        return [f["reduction"] for f in self]

    def module_name(self) -> list[str]:
        return [f["module"] for f in self]


class FeatureExtractor(nn.Module):
    """``(B, C, H, W) -> [(B, C_i, H / r_i, W / r_i), ...]``: the levels ``out_indices`` of a
    vitattn model's ``feature_info`` (ViT: block outputs as maps, stride = the patch; CNN: stage
    outputs, stride 2^(i+1)), from its ``forward_intermediates``; ``out_indices`` as timm takes
    them (``None`` for every level, an int ``n`` for the last ``n``, or indices)."""

    def __init__(self, model: nn.Module, out_indices: int | Sequence[int] | None = None) -> None:
        super().__init__()
        if not hasattr(model, "feature_info") or not hasattr(model, "forward_intermediates"):
            raise TypeError(f"features_only needs a vitattn model with feature_info, got {type(model).__name__}")
        self.model = model
        self.out_indices = feature_take_indices(len(model.feature_info), out_indices)
        self.feature_info = FeatureInfo(model.feature_info[i] for i in self.out_indices)
        self.pretrained_cfg = model.pretrained_cfg

    @property
    def default_cfg(self) -> dict:  # timm's older name
        return self.pretrained_cfg

    def forward(self, x: torch.Tensor) -> list[torch.Tensor]:
        return self.model.forward_intermediates(x, indices=self.out_indices, intermediates_only=True)
