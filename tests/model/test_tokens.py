"""Patches as tokens and positional encodings: exact inverses, formulas, purity, errors."""

import math

import pytest
import torch

from vitattn import PatchEmbed, patchify, resample_abs_pos_embed, sincos_1d, sincos_2d, unpatchify
from vitattn.pos_embed import apply_rope, rope_2d


@pytest.mark.parametrize("size,patch", [((32, 32), 4), ((24, 40), (4, 8)), ((6, 9), (3, 1))])
def test_patchify_unpatchify_round_trip(size, patch):
    x = torch.randn(2, 3, *size)
    p = patchify(x, patch)
    p1, p2 = (patch, patch) if isinstance(patch, int) else patch
    grid = (size[0] // p1, size[1] // p2)
    assert p.shape == (2, grid[0] * grid[1], 3 * p1 * p2)
    assert torch.equal(unpatchify(p, grid, patch, 3), x)


def test_patchify_token_order_is_row_major_channel_first():
    x = torch.arange(2 * 4 * 6, dtype=torch.float32).reshape(1, 2, 4, 6)
    p = patchify(x, (2, 3))
    # token 1 is the patch at grid row 0, column 1: rows 0-1, columns 3-5, channel 0 first
    assert p[0, 1].tolist() == x[0, :, 0:2, 3:6].flatten().tolist()


@pytest.mark.parametrize("size,patch", [((32, 32), 4), ((24, 40), (4, 8))])
def test_patch_embed_conv_equals_patchify_linear(size, patch):
    torch.manual_seed(0)
    pe = PatchEmbed(size, patch, 3, 16)
    x = torch.randn(2, 3, *size, requires_grad=True)
    (a, grid_a), (b, grid_b) = pe(x, fast=True), pe(x, fast=False)
    assert grid_a == grid_b == pe.grid_size
    assert torch.allclose(a, b, atol=1e-5)
    ga, = torch.autograd.grad(a.sum(), x)
    gb, = torch.autograd.grad(b.sum(), x)
    assert torch.allclose(ga, gb, atol=1e-5)


def test_patch_errors_say_what_came():
    pe = PatchEmbed(32, 4, 3, 8)
    with pytest.raises(ValueError, match="image height 30 is not divisible by patch size 4"):
        pe(torch.randn(1, 3, 30, 32))
    with pytest.raises(ValueError, match="image width 33 is not divisible by patch size 4"):
        pe(torch.randn(1, 3, 32, 33))
    with pytest.raises(ValueError, match="expected 3 input channels, got 1"):
        pe(torch.randn(1, 1, 32, 32))
    with pytest.raises(ValueError, match="expected a 4-D image batch"):
        pe(torch.randn(3, 32, 32))
    with pytest.raises(ValueError, match="expected patches of shape"):
        unpatchify(torch.randn(1, 5, 48), (2, 2), 4, 3)


def test_dynamic_img_pad_pads_instead_of_raising():
    torch.manual_seed(0)
    pe = PatchEmbed(32, 4, 3, 8, dynamic_img_pad=True)
    x = torch.randn(1, 3, 30, 33)
    tokens, grid = pe(x)
    assert grid == (8, 9) and tokens.shape == (1, 72, 8)
    padded = torch.nn.functional.pad(x, (0, 3, 0, 2))
    assert torch.allclose(tokens, pe(padded)[0])


def test_sincos_1d_formula():
    d = 6
    pe = sincos_1d(5, d)
    for p in range(5):
        for i in range(d // 2):
            w = 1.0 / 10000 ** (2 * i / d)
            assert math.isclose(pe[p, 2 * i].item(), math.sin(p * w), abs_tol=1e-6)
            assert math.isclose(pe[p, 2 * i + 1].item(), math.cos(p * w), abs_tol=1e-6)
    with pytest.raises(ValueError, match="even"):
        sincos_1d(4, 5)


def test_sincos_2d_rows_then_columns():
    gh, gw, d = 3, 4, 8
    pe = sincos_2d(gh, gw, d).reshape(gh, gw, d)
    assert torch.allclose(pe[:, :, : d // 2], sincos_1d(gh, d // 2)[:, None].expand(gh, gw, d // 2))
    assert torch.allclose(pe[:, :, d // 2:], sincos_1d(gw, d // 2)[None].expand(gh, gw, d // 2))
    # every position gets its own code
    flat = pe.reshape(-1, d)
    assert torch.cdist(flat, flat).add(torch.eye(gh * gw)).min() > 1e-3
    with pytest.raises(ValueError, match="divisible by 4"):
        sincos_2d(2, 2, 6)


def test_resample_is_pure_and_keeps_prefix():
    torch.manual_seed(0)
    pos = torch.randn(1, 1 + 4 * 6, 8)
    before = pos.clone()
    out = resample_abs_pos_embed(pos, (8, 3), (4, 6), num_prefix_tokens=1)
    assert out.shape == (1, 1 + 24, 8)
    assert torch.equal(pos, before)
    assert torch.equal(out[:, :1], pos[:, :1])
    assert resample_abs_pos_embed(pos, (4, 6), (4, 6)) is pos
    # a constant table stays constant (bicubic reproduces constants)
    const = torch.ones(1, 16, 4)
    assert torch.allclose(resample_abs_pos_embed(const, (7, 5), num_prefix_tokens=0), torch.ones(1, 35, 4), atol=1e-5)
    with pytest.raises(ValueError, match="not a square"):
        resample_abs_pos_embed(torch.randn(1, 1 + 12, 8), (4, 4))
    with pytest.raises(ValueError, match="old_grid"):
        resample_abs_pos_embed(torch.randn(1, 1 + 12, 8), (4, 4), (4, 4))


def test_resample_matches_timm():
    timm_pos = pytest.importorskip("timm.layers.pos_embed")
    torch.manual_seed(0)
    pos = torch.randn(1, 1 + 4 * 6, 8)
    ours = resample_abs_pos_embed(pos, (5, 9), (4, 6), num_prefix_tokens=1)
    theirs = timm_pos.resample_abs_pos_embed(pos, (5, 9), (4, 6), num_prefix_tokens=1)
    assert torch.allclose(ours, theirs, atol=1e-6)


def test_rope_scores_depend_on_the_offset_alone():
    """Rotary codes: the same query and key placed anywhere on the grid score by their offset
    (rows and columns separately), and the rotation keeps every vector's norm."""
    gh, gw, d = 5, 6, 16
    sin, cos = rope_2d(gh, gw, d)
    assert sin.shape == cos.shape == (gh * gw, d)
    torch.manual_seed(0)
    q, k = torch.randn(d), torch.randn(d)
    qr, kr = apply_rope(q.expand(gh * gw, d), sin, cos), apply_rope(k.expand(gh * gw, d), sin, cos)
    torch.testing.assert_close(qr.norm(dim=-1), q.norm().expand(gh * gw))
    scores = qr @ kr.T
    by_offset: dict[tuple[int, int], list[float]] = {}
    for i in range(gh * gw):
        for j in range(gh * gw):
            by_offset.setdefault((i // gw - j // gw, i % gw - j % gw), []).append(float(scores[i, j]))
    for offset, vals in by_offset.items():
        assert max(vals) - min(vals) < 1e-4, offset
    assert len({round(v[0], 3) for v in by_offset.values()}) > 20  # ... and differs between offsets
    torch.testing.assert_close(apply_rope(q[None], sin[:1], cos[:1]), q[None])  # place (0, 0): no turn
    # the first half of the channel pairs turns with the row, the second half with the column
    assert torch.equal(sin[1, : d // 2], torch.zeros(d // 2)) and torch.equal(sin[gw, d // 2:], torch.zeros(d // 2))
    with pytest.raises(ValueError, match="divisible by 4"):
        rope_2d(2, 2, 6)
