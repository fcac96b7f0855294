"""Multi-head attention, written so it can be read.

Attention looks up values by similarity: each query ``q`` scores every key ``k``, a softmax
turns the scores into weights, and the output is the weighted sum of the values ``v``::

    out_i = sum_j softmax_j(score(q_i, k_j)) * v_j

In self-attention Q, K and V are three linear maps of the same tokens; in cross-attention the
queries come from one sequence (the target) and keys/values from another (the source). Multi-head
attention splits the width into ``heads`` independent attentions of width ``d`` that run in
parallel (one batched matrix product) and joins them with the output projection ``proj``.

:class:`MultiHeadAttention` is that computation: the ``qkv`` projection, the heads, the score
(``q . k / sqrt(d)`` by default), the softmax, the weighted sum, the join, for self- and
cross-attention. Its options are one :class:`AttentionConfig`, passed down whole from the ViT's
config through each block: a score function by name (:mod:`vitattn.scores`: ``dot``,
``scaled_dot``, ``general``, ``additive``, ``lsa``; *different Q-K scores give different attention
mechanisms*), widths, biases, dropout and window attention (:mod:`vitattn.window`). Masks, the patch
grid and rotary position codes (:func:`vitattn.pos_embed.rotate_qk`) are arguments of the call.

Masks are boolean, True where a query may attend to a key, with torch's SDPA's meaning on every
path: a query whose keys are all masked gets zero weights and a zero output before ``proj``.

Two paths compute the same thing and tests hold them equal: the fused kernel
(``F.scaled_dot_product_attention``, used for dot / scaled_dot / general when weights are not
asked for) and the explicit ``softmax(score) @ v``, which also returns the weights. The fused
kernel is the default wherever it computes the same thing: in fp32 it was never slower in a whole
training step and is faster without gradients at every length measured, without an N x N
matrix. In bf16 on a CPU, short sequences take the same three plain ops instead, which run at
the native bf16 rate where torch's kernels do not (docs/performance.md).

Shapes: tokens ``B N D``; per head ``B heads N d``; weights ``B heads Nq Nk``.

References: Vaswani et al. 2017; timm ``vision_transformer.Attention``.
"""

from __future__ import annotations

import dataclasses

import torch
import torch.nn.functional as F
from einops import rearrange
from torch import nn

from .helpers import Size2, to_2tuple
from .pos_embed import rotate_qk
from .scores import SCORES
from .window import window_attend, window_mask

__all__ = ["SCORES", "Attention", "AttentionConfig", "MultiHeadAttention", "merge_masks", "window_mask"]

# calls in a torch.fx trace (torchvision's create_feature_extractor), not traced into: they read
# shapes and devices, which are proxies while tracing
for _leaf in ("rearrange", "rotate_qk", "fused_attention", "check_tokens", "window_attend"):
    torch.fx.wrap(_leaf)


# bf16 on a CPU: torch's attention kernels are slow there (flash at about fp32's speed; math with
# fp32-close results and a check of every row for -inf), while three plain ops run their products at
# the native bf16 rate: faster in training up to about 600 keys and in inference up to about 100
# (measured in docs/performance.md).
CPU_BF16_PLAIN_MAX_KEYS = {"train": 600, "infer": 100}


def masked_softmax(s: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
    """Scores ``(B, heads, Nq, Nk)`` -> weights over the keys, zero where ``mask`` is False. A query
    whose keys are all masked gets all-zero weights, as torch's SDPA gives it (a softmax over
    nothing is NaN): its row is softmaxed as zeros and then zeroed, so no NaN reaches a gradient."""
    if mask is None:
        return s.softmax(dim=-1)
    empty = ~mask.any(dim=-1, keepdim=True)
    s = s.masked_fill(~mask, float("-inf")).masked_fill(empty, 0.0)
    return s.softmax(dim=-1).masked_fill(empty, 0.0)


def fused_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None, dropout_p: float,
                    scale: float) -> torch.Tensor:
    """``softmax(q . k * scale) @ v``: ``F.scaled_dot_product_attention``, or the same three plain
    ops for bf16 on a CPU over at most ``CPU_BF16_PLAIN_MAX_KEYS`` keys."""
    if (q.dtype == torch.bfloat16 and q.device.type == "cpu"
            and k.shape[-2] <= CPU_BF16_PLAIN_MAX_KEYS["train" if torch.is_grad_enabled() else "infer"]):
        return F.dropout(masked_softmax((q * scale) @ k.transpose(-2, -1), mask), dropout_p) @ v
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=dropout_p, scale=scale)


def check_tokens(x: torch.Tensor, weight: torch.Tensor, name: str = "tokens") -> None:
    """Tokens ``(B, N, D)`` with at least one token, floating point in ``weight``'s dtype unless
    autocast casts them."""
    if x.ndim != 3:
        raise ValueError(f"expected {name} of shape (B, N, D), got a {x.ndim}-D tensor of shape {tuple(x.shape)}")
    if x.shape[1] == 0:
        raise ValueError(f"expected at least one of the {name}, got shape {tuple(x.shape)}")
    if not x.is_floating_point() or (x.dtype != weight.dtype and not torch.is_autocast_enabled(x.device.type)):
        raise TypeError(f"expected {weight.dtype} {name} (the weights' dtype, or any under autocast), got {x.dtype}")


@dataclasses.dataclass(frozen=True)
class AttentionConfig:
    """The options of one attention layer, built once (``ViT`` from its ``ViTConfig``) and passed
    down whole; a block's window is the one field that differs between blocks."""

    num_heads: int = 8
    hidden_dim: int | None = None  # width of q, k, v (all heads together); default: the tokens' width
    context_dim: int | None = None  # width of the context tokens in cross-attention, when it differs
    out_dim: int | None = None  # width after ``proj``; default: hidden_dim
    score: str | nn.Module = "scaled_dot"  # a name in SCORES, or a score module built for these heads
    qkv_bias: bool = False
    qk_norm: bool = False  # LayerNorm on q and k per head (Dehghani et al. 2023)
    attn_drop: float = 0.0
    proj_drop: float = 0.0
    window_size: int | Size2 | None = None  # attend within windows of the patch grid (ViTDet); None: global
    fused: bool = True  # the fused kernel wherever it computes the same thing
    norm_eps: float = 1e-6
    split_q: bool = False  # separate q and kv layers even when the widths agree (timm's attention pool)


class MultiHeadAttention(nn.Module):
    """Multi-head attention as it is taught: ``(B, N, dim) [+ context (B, Nk, context_dim)] -> (B, N, out_dim)``.

    Q, K and V are linear maps of the tokens (one ``qkv`` layer; in cross-attention keys and
    values come from ``context``, through separate ``q`` and ``kv`` layers when its width differs);
    the width splits into ``num_heads`` attentions of width ``d`` that run side by side; each
    query scores every key with ``score_fn`` (``q . k / sqrt(d)`` unless another is named), a
    softmax turns the scores into weights, the weighted sum of the values is the output, and
    ``proj`` joins the heads. :meth:`attend` holds the readable path and the fused kernel beside
    it; tests hold them equal. The parameter names are timm's.

    Built from an :class:`AttentionConfig` (``config=``) or its fields as keywords:
    ``MultiHeadAttention(10, 2, hidden_dim=20)`` is the notes' ``selfAttention(2, 10, 20)``.
    """

    def __init__(self, dim: int, num_heads: int | None = None, *, config: AttentionConfig | None = None,
                 **options) -> None:
        super().__init__()
        if config is None:
            config = AttentionConfig(**({"num_heads": num_heads} if num_heads is not None else {}), **options)
        elif num_heads is not None or options:
            raise TypeError("pass the options either as config= or as keywords, not both")
        c = self.config = config
        if isinstance(c.score, str) and c.score not in SCORES:
            raise ValueError(f"unknown score {c.score!r}; expected one of {tuple(SCORES)}")
        hidden_dim = c.hidden_dim or dim
        if hidden_dim % c.num_heads:
            raise ValueError(f"hidden width {hidden_dim} is not divisible by the number of heads {c.num_heads}")
        self.num_heads = c.num_heads
        self.head_dim = d = hidden_dim // c.num_heads
        self.hidden_dim = hidden_dim
        self.fused = c.fused
        # keys and values from tokens of another width (or kept apart, as timm's attention pool keeps them)
        self.cross = c.split_q or (c.context_dim is not None and c.context_dim != dim)
        if self.cross:
            self.q = nn.Linear(dim, hidden_dim, bias=c.qkv_bias)
            self.kv = nn.Linear(c.context_dim or dim, 2 * hidden_dim, bias=c.qkv_bias)
        else:
            self.qkv = nn.Linear(dim, 3 * hidden_dim, bias=c.qkv_bias)
        self.q_norm = nn.LayerNorm(d, eps=c.norm_eps) if c.qk_norm else nn.Identity()
        self.k_norm = nn.LayerNorm(d, eps=c.norm_eps) if c.qk_norm else nn.Identity()
        self.score_fn = SCORES[c.score](c.num_heads, d) if isinstance(c.score, str) else c.score
        self.attn_drop = nn.Dropout(c.attn_drop)
        self.proj = nn.Linear(hidden_dim, c.out_dim or hidden_dim)
        self.proj_drop = nn.Dropout(c.proj_drop)
        self.window_size = to_2tuple(c.window_size) if c.window_size is not None else None

    def project_qkv(self, x: torch.Tensor, context: torch.Tensor | None = None
                    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Tokens (and ``context`` for keys and values) -> per-head ``q, k, v`` ``(B, heads, N, d)``."""
        h, hd = self.num_heads, self.hidden_dim
        if self.cross:
            if context is None:
                raise ValueError("this attention was built with context_dim for cross-attention; pass context=")
            q, kv = self.q(x), self.kv(context)
        elif context is None:
            # Split q, k, v where they lie (axis 2) and only then move heads forward: the backward
            # stacks the three gradients straight into qkv's layout, one copy where unbinding a
            # 'three b h n d' view takes two (a stack, then a permuted clone).
            qkv = rearrange(self.qkv(x), "b n (three h d) -> b n three h d", three=3, h=h)
            q, k, v = qkv.unbind(2)  # unpacked in one statement, as torch.fx traces it
            q, k, v = (rearrange(t, "b n h d -> b h n d") for t in (q, k, v))
            return self.q_norm(q), self.k_norm(k), v
        else:  # one qkv layer: queries from the tokens, keys and values from the context
            w, b = self.qkv.weight, self.qkv.bias
            q = F.linear(x, w[:hd], None if b is None else b[:hd])
            kv = F.linear(context, w[hd:], None if b is None else b[hd:])
        q = rearrange(q, "b n (h d) -> b h n d", h=h)
        k, v = rearrange(kv, "b m (two h d) -> two b h m d", two=2, h=h).unbind(0)
        return self.q_norm(q), self.k_norm(k), v

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None = None,
               need_weights: bool = False) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Per head: ``(B, heads, Nq, d) -> (B, heads, Nq, d)``, and the weights when asked.
        ``mask`` is boolean, True where a query may attend to a key, broadcastable to
        ``(B, heads, Nq, Nk)``."""
        fused = self.score_fn.fused(q) if self.fused and not need_weights else None
        if fused is not None:  # the same computation in one kernel, without the N x N weights
            return fused_attention(fused[0], k, v, mask, self.attn_drop.p if self.training else 0.0, fused[1]), None
        weights = masked_softmax(self.score_fn(q, k), mask)  # the readable path: score, mask, softmax
        return self.attn_drop(weights) @ v, weights  # and the weighted sum

    def join_heads(self, out: torch.Tensor) -> torch.Tensor:
        """``(B, heads, N, d) -> (B, N, out_dim)``: concatenate the heads, project, drop."""
        return self.proj_drop(self.proj(rearrange(out, "b h n d -> b n (h d)")))

    def attention(
        self,
        x: torch.Tensor,
        context: torch.Tensor | None = None,
        *,
        need_weights: bool = False,
        attn_mask: torch.Tensor | None = None,
        key_padding_mask: torch.Tensor | None = None,
        grid: Size2 | None = None,
        num_prefix_tokens: int = 0,
        rope: tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The output ``(B, Nq, out_dim)`` and, when ``need_weights``, the weights.

        Args:
            context: ``(B, Nk, context_dim)`` tokens for keys and values (cross-attention).
            attn_mask: boolean, True = may attend; broadcastable to ``(B, heads, Nq, Nk)``.
            key_padding_mask: boolean ``(B, Nk)``, True = padding to ignore (as in
                ``torch.nn.MultiheadAttention``).
            grid: the patch grid ``(gh, gw)``; needed for window attention.
            num_prefix_tokens: tokens before the grid (class token) under window attention.
            rope: rotary angles ``(sin, cos)``, each ``(G, head_dim)``, for the last ``G`` keys
                (the patch tokens; :func:`vitattn.pos_embed.rope_2d`): see :func:`rotate_qk`.
        """
        check_tokens(x, self.proj.weight)
        if context is not None:
            check_tokens(context, self.proj.weight, "context tokens")
        q, k, v = self.project_qkv(x, context)
        if rope is not None:
            q, k = rotate_qk(q, k, rope)
        mask = merge_masks(attn_mask, key_padding_mask, q.shape, k.shape)
        if self.window_size is None:
            out, weights = self.attend(q, k, v, mask, need_weights=need_weights)
            return self.join_heads(out), weights
        if grid is None:
            raise ValueError("window attention needs the patch grid: pass grid=(gh, gw)")
        if context is not None or mask is not None:
            raise ValueError("window attention is self-attention without masks")
        if num_prefix_tokens + grid[0] * grid[1] != x.shape[1]:
            raise ValueError(f"grid {tuple(grid)} with {num_prefix_tokens} prefix tokens means "
                             f"{num_prefix_tokens + grid[0] * grid[1]} tokens, got {x.shape[1]}")
        if need_weights:  # readable path: global attention restricted by a window mask
            mask = window_mask(grid, self.window_size, num_prefix_tokens).to(x.device)
            out, weights = self.attend(q, k, v, mask, need_weights=True)
            return self.join_heads(out), weights
        return self.join_heads(window_attend(self.attend, q, k, v, grid, self.window_size, num_prefix_tokens)), None

    def forward(self, x: torch.Tensor, context: torch.Tensor | None = None, *, return_attention: bool = False,
                **options) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """The output ``(B, Nq, out_dim)``; with ``return_attention=True`` the pair (output, weights
        ``(B, heads, Nq, Nk)``). ``options`` go to :meth:`attention` (masks, grid, rotary codes)."""
        out, weights = self.attention(x, context, need_weights=return_attention, **options)
        return (out, weights) if return_attention else out


Attention = MultiHeadAttention  # timm's name for it


def merge_masks(attn_mask: torch.Tensor | None, key_padding_mask: torch.Tensor | None, q_shape: torch.Size,
                k_shape: torch.Size) -> torch.Tensor | None:
    """One boolean mask (True = may attend) from an ``attn_mask`` and a ``key_padding_mask``
    (True = padding), both checked; ``None`` when neither is given."""
    if attn_mask is None and key_padding_mask is None:
        return None
    b, h, nq, _ = q_shape
    nk = k_shape[2]
    mask = None
    if attn_mask is not None:
        if attn_mask.dtype != torch.bool:
            raise ValueError(f"attn_mask must be boolean (True = attend), got {attn_mask.dtype}")
        try:
            torch.broadcast_shapes(attn_mask.shape, (b, h, nq, nk))
        except RuntimeError:
            raise ValueError(
                f"attn_mask of shape {tuple(attn_mask.shape)} does not broadcast to (B, heads, Nq, Nk) = "
                f"{(b, h, nq, nk)}"
            ) from None
        mask = attn_mask
    if key_padding_mask is not None:
        if key_padding_mask.dtype != torch.bool or tuple(key_padding_mask.shape) != (b, nk):
            raise ValueError(
                f"key_padding_mask must be boolean of shape (B, Nk) = {(b, nk)}, got "
                f"{key_padding_mask.dtype} {tuple(key_padding_mask.shape)}"
            )
        keep = ~key_padding_mask[:, None, None, :]
        mask = keep if mask is None else mask & keep
    return mask
