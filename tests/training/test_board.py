"""vitattn.training.board: a run's TensorBoard curves, read back with tensorboard's own reader."""

from __future__ import annotations

import re
import signal
from pathlib import Path

import pytest
from conftest import tiny

import train_cifar as T
from vitattn.tasks import classify

pytestmark = pytest.mark.usefixtures("one_thread")
event_accumulator = pytest.importorskip("tensorboard.backend.event_processing.event_accumulator")


def curves(folder: Path) -> dict[str, list[int]]:
    """Each scalar tag's steps, as TensorBoard reads the folder (purges applied)."""
    acc = event_accumulator.EventAccumulator(str(folder), size_guidance={"scalars": 0})
    acc.Reload()
    return {tag: [e.step for e in acc.Scalars(tag)] for tag in acc.Tags()["scalars"]}


def test_a_run_writes_its_curves_and_end_figures_per_seed(tmp_path, folder, capsys):
    s = T.main(tiny(tmp_path, folder, epochs=2, seeds="0,1", tensorboard=True, time_budget=5.0))
    printed = capsys.readouterr().out  # what the budget leaves out is said first; each seed's end shows
    assert "--time-budget 5 min counts training steps only" in printed
    assert re.findall(r"^\[cnn\] final evaluation, seed (\d) \((\d)/2\)", printed, re.M) == [("0", "1"), ("1", "2")]
    for k in (0, 1):
        c = curves(Path(s["out"]) / "tensorboard" / "cnn" / f"seed{k}")
        assert c["epoch/test_acc"] == [3, 6] and c["epoch/train_loss"] == [3, 6]
        assert c["train/loss"] and c["lr"] and c["images_per_s"]
        assert c["final/acc"] == [7] and c["context/erf_radius_px/layer0"] == [7]  # one step after the last
    assert not (Path(s["out"]) / "tensorboard" / "vit").exists()


def test_a_resumed_run_continues_its_curves_without_a_duplicate_step(tmp_path, folder, monkeypatch):
    ref = T.main(tiny(tmp_path / "a", folder, epochs=3, tensorboard=True))
    calls, cross_entropy = {"n": 0}, classify.task.F.cross_entropy

    def interrupt_in_epoch_3(*args, **kw):  # 3 training steps + 1 evaluation batch per epoch
        calls["n"] += 1
        if calls["n"] == 10:
            signal.raise_signal(signal.SIGINT)
        return cross_entropy(*args, **kw)

    monkeypatch.setattr(classify.task.F, "cross_entropy", interrupt_in_epoch_3)
    cfg = tiny(tmp_path / "b", folder, epochs=3, tensorboard=True)
    assert T.main(cfg)["status"] == "interrupted"
    monkeypatch.setattr(classify.task.F, "cross_entropy", cross_entropy)
    T.main(T.Config(resume=cfg.out, progress=False))
    got, want = curves(Path(cfg.out) / "tensorboard" / "cnn"), curves(Path(ref["out"]) / "tensorboard" / "cnn")
    assert set(got) == set(want)
    for tag, steps in got.items():
        assert steps == sorted(set(steps)), tag  # each step once
    assert got["epoch/test_acc"] == want["epoch/test_acc"] == [3, 6, 9]
    assert got["final/acc"] == [10]


def test_no_curves_with_no_tensorboard(tmp_path, folder):
    s = T.main(tiny(tmp_path, folder, epochs=1, tensorboard=False))
    assert not (Path(s["out"]) / "tensorboard").exists()
