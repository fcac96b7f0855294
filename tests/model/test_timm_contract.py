"""The contract timm's own generic model tests hold every timm model to, checked on every preset
and its ``features_only`` form: forward and backward, the ``default_cfg`` fields and the heads
they describe, ``feature_info``, ``forward_intermediates``, and tracing by torch.fx (torchvision's
``create_feature_extractor``) and ``torch.export``. Our tests, in our words; timm's
``tests/test_models.py`` itself was run against these presets as well (docs/api.md)."""

from __future__ import annotations

import math

import pytest
import torch

import vitattn

PRESETS = vitattn.list_models()
# the fine-tuning families' presets (ViT-S at 518 px, ViT-B at 224) keep every option here with two
# blocks and, for DINOv2, a smaller image: the contract is the same, the suite minutes are not; timm's
# own model tests ran on them whole (docs/api.md)
SHRUNK = {name: dict(depth=2, **({"img_size": 112} if "dinov2" in name else {}))
          for name in vitattn.registry.TIMM_TWINS if name not in ("vit_tiny_patch16_224", "vit_small_patch16_224",
                                                                 "vit_base_patch16_224")}


def build(name: str, **kw):
    return vitattn.create_model(name, **{**SHRUNK.get(name, {}), **kw})
SPATIAL = ("cnn", "bof")  # families whose features are maps (B, C, h, w); the ViT's are tokens (B, N, D)


def family(name: str) -> str:
    return vitattn.registry.PRESETS[name][0]


def images(model, batch: int = 2) -> torch.Tensor:
    return torch.randn(batch, *model.pretrained_cfg["input_size"], generator=torch.Generator().manual_seed(0))


@pytest.fixture(autouse=True)
def seeded():
    torch.manual_seed(0)


@pytest.mark.parametrize("name", PRESETS)
def test_forward_and_backward_reach_every_parameter(name):
    model = build(name, num_classes=7).train()
    out = model(images(model))
    assert out.shape == (2, 7) and not out.isnan().any()
    out.mean().backward()
    missing = [n for n, p in model.named_parameters() if p.grad is None]
    assert not missing, f"no gradient for {missing}"
    assert all(not p.requires_grad for p in model.buffers())  # what does not learn is a buffer


@pytest.mark.parametrize("name", PRESETS)
def test_default_cfg_heads_and_names(name):
    headless = vitattn.get_config(name).num_classes == 0  # a features-only preset (DINOv2, SigLIP) given a head
    model = build(name, **({"num_classes": 10} if headless else {})).eval()
    cfg = model.default_cfg
    assert model.num_classes == cfg["num_classes"] > 0 and model.num_features > 0 and model.head_hidden_size > 0
    x = images(model, 1)
    with torch.no_grad():
        feats = model.forward_features(x)
        pre = model.forward_head(feats, pre_logits=True)
        assert feats.shape[1 if family(name) in SPATIAL else -1] == model.num_features
        assert pre.shape == (1, model.head_hidden_size)
        if family(name) in SPATIAL:
            assert tuple(feats.shape[-2:]) == tuple(cfg["pool_size"])
        model.reset_classifier(0)
        assert model.num_classes == 0 and model(x).shape == pre.shape
        model.reset_classifier(0, "")
        unpooled = model(x)
        assert unpooled.shape == feats.shape
        built = build(name, num_classes=0, global_pool="").eval()
        assert built(x).shape == feats.shape
    state = build(name, **({"num_classes": 10} if headless else {})).state_dict()
    assert cfg["classifier"] + ".weight" in state and cfg["first_conv"] + ".weight" in state


@pytest.mark.parametrize("name", PRESETS)
def test_pretrained_cfg_gives_a_correct_eval_transform_through_timm(name):
    from timm.data import create_transform, resolve_data_config

    model = build(name)
    cfg = resolve_data_config({}, model=model)
    assert cfg["input_size"] == model.pretrained_cfg["input_size"]
    assert cfg["mean"] == tuple(model.pretrained_cfg["mean"]) and cfg["std"] == tuple(model.pretrained_cfg["std"])
    from PIL import Image

    image = Image.new("RGB", (3 * cfg["input_size"][2] // 2, cfg["input_size"][1] + 7), (128, 64, 32))
    x = create_transform(**cfg)(image)
    assert tuple(x.shape) == cfg["input_size"]
    expect = (torch.tensor([128, 64, 32]) / 255 - torch.tensor(cfg["mean"])) / torch.tensor(cfg["std"])
    torch.testing.assert_close(x[:, 0, 0], expect.float(), atol=0.02, rtol=0)
    # a learned position table fits one grid: timm's tools must not feed another size
    learned = family(name) == "vit" and model.config.pos_embed == "learn"
    assert model.pretrained_cfg.get("fixed_input_size", False) == learned


@pytest.mark.parametrize("name", PRESETS)
@pytest.mark.parametrize("features_only", [False, True], ids=["plain", "features_only"])
def test_feature_info_describes_the_maps(name, features_only):
    from timm.models import FeatureInfo

    model = build(name, features_only=features_only).eval()
    info = model.feature_info if features_only else FeatureInfo(model.feature_info, len(model.feature_info))
    x = images(model, 1)
    with torch.no_grad():
        maps = model(x) if features_only else model.forward_intermediates(x, intermediates_only=True)
    assert features_only or len(info.channels()) == len(model.feature_info)
    assert len(maps) == len(info.channels()) >= 2
    for m, chans, r in zip(maps, info.channels(), info.reduction()):
        assert m.shape[:2] == (1, chans) and not m.isnan().any()
        assert m.shape[2] <= math.ceil(x.shape[2] / r) + 1 and m.shape[3] <= math.ceil(x.shape[3] / r) + 1
    if features_only:
        assert model.default_cfg is model.pretrained_cfg


@pytest.mark.parametrize("name", PRESETS)
def test_forward_intermediates_ends_in_forward_features_with_and_without_checkpointing(name):
    model = build(name).eval()
    x = images(model, 1)
    with torch.no_grad():
        ref = model.forward_features(x)
        final, _ = model.forward_intermediates(x)
        torch.testing.assert_close(final, ref, rtol=0, atol=0)
    if family(name) == "bof":
        with pytest.raises(RuntimeError, match="nothing to checkpoint"):
            model.set_grad_checkpointing()
        return
    model.set_grad_checkpointing()
    again, _ = model.forward_intermediates(x.requires_grad_())  # with grad: checkpointing is on
    torch.testing.assert_close(again, ref, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(model(x), model.forward_head(ref), rtol=1e-5, atol=1e-5)


def _last_node(model) -> str:
    from torchvision.models.feature_extraction import get_graph_node_names

    return get_graph_node_names(model)[1][-1]


@pytest.mark.parametrize("name", PRESETS)
def test_torch_fx_traces_every_preset_equal_to_eager_forward_and_backward(name):
    from torchvision.models.feature_extraction import create_feature_extractor

    model = build(name, num_classes=7)
    x = images(model)
    traced = create_feature_extractor(model, return_nodes={_last_node(model): "out"})
    model.eval(), traced.eval()
    # the trace runs the whole last block, as forward_features does; eager forward's class-token
    # shortcut gives the same logits up to rounding (tests/model/test_vit.py)
    whole = model.forward_head(model.forward_features(x)) if family(name) == "vit" else model(x)
    with torch.no_grad():
        assert torch.equal(traced(x)["out"], whole)
        torch.testing.assert_close(traced(x)["out"], model(x), rtol=1e-5, atol=1e-6)
    model.train(), traced.train()
    torch.manual_seed(1)
    traced(x)["out"].square().mean().backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters()}  # traced shares the parameters
    model.zero_grad()
    torch.manual_seed(1)
    (model.forward_head(model.forward_features(x)) if family(name) == "vit" else model(x)).square().mean().backward()
    for n, p in model.named_parameters():
        torch.testing.assert_close(grads[n], p.grad, rtol=1e-5, atol=1e-7, msg=n)


@pytest.mark.parametrize("name,node", [("vit_quick", "blocks.3"), ("cnn_quick", "stages.1")])
def test_torchvision_feature_extraction_takes_a_block_or_a_stage(name, node):
    from torchvision.models.feature_extraction import create_feature_extractor

    model = build(name).eval()
    x = images(model)
    feats = create_feature_extractor(model, return_nodes={node: "f"})(x)["f"]
    with torch.no_grad():
        expect = model.forward_intermediates(x, indices=[int(node.split(".")[1])], intermediates_only=True,
                                             **({"output_fmt": "NLC"} if name.startswith("vit") else {}))[0]
    if name.startswith("vit"):  # the block's tokens, class token first
        expect = torch.cat([feats[:, :1], expect], dim=1)
    torch.testing.assert_close(feats, expect, rtol=0, atol=0)


@pytest.mark.parametrize("name", ["vit_quick", "vit_longrange", "cnn_quick", "cnn_cifar10", "bof_longrange"])
def test_torch_export_with_a_dynamic_batch_matches_eager(name):
    model = build(name).eval()
    x = images(model, 3)
    batch = torch.export.Dim("batch", min=2, max=64)
    exported = torch.export.export(model, (x,), dynamic_shapes=({0: batch},))
    for n in (3, 5):
        y = images(model, n)
        with torch.no_grad():
            torch.testing.assert_close(exported.module()(y), model(y), rtol=1e-5, atol=1e-5)


def test_vitdet_backbone_checkpoints_its_blocks_with_equal_gradients():
    from vitattn.vitdet import ViTDetBackbone

    def saved_bytes_and_grads(checkpointing: bool) -> tuple[int, dict]:
        torch.manual_seed(0)
        backbone = ViTDetBackbone(vitattn.create_model("vit_quick", depth=4), out_channels=32)
        backbone.vit.set_grad_checkpointing(checkpointing)
        saved = []

        def pack(t):
            saved.append(t.numel() * t.element_size())
            return t

        x = torch.randn(2, 3, 64, 64, generator=torch.Generator().manual_seed(0))
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            loss = sum(f.square().mean() for f in backbone(x).values())
        loss.backward()
        return sum(saved), {n: p.grad for n, p in backbone.named_parameters()}

    plain, grads = saved_bytes_and_grads(False)
    kept, grads_ckpt = saved_bytes_and_grads(True)
    assert kept < plain / 2
    for n, g in grads.items():
        torch.testing.assert_close(grads_ckpt[n], g, rtol=1e-5, atol=1e-6, msg=n)


def test_every_forward_method_goes_through_the_one_block_loop(monkeypatch):
    model = vitattn.create_model("vit_quick", depth=3).eval()
    calls = []
    run_blocks = model.run_blocks

    def counted(*args, **kwargs):
        calls.append(kwargs)
        return run_blocks(*args, **kwargs)

    monkeypatch.setattr(model, "run_blocks", counted)
    x = images(model, 1)
    model(x), model.forward_features(x), model.forward_intermediates(x), model.get_attention_maps(x)
    assert len(calls) == 4


def _pools(name: str) -> list[str]:
    """Every ``global_pool`` a preset can be built with (a ViT without a class token has no 'token')."""
    if family(name) != "vit":
        return [vitattn.get_config(name).global_pool]
    token = vitattn.get_config(name).class_token
    return [p for p in vitattn.vit.GLOBAL_POOLS if p != "token" or token]


HOOKED = [(n, p) for n in PRESETS if family(n) == "vit" for p in _pools(n)]


@pytest.mark.parametrize("name, pool", HOOKED, ids=[f"{n}-{p or 'none'}" for n, p in HOOKED])
def test_hooks_and_fx_see_every_block_whole(name, pool):
    """A forward hook on each block fires once per forward with the block's whole token sequence,
    and FX (torchvision's create_feature_extractor) returns for each block what its hook saw, for
    every preset and every read-out: the last block is a block like the others."""
    from torchvision.models.feature_extraction import create_feature_extractor

    model = build(name, global_pool=pool, num_classes=0 if pool == "" else 5).eval()
    x = images(model)
    seen: dict[str, list[torch.Tensor]] = {}
    handles = [m.register_forward_hook(lambda mod, args, out, k=k: seen.setdefault(k, []).append(out))
               for k, m in [*((f"blocks.{i}", b) for i, b in enumerate(model.blocks)), ("norm", model.norm)]]
    with torch.no_grad():
        logits = model(x)
    tokens = model.num_prefix_tokens + math.prod(model.grid_size)
    assert sorted(seen) == sorted([f"blocks.{i}" for i in range(len(model.blocks))] + ["norm"])
    for k, outs in seen.items():
        assert len(outs) == 1 and outs[0].shape == (2, tokens, model.embed_dim), (k, [o.shape for o in outs])
    for h in handles:
        h.remove()
    nodes = {f"blocks.{i}": f"b{i}" for i in range(len(model.blocks))}
    with torch.no_grad():
        feats = create_feature_extractor(model, return_nodes={**nodes, "norm": "norm"})(x)
        torch.testing.assert_close(model(x), logits, rtol=1e-5, atol=1e-6)  # the hooks gone: the same logits
    for k, v in nodes.items():
        torch.testing.assert_close(feats[v], seen[k][0], rtol=1e-5, atol=1e-6, msg=k)


@pytest.mark.parametrize("pool", _pools("vit_quick"), ids=lambda p: p or "none")
def test_export_and_compile_see_every_block_whole(pool):
    """torch.export's modules (unflattened) and a compiled model's hooks see the last block's whole
    sequence, and both give forward's logits."""
    model = vitattn.create_model("vit_quick", global_pool=pool, num_classes=0 if pool == "" else 5).eval()
    x, last = images(model), len(model.blocks) - 1
    tokens = (2, model.num_prefix_tokens + math.prod(model.grid_size), model.embed_dim)
    with torch.no_grad():
        want = model(x)
    unflat = torch.export.unflatten(torch.export.export(model, (x,)))
    seen = []
    unflat.blocks.get_submodule(str(last)).register_forward_hook(lambda m, a, out: seen.append(out.shape))
    torch.testing.assert_close(unflat(x), want, rtol=1e-5, atol=1e-6)
    model.blocks[last].register_forward_hook(lambda m, a, out: seen.append(out.shape))
    torch._dynamo.reset()
    with torch.no_grad():
        torch.testing.assert_close(torch.compile(model, backend="eager")(x), want, rtol=1e-5, atol=1e-6)
    assert seen == [tokens, tokens]


@pytest.mark.parametrize("name", [n for n in PRESETS if family(n) == "vit" and build(n).global_pool == "token"])
def test_eval_forward_is_bitwise_what_fx_and_forward_features_give(name):
    """In eval, forward computes exactly what forward_head(forward_features(x)) and an FX trace
    compute, bit for bit (timm's test_model_forward_fx asks ==): the class-token shortcut, whose
    smaller products round differently, is a training-step saving only."""
    from torchvision.models.feature_extraction import create_feature_extractor

    model = build(name).eval()
    x = images(model, batch=1)
    with torch.inference_mode():
        out = model(x)
        assert torch.equal(out, model.forward_head(model.forward_features(x)))
        traced = create_feature_extractor(model, return_nodes={"head": "head"})
        assert torch.equal(out, traced(x)["head"])
