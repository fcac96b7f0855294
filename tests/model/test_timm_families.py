"""The families people fine-tune today, timm's twin number for number both ways: DINOv2 (with and
without registers), DeiT-III, SigLIP's attention pool, the register-GAP ViTs and CLIP (pre-norm,
quick GELU); timm's dense-feature calls; the presets in timm's registry."""

import subprocess
import sys

import pytest
import torch

import vitattn

timm = pytest.importorskip("timm")

# each preset shrunk to two blocks and a small image (every option kept), random weights
FAMILIES = ["vit_small_patch14_dinov2", "vit_small_patch14_reg4_dinov2", "deit3_small_patch16_224",
            "vit_base_patch16_siglip_224", "vit_little_patch16_reg1_gap_256", "vit_base_patch16_clip_224",
            "vit_base_patch16_clip_quickgelu_224"]


def small_timm(name: str, **kw):
    patch = 14 if "patch14" in name else 16
    t = timm.create_model(name, img_size=4 * patch, depth=2, **kw).eval()
    torch.manual_seed(0)
    with torch.no_grad():
        for p in t.parameters():
            p.normal_(0, 0.2)
    return t


def close(a, b):
    torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("name", FAMILIES)
def test_each_family_converts_both_ways_with_every_dense_call_equal(name):
    t = small_timm(name, num_classes=5)
    v = vitattn.from_timm(t).eval()
    back = vitattn.to_timm(v).eval()
    x = torch.randn(2, 3, *t.patch_embed.img_size, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        for other in (t, back):
            close(v(x), other(x))
            close(v.forward_features(x), other.forward_features(x))
            for kw in (dict(n=2), dict(n=[0], reshape=True, norm=True), dict(n=1, return_prefix_tokens=True)):
                for a, b in zip(v.get_intermediate_layers(x, **kw), other.get_intermediate_layers(x, **kw)):
                    for p, q in zip(*((a, b) if isinstance(a, tuple) else ((a,), (b,)))):
                        close(p, q)
            final, inter = v.forward_intermediates(x)
            final_t, inter_t = other.forward_intermediates(x)
            close(final, final_t)
            for a, b in zip(inter, inter_t):
                close(a, b)
    assert v.config.num_classes == 5 and set(v.state_dict()) == set(t.state_dict())


@pytest.mark.parametrize("name", FAMILIES)
def test_each_family_preset_is_timm_s_model_of_that_name(name):
    with torch.device("meta"):  # shapes and configs only: no weights drawn
        v, t = vitattn.create_model(name), timm.create_model(name)
    shapes = [{k: tuple(p.shape) for k, p in m.state_dict().items()} for m in (v, t)]
    assert shapes[0] == shapes[1]
    for key in ("input_size", "mean", "std", "crop_pct", "interpolation", "num_classes", "classifier", "first_conv"):
        ours, theirs = v.pretrained_cfg[key], t.pretrained_cfg[key]
        assert (tuple(ours) == theirs) if isinstance(theirs, tuple) else ours == theirs, key


def test_patch_dropout_keeps_timm_s_tokens_in_training():
    t = small_timm("vit_little_patch16_reg1_gap_256", patch_drop_rate=0.5, num_classes=3)
    v = vitattn.from_timm(t)
    t.train(), v.train()
    x = torch.randn(2, 3, 64, 64)
    torch.manual_seed(3)
    a = v.forward_features(x)
    torch.manual_seed(3)
    b = t.forward_features(x)
    assert a.shape == (2, 1 + 8, 320)  # the register and half of the 16 patches
    close(a, b)
    with pytest.raises(ValueError, match="no whole grid"):
        v.forward_intermediates(x)
    v.eval()
    assert v.forward_intermediates(x, intermediates_only=True)[0].shape == (2, 320, 4, 4)  # eval keeps every patch


@pytest.mark.parametrize("patch", [None, 8])
def test_set_input_size_is_timm_s(patch):
    t = small_timm("vit_small_patch14_reg4_dinov2")
    v = vitattn.from_timm(t).eval()
    for m in (t, v):
        m.set_input_size(img_size=(56, 112), patch_size=patch)
    x = torch.randn(1, 3, 56, 112)
    with torch.no_grad():
        close(v(x), t(x))
    assert v.config.img_size == (56, 112) and v.pretrained_cfg["input_size"] == (3, 56, 112)
    assert v.patch_embed.patch_size == t.patch_embed.patch_size
    rebuilt = vitattn.ViT(v.config)  # the config describes the model as it now is
    rebuilt.load_state_dict(v.state_dict())


def test_prune_intermediate_layers_is_timm_s():
    t = small_timm("vit_base_patch16_siglip_224")
    v = vitattn.from_timm(t).eval()
    assert v.prune_intermediate_layers([0], prune_norm=True) == t.prune_intermediate_layers([0], prune_norm=True)
    assert set(v.state_dict()) == set(t.state_dict()) and len(v.blocks) == 1 and v.attn_pool is None
    x = torch.randn(1, 3, 64, 64)
    with torch.no_grad():
        close(v.forward_intermediates(x, indices=1)[1][0], t.forward_intermediates(x, indices=1)[1][0])
    vitattn.ViT(v.config).load_state_dict(v.state_dict())


def test_the_attention_pool_is_kept_or_dropped_never_added():
    v = vitattn.ViT(img_size=16, patch_size=4, embed_dim=32, depth=1, num_heads=2, class_token=False,
                    global_pool="map", num_classes=3)
    v.reset_classifier(5)
    assert v.attn_pool is not None and v(torch.randn(1, 3, 16, 16)).shape == (1, 5)
    v.reset_classifier(0, "avg")
    assert v.attn_pool is None
    with pytest.raises(ValueError, match="attention pool the model was built with"):
        v.reset_classifier(0, "map")


def test_registers_are_prefix_tokens_for_every_measure_and_window_attention():
    from vitattn.context import head_attention_maps, rollout_map

    v = vitattn.create_model("vit_little_patch16_reg1_gap_256", img_size=64, depth=2, window_size=2,
                             window_block_indexes=(0,)).eval()
    x = torch.randn(2, 3, 64, 64)
    maps = v.get_attention_maps(x)
    assert maps[0].shape == (2, 5, 17, 17)
    # the register attends everywhere and is seen from every window; patches see their window only
    assert (maps[0][:, :, 0] > 0).all() and (maps[0][:, :, 1:, 0] > 0).all()
    assert (maps[0][:, :, 1, 1 + 2] == 0).all()  # patch (0, 0) does not see patch (0, 2)
    readable = vitattn.create_model("vit_little_patch16_reg1_gap_256", img_size=64, depth=2, window_size=2,
                                    window_block_indexes=(0,), fused_attn=False).eval()
    readable.load_state_dict(v.state_dict())
    with torch.no_grad():  # the windows batched equal global attention under the window mask
        close(v.forward_features(x), readable.forward_features(x))
    # no class token: the maps read the centre patch's query and the patch queries, not the register's
    centre = head_attention_maps(maps[-1], (4, 4), 1, class_token=False)
    query = maps[-1][:, :, 1 + 2 * 4 + 2]  # token 1 + patch (2, 2)
    torch.testing.assert_close(centre[:, :, 0, 0], query[:, :, 1] / query[:, :, 1:].sum(-1))
    assert rollout_map(torch.eye(17).expand(2, 17, 17), (4, 4), 1, class_token=False).sum((1, 2)).allclose(
        torch.ones(2))


def test_vitdet_runs_a_detector_step_on_dinov2_with_registers_and_windows():
    pytest.importorskip("torchvision")
    from vitattn.vitdet import ViTDetBackbone, build_detector

    vit = vitattn.create_model("vit_small_patch14_reg4_dinov2", img_size=112, depth=3, embed_dim=64, num_heads=2,
                               window_size=4)
    backbone = ViTDetBackbone(vit, 32, scale_factors=(2.0, 1.0, 0.5))
    assert backbone.strides == {"0": 7, "1": 14, "2": 28, "pool": 56}
    model = build_detector("fcos", backbone, num_classes=3, min_size=112, max_size=112)
    images = [torch.rand(3, 112, 112), torch.rand(3, 98, 112)]
    targets = [{"boxes": torch.tensor([[10.0, 12.0, 60.0, 70.0]]), "labels": torch.tensor([1])},
               {"boxes": torch.tensor([[30.0, 20.0, 90.0, 80.0]]), "labels": torch.tensor([2])}]
    loss = sum(model(images, targets).values())
    loss.backward()
    assert torch.isfinite(loss) and vit.reg_token.grad is not None and vit.reg_token.grad.abs().sum() > 0
    assert all(p.grad is not None for p in model.parameters() if p.requires_grad), "a parameter got no gradient"


def test_timm_builds_vitattn_presets_once_vitattn_is_imported_in_either_order():
    code = ("import {first}, {second}, torch; m = timm.create_model('vit_cifar10_vitattn', num_classes=3); "
            "print(type(m).__module__, m(torch.randn(1, 3, 32, 32)).shape[1], "
            "timm.models.get_pretrained_cfg_value('vit_cifar10_vitattn', 'mean'), "
            "len(timm.list_models('*_vitattn')) == len(vitattn.list_models()))")
    for first, second in (("vitattn", "timm"), ("timm", "vitattn")):
        out = subprocess.run([sys.executable, "-c", code.format(first=first, second=second)], capture_output=True,
                             text=True, timeout=120)
        assert out.returncode == 0, out.stderr
        assert out.stdout.split() == ["vitattn.vit", "3", "(0.4914,", "0.4822,", "0.4465)", "True"], out.stdout
    assert not any(n.endswith("_vitattn") for n in vitattn.list_models())  # the suffix is timm's side only


def test_run_timm_runs_a_script_of_timm_s_with_the_presets_registered(tmp_path):
    script = tmp_path / "script.py"  # stands in for timm's train.py: a script that only imports timm
    script.write_text("import sys, timm\nm = timm.create_model(sys.argv[1])\n"
                      "print(sys.argv[1:], type(m).__name__, __name__)\n")
    run = [sys.executable, "-m", "vitattn.run_timm"]
    out = subprocess.run([*run, str(script), "vit_quick_vitattn"], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split("\n")[0] == "['vit_quick_vitattn'] ViT __main__"
    missing = subprocess.run([*run, str(tmp_path / "train.py")], capture_output=True, text=True, timeout=60)
    assert missing.returncode == 2 and "no such file" in missing.stderr and "Traceback" not in missing.stderr
    # -m MODULE as python's own: how timm's test suite runs (-m pytest), its exit status passed on
    (tmp_path / "fake_suite.py").write_text(script.read_text() + "raise SystemExit(3)\n")
    out = subprocess.run([*run, "-m", "fake_suite", "vit_quick_vitattn"], cwd=tmp_path, capture_output=True,
                         text=True, timeout=120)
    assert out.returncode == 3 and out.stdout.split("\n")[0] == "['vit_quick_vitattn'] ViT __main__", out.stderr
    for bad in (["-m"], ["-m", "no_such_module_here"]):
        out = subprocess.run([*run, *bad], cwd=tmp_path, capture_output=True, text=True, timeout=60)
        assert out.returncode == 2 and "expected a module" in out.stderr and "Traceback" not in out.stderr, out.stderr
