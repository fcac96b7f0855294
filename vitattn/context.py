"""Global context, measured: how far each layer of a model looks.

Three measures in pixels of the input image, so a ViT and a CNN share one axis, and one in nats:

- ``mean_attention_distance``: for each layer and head, the attention-weighted distance between a
  query patch and the patches it attends to, ``sum_j A_ij * ||pos_i - pos_j||``, averaged over
  queries and images (ViT paper, appendix D.7). Uniform attention over an 8x8 grid of 4-px
  patches gives 16.55 px; attention to self only gives 0.
- ``effective_receptive_field``: the gradient of a layer's centre unit with respect to the input
  pixels (Luo et al. 2016), ``|grad|`` summed over channels and images, and its radius: the same
  weighted mean distance, with the normalised gradient as the weights, from the unit's centre.
- ``attention_rollout``: attention flow through the residual stream, head-averaged attention plus
  identity, renormalised and multiplied through the layers (Abnar & Zuidema 2020).
- ``token_norms``: the patch tokens' norms in the residual stream after each block, against
  each image's median: Darcet et al. (2024) found a few high-norm "artefact" patches in trained
  ViTs, which registers take over; ``max / median`` and the share above ``factor x median`` show them.
- ``attention_entropy``: how spread each query's attention is, ``-sum_j A_ij log A_ij`` in nats,
  ``log N`` for uniform attention over N patches and 0 for attention to one patch. Not in pixels:
  it tells near-uniform attention from attention that is sharp but lands at every distance, which
  a mean distance near the uniform value cannot.

Prefix tokens (class / register tokens) have no place on the image, so distances leave them out:
prefix queries are dropped, prefix keys are dropped and each remaining row is renormalised over
the patch keys (``renormalize=True``), i.e. the distance of the attention a patch pays to other
patches. ``renormalize=False`` keeps the raw weights, which counts attention to prefix tokens as
distance 0 (an attention-to-class-token-heavy head then reads as local).

Shapes: attention maps ``(B, heads, P + N, P + N)`` per layer (``ViT.get_attention_maps``),
``P`` prefix tokens, ``N = gh * gw`` patches in row-major order; images ``(B, C, H, W)``.

References: Dosovitskiy et al. 2021, appendix D.7; Luo et al. 2016, "Understanding the Effective
Receptive Field in Deep CNNs"; Abnar & Zuidema 2020, "Quantifying Attention Flow in
Transformers"; jacobgil/vit-explain for the head-fusion options of rollout.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from einops import rearrange
from torch import nn

from .helpers import Size2, feature_take_indices, to_2tuple


def patch_centres(grid: int | Size2, patch_size: int | Size2) -> torch.Tensor:
    """``(gh * gw, 2)`` pixel coordinates (row, col) of each patch centre, row-major."""
    (gh, gw), (ph, pw) = to_2tuple(grid), to_2tuple(patch_size)
    rows, cols = torch.meshgrid(torch.arange(gh), torch.arange(gw), indexing="ij")
    return torch.stack([(rows.flatten() + 0.5) * ph, (cols.flatten() + 0.5) * pw], 1).double()


def _layers(maps: torch.Tensor | Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """Per-layer ``(B, heads, T, T)`` maps from a list, an ``(L, B, heads, T, T)`` tensor or a single
    ``(B, heads, T, T)`` map. Layers stay separate (no stacked copy), so ViT-B sized maps fit."""
    if isinstance(maps, torch.Tensor):
        if maps.ndim not in (4, 5):
            raise ValueError(f"expected attention maps (layers, B, heads, T, T) or (B, heads, T, T), "
                             f"got {tuple(maps.shape)}")
        maps = [maps] if maps.ndim == 4 else list(maps.unbind(0))
    maps = list(maps)
    if not maps:
        raise ValueError("expected at least one attention map, got an empty list")
    shapes = {tuple(m.shape) for m in maps}
    if len(shapes) != 1 or len(next(iter(shapes))) != 4:
        raise ValueError(f"expected per-layer maps of one shape (B, heads, T, T), got {sorted(shapes)}")
    t = maps[0].shape
    if t[-1] != t[-2]:
        raise ValueError(f"expected square self-attention maps (B, heads, T, T), got {tuple(t)}")
    return maps


def patch_attention(attn: torch.Tensor, num_prefix_tokens: int, renormalize: bool = True) -> torch.Tensor:
    """One layer ``(B, heads, P + N, P + N) -> (B, heads, N, N)``: patch queries to patch keys,
    rows renormalised to sum to 1 when ``renormalize`` (see the module note on prefix tokens)."""
    p = num_prefix_tokens
    if attn.shape[-1] <= p:
        raise ValueError(f"attention maps {tuple(attn.shape[-2:])} do not fit {p} prefix tokens plus patches")
    a = attn[..., p:, p:].float()
    if renormalize:
        a = a / a.sum(-1, keepdim=True).clamp_min(1e-12)
    return a


def mean_attention_distance(maps: torch.Tensor | Sequence[torch.Tensor], grid: int | Size2,
                            patch_size: int | Size2, num_prefix_tokens: int, *,
                            renormalize: bool = True) -> torch.Tensor:
    """Mean attention distance in pixels, ``(layers, heads)``.

    ``maps``: per-layer ``(B, heads, P + N, P + N)`` attention weights (a list, or a stacked
    ``(L, B, heads, P + N, P + N)`` tensor). Each patch query i contributes
    ``sum_j A_ij ||pos_i - pos_j||`` over patch keys j (patch centres in pixels); the result is the
    mean over queries and images. Prefix tokens: see the module note.
    """
    layers = _layers(maps)
    pos = patch_centres(grid, patch_size)
    n = layers[0].shape[-1] - num_prefix_tokens
    if n != len(pos):
        raise ValueError(f"attention maps have {n} patch tokens after {num_prefix_tokens} prefix "
                         f"token(s), but the grid {to_2tuple(grid)} has {len(pos)}")
    dist = torch.cdist(pos, pos).float().to(layers[0].device)  # (N, N) pixels
    out = []
    for attn in layers:
        a = patch_attention(attn, num_prefix_tokens, renormalize)
        per_query = torch.einsum("bhij,ij->bhi", a, dist)  # (B, heads, N)
        out.append(per_query.double().mean(dim=(0, 2)))
    return torch.stack(out).float().cpu()


def attention_entropy(maps: torch.Tensor | Sequence[torch.Tensor], num_prefix_tokens: int) -> torch.Tensor:
    """Entropy of each patch query's attention over patch keys in nats, ``(layers, heads)``.

    ``-sum_j A_ij log A_ij`` per patch query i, averaged over queries and images; ``log N`` for
    uniform attention over the N patches, 0 for all weight on one. Prefix tokens are dropped and
    each row renormalised over the patch keys, as in :func:`mean_attention_distance` (raw rows
    would not sum to 1, and their value would not be an entropy).
    """
    out = []
    for attn in _layers(maps):
        a = patch_attention(attn, num_prefix_tokens)
        per_query = -torch.special.xlogy(a, a).sum(-1)  # (B, heads, N); 0 log 0 = 0
        out.append(per_query.double().mean(dim=(0, 2)))
    return torch.stack(out).float().cpu()


def token_norms(layers: torch.Tensor | Sequence[torch.Tensor], factor: float = 3.0) -> dict[str, torch.Tensor]:
    """Outlier patch tokens per layer, from block outputs ``(B, N, D)`` (patch tokens only, as
    ``ViT.get_intermediate_layers`` gives them): ``max_ratio`` ``(layers,)``, the largest norm over
    the image's median norm, averaged over images, and ``outlier_share`` ``(layers,)``, the share of
    patch tokens whose norm is over ``factor`` times their image's median."""
    if factor <= 1.0:
        raise ValueError(f"factor must be over 1 (a multiple of the median norm), got {factor}")
    layers = list(layers.unbind(0) if isinstance(layers, torch.Tensor) and layers.ndim == 4 else
                  [layers] if isinstance(layers, torch.Tensor) else layers)
    if not layers or any(x.ndim != 3 for x in layers):
        raise ValueError(f"expected block outputs (B, N, D), got {[tuple(x.shape) for x in layers]}")
    ratio, share = [], []
    for x in layers:
        norm = x.double().norm(dim=-1)  # (B, N)
        median = norm.median(dim=-1, keepdim=True).values.clamp_min(1e-12)
        ratio.append((norm.amax(-1) / median.squeeze(-1)).mean())
        share.append((norm > factor * median).double().mean())
    return {"max_ratio": torch.stack(ratio).float().cpu(), "outlier_share": torch.stack(share).float().cpu()}


def _num_layers(model: nn.Module) -> int:
    for name in ("blocks", "stages"):
        if isinstance(getattr(model, name, None), nn.ModuleList | nn.Sequential):
            return len(getattr(model, name))
    raise ValueError(f"{type(model).__name__} has neither .blocks nor .stages; pass explicit indices")


def _layer_name(model: nn.Module, i: int) -> str:
    for name in ("blocks", "stages"):
        if hasattr(model, name):
            return f"{name}.{i}"
    return f"layer{i}"


def _resolve_indices(model: nn.Module, indices: int | Sequence[int] | None) -> list[int]:
    return feature_take_indices(_num_layers(model), indices)


def weighted_radius(weights: torch.Tensor, centre: Sequence[float]) -> float:
    """``sum_p w_p ||p - centre|| / sum_p w_p`` over the pixels of an ``(H, W)`` weight map."""
    h, w = weights.shape
    rows, cols = torch.meshgrid(torch.arange(h, dtype=torch.float64), torch.arange(w, dtype=torch.float64),
                                indexing="ij")
    dist = torch.hypot(rows - centre[0], cols - centre[1])
    wts = weights.double()
    total = wts.sum()
    if total <= 0:
        raise ValueError("the weight map is all zero; the unit does not depend on the input")
    return float((wts * dist).sum() / total)


def mass_radius(weights: torch.Tensor, centre: Sequence[float], fraction: float = 0.9) -> float:
    """The smallest distance from ``centre`` within which ``fraction`` of the weight lies."""
    h, w = weights.shape
    rows, cols = torch.meshgrid(torch.arange(h, dtype=torch.float64), torch.arange(w, dtype=torch.float64),
                                indexing="ij")
    dist = torch.hypot(rows - centre[0], cols - centre[1]).flatten()
    order = dist.argsort()
    cum = weights.double().flatten()[order].cumsum(0)
    k = int(torch.searchsorted(cum, fraction * cum[-1]))
    return float(dist[order][min(k, len(order) - 1)])


def effective_receptive_field(model: nn.Module, images: torch.Tensor,
                              indices: int | Sequence[int] | None = None) -> list[dict]:
    """The effective receptive field of each ViT block / CNN stage (Luo et al. 2016).

    For each layer map ``(B, C, h, w)`` from ``model.forward_intermediates(x, indices=...,
    intermediates_only=True)``, the centre unit ``(h // 2, w // 2)`` summed over channels is
    differentiated with respect to the input; ``|grad|`` summed over input channels and images is
    the field ``grad`` ``(H, W)``. Images are independent in eval mode, so one backward pass per
    layer gives every image's gradient at once.

    Returns one dict per layer: ``index``, ``name`` (e.g. ``'blocks.3'``), ``stride`` (input pixels
    per map cell, ``(sy, sx)``), ``map_size`` ``(h, w)``, ``centre`` (the unit's centre in input
    pixel coordinates), ``grad`` (H, W) float32 on the CPU, ``radius_px`` (gradient-weighted mean
    distance from the centre: the attention-distance formula with the normalised gradient as the
    weights), ``radius90_px`` (radius holding 90% of the gradient mass). The model runs in eval
    mode without touching parameter ``.grad``; its train/eval mode is restored.
    """
    if images.ndim != 4 or not images.is_floating_point():
        raise ValueError(f"expected float images (B, C, H, W), got {images.dtype} {tuple(images.shape)}")
    idx = _resolve_indices(model, indices)
    was_training = model.training
    model.eval()
    try:
        x = images.detach().clone().requires_grad_(True)
        with torch.enable_grad():
            feats = model.forward_intermediates(x, indices=idx, intermediates_only=True)
            if len(feats) != len(idx):
                raise ValueError(f"forward_intermediates gave {len(feats)} maps for indices {idx}")
            out = []
            for k, (i, f) in enumerate(zip(idx, feats)):
                if f.ndim != 4:
                    raise ValueError(f"layer {i}: expected an NCHW map, got {tuple(f.shape)}")
                h, w = f.shape[-2:]
                centre_unit = f[:, :, h // 2, w // 2].sum()
                (g,) = torch.autograd.grad(centre_unit, x, retain_graph=k < len(feats) - 1)
                field = g.abs().sum(dim=(0, 1)).float().cpu()
                sy, sx = x.shape[-2] / h, x.shape[-1] / w
                # The unit's centre in pixel-index coordinates (pixel k spans [k - .5, k + .5]).
                centre = ((h // 2 + 0.5) * sy - 0.5, (w // 2 + 0.5) * sx - 0.5)
                out.append(dict(index=i, name=_layer_name(model, i), stride=(sy, sx), map_size=(h, w),
                                centre=centre, grad=field, radius_px=weighted_radius(field, centre),
                                radius90_px=mass_radius(field, centre, 0.9)))
    finally:
        model.train(was_training)
    return out


def attention_rollout(maps: torch.Tensor | Sequence[torch.Tensor], num_prefix_tokens: int, *,
                      head_fusion: str = "mean", residual_weight: float = 0.5,
                      start_layer: int = 0) -> torch.Tensor:
    """Attention rollout ``(B, P + N, P + N)`` (Abnar & Zuidema 2020).

    Per layer: fuse heads (``'mean'`` as in the paper, or ``'max'`` / ``'min'``), add the identity
    for the residual path, ``A' = (1 - r) A + r I`` with ``r = residual_weight`` (0.5 in the paper),
    renormalise rows; then ``R = A'_L ... A'_{start}``. Row i of ``R`` says how much each input token
    flows into token i at the last layer; every row sums to 1. ``num_prefix_tokens`` only checks
    that the maps have room for them: rollout keeps every token, prefix ones included.
    """
    layers = _layers(maps)
    if layers[0].shape[-1] <= num_prefix_tokens:
        raise ValueError(f"attention maps {tuple(layers[0].shape[-2:])} do not fit {num_prefix_tokens} prefix tokens")
    fuse = dict(mean=lambda a: a.mean(1), max=lambda a: a.amax(1), min=lambda a: a.amin(1)).get(head_fusion)
    if fuse is None:
        raise ValueError(f"head_fusion must be 'mean', 'max' or 'min', got {head_fusion!r}")
    if not 0.0 <= residual_weight <= 1.0:
        raise ValueError(f"residual_weight must be in [0, 1], got {residual_weight}")
    b, _, t, _ = layers[0].shape
    eye = torch.eye(t, dtype=torch.float64, device=layers[0].device)
    rollout = eye.expand(b, t, t).clone()
    for attn in layers[start_layer:]:
        a = (1 - residual_weight) * fuse(attn.double()) + residual_weight * eye
        a = a / a.sum(-1, keepdim=True)
        rollout = a @ rollout
    return rollout.float()


def rollout_map(rollout: torch.Tensor, grid: int | Size2, num_prefix_tokens: int,
                class_token: bool | None = None) -> torch.Tensor:
    """``(B, P + N, P + N) -> (B, gh, gw)``: what the class token draws from each patch (the mean
    over the patch queries when there is none: registers are prefix tokens but no read-out),
    renormalised over patches to sum to 1. ``class_token``: whether the first prefix token is a
    class token (default: whether there is a prefix)."""
    gh, gw = to_2tuple(grid)
    p = num_prefix_tokens
    if rollout.shape[-1] != p + gh * gw:
        raise ValueError(f"rollout has {rollout.shape[-1]} tokens, expected {p} + {gh}x{gw}")
    row = rollout[:, 0, p:] if (p > 0 if class_token is None else class_token) else rollout[:, p:, p:].mean(1)
    row = row / row.sum(-1, keepdim=True).clamp_min(1e-12)
    return rearrange(row, "b (gh gw) -> b gh gw", gh=gh, gw=gw)


def head_attention_maps(attn: torch.Tensor, grid: int | Size2, num_prefix_tokens: int,
                        query: int | Size2 | None = None, class_token: bool | None = None) -> torch.Tensor:
    """One layer's attention ``(B, heads, P + N, P + N) -> (B, heads, gh, gw)``: where each head
    of one query looks, over the patch keys (renormalised). ``query``: ``None`` for the class
    token (the centre patch when there is none), a patch index (row-major) or a ``(row, col)``
    grid position. ``class_token``: whether the first prefix token is one (default: whether
    there is a prefix; registers alone are not)."""
    gh, gw = to_2tuple(grid)
    p = num_prefix_tokens
    if attn.ndim != 4 or attn.shape[-1] != p + gh * gw:
        raise ValueError(f"expected attention (B, heads, {p + gh * gw}, {p + gh * gw}), got {tuple(attn.shape)}")
    if query is None:
        q = 0 if (p > 0 if class_token is None else class_token) else p + (gh // 2) * gw + gw // 2
    elif isinstance(query, int):
        if not 0 <= query < gh * gw:
            raise ValueError(f"query patch {query} out of range for a {gh}x{gw} grid")
        q = p + query
    else:
        r, c = query
        if not (0 <= r < gh and 0 <= c < gw):
            raise ValueError(f"query position {(r, c)} outside the {gh}x{gw} grid")
        q = p + r * gw + c
    a = attn[:, :, q, p:]
    a = a / a.sum(-1, keepdim=True).clamp_min(1e-12)
    return rearrange(a, "b heads (gh gw) -> b heads gh gw", gh=gh, gw=gw)
