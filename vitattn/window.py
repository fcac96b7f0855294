"""Window attention (ViTDet): patch tokens attend within non-overlapping windows of the grid.

Two ways to compute it, held equal by tests: global attention under :func:`window_mask` (the
readable one, which also gives the weights) and :func:`window_attend`, which cuts the grid into
windows and batches them, so the cost grows with the window's area instead of the image's.

Reference: Li et al. 2022, "Exploring Plain Vision Transformer Backbones for Object Detection".
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from einops import rearrange, repeat

from .helpers import Size2


def window_mask(grid: Size2, window: Size2, num_prefix_tokens: int = 0) -> torch.Tensor:
    """``(P + N, P + N)`` boolean mask, True where query i may attend to key j under window
    attention: patch tokens see the patches of their own window (windows tile the grid from the
    top left) and every prefix token; prefix tokens see everything."""
    gh, gw = grid
    rows = torch.arange(gh).repeat_interleave(gw) // window[0]
    cols = torch.arange(gw).repeat(gh) // window[1]
    win = rows * (gw + window[1]) + cols  # window id of each patch token
    same = win[:, None] == win[None, :]
    p = num_prefix_tokens
    mask = torch.ones(p + gh * gw, p + gh * gw, dtype=torch.bool)
    mask[p:, p:] = same
    return mask


Attend = Callable[..., tuple[torch.Tensor, torch.Tensor | None]]  # (q, k, v, mask) -> (out, weights)


def window_attend(attend: Attend, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, grid: Size2, window: Size2,
                  num_prefix_tokens: int = 0) -> torch.Tensor:
    """``attend`` (e.g. :meth:`vitattn.Attention.attend`) within windows, ``(B, heads, P + N, d)``
    in and out. Windows that overhang the grid are padded and the padded keys masked, so the
    result equals global attention under :func:`window_mask`; prefix tokens are keys of every
    window and attend globally themselves."""
    (gh, gw), (wh, ww), p = grid, window, num_prefix_tokens
    b = q.shape[0]
    ph, pw = (-gh) % wh, (-gw) % ww

    def to_windows(t: torch.Tensor) -> torch.Tensor:
        t = rearrange(t, "b h (gh gw) d -> b h gh gw d", gh=gh)
        if ph or pw:
            t = F.pad(t, (0, 0, 0, pw, 0, ph))
        return rearrange(t, "b h (nh wh) (nw ww) d -> (b nh nw) h (wh ww) d", wh=wh, ww=ww)

    qw, kw, vw = (to_windows(t[:, :, p:]) for t in (q, k, v))
    n_win = qw.shape[0] // b
    mask = None
    if ph or pw:
        valid = F.pad(torch.ones(gh, gw, dtype=torch.bool, device=q.device), (0, pw, 0, ph))
        valid = rearrange(valid, "(nh wh) (nw ww) -> (nh nw) (wh ww)", wh=wh, ww=ww)
        mask = repeat(valid, "n k -> (b n) 1 1 k", b=b)
    if p:
        kw = torch.cat([repeat(k[:, :, :p], "b h p d -> (b n) h p d", n=n_win), kw], dim=2)
        vw = torch.cat([repeat(v[:, :, :p], "b h p d -> (b n) h p d", n=n_win), vw], dim=2)
        if mask is not None:
            mask = F.pad(mask, (p, 0), value=True)
    out, _ = attend(qw, kw, vw, mask)
    out = rearrange(out, "(b nh nw) h (wh ww) d -> b h (nh wh) (nw ww) d", b=b, nh=(gh + ph) // wh, wh=wh, ww=ww)
    out = rearrange(out[:, :, :gh, :gw], "b h gh gw d -> b h (gh gw) d")
    if p:
        out_prefix, _ = attend(q[:, :, :p], k, v)
        out = torch.cat([out_prefix, out], dim=2)
    return out
