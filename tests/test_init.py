"""Initialisations (vitattn.init) and the shared helpers (vitattn.helpers): the products and
statistics they promise, and their errors."""

import pytest
import torch
from einops import rearrange

import vitattn
from vitattn.helpers import feature_take_indices, to_2tuple
from vitattn.init import mimetic_attention_weights, patch_whitening_weights, whitening_basis


def test_mimetic_products_are_the_targets_best_low_rank_approximations():
    dim, heads = 64, 4
    d = dim // heads
    w = mimetic_attention_weights(dim, heads, generator=torch.Generator().manual_seed(0))
    assert all(t.shape == (dim, dim) for t in w.values())
    eye = torch.eye(dim)
    for h in range(heads):
        q, k = w["q"][h * d:(h + 1) * d], w["k"][h * d:(h + 1) * d]
        qk = q.T @ k  # the bilinear form of head h's scores: x^T (q^T k) x'
        assert torch.linalg.matrix_rank(qk) == d
        # a positive diagonal (a token prefers tokens like itself), well above the off-diagonal
        assert qk.diagonal().mean() > 3 * (qk - qk.diagonal().diag()).abs().mean() > 0
    # one head of full width: q^T k is the target itself, 0.7 Z + 0.7 I with Z ~ N(0, 1/dim)
    one = mimetic_attention_weights(dim, 1, generator=torch.Generator().manual_seed(1))
    qk = one["q"].T @ one["k"]
    assert qk.diagonal().mean() == pytest.approx(0.7, abs=0.05)
    assert (qk - qk.diagonal().diag()).std() == pytest.approx(0.7 / dim**0.5, rel=0.1)
    vo = w["v"].T @ w["proj"].T  # full rank: alpha2 Z - beta2 I exactly
    target_diag = vo.diagonal().mean()
    assert target_diag == pytest.approx(-0.4, abs=0.05)
    off = vo - vo.diagonal().diag()
    assert off.std() == pytest.approx(0.4 / dim**0.5, rel=0.1)  # alpha2 * N(0, 1/dim)
    assert torch.isfinite(vo).all() and (vo + 0.4 * eye).diagonal().abs().mean() < 0.1
    with pytest.raises(ValueError, match="not divisible"):
        mimetic_attention_weights(30, 4)


def test_mimetic_vit_starts_with_those_weights_and_trains():
    torch.manual_seed(0)
    m = vitattn.ViT(img_size=16, patch_size=4, embed_dim=32, depth=2, num_heads=2, num_classes=3, weight_init="mimetic")
    a = m.blocks[1].attn
    q, k = a.qkv.weight[:16], a.qkv.weight[32:48]
    assert (q.T @ k).diagonal().mean() > 0.1  # head 0 starts local-to-similar, not random
    vo = a.qkv.weight[64:].T @ a.proj.weight.T
    assert vo.diagonal().mean() < -0.3
    out = m(torch.randn(2, 3, 16, 16))
    out.sum().backward()
    assert a.qkv.weight.grad.abs().sum() > 0
    with pytest.raises(ValueError, match="weight_init"):
        vitattn.ViTConfig(weight_init="xavier")


def test_jax_init_draws_each_tensor_as_timms_jax_mode():
    """Per tensor: the distribution timm's ``weight_init='jax'`` draws (Xavier-uniform bounds and
    spread, a zero head, LeCun-normal patches cut at 2 std), checked on the same shapes against
    timm itself where it is installed."""
    torch.manual_seed(0)
    m = vitattn.ViT(img_size=32, patch_size=4, embed_dim=96, depth=2, num_heads=3, mlp_ratio=2.0,
                    num_classes=4, weight_init="jax")
    sd = m.state_dict()
    for name, mod in m.named_modules():
        if isinstance(mod, torch.nn.Linear) and name != "head":
            fan_out, fan_in = mod.weight.shape
            bound = (6 / (fan_in + fan_out)) ** 0.5
            w, b = mod.weight.detach(), mod.bias.detach()
            assert w.abs().max() <= bound
            assert float(w.std()) == pytest.approx(bound / 3**0.5, rel=0.05), name
            assert b.abs().max() < 1e-4 and bool((b != 0).any()) == (".mlp." in name), name
    assert not sd["head.weight"].any() and not sd["head.bias"].any()
    w = sd["patch_embed.proj.weight"]
    std = (1 / w[0].numel()) ** 0.5
    assert float(w.std()) == pytest.approx(std, rel=0.05) and w.abs().max() <= 2 * std / 0.8796 + 1e-6
    default = vitattn.ViT(img_size=32, patch_size=4, embed_dim=96, depth=2, num_heads=3, num_classes=4)
    assert sd["blocks.0.attn.qkv.weight"].std() > 2 * default.blocks[0].attn.qkv.weight.std()
    timm = pytest.importorskip("timm")
    t = timm.models.vision_transformer.VisionTransformer(
        img_size=32, patch_size=4, embed_dim=96, depth=2, num_heads=3, mlp_ratio=2.0, num_classes=4,
        weight_init="jax").state_dict()
    for k, v in sd.items():
        if v.numel() > 1000:
            assert float(v.std()) == pytest.approx(float(t[k].std()), rel=0.05), k
            if k.endswith("weight"):  # bounded draws (uniform, cut normal): their largest values agree too
                assert float(v.abs().max()) == pytest.approx(float(t[k].abs().max()), rel=0.05), k


def test_patch_whitening_decorrelates_training_patches():
    g = torch.Generator().manual_seed(0)
    # correlated images: smooth noise, so neighbouring pixels and channels covary strongly
    images = torch.nn.functional.interpolate(torch.randn(64, 3, 8, 8, generator=g), size=32, mode="bilinear")
    images = images + 0.3 * images.mean(1, keepdim=True) + 0.1 * torch.randn(images.shape, generator=g)
    w = patch_whitening_weights(images, 4, embed_dim=128, eps=1e-6)
    assert w.shape == (48, 48)  # min(embed_dim, 3 * 4 * 4) rows
    patches = rearrange(images, "b c (gh p1) (gw p2) -> (b gh gw) (c p1 p2)", p1=4, p2=4)
    z = patches @ w.T
    cov = z.T @ z / len(z)
    torch.testing.assert_close(cov, torch.eye(48), atol=2e-3, rtol=0)
    assert patch_whitening_weights(images, 4, embed_dim=16).shape == (16, 48)  # the strongest directions
    with pytest.raises(ValueError, match="divisible by the patch"):
        patch_whitening_weights(images[..., :30], 4, 64)


def test_vit_init_stem_sets_the_patch_projection_from_data_and_stays_trainable():
    torch.manual_seed(0)
    m = vitattn.ViT(img_size=16, patch_size=4, embed_dim=64, depth=1, num_heads=2, num_classes=3, patch_init="whiten")
    images = torch.randn(32, 3, 16, 16)
    before = m.patch_embed.proj.weight.clone()
    m.init_stem(images)
    w = m.patch_embed.proj.weight.view(64, -1)
    torch.testing.assert_close(w[:48], patch_whitening_weights(images, 4, 64))
    torch.testing.assert_close(w[48:], before.view(64, -1)[48:])  # the rest keep their init
    assert m.patch_embed.proj.bias.abs().sum() == 0 and m.patch_embed.proj.weight.requires_grad
    plain = vitattn.ViT(img_size=16, patch_size=4, embed_dim=64, depth=1, num_heads=2)
    kept = plain.patch_embed.proj.weight.clone()
    plain.init_stem(images)  # without patch_init='whiten' nothing changes
    assert torch.equal(plain.patch_embed.proj.weight, kept)


def test_one_whitening_basis_serves_the_cnn_stem_and_the_patch_embedding():
    x = torch.randn(500, 12, dtype=torch.float64) @ torch.randn(12, 12, dtype=torch.float64)
    basis = whitening_basis(x, eps=0.0)
    torch.testing.assert_close(basis @ (x.T @ x / len(x)) @ basis.T, torch.eye(12, dtype=torch.float64))
    images = torch.randn(16, 3, 8, 8)
    filters = vitattn.whitening_filters(images)
    assert filters.shape == (24, 3, 2, 2) and torch.equal(filters[12:], -filters[:12])


def test_to_2tuple_and_feature_take_indices():
    assert to_2tuple(4) == (4, 4) and to_2tuple([3, 5]) == (3, 5)
    with pytest.raises(ValueError, match="pair"):
        to_2tuple((1, 2, 3))
    assert feature_take_indices(6) == list(range(6))
    assert feature_take_indices(6, 2) == [4, 5]
    assert feature_take_indices(6, [0, -1, -6]) == [0, 5, 0]
    for bad in (0, 7, [6], [-7]):
        with pytest.raises(ValueError, match="out of range|expected 1..6"):
            feature_take_indices(6, bad)


def test_every_model_checks_its_layer_indices_the_same_way():
    cnn = vitattn.create_model("cnn_quick")
    vit = vitattn.ViT(img_size=16, patch_size=4, embed_dim=32, depth=2, num_heads=2)
    for model, x in ((cnn, torch.randn(1, 3, 32, 32)), (vit, torch.randn(1, 3, 16, 16))):
        with pytest.raises(ValueError, match="out of range"):
            model.forward_intermediates(x, indices=[5])
    assert len(cnn.forward_intermediates(torch.randn(1, 3, 32, 32), indices=[-1], intermediates_only=True)) == 1
