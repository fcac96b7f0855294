"""Positional encodings as pure functions.

Attention is blind to order: permute the tokens and the outputs permute with them, so "I like
you" and "you like me" look alike. Adding a position code to each token breaks that symmetry.

All functions here are pure: they build new tensors and never modify their inputs.

Rotary codes (RoPE) work in the score instead: each query and key is rotated by angles set by
its place, so ``q_i . k_j`` depends on the offset ``i - j`` alone and attention sees relative
positions directly.

References: Vaswani et al. 2017 (sinusoidal 1-D); MAE ``util/pos_embed.py`` and SimpleViT
(Beyer et al. 2022) for 2-D sin-cos; timm ``layers/pos_embed.py`` for resampling; Su et al.
2021 (RoFormer) and Heo et al. 2024 (RoPE-Axial for ViTs) for rotary codes.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from einops import rearrange

from .helpers import Size2


def sincos_1d(positions: int | torch.Tensor, dim: int, temperature: float = 10000.0) -> torch.Tensor:
    """Vaswani et al.'s table: ``pe[p, 2i] = sin(p / T^(2i/dim))``, ``pe[p, 2i+1] = cos(...)``.

    ``positions`` is a count ``n`` (positions ``0..n-1``) or a 1-D tensor of positions.
    Returns ``(n, dim)`` in float32.
    """
    if dim % 2:
        raise ValueError(f"sincos_1d needs an even dim, got {dim}")
    pos = torch.arange(positions, dtype=torch.float32) if isinstance(positions, int) else positions.float()
    omega = temperature ** (-torch.arange(0, dim, 2, dtype=torch.float32) / dim)  # (dim/2,)
    angles = pos[:, None] * omega[None, :]  # (n, dim/2)
    return rearrange(torch.stack([angles.sin(), angles.cos()], dim=-1), "n half two -> n (half two)")


def sincos_2d(gh: int, gw: int, dim: int, temperature: float = 10000.0) -> torch.Tensor:
    """2-D table ``(gh*gw, dim)`` in row-major token order: the first half of the channels is
    ``sincos_1d`` of the patch's row, the second half of its column."""
    if dim % 4:
        raise ValueError(f"sincos_2d needs dim divisible by 4, got {dim}")
    rows = sincos_1d(gh, dim // 2, temperature)  # (gh, dim/2)
    cols = sincos_1d(gw, dim // 2, temperature)  # (gw, dim/2)
    rows = rearrange(rows, "gh d -> gh 1 d").expand(gh, gw, dim // 2)
    cols = rearrange(cols, "gw d -> 1 gw d").expand(gh, gw, dim // 2)
    return rearrange(torch.cat([rows, cols], dim=-1), "gh gw d -> (gh gw) d")


def fixed_pos_table(kind: str, grid: Size2, dim: int, num_prefix_tokens: int = 0) -> torch.Tensor:
    """A ViT's fixed table ``(1, P + gh*gw, dim)``: ``'sincos2d'`` (by row and column) or
    ``'sincos1d'`` (in reading order) for the patches, zeros for the ``P`` prefix tokens."""
    gh, gw = grid
    table = sincos_2d(gh, gw, dim) if kind == "sincos2d" else sincos_1d(gh * gw, dim)
    return torch.cat([torch.zeros(num_prefix_tokens, dim), table])[None]


def resample_abs_pos_embed(
    pos: torch.Tensor,
    new_grid: Size2,
    old_grid: Size2 | None = None,
    num_prefix_tokens: int = 1,
    mode: str = "bicubic",
    antialias: bool = True,
) -> torch.Tensor:
    """Resample a learned table ``(1, P + gh*gw, D)`` to another patch grid.

    The ``P`` prefix (class) positions are kept as they are; the grid part is interpolated as an
    image (bicubic by default, as timm does). ``old_grid`` defaults to a square grid. Works for
    non-square grids both ways. Returns a new tensor; ``pos`` is left untouched.
    """
    if pos.ndim != 3 or pos.shape[0] != 1:
        raise ValueError(f"expected a position table of shape (1, N, D), got {tuple(pos.shape)}")
    n_grid = pos.shape[1] - num_prefix_tokens
    if old_grid is None:
        side = int(round(n_grid**0.5))
        if side * side != n_grid:
            raise ValueError(f"{n_grid} grid positions are not a square; pass old_grid")
        old_grid = (side, side)
    if old_grid[0] * old_grid[1] != n_grid:
        raise ValueError(
            f"old_grid {tuple(old_grid)} has {old_grid[0] * old_grid[1]} positions, the table has {n_grid} "
            f"(after {num_prefix_tokens} prefix tokens)"
        )
    new_grid = (int(new_grid[0]), int(new_grid[1]))
    if tuple(new_grid) == tuple(old_grid):
        return pos
    prefix, grid = pos[:, :num_prefix_tokens], pos[:, num_prefix_tokens:]
    dtype = grid.dtype
    grid = rearrange(grid.float(), "1 (gh gw) d -> 1 d gh gw", gh=old_grid[0], gw=old_grid[1])
    grid = F.interpolate(grid, size=new_grid, mode=mode, antialias=antialias)
    grid = rearrange(grid, "1 d gh gw -> 1 (gh gw) d").to(dtype)
    return torch.cat([prefix, grid], dim=1)


def rope_2d(gh: int, gw: int, dim: int, temperature: float = 100.0) -> tuple[torch.Tensor, torch.Tensor]:
    """Axial 2-D rotary angles for a ``gh x gw`` grid, as ``(sin, cos)``, each ``(gh*gw, dim)``
    in row-major token order.

    Channels come in pairs ``(2i, 2i+1)`` that share an angle: the first half of the pairs turns
    with the patch's row, the second half with its column, at frequencies
    ``temperature ** (-j / (dim / 4))``, ``j = 0 .. dim/4 - 1``.
    """
    if dim % 4:
        raise ValueError(f"rope_2d needs dim divisible by 4, got {dim}")
    omega = temperature ** (-torch.arange(dim // 4, dtype=torch.float32) / (dim // 4))  # (dim/4,)
    rows = torch.arange(gh, dtype=torch.float32).repeat_interleave(gw)  # (N,)
    cols = torch.arange(gw, dtype=torch.float32).repeat(gh)
    angles = torch.cat([rows[:, None] * omega, cols[:, None] * omega], dim=1)  # (N, dim/2)
    angles = angles.repeat_interleave(2, dim=1)  # each pair's two channels share its angle
    return angles.sin(), angles.cos()


def apply_rope(x: torch.Tensor, sin: torch.Tensor, cos: torch.Tensor) -> torch.Tensor:
    """Rotate each channel pair of ``x (..., N, dim)`` by its angle: ``(a, b) -> (a cos - b sin,
    a sin + b cos)``. ``sin``, ``cos``: ``(N, dim)`` from :func:`rope_2d`. Norms are kept, and
    ``apply_rope(q)_i . apply_rope(k)_j`` depends on the positions only through ``i - j``."""
    pairs = rearrange(x, "... (d two) -> ... d two", two=2)
    turned = rearrange(torch.stack([-pairs[..., 1], pairs[..., 0]], dim=-1), "... d two -> ... (d two)")
    return x * cos.to(x.dtype) + turned * sin.to(x.dtype)


def rotate_qk(q: torch.Tensor, k: torch.Tensor,
              rope: tuple[torch.Tensor, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotary codes on per-head ``q`` and ``k`` ``(B, heads, N, d)``: the last ``G`` keys are the
    grid's tokens (``rope`` holds their angles, each ``(G, d)``), those before them (a class
    token) keep no position. Queries are the first ``Nq`` tokens of the same sequence (all of
    them in self-attention, the prefix alone in ``Block.forward_first``)."""
    sin, cos = rope
    p = k.shape[2] - sin.shape[0]
    if p < 0:
        raise ValueError(f"rope has angles for {sin.shape[0]} tokens, the keys are {k.shape[2]}")

    def turn(t: torch.Tensor) -> torch.Tensor:
        n = t.shape[2] - p  # grid tokens among these
        if n <= 0:
            return t
        grid = apply_rope(t[:, :, p:], sin[:n], cos[:n])
        return torch.cat([t[:, :, :p], grid], dim=2) if p else grid

    return turn(q), turn(k)
