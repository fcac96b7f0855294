"""vitattn.training.cli through train_cifar.py's command line: help, presets, bad options, timm's names."""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path

import pytest
import torch

import train_cifar as T

pytestmark = pytest.mark.usefixtures("one_thread")


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


def test_both_scripts_declare_their_shared_options_once():
    """The options every script has live in runtime.RunOptions, re-declared by neither config;
    gradient clipping has one name in both (grad_clip, timm's --clip-grad as an alias)."""
    from vitattn.tasks import detect
    from vitattn.training import cli, runtime

    shared = {f.name for f in dataclasses.fields(runtime.RunOptions)}
    for cfg in (T.Config, detect.Config):
        assert issubclass(cfg, runtime.RunOptions)
        assert not shared & set(vars(cfg).get("__annotations__", {})), cfg
        assert "grad_clip" in {f.name for f in dataclasses.fields(cfg)}
    parsed = cli.parse_config(cli.build_parser(detect.Config, "d"), detect.Config,
                              ["--data-dir", "x", "--clip-grad", "2", "--seed", "3", "--amp"])
    assert (parsed.grad_clip, parsed.seed, parsed.autocast_dtype()) == (2.0, 3, torch.bfloat16)


def test_help_says_each_default_once_and_the_chosen_models_recipe(capsys):
    import re

    import train_cifar

    def help_of(*argv) -> str:
        with pytest.raises(SystemExit):
            train_cifar.parse_args([*argv, "--help"])
        return " ".join(capsys.readouterr().out.split())

    both = help_of()
    assert not re.search(r"\(default:[^)]*\) \(default:", both) and "(default: None) (default" not in both
    assert "--lr LR peak learning rate (default: vit 0.002, cnn 0.8: each family's recipe)" in both
    assert "(default: 0.002, the vit recipe's)" in help_of("--model", "vit")
    assert "--batch-size BATCH_SIZE images per step" in help_of("--model", "cnn", "--dataset", "long-range")
    assert "(default: 64, the cnn recipe's)" in help_of("--model", "cnn", "--dataset", "long-range")
    assert "(default: --no-amp)" in both


def test_a_config_file_reads_yaml_numbers_as_people_write_them_and_the_command_line_wins(tmp_path, capsys):
    """``lr: 1e-3`` is a number (YAML 1.2 and every other reader; PyYAML's 1.1 made it a string);
    ``--seed`` on the command line beats the file's ``seeds`` and ``--seeds`` its ``seed``: the two
    are one option, and the command line always wins."""
    f = tmp_path / "c.yaml"
    f.write_text("lr: 1e-3\nweight_decay: 5E-4\nwarmup_lr: 2.5e-5\nmin_lr: 0\n")
    cfg = T.parse_args(["-c", str(f), "--model", "vit"])
    assert (cfg.lr, cfg.weight_decay, cfg.warmup_lr, cfg.min_lr) == (1e-3, 5e-4, 2.5e-5, 0.0)
    f.write_text("seeds: 0-3\n")
    for argv, seeds in ((["--seed", "1"], (1,)), (["--seed", "0"], (0,)), ([], (0, 1, 2, 3))):
        assert T.parse_args(["-c", str(f), *argv]).seed_list() == seeds, argv
    f.write_text("seed: 5\n")
    assert T.parse_args(["-c", str(f), "--seeds", "2,3"]).seed_list() == (2, 3)
    assert T.parse_args(["-c", str(f)]).seed_list() == (5,)
    f.write_text("seed: 5\nseeds: 0-3\n")  # both in one file: the file itself is ambiguous
    with pytest.raises(SystemExit) as e:
        T.parse_args(["-c", str(f)])
    assert e.value.code == 2 and "together" in capsys.readouterr().err


@pytest.mark.parametrize("script", ["train_cifar", "train_detection"])
def test_help_comes_in_groups_a_newcomer_reads_in_order_and_says_defaults_as_values(script, capsys):
    """--help's groups run data first, then models, budget and run folder, recipe, precision and
    devices, outputs; every option is in one of them; and no default prints an internal name."""
    import re
    import sys

    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "examples"))
    module = __import__(script)
    with pytest.raises(SystemExit):
        (module.parse_args if script == "train_cifar" else module.command_line)(["--help"])
    text = capsys.readouterr().out
    titles = re.findall(r"^(\S[^\n]*):$", text, re.M)
    expected = (["options", "data and task", "models", "budget, seeds and run folder",
                 "recipe (each model family's own unless given)", "precision, devices and speed", "outputs"]
                if script == "train_cifar" else
                ["options", "data", "detector and backbone", "budget, seed and run folder", "recipe",
                 "precision and devices", "outputs and scoring"])
    assert titles == expected
    assert text.index("--data-dir") < text.index("--epochs") < text.index("--lr") < text.index("--amp")
    flat = " ".join(text.split())
    for bad in ("DEFAULT_PRESETS", "default: None", "default: unset", "(default: )"):
        assert bad not in flat, bad
    assert "--malloc" in flat and re.search(r"--malloc \{keep,system\}.*?\(default: keep\)", flat)
