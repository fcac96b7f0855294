"""Initialisations beyond PyTorch's defaults.

- ``lecun_normal_``: JAX's LeCun-normal draw, the patch projection of ``weight_init='jax'``
  (timm's ``init_weights_vit_jax``).
- ``init_vit_``: timm's two ViT schemes, ``''`` and ``'jax'``.
- ``whitening_basis``: the rows that whiten flattened patches, behind the CNN's whitening stem
  (airbench's; :func:`vitattn.cnn.whitening_filters`).

Two more were measured and left the library (journal.md): a mimetic init of the attention
weights (Trockman & Kolter 2023) and a whitened patch embedding; neither helped by ten epochs.
"""

from __future__ import annotations

import torch
from torch import nn


def lecun_normal_(weight: torch.Tensor) -> torch.Tensor:
    """In place: a normal truncated at two standard deviations, scaled so the variance is
    ``1 / fan_in`` (JAX's ``lecun_normal``, timm's ``lecun_normal_``)."""
    fan_in = weight[0].numel()
    std = (1.0 / fan_in) ** 0.5 / 0.87962566103423978  # the std of a standard normal cut at +-2
    return nn.init.trunc_normal_(weight, std=std, a=-2 * std, b=2 * std)


def init_vit_(vit: nn.Module, scheme: str = "") -> None:
    """timm's ViT schemes, in place. Both: a truncated normal (std .02) position table, near-zero
    class and register tokens. Default (``''``): truncated normal (std .02) for linear layers, zero biases, the
    patch projection keeps PyTorch's init. ``'jax'`` (timm's ``init_weights_vit_jax``):
    Xavier-uniform linear layers (MLP biases ~N(0, 1e-6), others 0), a zero head, a LeCun-normal
    patch projection; its block weights start about 3x larger than the default's."""
    if getattr(vit, "pos_embed", None) is not None:
        nn.init.trunc_normal_(vit.pos_embed, std=0.02)
    for name in ("cls_token", "reg_token"):
        if getattr(vit, name, None) is not None:
            nn.init.normal_(getattr(vit, name), std=1e-6)
    if getattr(vit, "dist_token", None) is not None:
        nn.init.trunc_normal_(vit.dist_token, std=0.02)  # timm's VisionTransformerDistilled
    jax = scheme == "jax"
    for name, m in vit.named_modules():
        if isinstance(m, nn.Linear):
            if jax and name in ("head", "head_dist"):
                nn.init.zeros_(m.weight)
            elif jax:
                nn.init.xavier_uniform_(m.weight)
            else:
                nn.init.trunc_normal_(m.weight, std=0.02)
            if m.bias is not None and jax and ".mlp." in name:
                nn.init.normal_(m.bias, std=1e-6)
            elif m.bias is not None:
                nn.init.zeros_(m.bias)
    if jax:
        lecun_normal_(vit.patch_embed.proj.weight)
        if vit.patch_embed.proj.bias is not None:
            nn.init.zeros_(vit.patch_embed.proj.bias)


def whitening_basis(patches: torch.Tensor, eps: float) -> torch.Tensor:
    """Rows ``(n_dims, n_dims)`` that whiten flattened ``patches`` ``(n, n_dims)``: the eigenvectors
    of their second-moment matrix, largest eigenvalue first, each divided by
    ``sqrt(eigenvalue + eps)``, so row ``i`` maps a patch to a coordinate of variance near 1."""
    p = patches.double()
    eigvals, eigvecs = torch.linalg.eigh(p.T @ p / len(p))  # ascending
    eigvals, eigvecs = eigvals.flip(0), eigvecs.flip(1)
    return (eigvecs / (eigvals.clamp_min(0) + eps).sqrt()).T

