"""train_cifar.py: main(config) end to end on tiny generated data, resume, interrupts, NaN, DDP."""

from __future__ import annotations

import copy
import dataclasses
import json
import math
import os
import re
import signal
import socket
import subprocess
import sys
import time
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from test_data import write_batches, write_folder, write_tar

import train_cifar as T
from vitattn.helpers import flops_per_image
from vitattn.training import classify, runtime
from vitattn.training.classify import evaluate
from vitattn.training.data import DataError, Normalize
from vitattn.training.optim import get_lr, param_groups
from vitattn.training.recipes import RECIPES
from vitattn.training.runfolder import save_atomic
from vitattn.training.runtime import Dist

ROOT = Path(__file__).resolve().parents[1]

SCORE_KEYS = ("model", "epoch", "step", "train_loss", "train_acc", "test_loss", "test_acc", "lr")


def tiny(tmp_path: Path, data_dir, **kw) -> T.Config:
    base = dict(data_dir=str(data_dir), out=str(tmp_path / "run"), model="cnn", cnn_preset="cnn_quick",
                epochs=3, batch_size=12, lr=0.05, progress=False, plots=False)
    return T.Config(**{**base, **kw})


def metrics(out) -> list[dict]:
    return [json.loads(s) for s in (Path(out) / "metrics.jsonl").read_text().splitlines()]


def scores(rows: list[dict]) -> list[tuple]:
    """The parts of a metrics line that depend on the computation, not on the clock."""
    return [tuple(r[k] for k in SCORE_KEYS) for r in rows]


pytestmark = pytest.mark.usefixtures("one_thread")


# -- pure pieces -----------------------------------------------------------------------------
def test_lr_schedule_warms_up_then_decays_to_zero():
    for decay in ("cosine", "linear"):
        lrs = [get_lr(p / 100, 1.0, 0.1, decay) for p in range(101)]
        assert lrs[0] == 0 and lrs[10] == pytest.approx(1.0) and lrs[100] == pytest.approx(0.0, abs=1e-12)
        assert all(a <= b for a, b in zip(lrs[:10], lrs[1:11]))
        assert all(a >= b for a, b in zip(lrs[10:], lrs[11:]))
    assert get_lr(0.55, 2.0, 0.1, "cosine") == pytest.approx(1.0)  # half way through the cosine


def test_lr_schedule_can_start_and_end_above_zero():
    """airbench's triangle: 0.2 of the peak at the start, the peak at 23%, 0.07 of it at the end."""
    for decay in ("cosine", "linear"):
        lrs = [get_lr(p / 100, 1.0, 0.23, decay, warmup_lr=0.2, min_lr=0.07) for p in range(101)]
        assert lrs[0] == pytest.approx(0.2) and lrs[23] == pytest.approx(1.0) and lrs[100] == pytest.approx(0.07)
        assert min(lrs) == pytest.approx(0.07) and max(lrs) == pytest.approx(1.0)
    assert get_lr(0.115, 1.0, 0.23, "linear", warmup_lr=0.2) == pytest.approx(0.6)  # half way up the ramp
    assert get_lr(0.615, 1.0, 0.23, "linear", min_lr=0.1) == pytest.approx(0.55)  # half way down
    cfg = T.Config(model="cnn", momentum=0.85, warmup_lr=0.1, min_lr=0.05)
    r = cfg.recipe("cnn")
    assert (r.momentum, r.warmup_lr, r.min_lr) == (0.85, 0.1, 0.05)


def test_weight_decay_skips_biases_norms_and_position_tables():
    import vitattn

    m = vitattn.create_model("vit_quick")
    decay, no_decay = param_groups(m, 0.05)
    names = {id(p): n for n, p in m.named_parameters()}
    skipped = {names[id(p)] for p in no_decay["params"]}
    assert {"pos_embed", "cls_token", "blocks.0.norm1.weight", "head.bias"} <= skipped
    assert all(p.ndim >= 2 for p in decay["params"]) and no_decay["weight_decay"] == 0


def test_bias_lr_scale_speeds_up_only_the_parameters_without_decay():
    import vitattn
    from vitattn.training.optim import create_optimizer, set_lr

    m = vitattn.create_model("cnn_quick")
    for name in ("sgd", "adamw"):
        opt = create_optimizer(m, **replace(RECIPES["cnn"], optimizer=name, bias_lr_scale=64.0).optimizer_kwargs())
        set_lr(opt, 0.1)
        decay, no_decay = opt.param_groups
        assert decay["lr"] == pytest.approx(0.1) and no_decay["lr"] == pytest.approx(6.4)
        assert all(p.ndim == 1 for p in no_decay["params"]) and decay["weight_decay"] > 0 == no_decay["weight_decay"]
    vit = vitattn.create_model("vit_quick")
    opt = create_optimizer(vit, **replace(RECIPES["vit"], bias_lr_scale=3.0).optimizer_kwargs())  # Muon + AdamW
    set_lr(opt, 0.01)
    assert sorted(round(g["lr"], 6) for g in opt.param_groups) == [0.01, 0.01, 0.03]


def test_model_ema_is_the_closed_form_average_of_weights_and_buffers():
    from vitattn.training.optim import ModelEma, ema_decay_at

    torch.manual_seed(0)
    m = torch.nn.Sequential(torch.nn.Linear(3, 2), torch.nn.BatchNorm1d(2))
    ema = ModelEma(m, 0.9)
    expect_w, expect_mean = None, None
    for n in range(6):
        with torch.no_grad():
            m[0].weight.normal_()
        m(torch.randn(5, 3))  # moves the BatchNorm statistics
        ema.update_parameters(m)
        if n == 0:  # the first update copies
            expect_w, expect_mean = m[0].weight.detach().clone(), m[1].running_mean.clone()
        else:
            d = ema_decay_at(0.9, n)
            expect_w = d * expect_w + (1 - d) * m[0].weight.detach()
            expect_mean = d * expect_mean + (1 - d) * m[1].running_mean
        torch.testing.assert_close(ema.module[0].weight, expect_w)
        torch.testing.assert_close(ema.module[1].running_mean, expect_mean)
    assert ema.module[1].num_batches_tracked == m[1].num_batches_tracked == 6  # integers are copied
    assert [ema_decay_at(0.9, n) for n in (0, 8, 100)] == [0.1, 0.5, 0.9]  # fast at first, then the decay
    assert not torch.equal(ema.module[0].weight, m[0].weight)  # an average, not the last weights
    with pytest.raises(ValueError, match="in \\(0, 1\\)"):
        ModelEma(m, 1.0)


def _muon_steps(opt_cls, shapes, steps=3, **kw):
    torch.manual_seed(0)
    ps = [torch.nn.Parameter(torch.randn(*s)) for s in shapes]
    opt = opt_cls(ps, lr=0.02, weight_decay=0.1, **kw)
    for i in range(steps):
        torch.manual_seed(10 + i)
        for p in ps:
            p.grad = torch.randn_like(p)
        opt.step()
    return ps, opt


@pytest.mark.parametrize("adjust", [None, "match_rms_adamw", "spectral_unclamped"])
@pytest.mark.parametrize("nesterov", [True, False])
def test_muon_in_bfloat16_steps_exactly_as_torch_and_in_fp32_close_to_it(adjust, nesterov):
    from vitattn.training.optim import Muon
    shapes = [(48, 16), (16, 40), (24, 24)]  # tall, wide, square
    ref, ref_opt = _muon_steps(torch.optim.Muon, shapes, nesterov=nesterov, adjust_lr_fn=adjust)
    ours, ours_opt = _muon_steps(Muon, shapes, nesterov=nesterov, adjust_lr_fn=adjust, ns_dtype=torch.bfloat16)
    for a, b in zip(ref, ours):
        assert torch.equal(a, b)
    fast, fast_opt = _muon_steps(Muon, shapes, nesterov=nesterov, adjust_lr_fn=adjust)  # CPU: fp32
    torch.manual_seed(0)
    start = [torch.randn(*s) for s in shapes]  # as _muon_steps draws them
    for a, b, p0 in zip(ref, fast, start):
        assert not torch.equal(a, b)  # it is another dtype
        moved = (a - p0 * (1 - 0.02 * 0.1) ** 3).norm()  # the updates' part of the change
        assert (a - b).norm() < 0.05 * moved
    # the state is torch's: a checkpoint of one loads into the other
    torch.optim.Muon(fast, lr=0.02).load_state_dict(fast_opt.state_dict())


@pytest.mark.parametrize("ns_dtype", [torch.float32, torch.bfloat16])
def test_muon_batched_by_shape_equals_one_matrix_at_a_time(ns_dtype):
    """Matrices of one shape share one batched Newton-Schulz (a few kernels instead of a few dozen
    per matrix); each still steps exactly as if it were alone."""
    from vitattn.training.optim import Muon
    shapes = [(32, 16), (32, 16), (16, 48), (32, 16), (16, 48)]
    together, _ = _muon_steps(Muon, shapes, ns_dtype=ns_dtype, adjust_lr_fn="match_rms_adamw")
    torch.manual_seed(0)
    alone = [torch.nn.Parameter(torch.randn(*s)) for s in shapes]  # as _muon_steps draws them
    opts = [Muon([p], lr=0.02, weight_decay=0.1, ns_dtype=ns_dtype, adjust_lr_fn="match_rms_adamw") for p in alone]
    for i in range(3):
        torch.manual_seed(10 + i)
        for p in alone:
            p.grad = torch.randn_like(p)
        for o in opts:
            o.step()
    for a, b in zip(together, alone):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-6)


def test_orthogonalize_keeps_singular_vectors_and_pulls_singular_values_near_one():
    from vitattn.training.optim import orthogonalize
    g = torch.randn(64, 24, generator=torch.Generator().manual_seed(0)) @ torch.diag(torch.logspace(-2, 1, 24))
    u, _, vh = torch.linalg.svd(g, full_matrices=False)
    d = torch.optim.Muon([torch.nn.Parameter(g)]).defaults  # torch's coefficients, steps and eps
    x = orthogonalize(g, d["ns_coefficients"], d["ns_steps"], d["eps"], torch.float32)
    s = torch.diagonal(u.T @ x @ vh.T)  # x in g's singular bases
    assert torch.allclose(u.T @ x @ vh.T, torch.diag(s), atol=1e-4)  # the same singular vectors
    assert s[:16].min() > 0.5 and s.max() < 1.3  # all but the ~1e-2-scaled directions lifted near 1
    assert torch.linalg.matrix_norm(g, 2) > 1000 * torch.linalg.matrix_norm(g, -2)  # while g spans 3 decades


def test_muon_takes_the_block_matrices_adamw_the_rest_and_the_chain_resumes_exactly():
    import vitattn
    from vitattn.training.optim import Muon, OptimizerChain, create_optimizer

    def make():
        torch.manual_seed(0)
        m = vitattn.create_model("vit_quick", depth=2, embed_dim=32, num_heads=2)
        return m, create_optimizer(m, **replace(RECIPES["vit"], optimizer="muon", lr=3e-3).optimizer_kwargs())

    m, opt = make()
    assert isinstance(opt, OptimizerChain) and isinstance(opt.optimizers[0], Muon)
    names = {id(p): n for n, p in m.named_parameters()}
    muon = {names[id(p)] for g in opt.optimizers[0].param_groups for p in g["params"]}
    adamw = [names[id(p)] for g in opt.optimizers[1].param_groups for p in g["params"]]
    assert muon == {n for n, p in m.named_parameters() if n.startswith("blocks.") and p.ndim == 2}
    assert {"blocks.0.attn.qkv.weight", "blocks.1.mlp.fc2.weight"} <= muon and "head.weight" in adamw
    assert len(muon) + len(adamw) == len(names) and not muon & set(adamw)  # each parameter once
    torch.manual_seed(1)
    x, y = torch.randn(16, 3, 32, 32), torch.randint(0, 10, (16,))

    def steps(model, o, n):
        losses = []
        for _ in range(n):
            loss = torch.nn.functional.cross_entropy(model(x), y)
            o.zero_grad(set_to_none=True)
            loss.backward()
            o.step()
            losses.append(loss.item())
        return losses

    losses = steps(m, opt, 20)
    assert losses[-1] < 0.6 * losses[0]  # it learns the batch
    weights, state = copy.deepcopy(m.state_dict()), copy.deepcopy(opt.state_dict())  # a checkpoint mid-run
    steps(m, opt, 3)
    m2, opt2 = make()
    m2.load_state_dict(weights)
    opt2.load_state_dict(state)
    steps(m2, opt2, 3)
    for (n, a), b in zip(m.state_dict().items(), m2.state_dict().values()):
        assert torch.equal(a, b), n
    with pytest.raises(ValueError, match="state of 2 chained optimisers"):
        opt2.load_state_dict({"chain": state["chain"][:1]})
    with pytest.raises(ValueError, match="needs 2-D weights in blocks"):
        create_optimizer(vitattn.create_model("cnn_quick"), "muon", lr=0.1, weight_decay=0.0)


def test_test_time_augmentation_views_and_weights():
    torch.manual_seed(0)
    x = torch.randint(0, 256, (40, 3, 8, 8), dtype=torch.uint8)
    y = torch.randint(0, 4, (40,))
    norm = Normalize((0.5, 0.5, 0.5), (0.25, 0.25, 0.25))
    # a model that ignores its input: every kind of averaging gives the plain accuracy
    const = torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(192, 4))
    with torch.no_grad():
        const[1].weight.zero_()
    r = evaluate(const, norm, x, y, batch_size=16, dd=Dist(), tta=True)
    assert r["acc"] == r["acc_tta"] == r["acc_tta_shift"]
    # a model that reads every pixel: the counts match the views written out by hand
    torch.manual_seed(1)
    model = torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(192, 4)).eval()
    r = evaluate(model, norm, x, y, batch_size=16, tta=True)
    with torch.no_grad():
        xb = norm(x)
        prob = lambda v: model(v).softmax(1)  # noqa: E731
        pad = torch.nn.functional.pad(xb, (1, 1, 1, 1), mode="reflect")
        up_left, down_right = pad[..., :8, :8], pad[..., 2:, 2:]
        pair = (prob(xb) + prob(xb.flip(3))) / 2
        four = (prob(up_left) + prob(up_left.flip(3)) + prob(down_right) + prob(down_right.flip(3))) / 4
    assert r["acc"] == pytest.approx(float((model(xb).argmax(1) == y).float().mean()))
    assert r["acc_tta"] == pytest.approx(float((pair.argmax(1) == y).float().mean()))
    assert r["acc_tta_shift"] == pytest.approx(float(((pair + four).argmax(1) == y).float().mean()))
    assert len({r["acc"], r["acc_tta"], r["acc_tta_shift"]}) > 1  # the views do differ here


def test_flops_per_image_counts_every_matrix_product():
    import vitattn

    m = vitattn.create_model("vit_quick", embed_dim=192, num_heads=3)  # D 192, depth 6, mlp 2, 64 patches + cls
    d, t, depth = 192, 65, 6
    per_block = 2 * t * (3 * d * d + d * d + 2 * 2 * d * d) + 4 * t * t * d  # qkv, proj, mlp; QK^T and AV
    # the last block runs for the class token only: k, v of every token; q, attention, proj, mlp of one
    last_block = 2 * t * (2 * d * d) + 2 * (d * d + d * d + 2 * 2 * d * d) + 4 * t * d
    want = 2 * (3 * 4 * 4) * d * 64 + (depth - 1) * per_block + last_block + 2 * d * 10  # embed, blocks, head
    assert flops_per_image(m, (32, 32)) == want


def test_cli_help_and_preset_routing(capsys):
    with pytest.raises(SystemExit) as e:
        T.parse_args(["--help"])
    assert e.value.code == 0 and "--time-budget" in capsys.readouterr().out
    cfg = T.parse_args(["--vit-preset", "vit_longrange", "--cnn-preset", "cnn_quick", "--bf16"])
    assert (cfg.vit_preset, cfg.cnn_preset, cfg.bf16) == ("vit_longrange", "cnn_quick", True)
    assert (cfg.amp, cfg.autocast_dtype()) == (True, torch.bfloat16)  # --bf16 is --amp --amp-dtype bfloat16
    assert T.parse_args(["--amp", "--amp-dtype", "float16"]).autocast_dtype() == torch.float16
    assert T.parse_args([]).autocast_dtype() is None
    with pytest.raises(SystemExit):
        T.parse_args(["--vit-preset", "cnn_longrange"])  # a CNN preset where a ViT one belongs


# -- end to end ------------------------------------------------------------------------------
def test_both_models_train_and_every_output_appears(tmp_path, folder):
    cfg = tiny(tmp_path, folder, model="both", epochs=3, plots=True, lr=None,
               vit_preset="vit_quick", batch_size=12)
    s = T.main(cfg)
    out = Path(cfg.out)
    assert s["status"] == "ok"
    for name in ("config.json", "metrics.jsonl", "summary.json", "report.md", "examples.png", "curves.png",
                 "context.png", "erf.png", "attention.png", "checkpoints/vit.pt", "checkpoints/cnn.pt",
                 "checkpoints/vit.safetensors", "checkpoints/cnn.safetensors"):
        assert (out / name).is_file(), name
    assert not list(out.rglob("*.tmp*"))
    rows = metrics(out)
    for fam in ("vit", "cnn"):
        mine = [r for r in rows if r["model"] == fam]
        assert [r["epoch"] for r in mine] == [1, 2, 3]
        assert mine[-1]["train_loss"] < mine[0]["train_loss"]  # it learns
        r = s["models"][fam]
        assert r["final_acc"] > 0.6 and r["params"] > 0 and r["flops_per_image"] > 0
    summary = json.loads((out / "summary.json").read_text())
    assert summary["environment"]["torch"] == torch.__version__ and "git_commit" in summary["environment"]
    mad = torch.tensor(summary["models"]["vit"]["attention_distance_px"])
    assert mad.shape == (6, 4) and (mad > 0).all() and (mad < 32 * math.sqrt(2)).all()
    ent = torch.tensor(summary["models"]["vit"]["attention_entropy_nats"])
    assert ent.shape == (6, 4) and (ent >= 0).all() and (ent <= math.log(64) + 1e-4).all()
    assert len(summary["models"]["cnn"]["erf_radius_px"]) == 3
    ck = torch.load(out / "checkpoints" / "vit.pt", weights_only=True)  # no pickled code
    assert ck["state"]["done"] and ck["result"]["final_acc"] == s["models"]["vit"]["final_acc"]
    from safetensors.torch import load_file

    sd = load_file(str(out / "checkpoints" / "cnn.safetensors"))
    torch.testing.assert_close(sd["head.weight"], s["modules"]["cnn"].head.weight)
    report = (out / "report.md").read_text()
    assert "| ViT |" in report and "| CNN |" in report and "![" in report and "attention entropy (nats)" in report


@pytest.mark.parametrize("layout", ["tar", "batches"])
def test_the_other_layouts_train(tmp_path, layout):
    src = write_tar(tmp_path / "c.tar.gz") if layout == "tar" else write_batches(tmp_path / "b")
    s = T.main(tiny(tmp_path, src))
    rows = metrics(s["out"])
    assert s["status"] == "ok" and len(rows) == 3 and rows[-1]["train_loss"] < rows[0]["train_loss"]


def test_a_whitening_stem_is_set_from_the_training_images(tmp_path, folder):
    import vitattn

    cfg = tiny(tmp_path, folder, cnn_preset="cnn_cifar10", epochs=2)
    s = T.main(cfg)
    rows = metrics(s["out"])
    assert s["status"] == "ok" and rows[-1]["train_loss"] < rows[0]["train_loss"]
    ds = classify.load_dataset(cfg)
    want = vitattn.whitening_filters(ds.norm(ds.data.train_x[:5000]))
    ck = torch.load(Path(s["out"]) / "checkpoints" / "cnn.pt", weights_only=True)
    torch.testing.assert_close(ck["model"]["stem.0.weight"], want)  # set from data, then frozen
    assert ck["model"]["stem.0.bias"].abs().sum() > 0  # the bias learns


def test_long_range_reports_accuracy_against_distance(tmp_path):
    s = T.main(tiny(tmp_path, "unused", dataset="long-range", long_range_train=96, long_range_test=64, epochs=1,
                    model="both", vit_preset="vit_quick"))
    for fam in ("vit", "cnn"):
        b = s["models"][fam]["accuracy_by_distance"]
        assert sum(b["count"]) == 64 and len(b["accuracy"]) == len(b["edges"]) - 1
    assert "Accuracy against mark distance" in (Path(s["out"]) / "report.md").read_text()


@pytest.mark.parametrize("task, classes, edges", [
    ("pointing", ["away", "towards"], 7), ("alignment", ["same row", "same column"], 3)])
def test_the_relation_tasks_run_end_to_end(tmp_path, task, classes, edges):
    s = T.main(tiny(tmp_path, "unused", dataset="long-range", long_range_task=task, long_range_train=96,
                    long_range_test=64, epochs=1, cnn_preset="bof_longrange"))  # the CNN slot takes the control
    assert s["classes"] == classes and task in s["data_source"]
    assert s["models"]["cnn"]["preset"] == "bof_longrange" and len(s["models"]["cnn"]["erf_radius_px"]) == 2
    by = s["models"]["cnn"]["accuracy_by_distance"]
    assert sum(by["count"]) == 64 and len(by["accuracy"]) == edges


def test_model_kwargs_change_the_preset_and_are_recorded(tmp_path):
    s = T.main(tiny(tmp_path, "unused", dataset="long-range", long_range_train=96, long_range_test=64, epochs=1,
                    model="both", vit_preset="vit_quick",
                    vit_kwargs='{"depth": 1, "pos_embed": "sincos2d"}', cnn_kwargs='{"widths": [16, 32]}'))
    vit, cnn = s["modules"]["vit"], s["modules"]["cnn"]
    assert len(vit.blocks) == 1 and vit.config.pos_embed == "sincos2d" and vit.num_classes == 2
    assert len(cnn.stages) == 2 and len(s["models"]["cnn"]["erf_radius_px"]) == 2  # one per stage
    saved = json.loads((Path(s["out"]) / "config.json").read_text())
    assert json.loads(saved["vit_kwargs"]) == {"depth": 1, "pos_embed": "sincos2d"}
    assert "plain background" in s["data_source"]


def test_an_ema_run_keeps_and_reports_the_averaged_weights(tmp_path, folder):
    s = T.main(tiny(tmp_path, folder, epochs=2, model_ema_decay=0.5))
    r, rows = s["models"]["cnn"], metrics(s["out"])
    assert r["recipe"]["model_ema_decay"] == 0.5 and 0 <= r["final_acc_no_ema"] <= 1
    assert all("test_acc_no_ema" in row and "test_loss_no_ema" in row for row in rows)
    assert rows[-1]["test_acc"] == r["final_acc"]  # the reported figure is the EMA's
    assert r["final_acc_no_ema"] == rows[-1]["test_acc_no_ema"]  # the raw weights' last evaluation
    assert f"(EMA; raw weights {r['final_acc_no_ema']:.4f})" in (Path(s["out"]) / "report.md").read_text()
    from safetensors.torch import load_file

    ck = torch.load(Path(s["out"]) / "checkpoints" / "cnn.pt", weights_only=True)
    kept = load_file(str(Path(s["out"]) / "checkpoints" / "cnn.safetensors"))
    for k, v in ck["ema"].items():  # the saved model is the average, not the last step's weights
        if k.startswith("module.") and v.is_floating_point():
            torch.testing.assert_close(kept[k.removeprefix("module.")], v.to(kept[k.removeprefix("module.")].dtype))


# -- nothing lost ----------------------------------------------------------------------------
@pytest.mark.parametrize("family, kw, at", [("cnn", {}, 10), ("vit", dict(model="vit", optimizer="muon", lr=1e-3), 10),
                                            ("cnn", dict(model_ema_decay=0.5, bias_lr_scale=4.0), 12),
                                            ("cnn", dict(padding_mode="reflect", momentum=0.85,
                                                         warmup_lr=0.01, min_lr=0.01), 10),
                                            ("vit", dict(model="vit", amp=True, amp_dtype="float16"), 10),
                                            ("cnn", dict(amp=True, amp_dtype="bfloat16"), 10)],
                         ids=["cnn-sgd", "vit-muon", "cnn-ema", "cnn-schedule", "vit-fp16", "cnn-bf16"])
def test_interrupted_and_resumed_equals_uninterrupted(tmp_path, folder, monkeypatch, family, kw, at):
    ref = T.main(tiny(tmp_path / "a", folder, epochs=3, **kw))
    calls = {"n": 0}
    cross_entropy = classify.F.cross_entropy

    def interrupt_in_epoch_3(*args, **kw):  # 3 training steps + 1 evaluation batch per epoch (2 with an EMA)
        calls["n"] += 1
        if calls["n"] == at:  # the second step of epoch 3 (0-based epoch 2)
            signal.raise_signal(signal.SIGINT)
        return cross_entropy(*args, **kw)

    monkeypatch.setattr(classify.F, "cross_entropy", interrupt_in_epoch_3)
    cfg = tiny(tmp_path / "b", folder, epochs=3, **kw)
    assert T.main(cfg)["status"] == "interrupted"
    ck = torch.load(Path(cfg.out) / "checkpoints" / f"{family}.pt", weights_only=True)
    assert (ck["state"]["epoch"], ck["state"]["step_in_epoch"]) == (2, 2)  # stops before the next step
    assert ("scaler" in ck) == (kw.get("amp_dtype") == "float16")  # fp16's loss scale resumes too
    monkeypatch.setattr(classify.F, "cross_entropy", cross_entropy)
    resumed = T.main(T.Config(resume=cfg.out, progress=False))
    assert resumed["status"] == "ok"
    assert scores(metrics(cfg.out)) == scores(metrics(ref["out"]))
    assert resumed["models"][family]["final_acc"] == ref["models"][family]["final_acc"]
    for k, v in ref["modules"][family].state_dict().items():
        assert torch.equal(v, resumed["modules"][family].state_dict()[k]), k


@pytest.mark.parametrize("after_line", [False, True], ids=["during-the-evaluation", "after-its-line"])
def test_a_crash_at_an_epoch_s_evaluation_loses_no_line_and_writes_none_twice(tmp_path, folder, monkeypatch,
                                                                              after_line):
    """Each epoch is checkpointed before it is evaluated. A crash during the evaluation, or after
    its metrics line but before the checkpoint that follows, resumes to the evaluation: every
    line once, the metrics and weights of a run that never stopped."""
    from vitattn.training import loop, runfolder

    ref = T.main(tiny(tmp_path / "ref", folder, epochs=3))
    cfg = tiny(tmp_path / "run", folder, epochs=3)
    evaluate, append = classify.ClassifyTask.evaluate, runfolder.append_jsonl
    calls = {"n": 0}

    def crash_in_epoch_2(self, model):
        calls["n"] += 1
        if calls["n"] == 2 and not after_line:
            raise RuntimeError("the machine went away")
        return evaluate(self, model)

    def crash_after_epoch_2_line(path, row):
        append(path, row)
        if row.get("epoch") == 2.0:
            raise RuntimeError("the machine went away")

    monkeypatch.setattr(classify.ClassifyTask, "evaluate", crash_in_epoch_2)
    monkeypatch.setattr(loop.runfolder, "append_jsonl", crash_after_epoch_2_line if after_line else append)
    with pytest.raises(RuntimeError, match="went away"):
        T.main(cfg)
    ck = torch.load(Path(cfg.out) / "checkpoints" / "cnn.pt", weights_only=True)
    assert ck["state"]["eval_at"] == 2.0 and ck["state"]["epoch"] == 2
    monkeypatch.setattr(classify.ClassifyTask, "evaluate", evaluate)
    monkeypatch.setattr(loop.runfolder, "append_jsonl", append)
    resumed = T.main(T.Config(resume=cfg.out, progress=False))
    assert [r["epoch"] for r in metrics(cfg.out)] == [1.0, 2.0, 3.0]
    assert scores(metrics(cfg.out)) == scores(metrics(ref["out"]))
    for k, v in ref["modules"]["cnn"].state_dict().items():
        assert torch.equal(v, resumed["modules"]["cnn"].state_dict()[k]), k


@pytest.mark.parametrize("sig, code", [(signal.SIGINT, 130), (signal.SIGTERM, 143)], ids=["ctrl-c", "sigterm"])
def test_a_stop_signal_on_the_command_line_saves_and_exits_cleanly(tmp_path, folder, sig, code):
    """Ctrl-C, and SIGTERM as kill, schedulers and containers send it: a checkpoint, 128 + signal."""
    out = tmp_path / "run"
    cmd = [sys.executable, str(ROOT / "train_cifar.py"), "--data-dir", str(folder), "--out", str(out),
           "--model", "cnn", "--cnn-preset", "cnn_quick", "--epochs", "100000", "--batch-size", "12",
           "--no-progress", "--no-plots"]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env={**os.environ, "OMP_NUM_THREADS": "1"})
    deadline = time.time() + 60
    while not (out / "metrics.jsonl").exists() or not (out / "metrics.jsonl").read_text():
        assert time.time() < deadline and proc.poll() is None, proc.communicate()[0]
        time.sleep(0.05)
    proc.send_signal(sig)
    text = proc.communicate(timeout=60)[0]
    assert proc.returncode == code, text
    assert signal.Signals(sig).name in text and "--resume" in text and "Traceback" not in text
    ck = torch.load(out / "checkpoints" / "cnn.pt", weights_only=True)
    assert not ck["state"]["done"] and ck["state"]["global_step"] >= 3


def test_nan_loss_stops_with_a_message_and_keeps_the_last_good_checkpoint(tmp_path, folder, capsys):
    cfg = tiny(tmp_path, folder, epochs=1)
    T.main(cfg)
    ck_path = Path(cfg.out) / "checkpoints" / "cnn.pt"
    saved = json.loads((Path(cfg.out) / "config.json").read_text())
    # Continue for another epoch at an absurd learning rate: the loss blows up.
    (Path(cfg.out) / "config.json").write_text(json.dumps({**saved, "epochs": 2, "lr": 1e30}))
    ck = torch.load(ck_path, weights_only=True)
    ck["state"]["done"] = False
    ck["config"].update(epochs=2, lr=1e30)  # the checkpoint says the same (an edit of one alone is refused)
    save_atomic(ck, ck_path)
    good = ck_path.read_bytes()
    s = T.main(T.Config(resume=cfg.out, progress=False))
    assert s["status"] == "nan"
    assert "loss is nan" in capsys.readouterr().out.lower()
    assert ck_path.read_bytes() == good


def test_missing_data_says_how_to_supply_it_and_writes_nothing(tmp_path, capsys):
    cfg = tiny(tmp_path, tmp_path / "nowhere")
    with pytest.raises(DataError, match="--dataset long-range"):
        T.main(cfg)
    assert not Path(cfg.out).exists()
    assert T.command_line(["--data-dir", str(tmp_path / "nowhere"), "--out", cfg.out, "--no-progress"]) == 2
    assert "cifar-10-batches-py" in capsys.readouterr().err and not Path(cfg.out).exists()


def test_a_corrupt_image_is_named(tmp_path):
    root = write_folder(tmp_path / "f", n_train=2, n_test=1)
    (root / "test" / "frog" / "0002.png").write_bytes(b"\x89PNG broken")
    with pytest.raises(DataError, match="0002.png"):
        T.main(tiny(tmp_path, root))


# -- DistributedDataParallel -----------------------------------------------------------------
def _ddp_worker(rank: int, world: int, port: int, cfg: T.Config, out: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world),
                      LOCAL_RANK=str(rank))
    torch.set_num_threads(1)
    s = T.main(cfg)
    torch.save({"state": s["modules"]["cnn"].state_dict(), "status": s["status"]}, f"{out}/rank{rank}.pt")


def test_two_process_gloo_run_ends_with_equal_weights(tmp_path, folder):
    import torch.multiprocessing as mp

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    cfg = tiny(tmp_path, folder, epochs=2, batch_size=12)
    mp.spawn(_ddp_worker, args=(2, port, cfg, str(tmp_path)), nprocs=2, join=True)
    a, b = (torch.load(tmp_path / f"rank{r}.pt", weights_only=True) for r in range(2))
    assert a["status"] == b["status"] == "ok"
    ck = torch.load(Path(cfg.out) / "checkpoints" / "cnn.pt", weights_only=True)
    assert len(ck["rng"]) == 2 and not torch.equal(ck["rng"][0]["cpu"], ck["rng"][1]["cpu"])  # each rank's own
    for k, v in a["state"].items():  # DDP also broadcasts rank 0's BN statistics each step
        assert torch.equal(v, b["state"][k]), k
    rows = metrics(cfg.out)
    assert [r["epoch"] for r in rows] == [1, 2]  # rank 0 alone writes
    summary = json.loads((Path(cfg.out) / "summary.json").read_text())
    assert summary["world_size"] == 2 and summary["models"]["cnn"]["batch_per_rank"] == 6
    assert summary["models"]["cnn"]["ranks_agree"] is True


def test_compile_time_is_reported_apart_and_kept_off_the_budget(tmp_path, folder, monkeypatch):
    """--compile's first step compiles (minutes on a GPU for a large model): it is not training."""
    class SlowFirstCall(torch.nn.Module):
        def __init__(self, module):
            super().__init__()
            self.module, self.calls = module, 0

        def forward(self, x):
            self.calls += 1
            if self.calls == 1:
                time.sleep(1.5)  # what compiling costs, in miniature
            return self.module(x)

    monkeypatch.setattr(runtime.torch, "compile", SlowFirstCall)
    s = T.main(tiny(tmp_path, folder, epochs=1, compile=True))
    r = s["models"]["cnn"]
    assert r["compile_seconds"] >= 1.5 and r["train_seconds"] < 1.5


def test_configs_round_trip_through_json(tmp_path, folder):
    cfg = tiny(tmp_path, folder, time_budget=0.5, bf16=True)
    assert T.Config(**json.loads(json.dumps(dataclasses.asdict(cfg)))) == cfg
    assert replace(cfg, model="vit").models() == ["vit"]


def test_long_range_recipe_takes_small_batches_and_overrides_still_win():
    cnn = T.Config(dataset="long-range").recipe("cnn")
    assert (cnn.batch_size, cnn.lr) == (64, 0.1)
    vit = T.Config(dataset="long-range").recipe("vit")
    assert (vit.batch_size, vit.lr, vit.optimizer) == (64, 1e-3, "adamw")
    assert (cnn.epochs, vit.epochs) == (3, 6)
    for r in (cnn, vit):
        assert (r.translate, r.label_smoothing) == (0, 0.0)
    assert T.Config(dataset="long-range", batch_size=128).recipe("cnn").batch_size == 128
    assert T.Config().recipe("cnn").batch_size == RECIPES["cnn"].batch_size  # CIFAR-10 unchanged


# -- bad input: one message, exit 2, no traceback, nothing written -----------------------------
BAD_OPTIONS = [
    (["--optimizer", "muon"], "use it with --model vit, got --model both"),
    (["--batch-size", "0"], "--batch-size must be > 0"),
    (["--lr", "-1"], "--lr must be > 0"),
    (["--lr", "nan"], "--lr must be a finite number, got nan"),
    (["--epochs", "0"], "--epochs must be > 0"),
    (["--time-budget", "-3"], "--time-budget must be > 0"),
    (["--weight-decay", "-0.1"], "--weight-decay must be >= 0"),
    (["--label-smoothing", "1.5"], r"--label-smoothing must be in \[0, 1\)"),
    (["--warmup", "1"], r"--warmup must be in \[0, 1\)"),
    (["--momentum", "1"], r"--momentum must be in \[0, 1\)"),
    (["--min-lr", "-0.1"], "--min-lr must be >= 0"),
    (["--grad-clip", "-1"], "--grad-clip must be >= 0"),
    (["--translate", "-2"], "--translate must be >= 0"),
    (["--cutout", "-1"], "--cutout must be >= 0"),
    (["--model-ema-decay", "1"], r"--model-ema-decay must be in \[0, 1\)"),
    (["--bias-lr-scale", "0"], "--bias-lr-scale must be > 0"),
    (["--limit-train", "0"], "--limit-train must be > 0"),
    (["--limit-test", "-5"], "--limit-test must be > 0"),
    (["--long-range-train", "0"], "--long-range-train must be > 0"),
    (["--eval-batch-size", "0"], "--eval-batch-size must be > 0"),
    (["--batch-size", "2.5"], "invalid int value"),
    (["--vit-preset", "cnn_longrange"], "--vit-preset: cnn_longrange is a cnn preset, expected a vit one"),
    (["--cnn-preset", "nope"], "unknown preset 'nope'"),
    (["--resume", "runs/x", "--epochs", "3"], "drop .*--epochs"),
    (["--device", "tpu"], "not a device torch knows"),
    (["--seed", "-1"], "--seed must be >= 0"),
    (["--vit-kwargs", "{depth: 2}"], "--vit-kwargs must be a JSON object"),
    (["--vit-kwargs", "[2]"], "--vit-kwargs must be a JSON object of config fields"),
    (["--vit-kwargs", '{"dept": 2}'], r"--vit-kwargs: .*no option\(s\) \['dept'\]"),
    (["--cnn-kwargs", '{"stem": "fft"}'], "--cnn-kwargs: .*stem"),
    (["--long-range-background", "stars"], "invalid choice"),
    (["--seed", str(2**70)], r"--seed must be below 2\*\*32"),
    (["--bf16", "--amp", "--amp-dtype", "float16"], "--bf16 means --amp --amp-dtype bfloat16"),
    (["--amp-dtype", "float32"], "invalid choice"),
]


@pytest.mark.parametrize("argv,message", BAD_OPTIONS, ids=[" ".join(a) for a, _ in BAD_OPTIONS])
def test_bad_options_exit_2_with_one_message(tmp_path, capsys, argv, message):
    out = tmp_path / "run"
    try:
        code = T.command_line([*argv, "--out", str(out), "--no-progress", "--dataset", "long-range"])
    except SystemExit as e:  # argparse's usage errors
        code = e.code
    err = capsys.readouterr().err
    assert code == 2 and re.search(message, err), err
    assert "Traceback" not in err and not out.exists()


def run_cli(capsys, *argv) -> tuple[int, str]:
    extra = ["--no-progress"] if "--resume" in argv else ["--no-progress", "--no-plots"]
    code = T.command_line([str(a) for a in argv] + extra)
    io = capsys.readouterr()
    assert "Traceback" not in io.err + io.out
    return code, io.err


def test_bad_run_folders_are_refused_and_left_untouched(tmp_path, folder, capsys):
    code, err = run_cli(capsys, "--resume", tmp_path / "nowhere")
    assert code == 2 and "no such run folder" in err
    broken = tmp_path / "broken"
    broken.mkdir()
    code, err = run_cli(capsys, "--resume", broken)
    assert code == 2 and "no config.json" in err
    (broken / "config.json").write_text("{not json")
    code, err = run_cli(capsys, "--resume", broken)
    assert code == 2 and "not valid JSON" in err and (broken / "config.json").read_text() == "{not json"
    (broken / "config.json").write_text(json.dumps({"epochs": 1, "colour": "red"}))
    code, err = run_cli(capsys, "--resume", broken)
    assert code == 2 and "does not describe a run" in err
    # a finished run is not overwritten by a new one pointed at the same folder
    cfg = tiny(tmp_path, folder, epochs=1)
    T.main(cfg)
    before = {p: p.read_bytes() for p in Path(cfg.out).rglob("*") if p.is_file()}
    code, err = run_cli(capsys, "--data-dir", folder, "--out", cfg.out, "--model", "cnn")
    assert code == 2 and "is not a new or empty folder" in err and "--resume" in err
    assert {p: p.read_bytes() for p in Path(cfg.out).rglob("*") if p.is_file()} == before
    a_file = tmp_path / "notes.txt"
    a_file.write_text("keep me")
    code, err = run_cli(capsys, "--data-dir", folder, "--out", a_file, "--model", "cnn")
    assert code == 2 and "not a new or empty folder" in err and a_file.read_text() == "keep me"


def test_a_truncated_checkpoint_is_named_and_kept(tmp_path, folder, capsys):
    cfg = tiny(tmp_path, folder, epochs=1)
    T.main(cfg)
    ck = Path(cfg.out) / "checkpoints" / "cnn.pt"
    ck.write_bytes(ck.read_bytes()[:200])
    damaged = ck.read_bytes()
    code, err = run_cli(capsys, "--resume", cfg.out)
    assert code == 2 and str(ck) in err and "unreadable" in err
    assert ck.read_bytes() == damaged


def test_images_of_another_size_build_the_vit_for_them_or_are_refused_up_front(tmp_path, capsys):
    small = write_folder(tmp_path / "s16", n_train=4, n_test=2, size=16)
    s = T.main(tiny(tmp_path / "a", small, model="vit", vit_preset="vit_quick", epochs=1, batch_size=4))
    assert s["status"] == "ok" and s["modules"]["vit"].config.img_size == (16, 16)  # a 4x4 grid of 4-px patches
    odd = write_folder(tmp_path / "s30", n_train=4, n_test=2, size=30)
    out = tmp_path / "b" / "run"
    code, err = run_cli(capsys, "--data-dir", odd, "--out", out, "--model", "vit", "--epochs", 1)
    assert code == 2 and "30x30" in err and "4x4 patches" in err and not out.exists()


def test_a_global_batch_that_does_not_split_over_the_ranks_is_refused(tmp_path, folder):
    cfg = tiny(tmp_path, folder, batch_size=13)
    ds = classify.load_dataset(cfg)
    with pytest.raises(T.UsageError, match="--batch-size is the global batch and must split evenly over the 2 "
                                           "processes, got 13"):
        classify.build_model("cnn", cfg, ds, torch.device("cpu"), world=2)
    assert classify.build_model("cnn", replace(cfg, batch_size=12), ds, torch.device("cpu"), world=2) is not None


def test_fewer_images_than_one_batch_is_refused_up_front(tmp_path, folder, capsys):
    out = tmp_path / "run"
    code, err = run_cli(capsys, "--data-dir", folder, "--out", out, "--model", "cnn", "--batch-size", 64)
    assert code == 2 and "a batch of 64" in err and "36" in err and not out.exists()


def test_a_run_killed_mid_epoch_resumes_from_its_last_complete_checkpoint(tmp_path, folder):
    """SIGKILL (no handler runs) while training: --resume continues from the last checkpoint and
    ends where an uninterrupted run ends, each epoch logged once."""
    epochs = 100
    ref = T.main(tiny(tmp_path / "ref", folder, epochs=epochs))
    out = tmp_path / "run"
    cmd = [sys.executable, str(ROOT / "train_cifar.py"), "--data-dir", str(folder), "--out", str(out),
           "--model", "cnn", "--cnn-preset", "cnn_quick", "--epochs", str(epochs), "--batch-size", "12",
           "--lr", "0.05", "--no-progress", "--no-plots", "--context-images", "8"]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT, env=env)
    ck = out / "checkpoints" / "cnn.pt"
    deadline = time.time() + 120
    while not (ck.exists() and (out / "metrics.jsonl").exists() and len(metrics(out)) >= 3):
        assert time.time() < deadline and proc.poll() is None, "the run ended before it could be killed"
        time.sleep(0.02)
    proc.kill()
    proc.wait()
    state = torch.load(ck, weights_only=True)["state"]
    assert not state["done"] and state["epoch"] < epochs
    resumed = subprocess.run([sys.executable, str(ROOT / "train_cifar.py"), "--resume", str(out), "--no-progress"],
                             capture_output=True, text=True, env=env, timeout=300)
    assert resumed.returncode == 0, resumed.stdout + resumed.stderr
    assert "resuming at epoch" in resumed.stdout
    assert scores(metrics(out)) == scores(metrics(ref["out"]))
    assert json.loads((out / "summary.json").read_text())["models"]["cnn"]["final_acc"] == \
        ref["models"]["cnn"]["final_acc"]


def test_run_context_retakes_a_finished_runs_measures_and_rejects_other_folders(tmp_path, folder):
    s = T.main(tiny(tmp_path, folder, model="vit", vit_preset="vit_quick", epochs=1, lr=None))
    script = [sys.executable, "-m", "benchmarks.run_context"]  # from the repository root, as documented
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    got = subprocess.run([*script, s["out"], "--json"], capture_output=True, text=True, env=env, timeout=300,
                         cwd=ROOT)
    assert got.returncode == 0, got.stderr
    vit = json.loads(got.stdout)["vit"]
    torch.testing.assert_close(torch.tensor(vit["attention_distance"]),
                               torch.tensor(s["models"]["vit"]["attention_distance_px"]))
    torch.testing.assert_close(torch.tensor(vit["attention_entropy"]),
                               torch.tensor(s["models"]["vit"]["attention_entropy_nats"]))
    table = subprocess.run([*script, s["out"]], capture_output=True, text=True, env=env, timeout=300, cwd=ROOT)
    assert table.returncode == 0 and "| ViT | blocks.5 |" in table.stdout and "attention entropy (nats)" in table.stdout
    bad = subprocess.run([*script, str(tmp_path)], capture_output=True, text=True, env=env, timeout=300, cwd=ROOT)
    assert bad.returncode != 0 and "error:" in bad.stderr and "Traceback" not in bad.stderr


def test_timm_cli_names_config_file_and_model_list(tmp_path, capsys):
    cfg = T.parse_args(["--output", str(tmp_path / "o"), "--clip-grad", "2"])
    assert (cfg.out, cfg.grad_clip) == (str(tmp_path / "o"), 2.0)  # timm's names for --out, --grad-clip
    f = tmp_path / "c.yaml"
    f.write_text("lr: 0.01\n--epochs: 2\nmodel: cnn\n")
    cfg = T.parse_args(["-c", str(f), "--epochs", "3"])  # the file gives defaults, the command line wins
    assert (cfg.lr, cfg.epochs, cfg.model) == (0.01, 3.0, "cnn")
    bomb = "a: &a [x, x, x, x, x, x, x, x, x]\n" + "".join(
        f"{chr(98 + i)}: &{chr(98 + i)} [{', '.join([f'*{chr(97 + i)}'] * 9)}]\n" for i in range(8))
    for text, message in (("colour: red\n", "unknown option(s) ['colour']"),
                          ("epochs: [1, 2]\n", "epochs must be float | None, got [1, 2] (list)"),
                          ("lr: [oops\n", "cannot read it as a config"),
                          ("batch_size: true\n", "batch_size must be int | None, got True (bool)"),
                          ("model: null\n", "model must be str, got None"),
                          ("flip: 1\n", "flip must be bool, got 1 (int)"),
                          (b"lr: 0.01 \xff\xfe\n", "expected UTF-8 text, got a byte 0xff at offset 9"),
                          (bomb, "aliases expand to 490,329,064 values, more than 10,000")):
        f.write_bytes(text) if isinstance(text, bytes) else f.write_text(text)
        with pytest.raises(SystemExit) as e:
            T.parse_args(["-c", str(f)])
        err = capsys.readouterr().err
        assert e.value.code == 2 and message in err and len(err.strip().splitlines()[-1]) < 300, err[-500:]
    with pytest.raises(SystemExit) as e:
        T.parse_args(["--list-models", "cnn_*"])
    listing = capsys.readouterr().out
    assert e.value.code == 0 and "cnn_cifar10" in listing and "vit_" not in listing
    assert "[default for cifar10]" in listing and "1.16M" in listing
