"""The transformer block: ``x + attn(norm1(x))``, then ``x + mlp(norm2(x))`` (pre-norm).

Names follow timm (``norm1``, ``attn``, ``ls1``, ``drop_path1``, ``norm2``, ``mlp.fc1``, ``mlp.fc2``,
``ls2``, ``drop_path2``) so checkpoints convert by key.

References: Vaswani et al. 2017; Dosovitskiy et al. 2021; Huang et al. 2016 (stochastic depth);
Touvron et al. 2021, CaiT (LayerScale).
"""

from __future__ import annotations

import torch
from torch import nn

from .attention import AttentionConfig, MultiHeadAttention
from .helpers import Size2


class QuickGELU(nn.Module):
    """``x * sigmoid(1.702 x)``: OpenAI CLIP's cheaper GELU (timm's ``quick_gelu``)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * torch.sigmoid(1.702 * x)


# the MLP's activation by timm's name (``act_layer``)
ACT_LAYERS = {"gelu": nn.GELU, "gelu_tanh": lambda: nn.GELU(approximate="tanh"), "quick_gelu": QuickGELU}


class Mlp(nn.Module):
    """``(B, N, D) -> (B, N, out)``: ``fc1 -> activation -> dropout -> fc2 -> dropout``; the
    activation by its name in ``ACT_LAYERS`` (GELU unless told)."""

    def __init__(self, in_features: int, hidden_features: int, out_features: int | None = None, *,
                 drop: float = 0.0, bias: bool = True, act_layer: str = "gelu") -> None:
        super().__init__()
        if act_layer not in ACT_LAYERS:
            raise ValueError(f"unknown act_layer {act_layer!r}; expected one of {tuple(ACT_LAYERS)}")
        self.fc1 = nn.Linear(in_features, hidden_features, bias=bias)
        self.act = ACT_LAYERS[act_layer]()
        self.drop1 = nn.Dropout(drop)
        self.fc2 = nn.Linear(hidden_features, out_features or in_features, bias=bias)
        self.drop2 = nn.Dropout(drop)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.drop2(self.fc2(self.drop1(self.act(self.fc1(x)))))


class DropPath(nn.Module):
    """Stochastic depth: drop the whole residual branch for a random subset of samples while
    training, scaling the kept ones by ``1 / keep``."""

    def __init__(self, drop_prob: float = 0.0) -> None:
        super().__init__()
        self.drop_prob = drop_prob

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.drop_prob == 0.0 or not self.training:
            return x
        keep = 1.0 - self.drop_prob
        mask = x.new_empty((x.shape[0],) + (1,) * (x.ndim - 1)).bernoulli_(keep)
        return x * mask / keep

    def extra_repr(self) -> str:
        return f"drop_prob={self.drop_prob}"


class LayerScale(nn.Module):
    """Per-channel learned scale of a residual branch, started small (``init_values``)."""

    def __init__(self, dim: int, init_values: float = 1e-5) -> None:
        super().__init__()
        self.gamma = nn.Parameter(init_values * torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * self.gamma


class Block(nn.Module):
    """``(B, N, D) -> (B, N, D)``, pre-norm, optional LayerScale, DropPath and window attention.

    Args:
        dim: token width ``D``.
        attn: the attention's options (:class:`AttentionConfig`: heads, score, biases, dropout,
            window); its ``proj_drop`` also drops after the MLP.
        mlp_ratio: MLP hidden width as a multiple of ``D``.
        act_layer: the MLP's activation (``ACT_LAYERS``).
        norm_eps: the LayerNorms' epsilon (timm's 1e-6; CLIP's 1e-5).
        init_values: LayerScale start value; ``None`` for no LayerScale.
        drop_path: stochastic depth rate of this block.

    ``forward`` / ``forward_first`` take ``rope``, rotary angles for the patch tokens
    (:func:`vitattn.pos_embed.rotate_qk`), or ``None``.
    """

    def __init__(self, dim: int, attn: AttentionConfig, *, mlp_ratio: float = 4.0, init_values: float | None = None,
                 drop_path: float = 0.0, norm_eps: float = 1e-6, act_layer: str = "gelu") -> None:
        super().__init__()
        self.norm1 = nn.LayerNorm(dim, eps=norm_eps)
        self.attn = MultiHeadAttention(dim, config=attn)
        self.ls1 = LayerScale(dim, init_values) if init_values else nn.Identity()
        self.drop_path1 = DropPath(drop_path) if drop_path > 0.0 else nn.Identity()
        self.norm2 = nn.LayerNorm(dim, eps=norm_eps)
        self.mlp = Mlp(dim, int(dim * mlp_ratio), drop=attn.proj_drop, act_layer=act_layer)
        self.ls2 = LayerScale(dim, init_values) if init_values else nn.Identity()
        self.drop_path2 = DropPath(drop_path) if drop_path > 0.0 else nn.Identity()

    def forward(
        self,
        x: torch.Tensor,
        grid: Size2 | None = None,
        num_prefix_tokens: int = 0,
        return_attention: bool = False,
        rope: tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        # through the module's call, so hooks on ``attn`` see it; the pair only when asked
        a = self.attn(self.norm1(x), grid=grid, num_prefix_tokens=num_prefix_tokens, rope=rope,
                      return_attention=return_attention)
        a, weights = a if return_attention else (a, None)
        x = x + self.drop_path1(self.ls1(a))
        x = x + self.drop_path2(self.ls2(self.mlp(self.norm2(x))))
        return (x, weights) if return_attention else x

    def forward_first(self, x: torch.Tensor, n: int, rope: tuple[torch.Tensor, torch.Tensor] | None = None
                      ) -> torch.Tensor:
        """The block's output for the first ``n`` tokens only: ``(B, N, D) -> (B, n, D)``.

        Those tokens still attend to all ``N`` (keys and values come from every token), but no
        query, attention output, projection or MLP is computed for the other ``N - n``: equal to
        ``forward(x)[:, :n]``. A class-token classifier needs nothing else from its last block
        (``ViT.forward`` uses it). Global attention only.
        """
        if self.attn.window_size is not None:
            raise ValueError("forward_first needs global attention; this block uses window attention")
        h = self.norm1(x)
        x = x[:, :n] + self.drop_path1(self.ls1(self.attn(h[:, :n], context=h, rope=rope)))
        return x + self.drop_path2(self.ls2(self.mlp(self.norm2(x))))
