"""The Vision Transformer.

    image (B, C, H, W)
      -> patch_embed       (B, N, D), grid (gh, gw)
      -> + pos_embed       learned / sincos1d / sincos2d / none, over the prefix tokens too
                           unless no_embed_class (and / or rotary codes in every attention)
      -> prefix tokens     (B, P + N, D): class token, reg_tokens registers, distillation token
      -> patch_drop        training only: a random share of the patch tokens dropped
      -> norm_pre          pre_norm (CLIP)
      -> blocks x depth    (B, P + N, D)
      -> norm              forward_features (final_norm)
      -> pool, fc_norm     (B, D)          forward_head(pre_logits=True); 'map': attn_pool
      -> head              (B, num_classes)

Names and options follow timm's ``VisionTransformer`` so its checkpoints map key for key.

References: Dosovitskiy et al. 2021; timm ``models/vision_transformer.py``; big_vision
``models/vit.py`` (sincos2d, 'avg' pooling without class token); Darcet et al. 2024 (registers);
Touvron et al. 2022 (DeiT-III, positions on the patches only).
"""

from __future__ import annotations

from collections.abc import Collection
from dataclasses import asdict, dataclass, field, replace
from typing import Any

import torch
from einops import rearrange, repeat
from torch import nn
from torch.utils.checkpoint import checkpoint

from .attention import SCORES, AttentionConfig
from .block import ACT_LAYERS, Block
from .contract import TimmModel, resolve_config
from .helpers import (
    BuildCache,
    check_bool,
    check_float,
    check_int,
    check_size,
    feature_take_indices,
    to_2tuple,
    watched,
)
from .init import init_vit_
from .patch_embed import PatchDropout, PatchEmbed, ShiftedPatchEmbed
from .pool import GLOBAL_POOLS, AttentionPool, pool_tokens
from .pos_embed import fixed_pos_table, resample_abs_pos_embed, rope_2d

for _leaf in ("rearrange", "repeat"):  # calls in a torch.fx trace: einops reads shapes (proxies there)
    torch.fx.wrap(_leaf)

POS_EMBEDS = ("learn", "sincos1d", "sincos2d", "none")
WEIGHT_INITS = ("", "jax")


def vitdet_window_blocks(depth: int, global_every: int = 3) -> tuple[int, ...]:
    """ViTDet's layout: windows everywhere except every ``global_every``-th block, which stays
    global (blocks 2, 5, 8, 11 of 12) so information crosses windows."""
    return tuple(i for i in range(depth) if (i + 1) % global_every)


@dataclass(frozen=True)
class ViTConfig:
    """Everything that defines a ViT. Field names and values are timm's where timm has them. A
    value: changed by ``dataclasses.replace``, never under a model built from it."""

    img_size: int | tuple[int, int] = 224  # nominal input; sizes the learned position table
    patch_size: int | tuple[int, int] = 16  # patch height and width in pixels
    in_chans: int = 3  # image channels
    num_classes: int = 1000  # classifier outputs; 0 for no head (features only)
    global_pool: str = "token"  # 'token' (class token), 'avg' / 'max' / 'avgmax' over patch tokens, 'map' or ''
    embed_dim: int = 768  # token width D
    depth: int = 12  # number of blocks
    num_heads: int = 12  # attention heads per block
    mlp_ratio: float = 4.0  # MLP hidden width / D
    qkv_bias: bool = True  # bias in the q, k, v projection
    qk_norm: bool = False  # LayerNorm on each head's q and k
    init_values: float | None = None  # LayerScale start value; None = no LayerScale
    class_token: bool = True  # prepend a learned class token
    reg_tokens: int = 0  # learned register tokens after it (Darcet et al. 2024; DINOv2-reg)
    no_embed_class: bool = False  # positions for the patch tokens only, none for the prefix (DeiT-III, DINOv2-reg)
    pos_embed: str = "learn"  # 'learn', 'sincos1d', 'sincos2d' or 'none'
    use_rot_pos_emb: bool = False  # 2-D rotary codes on each head's q and k (timm's EVA name): relative places
    rope_temperature: float = 100.0  # the rotary codes' longest wavelength scale (Heo et al. 2024 use 100)
    dynamic_img_size: bool = False  # accept any image size divisible by the patch
    dynamic_img_pad: bool = False  # pad images up to a multiple of the patch instead of raising
    fc_norm: bool | None = None  # LayerNorm after pooling instead of before; None = timm's rule (avg, max)
    pre_norm: bool = False  # LayerNorm before the blocks, and a patch projection without bias (CLIP)
    final_norm: bool = True  # the LayerNorm after the blocks (before or after pooling, as fc_norm says)
    norm_eps: float = 1e-6  # every LayerNorm's epsilon (timm's 1e-6; CLIP's 1e-5)
    act_layer: str = "gelu"  # the MLPs' activation: 'gelu', 'gelu_tanh' or 'quick_gelu' (OpenAI CLIP)
    drop_rate: float = 0.0  # dropout before the head
    pos_drop_rate: float = 0.0  # dropout after adding positions
    patch_drop_rate: float = 0.0  # share of patch tokens dropped at random in training (PatchDropout)
    proj_drop_rate: float = 0.0  # dropout after attention / MLP projections
    attn_drop_rate: float = 0.0  # dropout on attention weights
    drop_path_rate: float = 0.0  # stochastic depth, rising linearly to this in the last block
    score: str = "scaled_dot"  # attention score function (see vitattn.attention)
    fused_attn: bool = True  # the fused kernel where it computes the same thing; False: the readable path (timm's name)
    window_size: int | None = None  # window attention (ViTDet) in the blocks below
    window_block_indexes: tuple[int, ...] = field(default_factory=tuple)  # blocks using windows; default ViTDet's
    weight_init: str = ""  # '' (timm's default) or 'jax' (timm's, as the JAX ViT)
    shifted_patches: bool = False  # shifted patch tokenisation (SPT, Lee et al. 2021) instead of one conv
    distilled: bool = False  # DeiT's distillation token and second head (timm's deit_*_distilled)

    def __post_init__(self) -> None:
        check_size("img_size", self.img_size)
        check_size("patch_size", self.patch_size)
        for name in ("in_chans", "embed_dim", "depth", "num_heads"):
            check_int(name, getattr(self, name))
        check_int("num_classes", self.num_classes, low=0)
        check_int("reg_tokens", self.reg_tokens, low=0)
        check_float("mlp_ratio", self.mlp_ratio, 0.0, low_open=True)
        check_float("rope_temperature", self.rope_temperature, 0.0, low_open=True)
        check_float("norm_eps", self.norm_eps, 0.0, low_open=True)
        for name in ("drop_rate", "pos_drop_rate", "proj_drop_rate", "attn_drop_rate", "drop_path_rate"):
            check_float(name, getattr(self, name), 0.0, 1.0)
        check_float("patch_drop_rate", self.patch_drop_rate, 0.0, 1.0, high_open=True)
        if self.init_values is not None:
            check_float("init_values", self.init_values, 0.0, low_open=True)
        if self.window_size is not None:
            check_int("window_size", self.window_size)
        for name in ("qkv_bias", "qk_norm", "class_token", "use_rot_pos_emb", "dynamic_img_size", "dynamic_img_pad",
                     "shifted_patches", "distilled", "fused_attn", "no_embed_class", "pre_norm", "final_norm"):
            check_bool(name, getattr(self, name))
        if self.fc_norm is not None:
            check_bool("fc_norm", self.fc_norm)
        if self.act_layer not in ACT_LAYERS:
            raise ValueError(f"unknown act_layer {self.act_layer!r}; expected one of {tuple(ACT_LAYERS)}")
        if self.score not in SCORES:
            raise ValueError(f"unknown score {self.score!r}; expected one of {tuple(SCORES)}")
        bad = [i for i in self.window_block_indexes if not (isinstance(i, int) and 0 <= i < self.depth)]
        if bad:
            raise ValueError(f"window_block_indexes must be block indices in 0..{self.depth - 1}, got {bad}")
        if self.pos_embed not in POS_EMBEDS:
            raise ValueError(f"unknown pos_embed {self.pos_embed!r}; expected one of {POS_EMBEDS}")
        if self.global_pool not in GLOBAL_POOLS:
            raise ValueError(f"unknown global_pool {self.global_pool!r}; expected one of {GLOBAL_POOLS}")
        if self.distilled and self.global_pool == "":
            raise ValueError("distilled=True adds a head on the distillation token: it needs a pooled head, "
                             "got global_pool=''")
        if self.global_pool == "token" and not self.class_token:
            raise ValueError("global_pool='token' needs class_token=True; use global_pool='avg' without it")
        if self.distilled and self.reg_tokens:
            raise ValueError("distilled=True with reg_tokens: the distillation token is the last prefix token, "
                             "which registers would displace; choose one")
        if self.patch_drop_rate and (self.use_rot_pos_emb or self.window_size is not None):
            raise ValueError("patch_drop_rate > 0 leaves a partial grid, which rotary codes and window attention "
                             "need whole; drop one of them")
        if not self.dynamic_img_pad:
            size, patch = to_2tuple(self.img_size), to_2tuple(self.patch_size)
            if size[0] % patch[0] or size[1] % patch[1]:
                raise ValueError(f"img_size {size} is not divisible by patch_size {patch}: the patches would not tile "
                                 "the image; choose sizes that divide, or dynamic_img_pad=True to pad the image")
        if self.embed_dim % self.num_heads:
            raise ValueError(f"embed_dim {self.embed_dim} is not divisible by num_heads {self.num_heads}")
        for name in ("img_size", "patch_size", "window_block_indexes"):  # lists (JSON's) held as tuples
            if isinstance(getattr(self, name), list):
                object.__setattr__(self, name, tuple(getattr(self, name)))
        if self.window_size is not None and not self.window_block_indexes:
            object.__setattr__(self, "window_block_indexes", vitdet_window_blocks(self.depth))
        if self.weight_init not in WEIGHT_INITS:
            raise ValueError(f"unknown weight_init {self.weight_init!r}; expected one of {WEIGHT_INITS}")
        if self.use_rot_pos_emb and (self.embed_dim // self.num_heads) % 4:
            raise ValueError(f"rotary codes turn channel pairs by row and by column: the head width "
                             f"{self.embed_dim // self.num_heads} must be divisible by 4")

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def data_cfg(c: ViTConfig) -> dict[str, Any]:
    """What timm's data tools read (``resolve_data_config``); the registry sets a preset's own data.
    A learned table fits one grid, so the input size is fixed unless resampled on the fly."""
    return dict(input_size=(c.in_chans, *to_2tuple(c.img_size)), mean=(0.5, 0.5, 0.5), std=(0.5, 0.5, 0.5),
                num_classes=c.num_classes, interpolation="bicubic", crop_pct=0.9, pool_size=None,
                first_conv="patch_embed.proj", classifier="head",
                fixed_input_size=c.pos_embed == "learn" and not c.dynamic_img_size)


def linear_head(dim: int, num_classes: int, init: bool = False) -> nn.Module:
    """A classifier (``nn.Identity`` for ``num_classes=0``); ``init``: timm's draw for a new head."""
    if num_classes == 0:
        return nn.Identity()
    head = nn.Linear(dim, num_classes)
    if init:
        nn.init.trunc_normal_(head.weight, std=0.02)
        nn.init.zeros_(head.bias)
    return head


def as_output(y: torch.Tensor, num_prefix_tokens: int, grid: tuple[int, int], output_fmt: str,
              return_prefix_tokens: bool) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """A block's tokens ``(B, P + N, D)`` as ``forward_intermediates`` gives them: the patch tokens
    as a map ``(B, D, gh, gw)`` (``'NCHW'``) or ``(B, N, D)`` (``'NLC'``), with the prefix if asked
    and there is one (timm's rule: a model without prefix tokens gives the maps alone)."""
    prefix, y = y[:, :num_prefix_tokens], y[:, num_prefix_tokens:]
    if output_fmt == "NCHW":
        y = rearrange(y, "b (gh gw) d -> b d gh gw", gh=grid[0], gw=grid[1])
    return (y, prefix) if return_prefix_tokens and num_prefix_tokens else y


class ViT(TimmModel, nn.Module):
    """Vision Transformer, ``(B, C, H, W) -> (B, num_classes)``; timm's contract from ``TimmModel``."""

    no_decay_names = ("pos_embed", "cls_token", "reg_token", "dist_token")

    def __init__(self, config: ViTConfig | None = None, **overrides: Any) -> None:
        super().__init__()
        self.config = c = resolve_config(ViTConfig, config, overrides)
        self.num_classes, self.global_pool, self.pretrained_cfg = c.num_classes, c.global_pool, data_cfg(c)
        self.embed_dim = self.num_features = self.head_hidden_size = c.embed_dim  # timm's three names
        self.num_prefix_tokens = int(c.class_token) + c.reg_tokens + int(c.distilled)
        self.num_reg_tokens, self.has_class_token, self.no_embed_class = c.reg_tokens, c.class_token, c.no_embed_class
        self.num_pos_prefix = 0 if c.no_embed_class else self.num_prefix_tokens  # prefix rows in the position table
        self.distilled_training, self.dynamic_img_size = False, c.dynamic_img_size  # timm's flags
        use_fc_norm = c.global_pool in ("avg", "avgmax", "max") if c.fc_norm is None else c.fc_norm

        embed_layer = ShiftedPatchEmbed if c.shifted_patches else PatchEmbed
        self.patch_embed = embed_layer(c.img_size, c.patch_size, c.in_chans, c.embed_dim,
                                       dynamic_img_pad=c.dynamic_img_pad, bias=not c.pre_norm)  # CLIP's: no bias
        self.grid_size = self.patch_embed.grid_size
        self.cls_token = nn.Parameter(torch.zeros(1, 1, c.embed_dim)) if c.class_token else None
        self.reg_token = nn.Parameter(torch.zeros(1, c.reg_tokens, c.embed_dim)) if c.reg_tokens else None
        self.dist_token = nn.Parameter(torch.zeros(1, 1, c.embed_dim)) if c.distilled else None
        n = self.num_pos_prefix + self.patch_embed.num_patches
        self.pos_embed = nn.Parameter(torch.zeros(1, n, c.embed_dim)) if c.pos_embed == "learn" else None
        self._fixed_pos = BuildCache()  # sincos tables and rotary angles per (grid, device, dtype)
        self.pos_drop = nn.Dropout(c.pos_drop_rate)
        self.patch_drop = PatchDropout(c.patch_drop_rate, self.num_prefix_tokens) if c.patch_drop_rate \
            else nn.Identity()
        self.norm_pre = nn.LayerNorm(c.embed_dim, eps=c.norm_eps) if c.pre_norm else nn.Identity()
        dpr = torch.linspace(0, c.drop_path_rate, c.depth, device="cpu").tolist()  # stochastic depth, linear rule
        attn = AttentionConfig(num_heads=c.num_heads, score=c.score, qkv_bias=c.qkv_bias, qk_norm=c.qk_norm,
                               attn_drop=c.attn_drop_rate, proj_drop=c.proj_drop_rate, fused=c.fused_attn,
                               norm_eps=c.norm_eps)
        self.blocks = nn.ModuleList(
            Block(c.embed_dim, replace(attn, window_size=c.window_size if i in c.window_block_indexes else None),
                  mlp_ratio=c.mlp_ratio, init_values=c.init_values, drop_path=dpr[i], norm_eps=c.norm_eps,
                  act_layer=c.act_layer)
            for i in range(c.depth)
        )
        # timm's per-level description: every block's tokens as a map at the patch's stride
        self.feature_info = [dict(module=f"blocks.{i}", num_chs=c.embed_dim,
                                  reduction=to_2tuple(c.patch_size)[0]) for i in range(c.depth)]
        final = lambda on: nn.LayerNorm(c.embed_dim, eps=c.norm_eps) if c.final_norm and on else nn.Identity()  # noqa: E731
        self.norm, self.fc_norm = final(not use_fc_norm), final(use_fc_norm)
        self.attn_pool = AttentionPool(c.embed_dim, c.num_heads, mlp_ratio=c.mlp_ratio, norm_eps=c.norm_eps,
                                       act_layer=c.act_layer, fused=c.fused_attn) if c.global_pool == "map" else None
        self.head_drop = nn.Dropout(c.drop_rate)
        self.head = linear_head(c.embed_dim, c.num_classes)
        if c.distilled:
            self.head_dist = linear_head(c.embed_dim, c.num_classes)
        init_vit_(self, c.weight_init)

    def rope_for(self, grid: tuple[int, int], x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor] | None:
        """Rotary angles ``(sin, cos)``, each ``(gh*gw, head_dim)``, for any grid; ``None`` without them."""
        if not self.config.use_rot_pos_emb:
            return None
        build = lambda: tuple(t.to(x.device, x.dtype) for t in rope_2d(  # noqa: E731
            *grid, self.embed_dim // self.config.num_heads, self.config.rope_temperature))
        return self._fixed_pos.get_or_build(("rope", tuple(grid), x.device, x.dtype), build)

    def pos_embed_for(self, grid: tuple[int, int], x: torch.Tensor) -> torch.Tensor | None:
        """Position codes ``(1, P + N, D)`` for a patch grid, resampled / built as needed."""
        kind = self.config.pos_embed
        if kind in ("sincos1d", "sincos2d"):
            build = lambda: fixed_pos_table(kind, grid, self.embed_dim, self.num_pos_prefix).to(x)  # noqa: E731
            return self._fixed_pos.get_or_build((tuple(grid), x.device, x.dtype, kind), build)
        if kind == "none" or tuple(grid) == tuple(self.grid_size):
            return self.pos_embed
        if not self.dynamic_img_size:
            raise ValueError(f"image gives a {grid[0]}x{grid[1]} patch grid but the position table is for "
                             f"{self.grid_size[0]}x{self.grid_size[1]} (img_size {to_2tuple(self.config.img_size)}); "
                             "build the model with dynamic_img_size=True to resample on the fly")
        return resample_abs_pos_embed(self.pos_embed, grid, self.grid_size, self.num_pos_prefix)

    def embed(self, x: torch.Tensor) -> tuple[torch.Tensor, tuple[int, int]]:
        """``(B, C, H, W) -> (B, P + N, D)`` tokens with positions, and the grid: the prefix tokens
        (class, registers, distillation) before the patches, positions added to all of them or,
        with ``no_embed_class``, to the patches only; then patch dropout and ``norm_pre``."""
        x, grid = self.patch_embed(x)
        pos = self.pos_embed_for(grid, x)
        prefix = [repeat(t, "1 p d -> b p d", b=x.shape[0])
                  for t in (self.cls_token, self.reg_token, self.dist_token) if t is not None]
        if self.no_embed_class:
            x = torch.cat([*prefix, x if pos is None else x + pos], dim=1)
        else:
            x = torch.cat([*prefix, x], dim=1) if prefix else x
            x = x if pos is None else x + pos
        return self.norm_pre(self.patch_drop(self.pos_drop(x))), grid

    def group_matcher(self, coarse: bool = False) -> dict[str, Any]:
        """Parameter groups by depth for layer-wise lr decay: the embedding first, then each block."""
        return dict(stem=r"^cls_token|^reg_token|^dist_token|^pos_embed|^patch_embed|^norm_pre",
                    blocks=[(r"^blocks\.(\d+)", None), (r"^norm", (99999,))])

    def get_classifier(self) -> nn.Module | tuple[nn.Module, nn.Module]:
        return (self.head, self.head_dist) if self.dist_token is not None else self.head

    def set_distilled_training(self, enable: bool = True) -> None:
        """timm's switch: in training, return ``(logits, dist_logits)`` (a loss each, DeiT), else their mean."""
        if enable and self.dist_token is None:
            raise ValueError("set_distilled_training needs a model built with distilled=True")
        self.distilled_training = enable

    def check_global_pool(self, global_pool: str, num_classes: int) -> None:
        if (global_pool not in GLOBAL_POOLS or (global_pool == "token" and self.cls_token is None)
                or (global_pool == "" and self.dist_token is not None)):
            raise ValueError(f"global_pool {global_pool!r} is not available for this model")
        if global_pool == "map" and self.attn_pool is None:  # timm's rule: kept or dropped, never added
            raise ValueError("global_pool='map' needs the attention pool the model was built with (global_pool='map')")

    def new_classifier(self, num_classes: int) -> None:
        if self.global_pool != "map":  # another read-out: the attention pool goes, as timm drops it
            self.attn_pool = None
        for name in ("head", "head_dist") if self.dist_token is not None else ("head",):
            setattr(self, name, linear_head(self.embed_dim, num_classes, init=True))

    def forward_features(self, x: torch.Tensor) -> torch.Tensor:
        """``(B, C, H, W) -> (B, P + N, D)``, after the final norm."""
        x, grid = self.embed(x)
        return self.norm(self.run_blocks(x, grid, self.rope_for(grid, x))[0])

    def run_blocks(self, x: torch.Tensor, grid: tuple[int, int], rope, *, stop: int | None = None,
                   take: Collection[int] = (), attention: bool = False
                   ) -> tuple[torch.Tensor, list[torch.Tensor], list[torch.Tensor]]:
        """The one loop over the blocks every forward method uses: tokens through ``blocks[:stop]``;
        returns ``(tokens, outputs of the blocks in take, each block's weights if attention)``."""
        kept, maps = [], []
        for i, blk in enumerate(self.blocks[:stop]):
            if attention:
                x, weights = blk(x, grid, self.num_prefix_tokens, rope=rope, return_attention=True)
                maps.append(weights)
            else:
                x = self.checkpointed(blk, x, grid, self.num_prefix_tokens, rope=rope)
            if i in take:
                kept.append(x)
        return x, kept, maps

    def checkpointed(self, fn, *args, **kwargs) -> torch.Tensor:  # activations recomputed in the backward
        if self.grad_checkpointing and torch.is_grad_enabled():
            return checkpoint(fn, *args, use_reentrant=False, **kwargs)
        return fn(*args, **kwargs)

    def forward_head(self, x: torch.Tensor, pre_logits: bool = False) -> torch.Tensor:
        """``(B, P + N, D) -> (B, num_classes)`` (``(B, D)`` with ``pre_logits``). A distilled
        model also reads its distillation token (the last prefix token) with ``head_dist`` and
        averages the two heads (:meth:`set_distilled_training` keeps them apart)."""
        pooled = self.attn_pool(x[:, self.num_prefix_tokens:]) if self.attn_pool is not None else \
            pool_tokens(x, self.global_pool, self.num_prefix_tokens)
        pooled = self.head_drop(self.fc_norm(pooled))
        if self.dist_token is None:
            return pooled if pre_logits else self.head(pooled)
        x_dist = self.head_drop(x[:, self.num_prefix_tokens - 1])
        if pre_logits:
            return (pooled + x_dist) / 2
        x, x_dist = self.head(pooled), self.head_dist(x_dist)
        return (x, x_dist) if self.distilled_training and self.training else (x + x_dist) / 2

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``forward_head(forward_features(x))``. A class-token head never reads the last block's
        patch tokens, so in training that block runs for the class token alone
        (``Block.forward_first``): the same logits (tested, gradients included) for most of its
        work less (docs/performance.md).
        Only while nobody looks: a hook on the last block, its parts or the final norm, or a trace
        (FX, export), sees the whole sequence, as timm's forward shows it."""
        if not self.class_token_shortcut():
            return self.forward_head(self.forward_features(x))
        x, grid = self.embed(x)
        rope = self.rope_for(grid, x)
        x = self.run_blocks(x, grid, rope, stop=-1)[0]
        return self.forward_head(self.norm(self.checkpointed(self.blocks[-1].forward_first, x,
                                                             self.num_prefix_tokens, rope)))

    def class_token_shortcut(self) -> bool:
        """Whether ``forward`` may run the last block for the class token alone: in training (in
        eval its smaller products would round differently from forward_features and a trace, which
        timm's tests compare bit for bit), a class-token read-out, a global-attention ``Block`` as
        built (no replaced module or method), and no hook or trace that would see the shortened sequence."""
        last = self.blocks[-1]
        return (self.training and self.global_pool == "token" and type(last) is Block and "forward" not in vars(last)
                and last.attn.window_size is None and not watched(last, self.norm))

    def forward_intermediates(self, x: torch.Tensor, indices: int | list[int] | tuple[int, ...] | None = None,
                              norm: bool = False, output_fmt: str = "NCHW", intermediates_only: bool = False,
                              return_prefix_tokens: bool = False, stop_early: bool = False):
        """Per-block outputs as maps ``(B, D, gh, gw)`` (``'NCHW'``) or tokens ``(B, N, D)``
        (``'NLC'``), timm's signature and ``indices`` (``None``: all; ``n``: the last ``n``; a list,
        negative from the end). Returns ``(final_features, intermediates)`` or, with
        ``intermediates_only``, the list; ``stop_early`` skips the blocks after the last asked for."""
        if output_fmt not in ("NCHW", "NLC"):
            raise ValueError(f"output_fmt must be 'NCHW' or 'NLC', got {output_fmt!r}")
        if output_fmt == "NCHW" and self.training and isinstance(self.patch_drop, PatchDropout):
            raise ValueError("patch dropout leaves no whole grid in training: use output_fmt='NLC' or eval()")
        take, p = feature_take_indices(len(self.blocks), indices), self.num_prefix_tokens
        x, grid = self.embed(x)
        x, kept, _ = self.run_blocks(x, grid, self.rope_for(grid, x), take=take,
                                     stop=max(take) + 1 if intermediates_only or stop_early else None)
        out = [as_output(self.norm(y) if norm else y, p, grid, output_fmt, return_prefix_tokens) for y in kept]
        return out if intermediates_only else (self.norm(x), out)

    def get_intermediate_layers(self, x: torch.Tensor, n: int | list[int] | tuple[int, ...] = 1, reshape: bool = False,
                                return_prefix_tokens: bool = False, norm: bool = False) -> list[torch.Tensor]:
        """DINO's call, as timm gives it: the outputs of the last ``n`` blocks (or those listed),
        tokens ``(B, N, D)`` or, with ``reshape``, maps ``(B, D, gh, gw)``; each a pair with its
        prefix tokens ``(B, P, D)`` when asked; after the final norm with ``norm``."""
        return self.forward_intermediates(x, n, norm=norm, output_fmt="NCHW" if reshape else "NLC",
                                          intermediates_only=True, return_prefix_tokens=return_prefix_tokens)

    def prune_intermediate_layers(self, indices: int | list[int] | tuple[int, ...] = 1, prune_norm: bool = False,
                                  prune_head: bool = True) -> list[int]:
        """Drop the blocks after the last of ``indices`` (timm's rule), and with ``prune_norm`` the
        final norm, with ``prune_head`` the read-out and head; returns the indices kept. The
        config follows (depth, windows, head), so the model saves and rebuilds as it now is."""
        take = feature_take_indices(len(self.blocks), indices)
        self.blocks = self.blocks[:max(take) + 1]
        self.feature_info = self.feature_info[:len(self.blocks)]
        changes: dict[str, Any] = dict(depth=len(self.blocks), window_block_indexes=tuple(
            i for i in self.config.window_block_indexes if i < len(self.blocks)))
        if prune_norm:
            self.norm = nn.Identity()
        if prune_head:
            self.fc_norm = nn.Identity()
            self.reset_classifier(0, "")
            changes.update(num_classes=0, global_pool="", fc_norm=False)
        if prune_norm and (prune_head or isinstance(self.fc_norm, nn.Identity)):
            changes["final_norm"] = False
        self.config = replace(self.config, **changes)
        return take

    def set_input_size(self, img_size: int | tuple[int, int] | None = None,
                       patch_size: int | tuple[int, int] | None = None) -> None:
        """Rebuild for another input size (and patch size), as timm's: a learned position table
        is resampled (bicubic) to the new grid, a patch projection to the new patch (FlexiViT's
        pseudo-inverse resize); the config and the data config follow."""
        new_patch = to_2tuple(patch_size) if patch_size is not None else self.patch_embed.patch_size
        new_size = to_2tuple(img_size) if img_size is not None else self.patch_embed.img_size
        config = replace(self.config, img_size=new_size, patch_size=new_patch)  # checks the sizes tile
        old_grid = self.grid_size
        self.patch_embed.set_input_size(new_size, new_patch)
        self.grid_size = self.patch_embed.grid_size
        if self.pos_embed is not None and tuple(self.grid_size) != tuple(old_grid):
            self.pos_embed = nn.Parameter(resample_abs_pos_embed(self.pos_embed.detach(), self.grid_size, old_grid,
                                                                 self.num_pos_prefix),
                                          requires_grad=self.pos_embed.requires_grad)
        self.feature_info = [dict(f, reduction=new_patch[0]) for f in self.feature_info]
        self.config = config
        self.pretrained_cfg["input_size"] = (self.config.in_chans, *new_size)

    @torch.no_grad()
    def get_attention_maps(self, x: torch.Tensor) -> list[torch.Tensor]:
        """Attention weights of every block, each ``(B, heads, P + N, P + N)`` (the explicit path)."""
        x, grid = self.embed(x)
        return self.run_blocks(x, grid, self.rope_for(grid, x), attention=True)[2]
