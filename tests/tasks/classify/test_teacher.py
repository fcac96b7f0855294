"""Distillation from a CNN run (train_cifar.py --teacher): DeiT's hard-label loss, the teacher
read from a finished run folder, its provenance in the summary, and the refusals."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import train_cifar as T
import vitattn
from vitattn.tasks import classify
from vitattn.tasks.classify import batches, data
from vitattn.training import runtime

pytestmark = pytest.mark.usefixtures("one_thread")


def config(tmp_path: Path, folder: Path, name: str, **kw) -> T.Config:
    base = dict(data_dir=str(folder), out=str(tmp_path / name), epochs=3, batch_size=12, progress=False,
                plots=False, vit_preset="vit_quick", cnn_preset="cnn_quick")
    return T.Config(**{**base, **kw})


@pytest.fixture(scope="module")
def teacher_run(tmp_path_factory, folder) -> Path:
    """A finished run of the default CNN (its whitening stem is a buffer set from the data) on the
    shared tiny folder."""
    tmp = tmp_path_factory.mktemp("teacher")
    cfg = config(tmp, folder, "cnn", model="cnn", lr=0.05, cnn_preset="cnn_cifar10")
    assert T.main(cfg)["status"] == "ok"
    return Path(cfg.out)


def test_the_loss_is_half_on_the_labels_and_half_on_the_teacher_s_labels():
    torch.manual_seed(0)
    student = vitattn.create_model("vit_quick", distilled=True, num_classes=3).train()
    student.set_distilled_training(True)
    teacher = nn.Sequential(nn.Flatten(), nn.Linear(3 * 32 * 32, 3))
    x = torch.randint(0, 256, (6, 3, 32, 32), dtype=torch.uint8)
    y = torch.tensor([0, 1, 2, 0, 1, 2])
    norm = data.Normalize((120.0,) * 3, (60.0,) * 3)
    loader = batches.BatchLoader(x, y, 6, shuffle=False, drop_last=True)
    task = classify.ClassifyTask("vit", loader, norm, x, y, device=torch.device("cpu"), ranks=runtime.Dist(),
                                 label_smoothing=0.1, teacher=teacher)
    loss, hits, n = task.loss(student, (x, y))
    xn = norm(x)
    cls, dist = student(xn)
    taught = teacher(xn).argmax(1)
    want = (F.cross_entropy(cls, y, label_smoothing=0.1) + F.cross_entropy(dist, taught)) / 2
    torch.testing.assert_close(loss, want)
    assert n == 6 and hits == ((cls + dist).argmax(1) == y).sum()


def test_the_teacher_read_back_scores_what_its_run_scored(tmp_path, folder, teacher_run):
    cfg = config(tmp_path, folder, "vit", model="vit", teacher=str(teacher_run))
    ds = classify.load_dataset(cfg)
    teacher = classify.load_teacher(cfg, ds, torch.device("cpu"))
    assert not teacher.model.training and not any(p.requires_grad for p in teacher.model.parameters())
    ev = classify.evaluate(teacher.model, ds.norm, ds.data.test_x, ds.data.test_y)
    assert ev["acc"] == teacher.info["final_acc"] > 1 / 3  # the saved weights, buffers included


def test_a_vit_learns_from_a_cnn_run_and_records_where_its_teacher_came_from(tmp_path, folder, teacher_run):
    cfg = config(tmp_path, folder, "vit", model="vit", teacher=str(teacher_run))
    s = T.main(cfg)
    assert s["status"] == "ok"
    vit = s["modules"]["vit"]
    assert vit.dist_token is not None and not vit.training
    rows = [json.loads(line) for line in (Path(cfg.out) / "metrics.jsonl").read_text().splitlines()]
    assert rows[-1]["train_loss"] < rows[0]["train_loss"]
    t = s["models"]["vit"]["teacher"]
    cnn = json.loads((teacher_run / "summary.json").read_text())["models"]["cnn"]
    assert t["run"] == str(teacher_run) and t["preset"] == "cnn_cifar10"
    assert t["final_acc"] == cnn["final_acc"] and t["train_seconds"] == cnn["train_seconds"]
    # without a token the class head learns both targets; the student is then a plain ViT
    cfg = config(tmp_path, folder, "plain", model="vit", teacher=str(teacher_run), vit_kwargs='{"distilled": false}')
    assert T.main(cfg)["modules"]["vit"].dist_token is None


def refused(capsys, tmp_path, *argv) -> str:
    out = tmp_path / "refused"
    try:
        code = T.command_line([*map(str, argv), "--out", str(out), "--no-progress"])
    except SystemExit as e:  # options refused while parsing
        code = e.code
    err = capsys.readouterr().err
    assert code == 2 and "Traceback" not in err and not out.exists(), err
    return err


def test_a_teacher_that_is_not_a_finished_cnn_run_is_refused_before_anything_is_written(
        tmp_path, folder, teacher_run, capsys):
    d = ["--data-dir", folder, "--vit-preset", "vit_quick", "--batch-size", 12]
    assert "use it with --model vit, got --model both" in refused(capsys, tmp_path, *d, "--teacher", teacher_run)
    assert "no summary.json there" in refused(capsys, tmp_path, *d, "--model", "vit", "--teacher", tmp_path)
    vit_only = tmp_path / "vit_only"
    vit_only.mkdir()
    summary = json.loads((teacher_run / "summary.json").read_text())
    (vit_only / "summary.json").write_text(json.dumps({**summary, "models": {}}))
    assert "names no trained CNN" in refused(capsys, tmp_path, *d, "--model", "vit", "--teacher", vit_only)
    other = tmp_path / "other"
    other.mkdir()
    (other / "summary.json").write_text(json.dumps({**summary, "dataset": "long-range"}))
    err = refused(capsys, tmp_path, *d, "--model", "vit", "--teacher", other)
    assert re.search(r"its CNN learned 'long-range' .* this run is 'cifar10'", err)
    unfinished = tmp_path / "unfinished"
    unfinished.mkdir()
    (unfinished / "summary.json").write_text(json.dumps(summary))
    assert "no checkpoints/cnn.safetensors there" in refused(capsys, tmp_path, *d, "--model", "vit", "--teacher",
                                                              unfinished)
