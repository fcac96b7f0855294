"""The curated results are what the raw run files say."""

from __future__ import annotations

import csv
import dataclasses
import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def test_the_csvs_and_readmes_table_are_up_to_date():
    r = subprocess.run([sys.executable, "-m", "results.build", "--check"], capture_output=True, text=True,
                       cwd=ROOT, timeout=300)
    assert r.returncode == 0, r.stderr


def test_every_row_has_its_hardware_and_a_command_that_names_the_model():
    for name in ("cifar10", "long_range"):
        rows = list(csv.DictReader(open(ROOT / "results" / f"{name}.csv")))
        assert rows
        for row in rows:
            assert row["hardware"] != "unknown", row["run"]
            assert row["command"].startswith(f"python train_cifar.py --model {row['model']}")
            assert 0 <= float(row["accuracy"]) <= 1 and float(row["images_per_s"]) > 0


def test_every_command_runs_today_with_todays_presets():
    """Each row's command parses with today's train_cifar.py and names a current preset, so a
    reader can paste it (options are checked, the model's fields too; no data is read)."""
    import shlex
    import warnings

    import train_cifar
    import vitattn

    for name in ("cifar10", "long_range"):
        for row in csv.DictReader(open(ROOT / "results" / f"{name}.csv")):
            argv = shlex.split(row["command"])
            assert argv[:2] == ["python", "train_cifar.py"], row["run"]
            assert row["preset"] in vitattn.list_models(), row["run"]  # not an earlier release's name
            with warnings.catch_warnings():
                warnings.simplefilter("error", FutureWarning)
                cfg = train_cifar.parse_args(argv[2:])
            assert cfg.preset(row["model"]) == row["preset"], row["run"]
            assert cfg.model_kwargs(row["model"]) == json.loads(row["model_kwargs"]), row["run"]


def test_every_detection_command_gives_back_its_run_s_options_and_names_only_those_it_changed():
    import shlex

    from examples.train_detection import Config
    from vitattn.training import cli

    kept = json.loads((ROOT / "docs" / "results" / "detection_runs.json").read_text())
    rows = {r["run"]: r for r in csv.DictReader(open(ROOT / "results" / "detection.csv"))}
    defaults = Config(data_dir="d")
    for name, run in kept.items():
        argv = shlex.split(rows[name]["command"])[2:]
        cfg = cli.parse_config(cli.build_parser(Config, ""), Config, argv)
        paths = ("data_dir", "initial_checkpoint", "out", "resume", "progress", "tensorboard", "workers")
        assert {k: v for k, v in dataclasses.asdict(cfg).items() if k not in paths} == {
            k: tuple(v) if isinstance(v, list) else v for k, v in run["config"].items() if k not in paths}, name
        flags = [a[2:].replace("-", "_") for a in argv if a.startswith("--") and not a.startswith("--no-")]
        assert [f for f in flags if getattr(cfg, f) == getattr(defaults, f)] == [], name  # only what differs


def test_step_speed_rows_name_their_hardware_and_a_benchmark_command():
    rows = list(csv.DictReader(open(ROOT / "results" / "step_speed.csv")))
    assert rows
    for row in rows:
        assert row["hardware"] != "unknown" and float(row["rate"]) > 0, row
        assert row["command"].startswith("python -m benchmarks."), row["command"]


def test_every_kept_run_builds_today_with_the_parameters_it_recorded():
    """The run files name today's presets and options only (no earlier names are read), and each
    recorded model is rebuilt by today's code to the weight count the run reported."""
    import dataclasses

    import vitattn
    from vitattn.tasks.classify import Config

    options = {f.name for f in dataclasses.fields(Config)}
    raw = ROOT / "docs" / "results"
    for path in [raw / "runs.json", *sorted(raw.glob("*_summaries.json"))]:
        for name, s in json.loads(path.read_text()).items():
            assert set(s["config"]) <= options, (name, set(s["config"]) - options)
            for fam, m in s["models"].items():
                slot = "vit" if fam == "vit" else "cnn"
                assert m["preset"] == s["config"][f"{slot}_preset"] in vitattn.list_models(), name
                size = 32 if s["dataset"] == "cifar10" else 64
                kw = {"num_classes": len(s["classes"]), **json.loads(s["config"][f"{slot}_kwargs"])}
                if fam == "vit":
                    kw["img_size"] = size
                model = vitattn.create_model(m["preset"], **kw)
                # trained and frozen weights (a CNN's frozen ones are buffers today), not BatchNorm's statistics
                state = model.state_dict()
                frozen = sum(v.numel() for k, v in state.items() if k.rsplit(".", 1)[-1] not in
                             ("running_mean", "running_var", "num_batches_tracked") and v.is_floating_point())
                assert m["params"] in (sum(p.numel() for p in model.parameters()), frozen), (name, fam)


def test_every_epoch_row_belongs_to_a_kept_run_and_each_kept_run_has_its_epochs():
    runs = json.loads((ROOT / "docs" / "results" / "runs.json").read_text())
    rows = list(csv.DictReader(open(ROOT / "results" / "epochs.csv")))
    assert {r["run"] for r in rows} == set(runs)
    for r in rows:
        assert r["model"] in runs[r["run"]]["models"] and 0 <= float(r["test_acc"]) <= 1, r["run"]


def test_add_refuses_a_run_it_cannot_take_in_one_line_and_writes_nothing(tmp_path, folder, capsys, monkeypatch):
    """results.build --add: a missing, unfinished, half-written or damaged run, a name without a
    machine tag and a name already kept are each refused (exit 2, one line, no traceback) before
    runs.json or epochs.csv changes; a good run goes in, and --replace replaces it."""
    from conftest import tiny

    import train_cifar as T
    from results import build

    runs, epochs = tmp_path / "runs.json", tmp_path / "epochs.csv"
    runs.write_text((ROOT / "docs" / "results" / "runs.json").read_text())
    epochs.write_text((ROOT / "results" / "epochs.csv").read_text())
    monkeypatch.setattr(build, "RUNS", runs)
    monkeypatch.setattr(build, "EPOCHS", epochs)
    good = Path(T.main(tiny(tmp_path / "good", folder, epochs=1))["out"])
    name = "cifar10_cnn_tiny_1epoch_epyc2"

    def broken(what: str) -> Path:
        copy = tmp_path / what.replace(" ", "_")
        subprocess.run(["cp", "-r", str(good), str(copy)], check=True)
        return copy

    cut = broken("cut summary")
    (cut / "summary.json").write_text((good / "summary.json").read_text()[:100])
    stopped = broken("stopped")
    (stopped / "summary.json").write_text(json.dumps({**json.loads((good / "summary.json").read_text()),
                                                      "status": "interrupted"}))
    unfinished = broken("unfinished")
    (unfinished / "summary.json").unlink()
    damaged = broken("damaged metrics")
    (damaged / "metrics.jsonl").write_text("{cut\n" + (good / "metrics.jsonl").read_text())
    gone = broken("gone option")
    (gone / "summary.json").write_text(json.dumps({**json.loads((good / "summary.json").read_text()),
                                                   "config": {**json.loads((good / "summary.json").read_text())[
                                                       "config"], "an_old_option": 3}}))
    kept = next(iter(json.loads(runs.read_text())))
    cases = [(tmp_path / "nowhere", name, "no such run folder"), (cut, name, "not whole JSON"),
             (stopped, name, "did not finish"), (unfinished, name, "no summary.json"),
             (damaged, name, "metrics.jsonl line 1 is damaged"), (gone, name, "no longer has (an_old_option)"),
             (good, "cifar10_cnn_no_machine", "must end in a machine tag"), (good, kept, "already a kept run")]
    before = runs.read_bytes(), epochs.read_bytes()
    for run, n, message in cases:
        assert build.main(["--add", str(run), n]) == 2, message
        err = capsys.readouterr().err
        assert message in err and len(err.strip().splitlines()) == 1 and "Traceback" not in err, err
        assert (runs.read_bytes(), epochs.read_bytes()) == before, message
    build.add_run(good, name)
    assert name in json.loads(runs.read_text()) and name in epochs.read_text()
    with pytest.raises(build.Refused, match="already a kept run"):
        build.add_run(good, name)
    build.add_run(good, name, replace=True)
    assert sum(r["run"] == name for r in csv.DictReader(open(epochs))) == 1


def test_the_catalog_is_data_and_a_bad_row_is_named(tmp_path, monkeypatch):
    """results/catalog.toml holds the curated runs (build.py holds no run names), and a row that
    names an undefined set is refused by the set's name."""
    from results import build

    code = (ROOT / "results" / "build.py").read_text()
    assert "_h200shared" not in code and "_epyc2bf16" not in code and "xeon2amx" not in code
    catalog = build.load_catalog()
    assert catalog.readme and catalog.tables["cifar10"] and catalog.machines["epyc2bf16"][1] == "EPYC BF16"
    bad = tmp_path / "catalog.toml"
    bad.write_text((ROOT / "results" / "catalog.toml").read_text().replace('"@rope"', '"@no_such_set"', 1))
    with pytest.raises(SystemExit, match="@no_such_set"):
        build.load_catalog(bad)
