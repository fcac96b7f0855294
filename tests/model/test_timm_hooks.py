"""timm's hooks, checked through timm's own tools: its optimizer factory with layer-wise lr decay,
its data config, and gradient checkpointing as its training script switches it on."""

from __future__ import annotations

import pytest
import torch
from torch.autograd.graph import saved_tensors_hooks

import vitattn
from vitattn.constants import CIFAR10_MEAN

timm = pytest.importorskip("timm")


def groups_by_name(model, opt) -> dict[str, tuple[float, float]]:
    """parameter name -> (lr_scale, weight_decay) of the group that holds it."""
    names = {id(p): n for n, p in model.named_parameters()}
    return {names[id(p)]: (g["lr_scale"], g["weight_decay"]) for g in opt.param_groups for p in g["params"]}


def test_timm_optimizer_factory_keeps_tokens_norms_biases_out_of_decay_and_scales_lr_by_depth():
    from timm.optim import create_optimizer_v2

    model = vitattn.create_model("vit_quick", num_classes=10)  # depth 6
    opt = create_optimizer_v2(model, "adamw", lr=1e-3, weight_decay=0.05, layer_decay=0.75)
    g = groups_by_name(model, opt)
    for name in ("pos_embed", "cls_token", "patch_embed.proj.bias", "blocks.0.norm1.weight", "blocks.3.attn.qkv.bias",
                 "norm.weight", "head.bias"):
        assert g[name][1] == 0.0, name
    for name in ("patch_embed.proj.weight", "blocks.0.attn.qkv.weight", "blocks.5.mlp.fc2.weight", "head.weight"):
        assert g[name][1] == 0.05, name
    depth = len(model.blocks)
    assert g["pos_embed"][0] == pytest.approx(0.75 ** (depth + 1))  # the embedding is layer 0
    for i in range(depth):
        assert g[f"blocks.{i}.attn.qkv.weight"][0] == pytest.approx(0.75 ** (depth - i))
    assert g["head.weight"][0] == 1.0
    cnn = vitattn.create_model("cnn_quick")
    g = groups_by_name(cnn, create_optimizer_v2(cnn, "sgd", lr=0.1, weight_decay=5e-4, layer_decay=0.8))
    assert g["stem.0.weight"][0] < g["stages.0.0.0.weight"][0] < g["stages.2.1.0.weight"][0] < g["head.weight"][0]
    assert g["stages.1.0.2.bias"][1] == 0.0 and g["stages.1.0.0.weight"][1] == 5e-4


@pytest.mark.parametrize("name, size, mean", [("vit_quick", 32, CIFAR10_MEAN),
                                              ("vit_tiny_patch16_224", 224, (0.5, 0.5, 0.5)),
                                              ("cnn_quick", 32, CIFAR10_MEAN)])
def test_timm_data_config_reads_the_models_own_values(name, size, mean):
    from timm.data import resolve_data_config

    model = vitattn.create_model(name)
    cfg = resolve_data_config(model=model)
    assert cfg["input_size"] == (3, size, size) and tuple(cfg["mean"]) == mean
    assert model.default_cfg is model.pretrained_cfg and model.get_classifier() is model.head
    model.pretrained_cfg["label_names"] = [f"class {i}" for i in range(model.num_classes)]
    model.reset_classifier(model.num_classes)
    assert len(model.pretrained_cfg["label_names"]) == model.num_classes  # the same classes keep their names
    model.reset_classifier(7)
    assert model.pretrained_cfg["num_classes"] == 7 and model.get_classifier().out_features == 7
    assert "label_names" not in model.pretrained_cfg  # a new head's classes are not the old names


def _grads_and_saved_bytes(model, x):
    saved = [0]

    def pack(t):
        saved[0] += t.numel() * t.element_size()
        return t

    model.zero_grad()
    with saved_tensors_hooks(pack, lambda t: t):
        model(x).square().mean().backward()
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}, saved[0]


@pytest.mark.parametrize("name", ["vit_quick", "cnn_quick"])
def test_grad_checkpointing_gives_equal_gradients_and_keeps_fewer_activations(name):
    torch.manual_seed(0)
    model = vitattn.create_model(name, num_classes=10).eval()  # eval: BatchNorm and dropout draw nothing
    x = torch.randn(4, 3, 32, 32)
    plain, plain_bytes = _grads_and_saved_bytes(model, x)
    model.set_grad_checkpointing(True)
    ckpt, ckpt_bytes = _grads_and_saved_bytes(model, x)
    assert plain.keys() == ckpt.keys()
    for k in plain:
        torch.testing.assert_close(ckpt[k], plain[k], rtol=1e-5, atol=1e-6)
    assert ckpt_bytes < plain_bytes / 2  # activations kept for the backward pass
    with torch.no_grad():  # no recomputation to arrange without gradients
        assert model(x).shape == (4, 10)


# -- pretrained weights, timm's way -----------------------------------------------------------------
def test_pretrained_weights_load_through_timm_from_a_local_file_and_match_timm(tmp_path):
    from safetensors.torch import save_file

    torch.manual_seed(0)
    twin = timm.create_model("vit_tiny_patch16_224", pretrained=False).eval()
    path = tmp_path / "model.safetensors"
    save_file({k: v.contiguous() for k, v in twin.state_dict().items()}, str(path))
    model = vitattn.create_model("vit_tiny_patch16_224", pretrained=True,
                                 pretrained_cfg_overlay=dict(file=str(path))).eval()
    x = torch.randn(2, 3, 224, 224)
    with torch.no_grad():
        torch.testing.assert_close(model(x), twin(x), rtol=1e-4, atol=1e-5)
    assert model.pretrained_cfg["mean"] == twin.pretrained_cfg["mean"]
    ten = vitattn.create_model("vit_tiny_patch16_224", pretrained=True, num_classes=10,
                               pretrained_cfg_overlay=dict(file=str(path))).eval()
    assert ten.head.out_features == 10  # a new head; the body is timm's
    torch.testing.assert_close(ten.blocks[3].mlp.fc1.weight, twin.blocks[3].mlp.fc1.weight)


def test_pretrained_offline_without_a_file_says_how_to_supply_one():
    import subprocess
    import sys

    code = ("import vitattn\n"
            "try:\n    vitattn.create_model('vit_tiny_patch16_224', pretrained=True)\n"
            "except RuntimeError as e:\n    print(e)\n")
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                       env={**__import__("os").environ, "HF_HUB_OFFLINE": "1"})
    assert "could not be loaded" in p.stdout and "pretrained_cfg_overlay=dict(file=" in p.stdout, p.stdout + p.stderr
    with pytest.raises(ValueError, match="no pretrained weights for vit_quick"):
        vitattn.create_model("vit_quick", pretrained=True)


def test_checkpoint_path_loads_a_vitattn_checkpoint_strictly(tmp_path):
    from safetensors.torch import save_file

    torch.manual_seed(1)
    source = vitattn.create_model("vit_quick", num_classes=3)
    save_file(source.state_dict(), str(tmp_path / "vit.safetensors"))
    torch.save({"model": source.state_dict(), "optimizer": {}, "state": {}}, tmp_path / "vit.pt")
    for f in ("vit.safetensors", "vit.pt"):
        model = vitattn.create_model("vit_quick", num_classes=3, checkpoint_path=str(tmp_path / f))
        for k, v in source.state_dict().items():
            assert torch.equal(model.state_dict()[k], v), (f, k)
    with pytest.raises(ValueError, match="does not hold this model's weights"):
        vitattn.create_model("vit_quick", checkpoint_path=str(tmp_path / "vit.safetensors"))
    with pytest.raises(ValueError, match="cannot read weights"):
        vitattn.create_model("vit_quick", checkpoint_path=str(tmp_path / "missing.pt"))


@pytest.mark.parametrize("name, out_indices, channels, reduction", [
    ("vit_quick", 2, [128, 128], [4, 4]),
    ("vit_tiny_patch16_224", (0, 5, 11), [192] * 3, [16] * 3),
    ("cnn_quick", None, [32, 96, 96], [2, 4, 8]),
])
def test_features_only_returns_the_maps_feature_info_describes(name, out_indices, channels, reduction):
    model = vitattn.create_model(name, features_only=True, out_indices=out_indices)
    size = model.pretrained_cfg["input_size"][-1]
    maps = model(torch.randn(1, 3, size, size))
    assert model.feature_info.channels() == channels and model.feature_info.reduction() == reduction
    assert [m.shape[1] for m in maps] == channels and [size // m.shape[-1] for m in maps] == reduction
