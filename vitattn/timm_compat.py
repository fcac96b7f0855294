"""Convert between timm's ``VisionTransformer`` and vitattn's ``ViT``.

The parameter names are the same on both sides, so conversion is reading timm's options, checking
that vitattn supports each one, and copying the state dict. timm is imported lazily: the core
package does not need it.
"""

from __future__ import annotations

from functools import partial
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


# LayerScale's start value when a converted model's gammas no longer show it (trained): it only
# decides a fresh init, which a converted model never has; timm's DeiT-III uses 1e-5 at this width
UNKNOWN_INIT_VALUES = 1e-5


def _layer_norm(m: nn.Module) -> bool:
    """A LayerNorm with a learned scale and shift (its epsilon is checked across the model)."""
    return isinstance(m, nn.LayerNorm) and m.weight is not None and m.bias is not None


def _act_name(act: nn.Module) -> str | None:
    """Our ``act_layer`` name of a timm MLP activation, or ``None`` for one we do not have."""
    from timm.layers.activations import GELU, GELUTanh, QuickGELU

    if type(act) in (nn.GELU, GELU):
        return {"none": "gelu", "tanh": "gelu_tanh"}.get(getattr(act, "approximate", "none"))
    return {GELUTanh: "gelu_tanh", QuickGELU: "quick_gelu"}.get(type(act))


def _norms(model: nn.Module) -> list[nn.Module]:
    """Every LayerNorm-like module of a timm ViT (the attention pool's and the q/k norms too)."""
    return [m for m in model.modules() if isinstance(m, nn.LayerNorm) or "Norm" in type(m).__name__]


def unsupported_options(model: nn.Module) -> list[str]:
    """The options of a timm ``VisionTransformer`` that vitattn's ``ViT`` does not carry, each as
    timm names it; empty when the model converts exactly. Every module is checked by its type, so
    a layer timm swaps in under another option is caught too."""
    from timm.layers import Mlp, PatchEmbed
    from timm.models.vision_transformer import Attention, Block

    bad = []

    def check(cond: bool, what: str) -> None:
        if cond and what not in bad:
            bad.append(what)

    from timm.layers import AttentionPoolLatent, PatchDropout

    check(getattr(model, "dist_token", None) is not None, "a distillation token (DeiT's distilled models)")
    check(model.global_pool not in ("token", "avg", "avgmax", "max", "map", ""), f"global_pool={model.global_pool!r}")
    pool = getattr(model, "attn_pool", None)
    if pool is not None:  # ours is timm's default: one latent query, no table, q projection, an MLP
        check(type(pool) is not AttentionPoolLatent, f"an attention pool {type(pool).__name__}")
        if type(pool) is AttentionPoolLatent:
            check(pool.latent_len != 1 or pool.pos_embed is not None or pool.pool != "token" or pool.mlp is None
                  or isinstance(pool.q, nn.Identity) or not isinstance(pool.q_norm, nn.Identity)
                  or pool.num_heads != model.blocks[0].attn.num_heads or pool.q.bias is None,
                  "an attention pool other than timm's default (global_pool='map')")
    check(getattr(model, "pool_include_prefix", False), "pool_include_prefix=True")
    drop = getattr(model, "patch_drop", nn.Identity())
    check(not isinstance(drop, nn.Identity) and (type(drop) is not PatchDropout or drop.ordered),
          f"patch dropout {type(drop).__name__}")
    pe = model.patch_embed
    check(type(pe) is not PatchEmbed, f"embed_layer {type(pe).__name__}")
    check(not isinstance(getattr(pe, "norm", nn.Identity()), nn.Identity), "embed_norm_layer (a patch embedding norm)")
    # timm drops the patch projection's bias exactly when pre_norm is on (CLIP)
    check(getattr(pe, "proj", None) is None or (pe.proj.bias is None) != (not isinstance(model.norm_pre, nn.Identity)),
          "a patch projection bias that does not follow pre_norm")
    norms = _norms(model)
    odd = [type(n).__name__ for n in norms if not _layer_norm(n)]
    check(bool(odd), f"norm_layer {odd[0] if odd else ''}")
    check(len({n.eps for n in norms if _layer_norm(n)}) > 1, "LayerNorms of different epsilons")
    for blk in model.blocks:
        check(type(blk) is not Block, f"block_fn {type(blk).__name__}")
        if type(blk) is not Block:
            continue
        attn, mlp = blk.attn, blk.mlp
        check(type(attn) is not Attention, f"attn_layer {type(attn).__name__}")
        check(type(mlp) is not Mlp, f"mlp_layer {type(mlp).__name__}")
        if type(attn) is Attention:
            check(not isinstance(attn.norm, nn.Identity), "scale_attn_norm=True")
            check(attn.proj.bias is None, "proj_bias=False")
            check(attn.scale != attn.head_dim**-0.5, f"an attention scale of {attn.scale:g}")
            qk = [not isinstance(n, nn.Identity) for n in (attn.q_norm, attn.k_norm)]
            check(any(qk) and not all(qk), "a norm on q or k alone")
        if type(mlp) is Mlp:
            check(_act_name(mlp.act) is None, f"act_layer {type(mlp.act).__name__}")
            check(not isinstance(mlp.norm, nn.Identity), "scale_mlp_norm=True")
            check(mlp.fc1.bias is None or mlp.fc2.bias is None, "proj_bias=False")
            check(isinstance(mlp.fc1, nn.Conv2d), "a convolutional MLP")
        for ls in (blk.ls1, blk.ls2):
            check(not isinstance(ls, nn.Identity) and not hasattr(ls, "gamma"), f"a layer scale {type(ls).__name__}")
    layer_scale = [not isinstance(b.ls1, nn.Identity) for b in model.blocks if type(b) is Block]
    check(0 < sum(layer_scale) < len(layer_scale), "LayerScale in some blocks only")
    widths = {(b.mlp.fc1.out_features, b.attn.num_heads, b.attn.qkv.bias is not None,
               not isinstance(b.attn.q_norm, nn.Identity), _act_name(b.mlp.act)) for b in model.blocks
              if type(b) is Block and type(b.attn) is Attention and type(b.mlp) is Mlp}
    check(len(widths) > 1, "blocks of different widths, heads, biases, norms or activations")
    return bad


def mlp_ratio_of(hidden: int, dim: int) -> float:
    """The ``mlp_ratio`` whose ``int(dim * mlp_ratio)`` (timm's and our MLP width) is ``hidden``:
    ``hidden / dim`` unless float rounding puts that just below, then the middle of the step."""
    ratio = hidden / dim
    return ratio if int(dim * ratio) == hidden else (hidden + 0.5) / dim


def config_from_timm(model: nn.Module) -> ViTConfig:
    """Read a timm ``VisionTransformer``'s options into a :class:`ViTConfig`.

    Raises ``ValueError`` naming every option vitattn does not support (:func:`unsupported_options`).
    ``init_values`` (LayerScale's start value) is the gammas' common value in an untrained model;
    a trained one no longer shows it, and the start value decides nothing once weights are
    loaded, so it is then ``UNKNOWN_INIT_VALUES``.
    """
    _timm()
    from timm.models.vision_transformer import VisionTransformer

    if not isinstance(model, VisionTransformer):
        raise ValueError(f"expected a timm VisionTransformer, got {type(model).__name__}")
    unsupported = unsupported_options(model)
    if unsupported:
        raise ValueError(f"timm model uses options vitattn does not support: {', '.join(unsupported)}")

    blk = model.blocks[0]
    has_pos = getattr(model, "pos_embed", None) is not None
    init_values = None
    if hasattr(blk.ls1, "gamma"):
        gamma = blk.ls1.gamma.detach()
        start = float(gamma.flatten()[0])
        init_values = start if start > 0 and bool((gamma == start).all()) else UNKNOWN_INIT_VALUES
    last_drop_path = model.blocks[-1].drop_path1  # timm's rates rise linearly to drop_path_rate, as ours
    final_norm = not (isinstance(model.norm, nn.Identity) and isinstance(model.fc_norm, nn.Identity))
    drop = getattr(model, "patch_drop", None)
    return ViTConfig(
        img_size=tuple(model.patch_embed.img_size),
        patch_size=tuple(model.patch_embed.patch_size),
        in_chans=model.patch_embed.proj.in_channels,
        num_classes=model.num_classes,
        global_pool=model.global_pool,
        embed_dim=model.embed_dim,
        depth=len(model.blocks),
        num_heads=blk.attn.num_heads,
        mlp_ratio=mlp_ratio_of(blk.mlp.fc1.out_features, model.embed_dim),
        qkv_bias=blk.attn.qkv.bias is not None,
        qk_norm=not isinstance(blk.attn.q_norm, nn.Identity),
        init_values=init_values,
        class_token=model.cls_token is not None,
        reg_tokens=getattr(model, "num_reg_tokens", 0),
        no_embed_class=bool(getattr(model, "no_embed_class", False)),
        pos_embed="learn" if has_pos else "none",
        dynamic_img_size=bool(getattr(model, "dynamic_img_size", False)),
        dynamic_img_pad=bool(getattr(model.patch_embed, "dynamic_img_pad", False)),
        fc_norm=not isinstance(model.fc_norm, nn.Identity),
        pre_norm=not isinstance(model.norm_pre, nn.Identity),
        final_norm=final_norm,
        norm_eps=blk.norm1.eps,
        act_layer=_act_name(blk.mlp.act),
        drop_rate=float(model.head_drop.p),
        pos_drop_rate=float(model.pos_drop.p),
        patch_drop_rate=float(getattr(drop, "prob", 0.0)),
        proj_drop_rate=float(blk.attn.proj_drop.p),
        attn_drop_rate=float(blk.attn.attn_drop.p),
        drop_path_rate=float(getattr(last_drop_path, "drop_prob", 0.0)),
    )


def from_timm(model: nn.Module) -> ViT:
    """A vitattn ``ViT`` with the same options and weights as a timm ``VisionTransformer``, on its
    device and in its dtype.

    Eval outputs match timm's within float rounding (tested at 1e-5 in fp32).
    """
    vit = ViT(config_from_timm(model))
    state = to_vitattn_state_dict(model.state_dict())
    try:
        vit.load_state_dict(state, strict=True)
    except RuntimeError as e:  # an option the checks above do not know of: name it, never a raw error
        raise ValueError(f"timm model holds weights vitattn's ViT does not have (an option vitattn does not "
                         f"support): {str(e).splitlines()[-1].strip()}") from None
    like = next(iter(state.values()), None)
    if like is not None:
        vit = vit.to(device=like.device, dtype=like.dtype)
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
    alone = [what for cond, what in ((c.score != "scaled_dot", f"score={c.score!r}"),
                                     (bool(c.window_block_indexes), "window attention"),
                                     (c.use_rot_pos_emb, "use_rot_pos_emb=True"),
                                     (c.shifted_patches, "shifted_patches=True"),
                                     (c.distilled, "distilled=True"),
                                     (fixed and c.dynamic_img_size, f"pos_embed={c.pos_embed!r} with dynamic_img_size "
                                      "(a sin-cos table built for each image size)")) if cond]
    if alone:
        raise ValueError(f"timm has no twin for these vitattn options: {', '.join(alone)}")
    # weight_init only chooses starting weights, which to_timm copies anyway
    return dict(
        img_size=c.img_size, patch_size=c.patch_size, in_chans=c.in_chans, num_classes=c.num_classes,
        global_pool=c.global_pool, embed_dim=c.embed_dim, depth=c.depth, num_heads=c.num_heads,
        mlp_ratio=c.mlp_ratio, qkv_bias=c.qkv_bias, qk_norm=c.qk_norm, init_values=c.init_values,
        class_token=c.class_token, reg_tokens=c.reg_tokens, no_embed_class=c.no_embed_class,
        pos_embed="learn" if fixed else c.pos_embed, dynamic_img_size=c.dynamic_img_size,
        dynamic_img_pad=c.dynamic_img_pad, fc_norm=c.fc_norm, pre_norm=c.pre_norm, final_norm=c.final_norm,
        drop_rate=c.drop_rate, pos_drop_rate=c.pos_drop_rate, patch_drop_rate=c.patch_drop_rate,
        proj_drop_rate=c.proj_drop_rate, attn_drop_rate=c.attn_drop_rate, drop_path_rate=c.drop_path_rate,
        **({} if c.act_layer == "gelu" else {"act_layer": c.act_layer}),
        **({} if c.norm_eps == 1e-6 else {"norm_layer": partial(nn.LayerNorm, eps=c.norm_eps)}),
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
    like = next(iter(sd.values()))
    return model.to(device=like.device, dtype=like.dtype).train(vit.training)
