"""Every bad input gets one clear answer: the script exits 2 (143 on SIGTERM) with a message that
names the option or file, no traceback and nothing written; the library raises TypeError /
ValueError naming the argument where the value enters. Options-only cases are in
tests/test_train.py (BAD_OPTIONS); these need data, files or a run."""

from __future__ import annotations

import json
import os
import pickle
import struct
import subprocess
import sys
import zlib
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import make_images, tiny, write_batches, write_folder

import train_cifar as T
import vitattn
from vitattn.tasks.classify.data import DataError, load_cifar
from vitattn.training import loop, runfolder

ROOT = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.usefixtures("one_thread")


def refused(capsys, argv: list, message: str, out: Path | None = None) -> str:
    """``train_cifar.py argv`` exits 2 with ``message`` and no traceback, and writes no ``out``."""
    try:
        extra = ["--no-progress"] + ([] if "--resume" in argv else ["--no-plots"])
        code = T.command_line([str(a) for a in argv] + extra)
    except SystemExit as e:
        code = e.code
    io = capsys.readouterr()
    assert code == 2, io.out + io.err
    assert message in io.err and "Traceback" not in io.err + io.out, io.err
    assert out is None or not out.exists()
    return io.err


# -- options that only the data can check ------------------------------------------------------
@pytest.mark.parametrize("argv, message", [
    (["--translate", "100"], "--translate must be smaller than the 32x32 images, got 100"),
    (["--cutout", "1000"], "--cutout must be smaller than the 32x32 images, got 1000"),
    (["--context-images", "100000"], "--context-images must be at most the 12 test images, got 100000"),
    (["--cnn-kwargs", '{"widths": []}'], "widths must be a non-empty list"),
    (["--model", "vit", "--vit-kwargs", '{"depth": 0}'], "depth must be >= 1, got 0"),
    (["--model", "vit", "--vit-kwargs", '{"img_size": 64}'], "img_size come from the data"),
    (["--cnn-kwargs", '{"num_classes": 3}'], "num_classes come from the data"),
])
def test_options_checked_against_the_data_are_refused_before_anything_is_written(tmp_path, folder, capsys, argv,
                                                                                   message):
    out = tmp_path / "run"
    refused(capsys, ["--data-dir", folder, "--out", out, "--model", "cnn", *argv], message, out)


# -- data that a decoder would take -------------------------------------------------------------
def _png_chunk(kind: bytes, data: bytes) -> bytes:
    return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))


def test_sixteen_bit_images_are_refused_not_clipped(tmp_path):
    from PIL import Image

    root = write_folder(tmp_path / "d", n_train=2, n_test=1)
    Image.fromarray(np.full((32, 32), 40000, dtype=np.uint16)).save(root / "train" / "cat" / "0000.png")
    with pytest.raises(DataError, match="0000.png has I;16 samples; expected 8-bit"):
        load_cifar(root, cache=False)


def test_a_decompression_bomb_is_refused_by_name(tmp_path):
    root = write_folder(tmp_path / "d", n_train=2, n_test=1)
    header = struct.pack(">IIBBBBB", 40_000, 40_000, 8, 2, 0, 0, 0)  # 1.6 billion pixels claimed
    bomb = b"\x89PNG\r\n\x1a\n" + _png_chunk(b"IHDR", header) + _png_chunk(b"IDAT", zlib.compress(b"\0" * 64))
    (root / "test" / "dog" / "0001.png").write_bytes(bomb + _png_chunk(b"IEND", b""))
    with pytest.raises(DataError, match="0001.png is refused"):
        load_cifar(root, cache=False)


def test_an_empty_class_folder_is_named_not_dropped(tmp_path):
    root = write_folder(tmp_path / "d", n_train=2, n_test=1)
    (root / "train" / "zebra").mkdir()
    with pytest.raises(DataError, match="zebra holds no images"):
        load_cifar(root, cache=False)


def test_one_class_is_refused(tmp_path):
    root = write_folder(tmp_path / "d", n_train=2, n_test=1, classes=("cat",))
    with pytest.raises(DataError, match="at least 2 classes"):
        load_cifar(root, cache=False)


def test_a_train_folder_without_a_test_folder_is_named(tmp_path):
    root = write_folder(tmp_path / "d", n_train=2, n_test=1)
    for f in (root / "test").rglob("*.png"):
        f.unlink()
    for d in sorted((root / "test").rglob("*"), reverse=True):
        d.rmdir()
    (root / "test").rmdir()
    with pytest.raises(DataError, match="has a train/ folder but no test/ folder"):
        load_cifar(root, cache=False)


class _RunsACommand:
    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def test_a_crafted_cifar_batch_cannot_run_code(tmp_path):
    root = write_batches(tmp_path / "b")
    marker = tmp_path / "ran"
    batch = root / "cifar-10-batches-py" / "data_batch_1"
    x, y = make_images(2, 0)
    batch.write_bytes(pickle.dumps({"data": _RunsACommand(marker), "labels": y.tolist()}))
    with pytest.raises(DataError, match="refused to load posix.system"):
        load_cifar(root, cache=False)
    assert not marker.exists()
    batch.write_bytes(pickle.dumps({"data": np.array([object()] * 4), "labels": [0, 1, 2, 3]}))
    with pytest.raises(DataError, match="refused to load"):
        load_cifar(root, cache=False)


def test_cifar_batches_as_python_writes_them_still_load(tmp_path):
    data = load_cifar(write_batches(tmp_path / "b"), cache=False)
    assert data.train_x.dtype == torch.uint8 and len(data.classes) == 3


def test_a_failure_mid_run_is_one_line_with_the_way_to_resume(tmp_path, folder, capsys, monkeypatch):
    def broken(*args, **kwargs):
        raise RuntimeError("a kernel failed")

    monkeypatch.setattr(loop, "end_epoch", broken)
    out = tmp_path / "run"
    assert T.command_line(["--data-dir", str(folder), "--model", "cnn", "--batch-size", "12", "--out", str(out),
                           "--no-progress", "--no-plots"]) == 1
    err = capsys.readouterr().err
    assert "error: the run failed: RuntimeError: a kernel failed" in err and f"--resume {out}" in err
    assert "no checkpoint was written yet" in err  # the first epoch's end failed: none to claim
    assert "Traceback" not in err


def test_a_failure_hint_names_only_a_folder_that_was_made(tmp_path, folder, capsys, monkeypatch):
    """Before the run folder exists there is nothing to resume; with no --out the hint names the
    folder the run did make (runs/<time>)."""
    def broken(*args, **kwargs):
        raise RuntimeError("a kernel failed")

    monkeypatch.setattr(T.classify, "check_memory", broken)  # fails before the folder is written
    out = tmp_path / "run"
    argv = ["--data-dir", str(folder), "--model", "cnn", "--batch-size", "12", "--no-progress", "--no-plots"]
    assert T.command_line([*argv, "--out", str(out)]) == 1
    err = capsys.readouterr().err
    assert "nothing was written" in err and "--resume" not in err and not out.exists(), err
    monkeypatch.undo()
    monkeypatch.setattr(loop, "end_epoch", broken)
    monkeypatch.chdir(tmp_path)
    assert T.command_line(argv) == 1
    err = capsys.readouterr().err
    made = [p for p in (tmp_path / "runs").iterdir()]
    assert len(made) == 1 and f"--resume {Path('runs') / made[0].name}" in err, err


@pytest.mark.parametrize("damage", ["not json {", "[1, 2]", '{"no": "model"}'])
def test_a_damaged_metrics_line_is_named_on_resume_and_nothing_is_changed(tmp_path, folder, capsys, damage):
    cfg = tiny(tmp_path, folder, epochs=2)
    T.main(cfg)
    run = Path(cfg.out)
    lines = (run / "metrics.jsonl").read_text().splitlines()
    (run / "metrics.jsonl").write_text("\n".join([lines[0], damage, *lines[1:]]) + "\n")
    before = {p: p.read_bytes() for p in run.rglob("*") if p.is_file()}
    err = refused(capsys, ["--resume", run], "metrics.jsonl line 2")
    assert "--resume" not in err.split("metrics.jsonl line 2", 1)[1].split(";")[0]
    assert len(err.strip().splitlines()) == 1 and "delete" in err
    assert {p: p.read_bytes() for p in run.rglob("*") if p.is_file()} == before


def test_a_config_json_edited_after_its_checkpoint_is_refused_on_resume(tmp_path, folder, capsys):
    cfg = tiny(tmp_path, folder, epochs=1)
    T.main(cfg)
    path = Path(cfg.out) / "config.json"
    saved = json.loads(path.read_text())
    path.write_text(json.dumps({**saved, "batch_size": 6, "epochs": 2}))
    before = {p: p.read_bytes() for p in Path(cfg.out).rglob("*") if p.is_file()}
    refused(capsys, ["--resume", cfg.out], "config.json no longer matches cnn.pt: batch_size is 6 there and 12 in "
            "the checkpoint (and 1 more); restore config.json")
    assert {p: p.read_bytes() for p in Path(cfg.out).rglob("*") if p.is_file()} == before


@pytest.mark.skipif(not hasattr(os, "geteuid") or os.geteuid() != 0, reason="mounting a small tmpfs needs root")
def test_a_full_disk_is_named_leaves_no_temp_file_and_no_row_for_an_unsaved_epoch(tmp_path, folder, capsys):
    disk = tmp_path / "disk"
    disk.mkdir()
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=256k", "tmpfs", str(disk)], capture_output=True).returncode:
        pytest.skip("cannot mount a tmpfs here")
    try:
        out = disk / "run"  # room for the config and the metrics, not for a checkpoint (about 2 MB)
        for argv in (["--data-dir", str(folder), "--model", "cnn", "--cnn-preset", "cnn_quick", "--batch-size", "12",
                      "--epochs", "2", "--out", str(out), "--no-plots"], ["--resume", str(out)]):
            assert T.command_line([*argv, "--no-progress"]) == 2
            err = capsys.readouterr().err.strip()
            assert err.startswith(f"error: No space left on device in {out / 'checkpoints'}") and "\n" not in err
            assert "no earlier cnn.pt exists" in err and "Traceback" not in err
            assert not list(out.rglob("*.tmp"))
            # the epoch's checkpoint comes before its evaluation: no row for an epoch that could not be saved
            assert not (out / "metrics.jsonl").exists()
    finally:
        subprocess.run(["umount", str(disk)], capture_output=True)


# -- run folders ---------------------------------------------------------------------------------
def test_an_out_folder_that_cannot_be_made_is_refused(tmp_path, folder, capsys):
    blocker = tmp_path / "a_file"
    blocker.write_text("x")
    refused(capsys, ["--data-dir", folder, "--model", "cnn", "--out", blocker / "run"], "cannot be created")
    assert blocker.read_text() == "x"


def test_resuming_with_another_models_checkpoint_is_refused_and_keeps_it(tmp_path, folder, capsys):
    a, b = tiny(tmp_path / "a", folder, epochs=1), tiny(tmp_path / "b", folder, epochs=1, cnn_preset="cnn_longrange")
    T.main(a)
    T.main(b)
    other = Path(b.out) / "checkpoints" / "cnn.pt"
    (Path(a.out) / "checkpoints" / "cnn.pt").write_bytes(other.read_bytes())
    refused(capsys, ["--resume", a.out], "does not hold this run's cnn model")
    assert (Path(a.out) / "checkpoints" / "cnn.pt").read_bytes() == other.read_bytes()


def test_a_checkpoint_of_another_version_of_the_loop_is_refused_and_kept(tmp_path, folder, capsys):
    cfg = tiny(tmp_path, folder, epochs=1)
    T.main(cfg)
    path = Path(cfg.out) / "checkpoints" / "cnn.pt"
    ck = torch.load(path, weights_only=True)
    ck["state"]["best_acc"] = ck["state"].pop("best")  # as the loop before this one named it
    torch.save(ck, path)
    before = path.read_bytes()
    refused(capsys, ["--resume", cfg.out], "written by another version of the training loop (its state has best_acc)")
    assert path.read_bytes() == before


def test_a_run_resumes_past_a_metrics_line_cut_by_a_crash_and_rewrites_cut_weights(tmp_path, folder, capsys):
    cfg = tiny(tmp_path, folder, epochs=1)
    T.main(cfg)
    metrics = Path(cfg.out) / "metrics.jsonl"
    metrics.write_text(metrics.read_text() + '{"model": "cnn", "epo')
    weights = Path(cfg.out) / "checkpoints" / "cnn.safetensors"
    weights.write_bytes(weights.read_bytes()[:100])
    assert T.command_line(["--resume", cfg.out, "--no-progress"]) == 0
    from safetensors.torch import load_file

    assert set(load_file(weights)) == set(vitattn.create_model("cnn_quick", num_classes=3).state_dict())
    assert "Traceback" not in capsys.readouterr().err


def test_a_config_json_with_an_unknown_option_or_preset_is_refused_and_left_as_it_was(tmp_path, folder, capsys):
    """No option or preset of an earlier version is read as today's: a run folder that names one
    is refused, with the folder left as it was."""
    cfg = tiny(tmp_path, folder, epochs=1, model="cnn")
    T.main(cfg)
    saved = Path(cfg.out) / "config.json"
    good = json.loads(saved.read_text())
    before = {p: p.read_bytes() for p in Path(cfg.out).rglob("*") if p.is_file()}
    for change, message in ((dict(lookahead_decay=0.95), "unexpected keyword argument 'lookahead_decay'"),
                            (dict(cnn_preset="cnn_cifar_small"), "unknown preset 'cnn_cifar_small'")):
        saved.write_text(json.dumps({**good, **change}))
        before[saved] = saved.read_bytes()
        refused(capsys, ["--resume", cfg.out], message)
        assert {p: p.read_bytes() for p in Path(cfg.out).rglob("*") if p.is_file()} == before


def test_a_second_resume_of_a_running_run_is_refused(tmp_path, folder, capsys):
    cfg = tiny(tmp_path, folder, epochs=1)
    T.main(cfg)
    before = {p: p.read_bytes() for p in Path(cfg.out).rglob("*") if p.is_file()}
    with runfolder.hold(Path(cfg.out), True):  # as the first resume does while it runs
        refused(capsys, ["--resume", cfg.out], "is in use by another process")
    assert {p: p.read_bytes() for p in Path(cfg.out).rglob("*") if p.is_file()} == before


# -- the library --------------------------------------------------------------------------------
@pytest.mark.parametrize("make, error, message", [
    (lambda: vitattn.create_model("vit_quick", depth="x"), TypeError, "depth must be a whole number"),
    (lambda: vitattn.create_model("vit_quick", depth=0), ValueError, "depth must be >= 1, got 0"),
    (lambda: vitattn.create_model("vit_quick", num_heads=0), ValueError, "num_heads must be >= 1"),
    (lambda: vitattn.create_model("vit_quick", patch_size=0), ValueError, "patch_size must be >= 1"),
    (lambda: vitattn.create_model("vit_quick", mlp_ratio=-1), ValueError, r"mlp_ratio must be in \(0.0"),
    (lambda: vitattn.create_model("vit_quick", num_classes=-1), ValueError, "num_classes must be >= 0"),
    (lambda: vitattn.create_model("vit_quick", drop_path_rate=1.5), ValueError, "drop_path_rate"),
    (lambda: vitattn.create_model("cnn_longrange", widths=[]), ValueError, "widths must be a non-empty list"),
    (lambda: vitattn.create_model("cnn_longrange").reset_classifier(-3), ValueError, "num_classes must be >= 0"),
    (lambda: vitattn.create_model("vit_quick").reset_classifier(-3), ValueError, "num_classes must be >= 0"),
    (lambda: vitattn.create_model("vit_quick", score="cosine"), ValueError, "unknown score 'cosine'"),
    (lambda: vitattn.create_model("vit_quick", dynamic_img_size="yes"), TypeError, "must be true or false"),
    (lambda: vitattn.create_model("vit_quick", window_size=2, window_block_indexes=[99]), ValueError,
     r"window_block_indexes must be block indices in 0..5, got \[99\]"),
    (lambda: vitattn.create_model("cnn_longrange", dirac_init=1), TypeError, "dirac_init must be true or false"),
    (lambda: vitattn.list_models(5), TypeError, "shell-style pattern"),
    (lambda: vitattn.to_timm(vitattn.create_model("cnn_quick")), TypeError, "takes a vitattn ViT"),
    (lambda: vitattn.create_model("vit_quick", img_size=32, patch_size=5), ValueError,
     r"img_size \(32, 32\) is not divisible by patch_size \(5, 5\)"),
    (lambda: vitattn.create_model("vit_quick").forward_intermediates(torch.zeros(1, 3, 32, 32), indices="10"),
     TypeError, "indices must be None, a whole number"),
    (lambda: vitattn.create_model("vit_quick").forward_intermediates(torch.zeros(1, 3, 32, 32), indices=[1.5]),
     TypeError, "whole layer indices, got \\[1.5\\]"),
    (lambda: vitattn.create_model("cnn_quick").forward_intermediates(torch.zeros(1, 3, 32, 32), indices=True),
     TypeError, "indices must be None"),
    (lambda: vitattn.create_model("cnn_quick", features_only=True, out_indices=[0.0]), TypeError,
     "whole layer indices"),
    (lambda: vitattn.create_model("cnn_quick").eval()(torch.zeros(2, 3, 6, 6)), ValueError,
     "images of 6x6 are too small: each stage halves the map, so this network needs at least 8x8"),
    (lambda: vitattn.create_model("cnn_cifar10").eval()(torch.zeros(2, 3, 8, 8)), ValueError, "at least 9x9"),
])
def test_library_arguments_are_checked_where_they_enter(make, error, message):
    with pytest.raises(error, match=message):
        make()


@pytest.mark.parametrize("name", [n for n in vitattn.list_models() if vitattn.registry.PRESETS[n][0] != "vit"])
def test_a_conv_net_takes_its_smallest_image_and_names_one_pixel_less(name):
    model = vitattn.create_model(name).eval()
    n = getattr(model, "min_size", 1)
    with torch.no_grad():
        assert model(torch.zeros(2, 3, n, n)).shape == (2, model.num_classes)
        assert len(model.forward_intermediates(torch.zeros(2, 3, n, n), intermediates_only=True)) >= 2
    if n > 1:
        with pytest.raises(ValueError, match=f"at least {n}x{n}"):
            model(torch.zeros(2, 3, n - 1, n + 5))


def test_layer_indices_may_be_numpy_or_0_d_tensor_integers():
    model = vitattn.create_model("vit_quick").eval()
    x = torch.zeros(1, 3, 32, 32)
    want = model.forward_intermediates(x, indices=[1, 3], intermediates_only=True)
    for idx in (np.array([1, 3]), [np.int64(1), torch.tensor(3)], (1, 3)):
        got = model.forward_intermediates(x, indices=idx, intermediates_only=True)
        assert all(torch.equal(a, b) for a, b in zip(got, want))


@pytest.mark.parametrize("call, error, message", [
    (lambda a: a(torch.zeros(2, 8)), ValueError, r"expected tokens of shape \(B, N, D\), got a 2-D tensor"),
    (lambda a: a(torch.zeros(1, 2, 3, 4, 8)), ValueError, "got a 5-D tensor"),
    (lambda a: a(torch.zeros(2, 4, 8, dtype=torch.int64)), TypeError, "expected torch.float32 tokens"),
    (lambda a: a(torch.zeros(2, 4, 8, dtype=torch.float64)), TypeError, "got torch.float64"),
    (lambda a: a(torch.zeros(2, 0, 8)), ValueError, "at least one of the tokens"),
    (lambda a: vitattn.MultiHeadAttention(8, 2)(torch.zeros(2, 4, 8), context=torch.zeros(2, 0, 8)), ValueError,
     "at least one of the context tokens"),
])
def test_attention_names_what_it_expected_and_what_came(call, error, message):
    with pytest.raises(error, match=message):
        call(vitattn.Attention(8, 2))


@pytest.mark.parametrize("out_indices, message", [((), "no layer indices given"), ((2, 2), "name a layer twice"),
                                                  ((1, -5), "name a layer twice")])
def test_features_only_refuses_empty_or_repeated_levels(out_indices, message):
    with pytest.raises(ValueError, match=message):
        vitattn.create_model("vit_quick", features_only=True, out_indices=out_indices)


@pytest.mark.parametrize("name", ["vit_quick", "cnn_quick"])
@pytest.mark.parametrize("dtype, message", [(torch.uint8, "expected floating-point images"),
                                            (torch.float64, "expected torch.float32 images"),
                                            (torch.float16, "expected torch.float32 images")])
def test_images_in_another_dtype_than_the_model_are_named(name, dtype, message):
    model = vitattn.create_model(name, num_classes=3)
    with pytest.raises(TypeError, match=message):
        model(torch.zeros(1, 3, 32, 32, dtype=dtype))
    with torch.autocast("cpu", dtype=torch.bfloat16):  # autocast casts for itself
        assert model(torch.zeros(1, 3, 32, 32)).shape == (1, 3)


def test_detection_and_attention_maps_want_a_vit():
    from vitattn.tasks.classify.report import attention_maps
    from vitattn.vitdet import ViTDetBackbone

    cnn = vitattn.create_model("cnn_quick")
    with pytest.raises(TypeError, match="ViTDetBackbone takes a vitattn ViT, got SmallCNN"):
        ViTDetBackbone(cnn)
    with pytest.raises(TypeError, match="attention maps need a model with get_attention_maps"):
        attention_maps(cnn, torch.zeros(1, 3, 32, 32))


def test_a_distilled_deit_is_named_as_unsupported():
    timm = pytest.importorskip("timm")
    with pytest.raises(ValueError, match="a distillation token"):
        vitattn.from_timm(timm.create_model("deit_tiny_distilled_patch16_224", pretrained=False))


def test_bad_options_only_the_config_can_check(capsys):
    for argv, message in ((["--epochs", "inf"], "--epochs must be a finite number"),
                          (["--time-budget", "inf"], "--time-budget must be a finite number"),
                          (["--min-lr", "5"], "--min-lr must not exceed the peak --lr"),
                          (["--vit-kwargs", '{"depth": "x"}'], "depth must be a whole number"),
                          (["--vit-kwargs", '{"num_heads": 0}'], "num_heads must be >= 1"),
                          (["--vit-kwargs", '{"score": "cosine"}'], "unknown score 'cosine'"),
                          (["--out", ""], "--out needs a value"),
                          (["--resume", ""], "--resume needs a value")):
        refused(capsys, [*argv, "--dataset", "long-range"], message)


@pytest.mark.slow
@pytest.mark.parametrize("argv, message", [
    (["--epochs", "inf"], "--epochs must be a finite number"),
    (["--translate", "100"], "--translate must be smaller than the 32x32 images"),
    (["--cnn-kwargs", '{"widths": []}'], "widths must be a non-empty list"),
])
def test_the_command_itself_exits_2_with_one_line(tmp_path, folder, argv, message):
    out = tmp_path / "run"
    p = subprocess.run([sys.executable, str(ROOT / "train_cifar.py"), "--data-dir", str(folder), "--model", "cnn",
                        "--out", str(out), "--no-progress", *argv], capture_output=True, text=True, timeout=120)
    assert p.returncode == 2 and message in p.stderr and "Traceback" not in p.stderr + p.stdout, p.stderr
    assert not out.exists()
