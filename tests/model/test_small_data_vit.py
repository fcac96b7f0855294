"""The ViT's small-data pieces: locality self-attention (LSA), shifted patch tokenisation (SPT)
and DeiT's distillation token, each checked against its definition."""

import math

import pytest
import torch
import torch.nn.functional as F

import vitattn
from vitattn import MultiHeadAttention
from vitattn.patch_embed import ShiftedPatchEmbed, patchify, shift_diagonally
from vitattn.training.optim import param_groups


def seeded(seed=0):
    return torch.Generator().manual_seed(seed)


# -- LSA ---------------------------------------------------------------------------------------
def test_lsa_leaves_each_token_out_of_its_own_weights_and_scales_by_a_learned_temperature():
    attn = MultiHeadAttention(32, 4, score="lsa").eval()
    x = torch.randn(2, 7, 32, generator=seeded())
    out, weights = attn(x, return_attention=True)
    assert (weights.diagonal(dim1=-2, dim2=-1) == 0).all()
    torch.testing.assert_close(weights.sum(-1), torch.ones(2, 4, 7))
    q, k, v = attn.project_qkv(x)
    s = q @ k.transpose(-2, -1) / math.sqrt(8)  # the temperature starts at 1 / sqrt(d)
    s = s.masked_fill(torch.eye(7, dtype=torch.bool), float("-inf"))
    torch.testing.assert_close(weights, s.softmax(-1))
    torch.testing.assert_close(attn(x), out)  # the path without weights computes the same
    with torch.no_grad():
        attn.score_fn.log_temperature.fill_(math.log(2.0))
    torch.testing.assert_close(attn(x, return_attention=True)[1], (2 * math.sqrt(8) * s).softmax(-1))


def test_lsa_temperature_learns():
    attn = MultiHeadAttention(16, 2, score="lsa")
    attn(torch.randn(3, 5, 16, generator=seeded())).square().sum().backward()
    assert attn.score_fn.log_temperature.grad.abs() > 0


def test_lsa_in_a_class_token_vit_keeps_the_last_block_shortcut_equal():
    torch.manual_seed(0)
    model = vitattn.create_model("vit_quick", score="lsa", class_token=True, global_pool="token",
                                 pos_embed="learn").eval()
    x = torch.randn(2, 3, 32, 32)
    torch.testing.assert_close(model(x), model.forward_head(model.forward_features(x)))


# -- SPT ---------------------------------------------------------------------------------------
def test_shift_diagonally_moves_four_copies_towards_the_corners():
    x = torch.randn(2, 3, 8, 8, generator=seeded())
    out = shift_diagonally(x, (2, 2))
    assert out.shape == (2, 15, 8, 8)
    torch.testing.assert_close(out[:, :3], x)
    for i, (dy, dx) in enumerate(((-2, -2), (-2, 2), (2, -2), (2, 2))):
        want = torch.zeros_like(x)
        for r in range(8):
            for c in range(8):
                if 0 <= r - dy < 8 and 0 <= c - dx < 8:
                    want[..., r, c] = x[..., r - dy, c - dx]  # content moved by (dy, dx)
        torch.testing.assert_close(out[:, 3 * (i + 1): 3 * (i + 2)], want)


def test_spt_is_patchify_of_the_shifted_stack_then_norm_then_linear():
    embed = ShiftedPatchEmbed(32, 4, 3, 24)
    x = torch.randn(2, 3, 32, 32, generator=seeded())
    tokens, grid = embed(x)
    want = embed.proj(F.layer_norm(patchify(shift_diagonally(x, (2, 2)), 4), (5 * 3 * 16,), embed.norm.weight,
                                   embed.norm.bias, 1e-6))
    assert grid == (8, 8) and tokens.shape == (2, 64, 24)
    torch.testing.assert_close(tokens, want)


def test_a_shifted_patch_token_sees_half_a_patch_beyond_its_edges():
    embed = ShiftedPatchEmbed(16, 4, 1, 8)
    x = torch.randn(1, 1, 16, 16, requires_grad=True)
    embed(x)[0][0, 5].sum().backward()  # token (1, 1): pixels 4..7 in each direction
    seen = (x.grad[0, 0] != 0).nonzero()
    assert seen.min().item() == 2 and seen.max().item() == 9  # 4 - 2 .. 7 + 2


# -- distillation token -----------------------------------------------------------------------
@pytest.mark.parametrize("kw", [dict(class_token=True, global_pool="token"),
                                dict(class_token=False, global_pool="avg")], ids=["class token", "mean of patches"])
def test_a_distilled_vit_averages_its_two_heads_and_trains_them_apart(kw):
    torch.manual_seed(0)
    model = vitattn.create_model("vit_quick", distilled=True, **kw)
    assert model.num_prefix_tokens == 1 + kw["class_token"]
    x = torch.randn(3, 3, 32, 32)
    model.eval()
    feats = model.forward_features(x)
    cls = model.head(model.fc_norm(vitattn.vit.pool_tokens(feats, model.global_pool, model.num_prefix_tokens)))
    dist = model.head_dist(feats[:, model.num_prefix_tokens - 1])
    torch.testing.assert_close(model(x), (cls + dist) / 2)
    assert model.forward_head(feats, pre_logits=True).shape == (3, 128)
    model.train()
    torch.testing.assert_close(model(x), (cls + dist) / 2)  # not switched on: one output
    model.set_distilled_training(True)
    a, b = model(x)
    torch.testing.assert_close(a, cls)
    torch.testing.assert_close(b, dist)
    (a.sum() + b.sum()).backward()
    assert all(p.grad is not None for p in model.parameters())


def test_the_distillation_token_is_kept_out_of_weight_decay_and_the_heads_reset_together():
    model = vitattn.create_model("vit_quick", distilled=True)
    assert "dist_token" in model.no_weight_decay()
    no_decay = param_groups(model, 0.05)[1]["params"]
    assert any(p is model.dist_token for p in no_decay)
    model.reset_classifier(4)
    assert model.head.out_features == model.head_dist.out_features == 4
    assert model.get_classifier() == (model.head, model.head_dist)


def test_distillation_and_spt_refusals_say_what_came():
    with pytest.raises(ValueError, match="set_distilled_training needs a model built with distilled=True"):
        vitattn.create_model("vit_quick").set_distilled_training(True)
    with pytest.raises(ValueError, match="needs a pooled head, got global_pool=''"):
        vitattn.create_model("vit_quick", distilled=True, global_pool="")
    for kw in (dict(distilled=True), dict(shifted_patches=True)):
        with pytest.raises(ValueError, match="timm has no twin"):
            vitattn.to_timm(vitattn.create_model("vit_tiny_patch16_224", **kw))


def test_the_cifar_vit_reads_out_the_mean_of_its_patch_tokens_over_sincos_positions():
    model = vitattn.create_model("vit_cifar10")
    assert model.cls_token is None and model.pos_embed is None and model.global_pool == "avg"
    assert model.num_prefix_tokens == 0 and model.config.pos_embed == "sincos2d"
