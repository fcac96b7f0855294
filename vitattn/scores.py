"""Score functions: how a query and a key are compared, which is what tells attention mechanisms apart.

Each is a small module ``(B, heads, Nq, d), (B, heads, Nk, d) -> (B, heads, Nq, Nk)`` that
:class:`vitattn.MultiHeadAttention` calls to compare queries and keys (``q . k / sqrt(d)`` unless
``score`` names another). ``fused(q)`` gives the query and scale that let the fused kernel (which computes
``q . k * scale``) compute the same score, or ``None`` when no such pair exists.

============  ===========================  ==========================================
name          score(q, k)                  notes
============  ===========================  ==========================================
dot           q . k                        Luong et al. 2015
scaled_dot    q . k / sqrt(d)              Vaswani et al. 2017; the default
general       q^T W k                      Luong et al. 2015; W per head, starts at I/sqrt(d)
additive      v^T tanh(W_q q + W_k k)      Bahdanau et al. 2015 ("concat" attention)
lsa           q . k * t, self masked       Lee et al. 2021; learned temperature t
============  ===========================  ==========================================
"""

from __future__ import annotations

import math

import torch
from torch import nn


class ScaledDot(nn.Module):
    """``q . k / sqrt(d)``: dot products shrunk so the softmax does not saturate as ``d`` grows."""

    def __init__(self, num_heads: int, head_dim: int) -> None:
        super().__init__()
        self.scale = head_dim**-0.5

    def forward(self, q: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
        return (q * self.scale) @ k.transpose(-2, -1)

    def fused(self, q: torch.Tensor) -> tuple[torch.Tensor, float] | None:
        return q, self.scale


class Dot(ScaledDot):
    """``q . k``, unscaled."""

    def __init__(self, num_heads: int, head_dim: int) -> None:
        super().__init__(num_heads, head_dim)
        self.scale = 1.0


class General(nn.Module):
    """``q^T W k`` with a learned ``W`` per head; ``W = I / sqrt(d)`` at the start, so it begins
    as ``scaled_dot`` and learns from there."""

    def __init__(self, num_heads: int, head_dim: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.eye(head_dim).repeat(num_heads, 1, 1) * head_dim**-0.5)

    def forward(self, q: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
        return torch.einsum("bhnd,hde->bhne", q, self.weight) @ k.transpose(-2, -1)

    def fused(self, q: torch.Tensor) -> tuple[torch.Tensor, float]:
        return torch.einsum("bhnd,hde->bhne", q, self.weight), 1.0  # q^T W k = (W^T q) . k


class Additive(nn.Module):
    """``v^T tanh(W_q q + W_k k)``: every (query, key) pair goes through a small tanh layer of
    width ``additive_dim`` (default ``d``); not a product of q and k, so no fused kernel."""

    def __init__(self, num_heads: int, head_dim: int, additive_dim: int | None = None) -> None:
        super().__init__()
        a = additive_dim or head_dim
        self.q = nn.Parameter(torch.randn(num_heads, head_dim, a) * head_dim**-0.5)
        self.k = nn.Parameter(torch.randn(num_heads, head_dim, a) * head_dim**-0.5)
        self.v = nn.Parameter(torch.randn(num_heads, a) * a**-0.5)

    def forward(self, q: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
        qa = torch.einsum("bhnd,hda->bhna", q, self.q)
        ka = torch.einsum("bhmd,hda->bhma", k, self.k)
        return torch.einsum("bhnma,ha->bhnm", torch.tanh(qa[:, :, :, None] + ka[:, :, None]), self.v)

    def fused(self, q: torch.Tensor) -> None:
        return None


class Locality(nn.Module):
    """Locality self-attention (LSA): ``q . k`` times a learned temperature (starting at
    ``1 / sqrt(d)``), with each token's score for itself removed. On small data a ViT's softmax
    stays flat; a learned temperature lets it sharpen, and without the (always large) self-score a
    token must weigh its neighbours against each other. Queries are the first ``Nq`` of the keys'
    tokens (self-attention, or ``Block.forward_first``), so "itself" is the diagonal."""

    def __init__(self, num_heads: int, head_dim: int) -> None:
        super().__init__()
        self.log_temperature = nn.Parameter(torch.full((1,), -0.5 * math.log(head_dim)))

    def forward(self, q: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
        s = (q @ k.transpose(-2, -1)) * self.log_temperature.exp()
        itself = torch.eye(q.shape[-2], k.shape[-2], dtype=torch.bool, device=q.device)
        return s.masked_fill(itself, float("-inf"))

    def fused(self, q: torch.Tensor) -> None:
        return None  # the diagonal mask is part of the score: the readable path computes it


SCORES: dict[str, type[nn.Module]] = {"scaled_dot": ScaledDot, "dot": Dot, "general": General, "additive": Additive,
                                  "lsa": Locality}
