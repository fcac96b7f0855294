"""Initialisations that give a ViT a head start on small data.

- ``mimetic_attention_weights``: Q, K, V and output weights whose products look like those of a
  trained ViT (Trockman & Kolter 2023): ``W_q^T W_k`` near ``alpha1 Z + beta1 I`` per head, so a
  token starts by attending to tokens like itself, and ``W_v^T W_proj^T`` near
  ``alpha2 Z - beta2 I``. Built by a truncated SVD of the target, so each product is the target's
  best rank-``d`` approximation.
- ``lecun_normal_``: JAX's LeCun-normal draw, the patch projection of ``weight_init='jax'``.
- ``patch_whitening_weights``: a patch projection whose first rows are the principal directions
  of the training patches scaled to unit variance (airbench's whitening stem, put on the patch
  embedding), so tokens start decorrelated.

Weights are in ``nn.Linear`` layout ``(out, in)``: ``q = x @ W_q.T``.

References: Trockman & Kolter 2023, "Mimetic Initialization of Self-Attention Layers";
Keller Jordan's airbench (patch whitening).
"""

from __future__ import annotations

import torch
from einops import rearrange
from torch import nn


def _factor(target: torch.Tensor, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``A (rank, D), B (rank, D)`` with ``A^T B`` the best rank-``rank`` approximation of ``target``."""
    u, s, vh = torch.linalg.svd(target)
    root = s[:rank].sqrt()
    return (u[:, :rank] * root).T, root[:, None] * vh[:rank]


def mimetic_attention_weights(dim: int, num_heads: int, *, alpha1: float = 0.7, beta1: float = 0.7,
                              alpha2: float = 0.4, beta2: float = 0.4,
                              generator: torch.Generator | None = None) -> dict[str, torch.Tensor]:
    """``{'q', 'k', 'v', 'proj'}`` weights, each ``(dim, dim)``, for one attention layer.

    Head ``h`` takes rows ``h*d:(h+1)*d`` of ``q`` and ``k`` (``d = dim / num_heads``), and
    ``q_h^T k_h`` is the rank-``d`` SVD truncation of ``alpha1 Z_h + beta1 I`` with ``Z_h`` a fresh
    Gaussian of variance ``1 / dim``. ``v^T proj^T`` equals ``alpha2 Z - beta2 I`` (full rank).
    """
    if dim % num_heads:
        raise ValueError(f"dim {dim} is not divisible by num_heads {num_heads}")
    d = dim // num_heads
    eye = torch.eye(dim, dtype=torch.float64)

    def gaussian() -> torch.Tensor:
        return torch.randn(dim, dim, generator=generator, dtype=torch.float64) / dim**0.5

    qs, ks = zip(*(_factor(alpha1 * gaussian() + beta1 * eye, d) for _ in range(num_heads)))
    v, proj_t = _factor(alpha2 * gaussian() - beta2 * eye, dim)  # v^T proj^T = target
    return {"q": torch.cat(qs).float(), "k": torch.cat(ks).float(), "v": v.float(), "proj": proj_t.T.float()}


def lecun_normal_(weight: torch.Tensor) -> torch.Tensor:
    """In place: a normal truncated at two standard deviations, scaled so the variance is
    ``1 / fan_in`` (JAX's ``lecun_normal``, timm's ``lecun_normal_``)."""
    fan_in = weight[0].numel()
    std = (1.0 / fan_in) ** 0.5 / 0.87962566103423978  # the std of a standard normal cut at +-2
    return nn.init.trunc_normal_(weight, std=std, a=-2 * std, b=2 * std)


def whitening_basis(patches: torch.Tensor, eps: float) -> torch.Tensor:
    """Rows ``(n_dims, n_dims)`` that whiten flattened ``patches`` ``(n, n_dims)``: the eigenvectors
    of their second-moment matrix, largest eigenvalue first, each divided by
    ``sqrt(eigenvalue + eps)``, so row ``i`` maps a patch to a coordinate of variance near 1."""
    p = patches.double()
    eigvals, eigvecs = torch.linalg.eigh(p.T @ p / len(p))  # ascending
    eigvals, eigvecs = eigvals.flip(0), eigvecs.flip(1)
    return (eigvecs / (eigvals.clamp_min(0) + eps).sqrt()).T


def patch_whitening_weights(images: torch.Tensor, patch_size: int | tuple[int, int], embed_dim: int,
                            eps: float = 1e-2) -> torch.Tensor:
    """Rows ``(k, C * p1 * p2)`` that whiten the patches of ``images`` ``(B, C, H, W)`` (normalised
    as the model sees them), ``k = min(embed_dim, C * p1 * p2)``: :func:`whitening_basis` of the
    non-overlapping patches in ``patchify``'s ``(c p1 p2)`` layout, so row ``i`` dotted with a
    flattened patch gives its ``i``-th whitened coordinate."""
    p1, p2 = (patch_size, patch_size) if isinstance(patch_size, int) else patch_size
    if images.ndim != 4 or images.shape[2] % p1 or images.shape[3] % p2:
        raise ValueError(f"expected images (B, C, H, W) with sides divisible by the patch {(p1, p2)}, "
                         f"got {tuple(images.shape)}")
    patches = rearrange(images, "b c (gh p1) (gw p2) -> (b gh gw) (c p1 p2)", p1=p1, p2=p2)
    return whitening_basis(patches, eps)[:embed_dim].float()
