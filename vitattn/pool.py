"""Read-outs: how a ViT turns its tokens ``(B, P + N, D)`` into one vector ``(B, D)`` for the head.

    'token'                 the class token (the first prefix token)
    'avg' / 'max' / 'avgmax'  the mean / max / (mean + max) / 2 of the patch tokens
    'map'                   a learned query attends to the patch tokens, then an MLP (:class:`AttentionPool`,
                            SigLIP's multi-head attention pooling)
    ''                      every token, unpooled

References: timm ``global_pool_nlc`` and ``AttentionPoolLatent``; Zhai et al. 2023 (SigLIP); Lee et
al. 2019 (pooling by multi-head attention).
"""

from __future__ import annotations

import torch
from einops import repeat
from torch import nn

from .attention import AttentionConfig, MultiHeadAttention
from .block import Mlp

torch.fx.wrap("repeat")  # a call in an FX trace: einops reads the batch size, a proxy while tracing

GLOBAL_POOLS = ("token", "avg", "avgmax", "max", "map", "")


def pool_tokens(x: torch.Tensor, global_pool: str, num_prefix_tokens: int) -> torch.Tensor:
    """``(B, P + N, D) -> (B, D)``: the class token, or the mean / max / (mean + max) / 2 of the
    patch tokens (timm's 'avg', 'max', 'avgmax', as its ``global_pool_nlc``); ``''`` keeps every
    token. ('map' is :class:`AttentionPool`, a module with weights.)"""
    if global_pool == "token":
        return x[:, 0]
    patches = x[:, num_prefix_tokens:]
    if global_pool == "avg":
        return patches.mean(dim=1)
    if global_pool == "max":
        return patches.amax(dim=1)
    if global_pool == "avgmax":
        return 0.5 * (patches.amax(dim=1) + patches.mean(dim=1))
    return x


class AttentionPool(MultiHeadAttention):
    """``(B, N, D) -> (B, D)``: one learned query (``latent``) attends to the tokens, and the
    result passes a pre-norm MLP residual, ``y + mlp(norm(y))``. The attention is the library's
    own, with timm's separate ``q`` and ``kv`` layers (timm's ``AttentionPoolLatent``, names and
    numbers); ``return_attention`` gives the query's weights ``(B, heads, 1, N)`` too."""

    def __init__(self, dim: int, num_heads: int, *, mlp_ratio: float = 4.0, norm_eps: float = 1e-6,
                 act_layer: str = "gelu", fused: bool = True) -> None:
        super().__init__(dim, config=AttentionConfig(num_heads=num_heads, qkv_bias=True, split_q=True, fused=fused))
        self.latent = nn.Parameter(torch.zeros(1, 1, dim))
        self.norm = nn.LayerNorm(dim, eps=norm_eps)
        self.mlp = Mlp(dim, int(dim * mlp_ratio), act_layer=act_layer)
        std = dim**-0.5  # timm's draw for the query: a normal cut at two standard deviations
        nn.init.trunc_normal_(self.latent, std=std, a=-2 * std, b=2 * std)

    def forward(self, x: torch.Tensor, return_attention: bool = False
                ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        query = repeat(self.latent, "1 l d -> b l d", b=x.shape[0])
        y, weights = self.attention(query, x, need_weights=return_attention)
        y = (y + self.mlp(self.norm(y)))[:, 0]
        return (y, weights) if return_attention else y
