"""train_cifar.py end to end on tiny generated data: both models, the data layouts, the whitening
stem, the long-range tasks, model options, EMA, run context."""

from __future__ import annotations

import json
import math
import re
from pathlib import Path

import pytest
import torch
from conftest import metrics, tiny, write_batches, write_tar

import train_cifar as T
from vitattn.tasks import classify

ROOT = Path(__file__).resolve().parents[1]

pytestmark = pytest.mark.usefixtures("one_thread")


def test_both_models_train_and_every_output_appears(tmp_path, folder, capsys):
    cfg = tiny(tmp_path, folder, model="both", epochs=3, plots=True, lr=None,
               vit_preset="vit_quick", batch_size=12)
    s = T.main(cfg)
    out = Path(cfg.out)
    assert s["status"] == "ok"
    # every phase after training that can take minutes says so, with its duration, in a log too
    printed = capsys.readouterr().out
    phases = [m.group(1) for m in re.finditer(r"^(.+): \d+\.\d s$", printed, re.M)]
    assert [p.split(" of ")[0] for p in phases if "final evaluation" in p] == ["[vit] final evaluation",
                                                                             "[cnn] final evaluation"]
    assert any(p.startswith("context measures (") for p in phases) and "plots" in phases, phases
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
    vit = summary["models"]["vit"]
    ratio, share = (torch.tensor(vit[k]) for k in ("token_norm_max_ratio", "token_norm_outlier_share"))
    assert ratio.shape == share.shape == (6,) and (ratio >= 1).all() and ((share >= 0) & (share <= 1)).all()
    assert "token_norm_max_ratio" not in summary["models"]["cnn"]
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
