"""The ViT, the CNN and the registry: interfaces, gradients, invariances, errors, learning."""

import pytest
import torch

import vitattn
from vitattn import CNNConfig, SmallCNN, ViT, ViTConfig, create_model, list_models, whitening_filters

TINY = dict(img_size=16, patch_size=4, embed_dim=32, depth=2, num_heads=4, num_classes=5)


def tiny(**kw):
    torch.manual_seed(0)
    return ViT(**{**TINY, **kw})


@pytest.mark.parametrize("pos_embed", ["learn", "sincos1d", "sincos2d", "none"])
@pytest.mark.parametrize("pool", ["token", "avg", "max", "avgmax"])
def test_every_parameter_gets_a_gradient(pos_embed, pool):
    m = tiny(pos_embed=pos_embed, global_pool=pool, class_token=pool == "token", init_values=0.1, qk_norm=True)
    out = m(torch.randn(2, 3, 16, 16))
    assert out.shape == (2, 5) and torch.isfinite(out).all()
    out.square().sum().backward()
    for name, p in m.named_parameters():
        assert p.grad is not None and p.grad.abs().sum() > 0, name


def test_encoder_is_permutation_equivariant_without_positions():
    m = tiny(pos_embed="none", class_token=False, global_pool="avg").eval()
    tokens, grid = m.patch_embed(torch.randn(2, 3, 16, 16))
    perm = torch.randperm(tokens.shape[1], generator=torch.Generator().manual_seed(0))

    def encode(x):
        for blk in m.blocks:
            x = blk(x)
        return m.norm(x)

    assert torch.allclose(encode(tokens)[:, perm], encode(tokens[:, perm]), atol=1e-5)
    # ... so the pooled prediction cannot see where things are: shuffled patches, same logits
    assert torch.allclose(m.forward_head(encode(tokens)), m.forward_head(encode(tokens[:, perm])), atol=1e-5)


def test_positions_break_the_symmetry():
    """'I like you' vs 'you like me': with positions, the same patches in another order give other logits."""
    m = tiny(pos_embed="sincos2d").eval()
    x = torch.randn(1, 3, 16, 16)
    swapped = torch.cat([x[..., 8:], x[..., :8]], dim=-1)  # swap left and right halves
    assert not torch.allclose(m(x), m(swapped), atol=1e-4)


def test_forward_features_head_and_pre_logits():
    m = tiny().eval()
    x = torch.randn(2, 3, 16, 16)
    feats = m.forward_features(x)
    assert feats.shape == (2, 1 + 16, 32)
    assert m.num_features == 32 and m.num_prefix_tokens == 1
    assert m.forward_head(feats, pre_logits=True).shape == (2, 32)
    assert torch.allclose(m.forward_head(feats), m(x))


@pytest.mark.parametrize("kw", [{}, dict(qk_norm=True, init_values=0.1), dict(score="general"),
                                dict(score="additive"), dict(pos_embed="sincos2d", qkv_bias=False),
                                dict(use_rot_pos_emb=True)])
def test_class_token_shortcut_equals_the_readable_path(kw):
    """forward() runs the last block for the class token alone; outputs and every gradient must
    equal forward_head(forward_features(x)), which computes the block for all tokens."""
    m = tiny(**kw).train()  # the shortcut is a training step's (nothing here draws at random)
    x = torch.randn(3, 3, 16, 16, requires_grad=True)
    assert m.class_token_shortcut()
    fast, slow = m(x), m.forward_head(m.forward_features(x))
    torch.testing.assert_close(fast, slow, atol=1e-5, rtol=1e-5)
    wrt = [x, *m.parameters()]
    g_fast = torch.autograd.grad(fast.square().sum(), wrt)
    g_slow = torch.autograd.grad(slow.square().sum(), wrt)
    for (name, _), a, b in zip([("input", x), *m.named_parameters()], g_fast, g_slow):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5, msg=name)
    blk, tokens = m.blocks[-1], torch.randn(2, 17, 32)
    rope = m.rope_for((4, 4), tokens)
    torch.testing.assert_close(blk.forward_first(tokens, 3, rope), blk(tokens, rope=rope)[:, :3], atol=1e-6, rtol=1e-6)


def test_class_token_shortcut_saves_the_work_it_claims():
    """The last block of a 2-block tiny model costs ~half the FLOPs; the shortcut keeps only its
    key/value projections and the class token's share (counted, not timed)."""
    from vitattn.helpers import count_flops

    m = tiny(img_size=32).train()  # 64 patches + 1 class token; the shortcut is training's
    x = torch.randn(2, 3, 32, 32)

    def flops(fn):
        with torch.no_grad():
            return count_flops(fn, x)

    fast, slow = flops(m), flops(lambda t: m.forward_head(m.forward_features(t)))
    assert fast < 0.65 * slow, (fast, slow)
    # avg pooling reads every token: no shortcut, identical work
    m_avg = tiny(img_size=32, class_token=False, global_pool="avg").train()
    assert flops(m_avg) == flops(lambda t: m_avg.forward_head(m_avg.forward_features(t)))


def test_forward_first_refuses_window_attention():
    m = tiny(window_size=2, window_block_indexes=(1,))
    with pytest.raises(ValueError, match="global attention"):
        m.blocks[1].forward_first(torch.randn(1, 17, 32), 1)
    assert m(torch.randn(1, 3, 16, 16)).shape == (1, 5)  # forward falls back to the full path


def test_forward_intermediates():
    m = tiny(depth=4).eval()
    x = torch.randn(2, 3, 16, 12)
    with pytest.raises(ValueError, match="position table"):
        m(x)
    m = tiny(depth=4, dynamic_img_size=True).eval()
    final, inter = m.forward_intermediates(x)
    assert torch.allclose(final, m.forward_features(x), atol=1e-6)
    assert len(inter) == 4 and all(t.shape == (2, 32, 4, 3) for t in inter)
    last2 = m.forward_intermediates(x, indices=2, intermediates_only=True)
    assert len(last2) == 2 and torch.allclose(last2[1], inter[3])
    picked = m.forward_intermediates(x, indices=[0, -1], output_fmt="NLC", norm=True, intermediates_only=True)
    assert picked[0].shape == (2, 12, 32)
    assert torch.allclose(picked[1], final[:, 1:], atol=1e-6)  # normed last block == forward_features
    with_prefix = m.forward_intermediates(x, indices=[1], return_prefix_tokens=True, intermediates_only=True)
    assert with_prefix[0][1].shape == (2, 1, 32)
    with pytest.raises(ValueError, match="out of range"):
        m.forward_intermediates(x, indices=[4])
    with pytest.raises(ValueError, match="output_fmt"):
        m.forward_intermediates(x, output_fmt="NHWC")


def test_attention_maps_match_forward():
    m = tiny(depth=3).eval()
    x = torch.randn(2, 3, 16, 16)
    maps = m.get_attention_maps(x)
    assert len(maps) == 3 and all(a.shape == (2, 4, 17, 17) for a in maps)
    assert all(torch.allclose(a.sum(-1), torch.ones(2, 4, 17), atol=1e-5) for a in maps)
    # the maps come from the same computation as forward: redo forward from them by hand in block 0
    blk = m.blocks[0]
    tokens, _ = m.embed(x)
    q, k, v = blk.attn.project_qkv(blk.norm1(tokens), None)
    assert torch.allclose(maps[0], ((q @ k.transpose(-2, -1)) * blk.attn.head_dim**-0.5).softmax(-1), atol=1e-5)


def test_rotary_codes_see_relative_places_only():
    """With rotary codes, a query-key score depends on the two tokens and their offset: the same
    tokens moved together by whole patches score the same; kept in place with other contents
    around them, other scores."""
    m = tiny(pos_embed="none", use_rot_pos_emb=True, class_token=False, global_pool="avg").eval()
    attn = m.blocks[0].attn
    torch.manual_seed(1)
    tokens = torch.randn(1, 16, 32)  # a 4 x 4 grid
    moved = torch.roll(tokens, shifts=8, dims=1)  # every token two rows down (rows 0-1 -> rows 2-3)
    rope = m.rope_for((4, 4), tokens)

    def scores(t):
        q, k, _ = attn.project_qkv(t, None)
        return attn.score_fn(*vitattn.rotate_qk(q, k, rope))

    s, s_moved = scores(tokens), scores(moved)
    torch.testing.assert_close(s_moved[..., 8:, 8:], s[..., :8, :8], atol=1e-5, rtol=1e-5)
    assert not torch.allclose(s_moved[..., :8, :8], s[..., :8, :8], atol=1e-3)  # not the content alone
    # every attention path agrees with the explicit one under rotary codes, gradients included
    m2 = tiny(use_rot_pos_emb=True, window_size=2, window_block_indexes=(0,)).eval()
    xx = torch.randn(2, 3, 16, 16, requires_grad=True)
    fast = m2.forward_features(xx)
    for blk in m2.blocks:
        blk.attn.fused = False
    slow = m2.forward_features(xx)
    torch.testing.assert_close(fast, slow, atol=1e-5, rtol=1e-5)
    with pytest.raises(ValueError, match="divisible by 4"):
        ViT(**{**TINY, "num_heads": 16, "use_rot_pos_emb": True})


def test_dynamic_img_size_and_fixed_encodings_take_any_size():
    for kw in (dict(dynamic_img_size=True), dict(pos_embed="sincos2d"), dict(pos_embed="sincos1d"),
               dict(pos_embed="none", use_rot_pos_emb=True)):
        m = tiny(**kw).eval()
        for size in ((16, 16), (8, 24), (32, 20)):
            assert m(torch.randn(1, 3, *size)).shape == (1, 5)


def test_sincos_tables_are_computed_for_the_grid():
    m = tiny(pos_embed="sincos2d").eval()
    pos = m.pos_embed_for((3, 5), torch.zeros(1))
    assert pos.shape == (1, 1 + 15, 32)
    assert torch.equal(pos[0, 0], torch.zeros(32))  # the class token gets no position
    assert torch.allclose(pos[0, 1:], vitattn.sincos_2d(3, 5, 32))


def test_load_weights_resamples_skips_head_and_names_bad_keys():
    src = tiny(num_classes=7)
    dst = tiny(img_size=24, num_classes=3)
    report = dst.load_weights(src.state_dict())
    assert report["skipped"] == ["head.weight", "head.bias"] and report["missing"] == []
    assert torch.equal(dst.blocks[1].mlp.fc2.weight, src.blocks[1].mlp.fc2.weight)
    assert dst.pos_embed.shape == (1, 1 + 36, 32)
    bad = tiny(mlp_ratio=2.0)
    with pytest.raises(ValueError, match=r"blocks\.0\.mlp\.fc1\.weight: checkpoint \(128, 32\) vs model \(64, 32\)"):
        bad.load_weights(src.state_dict())
    with pytest.raises(RuntimeError, match="size mismatch for blocks.0.mlp.fc1.weight"):
        bad.load_state_dict(src.state_dict())
    with pytest.raises(ValueError, match="missing"):
        dst.load_weights({k: v for k, v in src.state_dict().items() if k != "norm.weight"})


@pytest.mark.parametrize("make", [lambda: vitattn.ViTConfig(img_size=[32, 32], patch_size=4, window_size=2,
                                                              window_block_indexes=[0]),
                                  lambda: vitattn.AttentionConfig(num_heads=2), lambda: vitattn.CNNConfig(widths=[8]),
                                  lambda: vitattn.bof.BagOfFeaturesConfig()])
def test_configs_are_values_changed_by_replace(make):
    import dataclasses

    cfg = make()
    name = dataclasses.fields(cfg)[0].name
    with pytest.raises(dataclasses.FrozenInstanceError):
        setattr(cfg, name, getattr(cfg, name))
    assert dataclasses.replace(cfg) == cfg and hash(cfg) == hash(dataclasses.replace(cfg))  # lists held as tuples


def test_a_vitdet_backbone_gives_its_vit_a_new_config_and_leaves_the_old_one_alone():
    from vitattn.vitdet import ViTDetBackbone

    vit = vitattn.create_model("vit_quick")
    before = vit.config
    ViTDetBackbone(vit, 32)
    assert vit.config.dynamic_img_size and not before.dynamic_img_size and vit.config is not before


def test_config_errors():
    with pytest.raises(ValueError, match="unknown pos_embed"):
        ViTConfig(pos_embed="rope")
    with pytest.raises(ValueError, match="needs class_token=True"):
        ViTConfig(class_token=False, global_pool="token")
    with pytest.raises(ValueError, match="not divisible by num_heads"):
        ViTConfig(embed_dim=100, num_heads=3)


def test_registry():
    names = list_models()
    assert {"vit_tiny_patch16_224", "vit_small_patch16_224", "vit_base_patch16_224", "cnn_longrange"} <= set(names)
    assert list_models("cnn*") == [n for n in names if n.startswith("cnn")]
    with pytest.raises(ValueError, match="unknown model 'vit_huge'; available: .*vit_tiny_patch16_224"):
        create_model("vit_huge")
    with pytest.raises(TypeError, match="no option"):
        create_model("vit_quick", embed_dims=4)
    m = create_model("vit_quick", depth=2, global_pool="avg", class_token=False)
    assert len(m.blocks) == 2 and m.num_prefix_tokens == 0


def test_preset_dims_match_timm():
    timm = pytest.importorskip("timm")
    for name in ("vit_tiny_patch16_224", "vit_small_patch16_224"):
        ours = sum(p.numel() for p in create_model(name).parameters())
        theirs = sum(p.numel() for p in timm.create_model(name, pretrained=False).parameters())
        assert ours == theirs, name


def test_reset_classifier():
    m = tiny()
    m.reset_classifier(0)
    assert m(torch.randn(1, 3, 16, 16)).shape == (1, 32)
    m.reset_classifier(3, global_pool="avg")
    assert m(torch.randn(1, 3, 16, 16)).shape == (1, 3)


def test_drop_path_and_layer_scale():
    from vitattn import DropPath, LayerScale

    torch.manual_seed(0)
    dp = DropPath(0.5).train()
    y = dp(torch.ones(1000, 3))
    kept = (y[:, 0] != 0).float().mean()
    assert 0.4 < kept < 0.6 and torch.allclose(y[y != 0], torch.tensor(2.0))
    assert torch.equal(dp.eval()(torch.ones(4, 3)), torch.ones(4, 3))
    m = tiny(drop_path_rate=0.2, depth=3)
    assert [getattr(b.drop_path1, "drop_prob", 0.0) for b in m.blocks] == pytest.approx([0.0, 0.1, 0.2])
    assert torch.equal(LayerScale(4, 0.1)(torch.ones(2, 4)), torch.full((2, 4), 0.1))


def test_cnn_interface_and_strides():
    torch.manual_seed(0)
    cnn = create_model("cnn_quick").eval()
    assert isinstance(cnn, SmallCNN)
    x = torch.randn(2, 3, 32, 32)
    feats = cnn.forward_features(x)
    assert feats.shape == (2, cnn.num_features, 4, 4)
    assert cnn.forward_head(feats, pre_logits=True).shape == (2, cnn.num_features)
    inter = cnn.forward_intermediates(x, intermediates_only=True)
    assert [t.shape[-1] for t in inter] == [16, 8, 4]
    with pytest.raises(ValueError, match=r"expected images \(B, 3, H, W\)"):
        cnn(torch.randn(2, 1, 32, 32))


def test_cnn_airbench_options():
    torch.manual_seed(0)
    x = torch.randn(4, 3, 16, 16)
    plain = SmallCNN(stem_width=8, widths=(8, 16, 16), num_classes=3)
    scaled = SmallCNN(stem_width=8, widths=(8, 16, 16), num_classes=3, head_scale=1 / 9)
    scaled.load_state_dict(plain.state_dict())
    torch.testing.assert_close(scaled(x), plain(x) / 9)
    # shift-only BatchNorm: the scale is not trained (and stays 1 through a step)
    m = SmallCNN(stem_width=8, widths=(8, 16, 16), num_classes=3, bn_weight=False)
    bns = [mod for mod in m.modules() if isinstance(mod, torch.nn.BatchNorm2d)]
    assert bns and all(not b.weight.requires_grad and b.bias.requires_grad for b in bns)
    opt = torch.optim.SGD([p for p in m.parameters() if p.requires_grad], lr=0.1)
    m(x).square().sum().backward()
    opt.step()
    assert all(torch.equal(b.weight, torch.ones_like(b.weight)) for b in bns)
    # identity-started convs: out-channel i of the 8 -> 16 conv starts as a copy of in-channel i
    d = SmallCNN(stem_width=8, widths=(8, 16, 16), num_classes=3, dirac_init=True)
    conv = d.stages[1][0][0]
    probe = torch.randn(1, 8, 5, 5)
    torch.testing.assert_close(conv(probe)[:, :8], probe)
    assert conv.weight[8:].abs().sum() > 0  # the channels beyond the identity keep their random init
    # airbench's fast BatchNorm statistics: one training batch moves every running mean 40% of the way
    f = SmallCNN(stem_width=8, widths=(8, 16, 16), num_classes=3, bn_momentum=0.4, bn_eps=1e-12)
    bns = [mod for mod in f.modules() if isinstance(mod, torch.nn.BatchNorm2d)]
    assert all((b.momentum, b.eps) == (0.4, 1e-12) for b in bns)
    f.stem[0].register_forward_hook(lambda mod, inp, out: setattr(f, "stem_out", out.detach()))
    f(x)
    stem_bn = f.stem[1]
    torch.testing.assert_close(stem_bn.running_mean, 0.4 * f.stem_out.mean(dim=(0, 2, 3)))
    with pytest.raises(ValueError, match="bn_momentum must be in"):
        SmallCNN(bn_momentum=1.5)


def test_whitening_filters_decorrelate_patches():
    torch.manual_seed(0)
    x = torch.randn(32, 3, 12, 12)
    x = x + 0.8 * torch.roll(x, 1, dims=2) + 0.5 * x.mean(1, keepdim=True)  # correlated pixels and channels
    f = whitening_filters(x, eps=1e-6)
    assert f.shape == (24, 3, 2, 2)
    torch.testing.assert_close(f[12:], -f[:12])  # each direction and its negative
    z = torch.nn.functional.conv2d(x.double(), f[:12].double())
    z = z.transpose(0, 1).reshape(12, -1)
    torch.testing.assert_close(z @ z.T / z.shape[1], torch.eye(12, dtype=torch.float64), atol=1e-3, rtol=0)
    with pytest.raises(ValueError, match=r"expected images \(B, C, H, W\)"):
        whitening_filters(torch.randn(3, 12, 12))


def test_cnn_whitening_stem():
    with pytest.raises(ValueError, match="stem must be 'conv' or 'whiten'"):
        CNNConfig(stem="patch")
    with pytest.raises(ValueError, match="24 channels.*got stem_width=32"):
        CNNConfig(stem="whiten", stem_width=32)
    torch.manual_seed(0)
    m = SmallCNN(stem="whiten", stem_width=24, widths=(8, 16, 16), num_classes=3)
    x = torch.randn(6, 3, 32, 32)
    m.init_stem(x)
    conv = m.stem[0]
    torch.testing.assert_close(conv.weight, whitening_filters(x))
    assert not conv.weight.requires_grad and conv.bias.requires_grad and not conv.bias.any()
    # no padding: 32 -> 31, then 15, 7, 3 after the stages' pools
    assert [t.shape[-1] for t in m.forward_intermediates(x, intermediates_only=True)] == [15, 7, 3]
    m(x).square().sum().backward()
    assert conv.weight.grad is None and conv.bias.grad.abs().sum() > 0
    with pytest.raises(ValueError, match=r"expected images \(B, 3, H, W\), got \(6, 1, 32, 32\)"):
        m.init_stem(torch.randn(6, 1, 32, 32))
    plain = SmallCNN(widths=(8, 16, 16))
    before = {k: v.clone() for k, v in plain.state_dict().items()}
    plain.init_stem(x)  # a 3x3 conv stem is left as it is
    assert all(torch.equal(before[k], v) for k, v in plain.state_dict().items())


@pytest.mark.parametrize("name", ["vit_quick", "cnn_quick"])
def test_short_training_lowers_the_loss(name):
    """A few steps on a fixed synthetic batch: the model must fit it (loss falls by half)."""
    torch.manual_seed(0)
    overrides = dict(depth=1, embed_dim=64, num_heads=2) if name.startswith("vit") else dict(widths=(16, 32, 32))
    model = create_model(name, **overrides)
    x = torch.randn(16, 3, 32, 32)
    y = torch.randint(0, 10, (16,))
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    losses = []
    for _ in range(30):
        loss = torch.nn.functional.cross_entropy(model(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert losses[-1] < 0.5 * losses[0], losses[::8]


def test_every_model_family_takes_timms_contract_from_one_mixin():
    """ViT, CNN and the bag of features share TimmModel: a checkpoint with a head of another size
    loads into each with the head skipped and named, and reset_classifier follows each one's rules."""
    from vitattn.contract import TimmModel

    for name in ("vit_quick", "cnn_quick", "bof_longrange"):
        src, dst = create_model(name, num_classes=7), create_model(name, num_classes=3)
        assert isinstance(dst, TimmModel) and dst.default_cfg is dst.pretrained_cfg
        report = dst.load_weights(src.state_dict())
        head = dst.pretrained_cfg["classifier"]
        assert report["skipped"] == [f"{head}.weight"] + ([f"{head}.bias"] if f"{head}.bias" in src.state_dict()
                                                          else []), name
        assert not report["missing"] and not report["unexpected"]
        body = {k: v for k, v in src.state_dict().items() if not k.startswith(head + ".")}
        assert all(torch.equal(dst.state_dict()[k], v) for k, v in body.items()), name
        dst.reset_classifier(0)
        assert dst.num_classes == dst.pretrained_cfg["num_classes"] == 0 and isinstance(dst.get_classifier(),
                                                                                          torch.nn.Identity)
        with pytest.raises(ValueError):
            dst.reset_classifier(0, global_pool="nonsense")
