"""Convert between timm's ``VisionTransformer`` and vitattn's ``ViT``.

The parameter names are the same on both sides, so conversion is reading timm's options, checking
that vitattn supports each one, and copying the state dict. timm is imported lazily: the core
package does not need it.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from .pos_embed import fixed_pos_table
from .vit import ViT, ViTConfig


def _timm():
    try:
        import timm
    except ImportError as e:  # pragma: no cover - exercised only without timm
        raise ImportError("this needs timm: pip install 'vitattn[timm]'") from e
    return timm


def config_from_timm(model: nn.Module) -> ViTConfig:
    """Read a timm ``VisionTransformer``'s options into a :class:`ViTConfig`.

    Raises ``ValueError`` naming every option vitattn does not support.
    """
    _timm()
    from timm.layers import LayerScale as TimmLayerScale
    from timm.models.vision_transformer import VisionTransformer

    if not isinstance(model, VisionTransformer):
        raise ValueError(f"expected a timm VisionTransformer, got {type(model).__name__}")
    blk = model.blocks[0]
    unsupported = []

    def check(cond: bool, what: str) -> None:
        if cond:
            unsupported.append(what)

    check(getattr(model, "dist_token", None) is not None, "a distillation token (DeiT's distilled models)")
    check(getattr(model, "num_reg_tokens", 0) > 0, f"reg_tokens={model.num_reg_tokens}")
    check(getattr(model, "no_embed_class", False), "no_embed_class=True")
    check(model.global_pool not in ("token", "avg", "avgmax", "max", ""), f"global_pool={model.global_pool!r}")
    check(getattr(model, "attn_pool", None) is not None, "attention pooling ('map')")
    check(not isinstance(model.norm_pre, nn.Identity), "pre_norm=True")
    check(not isinstance(model.patch_embed.norm, nn.Identity), "patch embedding norm")
    check(not isinstance(getattr(model, "patch_drop", nn.Identity()), nn.Identity), "patch_drop_rate > 0")
    check(model.patch_embed.proj.bias is None, "patch projection without bias")
    check(not isinstance(blk.norm1, nn.LayerNorm) or blk.norm1.eps != 1e-6, "norm_layer other than LayerNorm(eps=1e-6)")
    check(not isinstance(blk.mlp.act, nn.GELU) or getattr(blk.mlp.act, "approximate", "none") != "none",
          f"act_layer {type(blk.mlp.act).__name__}")
    check(not isinstance(getattr(blk.mlp, "norm", nn.Identity()), nn.Identity), "scale_mlp_norm=True")
    check(not isinstance(getattr(blk.attn, "norm", nn.Identity()), nn.Identity), "scale_attn_norm=True")
    check(type(blk).__name__ != "Block", f"block_fn {type(blk).__name__}")
    check(type(blk.mlp).__name__ != "Mlp", f"mlp_layer {type(blk.mlp).__name__}")
    check(getattr(model, "pos_embed", None) is None and getattr(model, "rope", None) is not None, "rope")
    if unsupported:
        raise ValueError(f"timm model uses options vitattn does not support: {', '.join(unsupported)}")

    has_pos = getattr(model, "pos_embed", None) is not None
    qk_norm = not isinstance(blk.attn.q_norm, nn.Identity)
    ls = blk.ls1
    last_drop_path = model.blocks[-1].drop_path1  # timm's rates rise linearly to drop_path_rate, as ours
    return ViTConfig(
        img_size=tuple(model.patch_embed.img_size),
        patch_size=tuple(model.patch_embed.patch_size),
        in_chans=model.patch_embed.proj.in_channels,
        num_classes=model.num_classes,
        global_pool=model.global_pool,
        embed_dim=model.embed_dim,
        depth=len(model.blocks),
        num_heads=blk.attn.num_heads,
        mlp_ratio=blk.mlp.fc1.out_features / model.embed_dim,
        qkv_bias=blk.attn.qkv.bias is not None,
        qk_norm=qk_norm,
        init_values=float(ls.gamma.detach().flatten()[0]) if isinstance(ls, TimmLayerScale) else None,
        class_token=model.cls_token is not None,
        pos_embed="learn" if has_pos else "none",
        dynamic_img_size=bool(getattr(model, "dynamic_img_size", False)),
        dynamic_img_pad=bool(getattr(model.patch_embed, "dynamic_img_pad", False)),
        fc_norm=not isinstance(model.fc_norm, nn.Identity),
        drop_rate=float(model.head_drop.p),
        pos_drop_rate=float(model.pos_drop.p),
        proj_drop_rate=float(blk.attn.proj_drop.p),
        attn_drop_rate=float(blk.attn.attn_drop.p),
        drop_path_rate=float(getattr(last_drop_path, "drop_prob", 0.0)),
    )


def from_timm(model: nn.Module) -> ViT:
    """A vitattn ``ViT`` with the same options and weights as a timm ``VisionTransformer``.

    Eval outputs match timm's within float rounding (tested at 1e-5 in fp32).
    """
    vit = ViT(config_from_timm(model))
    vit.load_state_dict(to_vitattn_state_dict(model.state_dict()), strict=True)
    return vit.train(model.training)


def to_vitattn_state_dict(state_dict: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """timm keys -> vitattn keys (the same names; copies so the input is untouched)."""
    return {k: v.clone() for k, v in state_dict.items()}


def to_timm_state_dict(vit: ViT) -> dict[str, torch.Tensor]:
    """vitattn ``ViT`` -> a state dict that loads into the matching timm model."""
    return {k: v.clone() for k, v in vit.state_dict().items()}


def timm_kwargs(config: ViTConfig) -> dict[str, Any]:
    """Keyword arguments for ``timm.models.vision_transformer.VisionTransformer`` that build the
    timm twin of a config."""
    c = config
    fixed = c.pos_embed in ("sincos1d", "sincos2d")
    if (c.score != "scaled_dot" or c.window_block_indexes or c.use_rot_pos_emb or c.shifted_patches or c.distilled
            or (fixed and c.dynamic_img_size)):
        raise ValueError("timm has no twin for score / window / rotary / shifted-patch / distillation-token options, "
                         "nor for a sin-cos table built for each image size")
    # weight_init only chooses starting weights, which to_timm copies anyway
    return dict(
        img_size=c.img_size, patch_size=c.patch_size, in_chans=c.in_chans, num_classes=c.num_classes,
        global_pool=c.global_pool, embed_dim=c.embed_dim, depth=c.depth, num_heads=c.num_heads,
        mlp_ratio=c.mlp_ratio, qkv_bias=c.qkv_bias, qk_norm=c.qk_norm, init_values=c.init_values,
        class_token=c.class_token, pos_embed="learn" if fixed else c.pos_embed, dynamic_img_size=c.dynamic_img_size,
        dynamic_img_pad=c.dynamic_img_pad, fc_norm=c.fc_norm, drop_rate=c.drop_rate, pos_drop_rate=c.pos_drop_rate,
        proj_drop_rate=c.proj_drop_rate, attn_drop_rate=c.attn_drop_rate, drop_path_rate=c.drop_path_rate,
    )


def to_timm(vit: ViT) -> nn.Module:
    """The timm ``VisionTransformer`` twin of a vitattn ``ViT``, with its weights."""
    if not isinstance(vit, ViT):
        raise TypeError(f"to_timm takes a vitattn ViT, got {type(vit).__name__}")
    _timm()
    from timm.models.vision_transformer import VisionTransformer

    model = VisionTransformer(**timm_kwargs(vit.config))
    sd = to_timm_state_dict(vit)
    fixed = vit.config.pos_embed in ("sincos1d", "sincos2d")
    if fixed:  # a sin-cos table rides in timm's position table, frozen: the same numbers, never trained
        sd["pos_embed"] = fixed_pos_table(vit.config.pos_embed, vit.grid_size, vit.embed_dim, vit.num_prefix_tokens)
    model.load_state_dict(sd, strict=True)
    if fixed:
        model.pos_embed.requires_grad_(False)
    return model.train(vit.training)
