"""Initialisations (vitattn.init) and the shared helpers (vitattn.helpers): the products and
statistics they promise, and their errors."""

import pytest
import torch

import vitattn
from vitattn.helpers import feature_take_indices, to_2tuple
from vitattn.init import whitening_basis


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


def test_the_whitening_basis_whitens_and_serves_the_cnn_stem():
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
    assert feature_take_indices(6, [0, -1, -5]) == [0, 5, 1]
    for bad in (0, 7, [6], [-7]):
        with pytest.raises(ValueError, match="out of range|expected 1..6"):
            feature_take_indices(6, bad)
    for bad, message in (([], "no layer indices given"), ([0, -6], "name a layer twice")):
        with pytest.raises(ValueError, match=message):
            feature_take_indices(6, bad)


def test_every_model_checks_its_layer_indices_the_same_way():
    cnn = vitattn.create_model("cnn_quick")
    vit = vitattn.ViT(img_size=16, patch_size=4, embed_dim=32, depth=2, num_heads=2)
    for model, x in ((cnn, torch.randn(1, 3, 32, 32)), (vit, torch.randn(1, 3, 16, 16))):
        with pytest.raises(ValueError, match="out of range"):
            model.forward_intermediates(x, indices=[5])
    assert len(cnn.forward_intermediates(torch.randn(1, 3, 32, 32), indices=[-1], intermediates_only=True)) == 1
