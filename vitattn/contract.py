"""timm's model contract, written once for the ViT, the CNN and the bag-of-features control.

timm's tools (``create_optimizer_v2``, ``resolve_data_config``, its feature wrappers and
training scripts) call these methods by name on any model; each of our models builds its own
layers and heads, and takes the rest from :class:`TimmModel`: building from a config or keyword
overrides, ``default_cfg``, ``get_classifier``, ``set_grad_checkpointing``, ``no_weight_decay``,
``reset_classifier``, ``forward`` as ``forward_head(forward_features(x))`` and ``load_weights``.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from .helpers import check_int
from .pos_embed import resample_abs_pos_embed


def resolve_config(config_cls: type, config: Any, overrides: dict[str, Any]) -> Any:
    """A model's config: ``config`` (default: the class's defaults) with ``overrides`` on top."""
    if config is None:
        return config_cls(**overrides)
    return config_cls(**{**config.to_dict(), **overrides}) if overrides else config


class TimmModel:
    """What timm calls on a model; subclasses set ``config``, ``pretrained_cfg`` (its
    ``classifier`` names the head), ``num_classes``, ``global_pool`` and the layers."""

    grad_checkpointing = False
    no_decay_names: tuple[str, ...] = ()  # parameters kept out of weight decay besides 1-D ones

    @property
    def default_cfg(self) -> dict[str, Any]:  # timm's older name
        return self.pretrained_cfg

    def get_classifier(self) -> nn.Module:
        return self.get_submodule(self.pretrained_cfg["classifier"])

    def set_grad_checkpointing(self, enable: bool = True) -> None:
        self.grad_checkpointing = enable

    def no_weight_decay(self) -> set[str]:
        """Parameters timm's ``create_optimizer_v2`` keeps out of weight decay (besides 1-D ones)."""
        return {n for n in self.no_decay_names if getattr(self, n, None) is not None}

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.forward_head(self.forward_features(x))

    def reset_classifier(self, num_classes: int, global_pool: str | None = None) -> None:
        """Replace the head (timm's method); ``num_classes=0`` leaves the pooled features, and a
        ``global_pool`` the model supports changes the pooling."""
        check_int("num_classes", num_classes, low=0)
        if global_pool is not None:
            self.check_global_pool(global_pool, num_classes)
            self.global_pool = global_pool
        if num_classes != self.num_classes:  # the old head's class names name nothing now
            self.pretrained_cfg.pop("label_names", None)
        self.num_classes = self.pretrained_cfg["num_classes"] = num_classes
        self.new_classifier(num_classes)

    def load_weights(self, state_dict: dict[str, torch.Tensor], *, old_grid: tuple[int, int] | None = None,
                     strict: bool = True) -> dict[str, list[str]]:
        """Load a state dict of this kind of model (a ViT's may be timm's, converted), adapted:
        a position table for another grid is resampled (bicubic) and a classifier of another size
        skipped (this model keeps its own). Any other shape mismatch raises a ``ValueError``
        naming every key. Returns ``{'missing', 'unexpected', 'skipped'}``; the input is unchanged."""
        own, sd = self.state_dict(), dict(state_dict)
        if getattr(self, "pos_embed", None) is not None and "pos_embed" in sd \
                and sd["pos_embed"].shape != own["pos_embed"].shape:
            src = sd["pos_embed"]
            if src.shape[-1] != own["pos_embed"].shape[-1]:
                raise ValueError(f"pos_embed width {src.shape[-1]} != model width {own['pos_embed'].shape[-1]}")
            sd["pos_embed"] = resample_abs_pos_embed(src, self.grid_size, old_grid, self.num_prefix_tokens)
        heads = tuple(f"{name}." for name in (self.pretrained_cfg["classifier"], "head_dist"))
        skipped = [k for k in list(sd) if k.startswith(heads) and (k not in own or sd[k].shape != own[k].shape)]
        for k in skipped:
            del sd[k]
        bad = [f"{k}: checkpoint {tuple(v.shape)} vs model {tuple(own[k].shape)}"
               for k, v in sd.items() if k in own and v.shape != own[k].shape]
        if bad:
            raise ValueError("state dict shapes do not match the model:\n  " + "\n  ".join(bad))
        missing, unexpected = self.load_state_dict(sd, strict=False)
        missing = [k for k in missing if not (k.startswith(heads) and skipped)]
        if strict and (missing or unexpected):
            raise ValueError(f"state dict keys do not match: missing {missing}, unexpected {unexpected}")
        return {"missing": list(missing), "unexpected": list(unexpected), "skipped": skipped}
