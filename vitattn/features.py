"""``features_only=True``: a backbone that returns feature maps, with timm's ``feature_info``.

References: timm ``_features.py`` (``FeatureInfo``: channels, reduction and module per level).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn

from .helpers import feature_take_indices, to_2tuple


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
    vitattn ViT (block outputs as maps, stride = the patch) or CNN (stage outputs, stride 2^(i+1)),
    from the model's ``forward_intermediates``; ``out_indices`` as timm takes them (``None`` for
    every level, an int ``n`` for the last ``n``, or indices)."""

    def __init__(self, model: nn.Module, out_indices: int | Sequence[int] | None = None) -> None:
        super().__init__()
        if hasattr(model, "blocks"):
            levels = [dict(num_chs=model.embed_dim, reduction=to_2tuple(model.patch_embed.patch_size)[0],
                           module=f"blocks.{i}") for i in range(len(model.blocks))]
        elif hasattr(model, "stages"):
            levels = [dict(num_chs=w, reduction=2 ** (i + 1), module=f"stages.{i}")
                      for i, w in enumerate(model.config.widths)]
        else:
            raise TypeError(f"features_only needs a vitattn ViT or CNN, got {type(model).__name__}")
        self.model = model
        self.out_indices = feature_take_indices(len(levels), out_indices)
        self.feature_info = FeatureInfo(levels[i] for i in self.out_indices)
        self.pretrained_cfg = model.pretrained_cfg

    def forward(self, x: torch.Tensor) -> list[torch.Tensor]:
        return self.model.forward_intermediates(x, indices=self.out_indices, intermediates_only=True)
