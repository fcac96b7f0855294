"""vitattn.training.runfolder: configs that round-trip, run folders and checkpoints refused and kept."""

from __future__ import annotations

import dataclasses
import json
from dataclasses import replace
from pathlib import Path

import pytest
from conftest import run_train_cifar, tiny

import train_cifar as T

pytestmark = pytest.mark.usefixtures("one_thread")


def test_configs_round_trip_through_json(tmp_path, folder):
    cfg = tiny(tmp_path, folder, time_budget=0.5, bf16=True)
    assert T.Config(**json.loads(json.dumps(dataclasses.asdict(cfg)))) == cfg
    assert replace(cfg, model="vit").models() == ["vit"]


def test_bad_run_folders_are_refused_and_left_untouched(tmp_path, folder, capsys):
    code, err = run_train_cifar(capsys, "--resume", tmp_path / "nowhere")
    assert code == 2 and "no such run folder" in err
    broken = tmp_path / "broken"
    broken.mkdir()
    code, err = run_train_cifar(capsys, "--resume", broken)
    assert code == 2 and "no config.json" in err
    (broken / "config.json").write_text("{not json")
    code, err = run_train_cifar(capsys, "--resume", broken)
    assert code == 2 and "not valid JSON" in err and (broken / "config.json").read_text() == "{not json"
    (broken / "config.json").write_text(json.dumps({"epochs": 1, "colour": "red"}))
    code, err = run_train_cifar(capsys, "--resume", broken)
    assert code == 2 and "does not describe a run" in err
    # a finished run is not overwritten by a new one pointed at the same folder
    cfg = tiny(tmp_path, folder, epochs=1)
    T.main(cfg)
    before = {p: p.read_bytes() for p in Path(cfg.out).rglob("*") if p.is_file()}
    code, err = run_train_cifar(capsys, "--data-dir", folder, "--out", cfg.out, "--model", "cnn")
    assert code == 2 and "is not a new or empty folder" in err and "--resume" in err
    assert {p: p.read_bytes() for p in Path(cfg.out).rglob("*") if p.is_file()} == before
    a_file = tmp_path / "notes.txt"
    a_file.write_text("keep me")
    code, err = run_train_cifar(capsys, "--data-dir", folder, "--out", a_file, "--model", "cnn")
    assert code == 2 and "not a new or empty folder" in err and a_file.read_text() == "keep me"


def test_a_truncated_checkpoint_is_named_and_kept(tmp_path, folder, capsys):
    cfg = tiny(tmp_path, folder, epochs=1)
    T.main(cfg)
    ck = Path(cfg.out) / "checkpoints" / "cnn.pt"
    ck.write_bytes(ck.read_bytes()[:200])
    damaged = ck.read_bytes()
    code, err = run_train_cifar(capsys, "--resume", cfg.out)
    assert code == 2 and str(ck) in err and "unreadable" in err
    assert ck.read_bytes() == damaged
