"""The models leave eager PyTorch intact: ``torch.compile`` (inductor) and ONNX (dynamo exporter,
run by onnxruntime) give the eager outputs.

Small models keep the compile and export times to seconds on 2 cores; each check skips with the
reason when its toolchain (a C++ compiler for inductor, onnx / onnxruntime / onnxscript) is absent.
"""

from __future__ import annotations

import importlib.util

import pytest
import torch
from conftest import needs_cxx

import vitattn

TOL = 1e-4


def small_vit(**over) -> torch.nn.Module:
    """A 2-block ViT on 16x16 images: every part of the real model (class token, learned
    positions, fused qkv attention, MLP, final norm, head) at toy size."""
    torch.manual_seed(0)
    cfg = dict(img_size=16, patch_size=4, embed_dim=32, depth=2, num_heads=2, mlp_ratio=2.0, num_classes=10)
    return vitattn.ViT(**{**cfg, **over}).eval()


def small_cnn() -> torch.nn.Module:
    torch.manual_seed(0)
    model = vitattn.create_model("cnn_quick", num_classes=10).eval()
    with torch.no_grad():  # non-trivial BatchNorm statistics, so eval mode is actually exercised
        for m in model.modules():
            if isinstance(m, torch.nn.BatchNorm2d):
                m.running_mean.uniform_(-0.5, 0.5)
                m.running_var.uniform_(0.5, 2.0)
    return model


def assert_close(got: torch.Tensor, want: torch.Tensor, what: str) -> None:
    assert got.shape == want.shape, f"{what}: shape {tuple(got.shape)}, expected {tuple(want.shape)}"
    err = (got - want).abs().max().item()
    assert err <= TOL, f"{what}: max |difference| {err:.3g} from eager, expected <= {TOL}"


# -- torch.compile ----------------------------------------------------------------------------------
@needs_cxx
@pytest.mark.parametrize("build", [small_vit, small_cnn], ids=["vit", "cnn"])
def test_compile_matches_eager(build):
    torch._dynamo.reset()
    model = build()
    x = torch.randn(4, 3, 16, 16) if build is small_vit else torch.randn(4, 3, 32, 32)
    with torch.no_grad():
        want = model(x)
        got = torch.compile(model)(x)
    assert_close(got, want, f"compiled {type(model).__name__}")


@needs_cxx
def test_compile_training_step_matches_eager():
    """Gradients through the compiled ViT equal the eager ones (the benchmark compiles training)."""
    torch._dynamo.reset()
    model = small_vit().train()
    x, y = torch.randn(4, 3, 16, 16), torch.tensor([0, 3, 5, 9])
    torch.nn.functional.cross_entropy(model(x), y).backward()
    want = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad(set_to_none=True)
    torch.nn.functional.cross_entropy(torch.compile(model)(x), y).backward()
    for n, p in model.named_parameters():
        assert p.grad is not None, f"compiled backward gave no gradient for {n}"
        assert_close(p.grad, want[n], f"gradient of {n}")


@pytest.mark.parametrize("over", [dict(pos_embed="sincos2d", class_token=False, global_pool="avg"),
                                  dict(use_rot_pos_emb=True)], ids=["sincos", "rope"])
def test_compiled_model_compiles_once(over):
    """Fixed position tables are cached outside compiled graphs: a cache written inside one fails
    its guard at the next call and recompiles the model, which cost the GPU check's compiled run a
    quarter of its speed. Dynamo's own backend: the guards are what is checked, not the kernels."""
    torch._dynamo.reset()
    x = torch.randn(4, 3, 16, 16)
    small_vit(**over)(x)  # another instance's eager call: einops registers its tensor types once per process
    model = torch.compile(small_vit(**over).train(), backend="eager")
    with torch._dynamo.config.patch(error_on_recompile=True):
        for _ in range(3):
            model(x).sum().backward()


# -- ONNX -------------------------------------------------------------------------------------------
def _need_onnx() -> None:
    missing = [m for m in ("onnx", "onnxruntime", "onnxscript") if importlib.util.find_spec(m) is None]
    if missing:
        pytest.skip(f"ONNX export check needs {', '.join(missing)}")


@pytest.mark.parametrize("build", [small_vit, small_cnn], ids=["vit", "cnn"])
def test_onnx_dynamo_export_runs_in_onnxruntime(build, tmp_path):
    _need_onnx()
    import onnxruntime as ort

    model = build()
    x = torch.randn(2, 3, 16, 16) if build is small_vit else torch.randn(2, 3, 32, 32)
    path = tmp_path / "model.onnx"
    torch.onnx.export(model, (x,), str(path), dynamo=True, input_names=["images"], output_names=["logits"])
    sess = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    x2 = torch.randn_like(x)  # not the tracing input: the graph must not have baked it in
    for inp in (x, x2):
        (got,) = sess.run(None, {"images": inp.numpy()})
        with torch.no_grad():
            want = model(inp)
        assert_close(torch.from_numpy(got), want, f"onnxruntime {type(model).__name__}")
