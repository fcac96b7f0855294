"""timm parity: converted models give timm's outputs, both ways (random weights; no downloads)."""

import re
from functools import partial

import pytest
import torch

import vitattn

timm = pytest.importorskip("timm")
from timm.models.vision_transformer import VisionTransformer  # noqa: E402

CASES = {
    "cls_token": dict(img_size=32, patch_size=4, embed_dim=64, depth=2, num_heads=4, num_classes=10),
    "avg_no_cls_nonsquare": dict(img_size=(32, 48), patch_size=(4, 8), embed_dim=48, depth=2, num_heads=3,
                                 mlp_ratio=2.5, class_token=False, global_pool="avg", qkv_bias=False, num_classes=7),
    "layerscale_qknorm_dynamic": dict(img_size=32, patch_size=8, embed_dim=64, depth=3, num_heads=2, init_values=0.1,
                                      qk_norm=True, dynamic_img_size=True, num_classes=3),
    "cls_avg_pool": dict(img_size=24, patch_size=6, embed_dim=32, depth=1, num_heads=1, global_pool="avg",
                         num_classes=4),
    "max_no_cls": dict(img_size=16, patch_size=4, embed_dim=32, depth=2, num_heads=2, class_token=False,
                       global_pool="max", num_classes=3),
    "cls_avgmax_pool": dict(img_size=16, patch_size=4, embed_dim=32, depth=1, num_heads=2, global_pool="avgmax",
                            num_classes=3),
    "no_head": dict(img_size=16, patch_size=4, embed_dim=32, depth=2, num_heads=2, num_classes=0),
}


def randomised(kw):
    """A timm model with all parameters random (timm zero-inits some, which would hide mistakes)."""
    torch.manual_seed(0)
    model = VisionTransformer(**kw).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 0.2)
    return model


def images(kw, batch=2, size=None):
    s = kw["img_size"] if size is None else size
    h, w = (s, s) if isinstance(s, int) else s
    return torch.randn(batch, 3, h, w, generator=torch.Generator().manual_seed(1))


@pytest.mark.parametrize("case", CASES)
def test_from_timm_matches_outputs(case):
    kw = CASES[case]
    t = randomised(kw)
    v = vitattn.from_timm(t).eval()
    x = images(kw)
    with torch.no_grad():
        assert torch.allclose(v(x), t(x), atol=1e-5)
        assert torch.allclose(v.forward_features(x), t.forward_features(x), atol=1e-5)
        assert torch.allclose(v.forward_head(v.forward_features(x), pre_logits=True),
                              t.forward_head(t.forward_features(x), pre_logits=True), atol=1e-5)
    # fused and explicit paths are both timm's numbers
    for blk in v.blocks:
        blk.attn.fused = False
    with torch.no_grad():
        assert torch.allclose(v(x), t(x), atol=1e-5)


def test_dynamic_img_size_matches_timm_at_other_sizes():
    kw = CASES["layerscale_qknorm_dynamic"]
    t, = (randomised(kw),)
    v = vitattn.from_timm(t).eval()
    for size in ((48, 64), (16, 40)):
        x = images(kw, size=size)
        with torch.no_grad():
            assert torch.allclose(v(x), t(x), atol=1e-5), size


def test_intermediates_match_timm():
    kw = CASES["cls_token"]
    t = randomised(kw)
    v = vitattn.from_timm(t).eval()
    x = images(kw)
    with torch.no_grad():
        tf, ti = t.forward_intermediates(x, indices=2, norm=True)
        vf, vi = v.forward_intermediates(x, indices=2, norm=True)
    assert torch.allclose(tf, vf, atol=1e-5)
    assert all(a.shape == b.shape and torch.allclose(a, b, atol=1e-5) for a, b in zip(ti, vi))


@pytest.mark.parametrize("case", ["cls_token", "avg_no_cls_nonsquare", "layerscale_qknorm_dynamic"])
def test_to_timm_round_trip(case):
    kw = CASES[case]
    cfg = vitattn.ViTConfig(**kw)
    torch.manual_seed(0)
    v = vitattn.ViT(cfg).eval()
    with torch.no_grad():
        for p in v.parameters():
            p.normal_(0, 0.2)
    t = VisionTransformer(**kw).eval()
    t.load_state_dict(vitattn.to_timm_state_dict(v), strict=True)
    x = images(kw)
    with torch.no_grad():
        assert torch.allclose(v(x), t(x), atol=1e-5)
        assert torch.allclose(vitattn.to_timm(v).eval()(x), t(x), atol=1e-6)


def test_timm_preset_names_convert():
    t = timm.create_model("vit_tiny_patch16_224", pretrained=False, num_classes=5).eval()
    v = vitattn.from_timm(t).eval()
    assert v.config.embed_dim == 192 and v.config.depth == 12 and v.config.num_heads == 3
    x = torch.randn(1, 3, 224, 224)
    with torch.no_grad():
        assert torch.allclose(v(x), t(x), atol=1e-5)


def test_unsupported_options_are_named():
    t = VisionTransformer(img_size=16, patch_size=4, embed_dim=32, depth=1, num_heads=2, scale_attn_norm=True,
                          proj_bias=False)
    with pytest.raises(ValueError, match="scale_attn_norm=True, proj_bias=False"):
        vitattn.from_timm(t)
    with pytest.raises(ValueError, match="expected a timm VisionTransformer"):
        vitattn.from_timm(torch.nn.Linear(2, 2))
    for option in (dict(score="general"), dict(pos_embed="sincos2d", dynamic_img_size=True),
                   dict(use_rot_pos_emb=True), dict(shifted_patches=True), dict(distilled=True)):
        v = vitattn.ViT(img_size=16, patch_size=4, embed_dim=32, depth=1, num_heads=2, **option)
        with pytest.raises(ValueError, match="timm has no twin"):
            vitattn.to_timm(v)


def test_a_sincos_table_rides_in_timm_s_position_table_frozen():
    torch.manual_seed(0)
    v = vitattn.ViT(img_size=16, patch_size=4, embed_dim=32, depth=2, num_heads=2, num_classes=3,
                    pos_embed="sincos2d", class_token=False, global_pool="avg").eval()
    t = vitattn.to_timm(v).eval()
    x = torch.randn(2, 3, 16, 16)
    torch.testing.assert_close(t(x), v(x))
    assert not t.pos_embed.requires_grad


REGULARISED = dict(img_size=32, patch_size=8, embed_dim=32, depth=3, num_heads=2, num_classes=5, drop_rate=0.1,
                   pos_drop_rate=0.05, proj_drop_rate=0.15, attn_drop_rate=0.2, drop_path_rate=0.3,
                   dynamic_img_pad=True, dynamic_img_size=True)


def test_regularised_vit_carries_every_shared_option_both_ways():
    """Dropout rates, drop path and dynamic_img_pad survive to_timm and from_timm: the two
    models' options agree, and in eval mode (dropout off) their outputs, also on a padded size."""
    torch.manual_seed(0)
    v = vitattn.ViT(vitattn.ViTConfig(**REGULARISED)).eval()
    t = vitattn.to_timm(v).eval()
    assert t.head_drop.p == 0.1 and t.pos_drop.p == 0.05
    assert t.blocks[0].attn.attn_drop.p == 0.2 and t.blocks[0].attn.proj_drop.p == 0.15
    assert t.blocks[0].mlp.drop1.p == 0.15
    assert [b.drop_path1.drop_prob if hasattr(b.drop_path1, "drop_prob") else 0.0 for b in t.blocks] == \
        pytest.approx([0.0, 0.15, 0.3])
    assert t.patch_embed.dynamic_img_pad
    back = vitattn.from_timm(t)
    for name in ("drop_rate", "pos_drop_rate", "proj_drop_rate", "attn_drop_rate", "drop_path_rate"):
        assert getattr(back.config, name) == pytest.approx(REGULARISED[name]), name
    assert back.config.dynamic_img_pad and back.config.depth == 3
    x = torch.randn(2, 3, 30, 29)  # not a multiple of the patch: both pad to 32x32
    with torch.no_grad():
        torch.testing.assert_close(v(x), t(x), atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(back.eval()(x), t(x), atol=1e-5, rtol=1e-5)
    # in training mode the same rates act: outputs vary from call to call on both sides
    v.train()
    with torch.no_grad():
        assert not torch.equal(v(x), v(x))


def random_config(rng) -> dict:
    """timm keyword arguments drawn over every option vitattn carries."""
    heads = rng.choice([1, 2, 3])
    class_token = rng.random() < 0.6
    pools = ["avg", "avgmax", "max", "map", ""] + (["token"] * 3 if class_token else [])
    patch = rng.choice([4, (4, 8), 8])
    grid = rng.choice([(2, 2), (3, 2), (4, 4)])
    ph, pw = (patch, patch) if isinstance(patch, int) else patch
    pool = rng.choice(pools)
    return dict(img_size=(grid[0] * ph, grid[1] * pw), patch_size=patch, in_chans=rng.choice([1, 3]),
                num_classes=rng.choice([0, 3, 7]), global_pool=pool, embed_dim=heads * rng.choice([8, 16]),
                depth=rng.choice([1, 2, 3]), num_heads=heads, mlp_ratio=rng.choice([1.0, 2.5, 4.0, 100 / 48]),
                qkv_bias=rng.random() < 0.5, qk_norm=rng.random() < 0.3,
                init_values=rng.choice([None, None, 1e-5, 0.1]), class_token=class_token,
                pos_embed=rng.choice(["learn", "learn", "none"]), dynamic_img_size=rng.random() < 0.3,
                dynamic_img_pad=rng.random() < 0.2, fc_norm=rng.choice([None, True, False]),
                drop_rate=rng.choice([0.0, 0.1]), pos_drop_rate=rng.choice([0.0, 0.1]),
                proj_drop_rate=rng.choice([0.0, 0.1]), attn_drop_rate=rng.choice([0.0, 0.1]),
                drop_path_rate=rng.choice([0.0, 0.2]), reg_tokens=rng.choice([0, 0, 1, 4]),
                no_embed_class=rng.random() < 0.4, pre_norm=rng.random() < 0.3, final_norm=rng.random() < 0.8,
                patch_drop_rate=rng.choice([0.0, 0.0, 0.25]), act_layer=rng.choice(["gelu", "gelu_tanh", "quick_gelu"]),
                norm_layer=rng.choice([None, partial(torch.nn.LayerNorm, eps=1e-5)]))


def assert_twins(v, t, x) -> None:
    """Logits, features, pre-logits and every block's intermediates of two models agree at 1e-5."""
    with torch.no_grad():
        torch.testing.assert_close(v(x), t(x), atol=1e-5, rtol=1e-5)
        fv, ft = v.forward_features(x), t.forward_features(x)
        torch.testing.assert_close(fv, ft, atol=1e-5, rtol=1e-5)
        if v.global_pool:
            torch.testing.assert_close(v.forward_head(fv, pre_logits=True), t.forward_head(ft, pre_logits=True),
                                       atol=1e-5, rtol=1e-5)
        for fmt in ("NCHW", "NLC"):
            for norm in (False, True):
                kw = dict(indices=len(v.blocks), norm=norm, output_fmt=fmt,
                          return_prefix_tokens=v.num_prefix_tokens > 0)
                (fa, ia), (fb, ib) = v.forward_intermediates(x, **kw), t.forward_intermediates(x, **kw)
                torch.testing.assert_close(fa, fb, atol=1e-5, rtol=1e-5)
                for a, b in zip(ia, ib):
                    torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("draw", range(32))
def test_any_randomised_timm_vit_converts_both_ways(draw):
    """Over random configs of every option vitattn carries and random weights of either sign
    (LayerScale gammas and norms included, as a trained model has them), from_timm gives timm's
    numbers, and to_timm of the result gives them back."""
    import random

    kw = random_config(random.Random(draw))
    t = randomised(kw)
    v = vitattn.from_timm(t).eval()
    x = torch.randn(2, kw["in_chans"], *kw["img_size"], generator=torch.Generator().manual_seed(draw))
    assert_twins(v, t, x)
    assert_twins(v, vitattn.to_timm(v).eval(), x)
    if kw["dynamic_img_size"]:  # another size: resampled positions on both sides
        assert_twins(v, t, torch.randn(1, kw["in_chans"], 2 * kw["img_size"][0], kw["img_size"][1]))


def test_a_trained_layer_scale_converts_whatever_its_sign():
    t = randomised(dict(img_size=16, patch_size=4, embed_dim=32, depth=2, num_heads=2, init_values=1e-5))
    with torch.no_grad():
        t.blocks[0].ls1.gamma.fill_(-0.3)  # a trained gamma may be <= 0 anywhere
        t.blocks[1].ls2.gamma[0] = 0.0
    v = vitattn.from_timm(t).eval()
    assert v.config.init_values == vitattn.timm_compat.UNKNOWN_INIT_VALUES
    assert_twins(v, t, torch.randn(2, 3, 16, 16))
    fresh = VisionTransformer(img_size=16, patch_size=4, embed_dim=32, depth=1, num_heads=2, init_values=0.1)
    assert vitattn.from_timm(fresh).config.init_values == pytest.approx(0.1)  # untrained: the start value shows


class _OwnAttention(__import__("timm").models.vision_transformer.Attention):
    pass


def _refused():
    from timm.layers import SwiGLU
    from timm.models.vision_transformer import ParallelScalingBlock, ResPostBlock

    base = dict(img_size=16, patch_size=4, embed_dim=32, depth=2, num_heads=2)
    return [
        (dict(global_pool="prr"), "global_pool='prr'"), (dict(scale_attn_norm=True), "scale_attn_norm=True"),
        (dict(scale_mlp_norm=True), "scale_mlp_norm=True"), (dict(proj_bias=False), "proj_bias=False"),
        (dict(global_pool="avg", pool_include_prefix=True), "pool_include_prefix=True"),
        (dict(act_layer="silu"), "act_layer"),
        (dict(norm_layer="rmsnorm"), "norm_layer"), (dict(embed_norm_layer="layernorm"), "embed_norm_layer"),
        (dict(mlp_layer=SwiGLU), "mlp_layer SwiGLU"), (dict(block_fn=ResPostBlock), "block_fn ResPostBlock"),
        (dict(block_fn=ParallelScalingBlock), "block_fn ParallelScalingBlock"),
        (dict(attn_layer=_OwnAttention), "attn_layer _OwnAttention"),
    ], base


@pytest.mark.parametrize("kw, name", _refused()[0], ids=[n for _, n in _refused()[0]])
def test_every_option_vitattn_lacks_is_refused_by_name(kw, name):
    t = VisionTransformer(**{**_refused()[1], **kw})
    with pytest.raises(ValueError, match=re.escape(name)):
        vitattn.from_timm(t)


def test_options_that_only_choose_a_start_convert():
    for kw in (dict(weight_init="jax"), dict(fix_init=True)):
        t = randomised(dict(img_size=16, patch_size=4, embed_dim=32, depth=2, num_heads=2, **kw))
        assert_twins(vitattn.from_timm(t).eval(), t, torch.randn(2, 3, 16, 16))


def test_conversion_keeps_the_dtype_both_ways():
    t = randomised(dict(img_size=16, patch_size=4, embed_dim=32, depth=1, num_heads=2)).to(torch.bfloat16)
    v = vitattn.from_timm(t)
    assert {p.dtype for p in v.parameters()} == {torch.bfloat16}
    assert {p.dtype for p in vitattn.to_timm(v).parameters()} == {torch.bfloat16}
    for k, w in t.state_dict().items():
        assert torch.equal(v.state_dict()[k], w), k
