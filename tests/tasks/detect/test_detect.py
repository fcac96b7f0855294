"""examples/train_detection.py end to end on a tiny COCO-format folder made here, and the shapes
example's folder through it."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("pycocotools")
pytest.importorskip("torchvision")

from vitattn.tasks import detect  # noqa: E402  (after the skips)
from vitattn.tasks.detect.coco import check_coco, load_split  # noqa: E402
from vitattn.training import cli  # noqa: E402

ROOT = Path(__file__).resolve().parents[3]
SCRIPT = ROOT / "examples" / "train_detection.py"
TINY_VIT = json.dumps(dict(img_size=64, patch_size=8, embed_dim=32, depth=2, num_heads=2))
SMALL = ["--model", "vit_tiny_patch16_224", "--model-kwargs", TINY_VIT, "--strides", "8", "16",
         "--out-channels", "32", "--min-size", "64", "--max-size", "64", "--batch-size", "4", "--workers", "0",
         "--lr", "1e-3", "--no-progress"]


def write_coco(root: Path, split: str, n: int, seed: int) -> dict:
    """``n`` 64x64 PNGs of one or two filled squares on grey, categories 3 ('red') and 7 ('blue')
    (ids need not be 1..K); image 0 has no annotation and image 1 a crowd region besides."""
    from PIL import Image

    g = torch.Generator().manual_seed(seed)
    (root / split).mkdir(parents=True)
    images, anns = [], []
    for i in range(n):
        img = torch.full((64, 64, 3), 128, dtype=torch.uint8)
        for _ in range(0 if i == 0 else 1 + i % 2):
            side = int(torch.randint(12, 24, (1,), generator=g))
            x, y = (int(v) for v in torch.randint(0, 64 - side, (2,), generator=g))
            red = bool(torch.rand(1, generator=g) < 0.5)
            img[y:y + side, x:x + side] = torch.tensor([220, 30, 30] if red else [30, 30, 220], dtype=torch.uint8)
            anns.append({"id": len(anns) + 1, "image_id": 100 + i, "category_id": 3 if red else 7,
                         "bbox": [x, y, side, side], "area": side * side, "iscrowd": 0,
                         "segmentation": [[x, y, x + side, y, x + side, y + side, x, y + side]]})
        if i == 1:
            anns.append({"id": len(anns) + 1, "image_id": 100 + i, "category_id": 3, "bbox": [0, 0, 8, 8],
                         "area": 64, "iscrowd": 1, "segmentation": {"counts": [0, 64], "size": [64, 64]}})
        Image.fromarray(img.numpy()).save(root / split / f"im{i}.png")
        images.append({"id": 100 + i, "file_name": f"im{i}.png", "height": 64, "width": 64})
    data = {"images": images, "annotations": anns,
            "categories": [{"id": 3, "name": "red"}, {"id": 7, "name": "blue"}]}
    (root / "annotations").mkdir(exist_ok=True)
    (root / "annotations" / f"instances_{split}.json").write_text(json.dumps(data))
    return data


@pytest.fixture(scope="module")
def coco(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("coco")
    write_coco(root, "train", 12, 0)
    write_coco(root, "val", 6, 1)
    boxes = json.loads((root / "annotations" / "instances_train.json").read_text())
    for a in boxes["annotations"]:
        a.pop("segmentation", None)
    (root / "annotations" / "instances_boxes.json").write_text(json.dumps(boxes))  # boxes only, no masks
    shutil.copytree(root / "train", root / "boxes")
    return root


def script(*args: str, timeout: float = 300) -> subprocess.CompletedProcess:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    return subprocess.run([sys.executable, str(SCRIPT), *args], capture_output=True, text=True, timeout=timeout,
                          env=env, cwd=ROOT)


def test_one_epoch_end_to_end_writes_coco_ap_then_resumes_to_the_next(coco, tmp_path):
    out = tmp_path / "run"
    r = script("--data-dir", str(coco), *SMALL, "--epochs", "3", "--limit-train", "8", "--output", str(out),
               "--detector", "fcos", "--seed", "1")
    assert r.returncode == 0, r.stderr
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [row["epoch"] for row in rows] == [1, 2, 3] and rows[-1]["step"] == 6  # 8 annotated images, batch 4
    assert rows[-1]["train_loss"] < rows[0]["train_loss"]  # it learns
    for key in ("map", "map_50", "map_75", "map_small", "map_medium", "map_large"):
        assert all(-1 <= row[key] <= 1 for row in rows), key
    summary = json.loads((out / "summary.json").read_text())
    assert summary["status"] == "ok" and summary["final"] == rows[-1]
    assert summary["result"]["final_map"] == rows[-1]["map"] and summary["result"]["steps"] == 6
    ck = torch.load(out / "checkpoints" / "detector.pt", weights_only=True)
    assert ck["category_ids"] == [0, 3, 7] and ck["state"]["epoch"] == 3
    # a finished run resumed does no more steps and keeps its results
    r = script("--resume", str(out))
    assert r.returncode == 0, r.stderr
    assert len((out / "metrics.jsonl").read_text().splitlines()) == 3


def test_an_interrupted_run_resumes_where_it_stopped(td, coco, tmp_path, monkeypatch, one_thread):
    """In process: a Ctrl-C during the first step stops the run after it with a checkpoint; the
    resume finishes the epoch with the images the first part had not seen."""
    import signal

    cfg = cli.parse_config(cli.build_parser(td.Config, ""), td.Config,
                          ["--data-dir", str(coco), *SMALL, "--epochs", "1", "--limit-train", "8",
                           "--output", str(tmp_path / "r"), "--detector", "retinanet"])
    real = detect.DetectionTask.loss

    def interrupted_step(self, net, batch):
        signal.raise_signal(signal.SIGINT)  # the loop finishes this step and stops before the next
        return real(self, net, batch)

    monkeypatch.setattr(detect.DetectionTask, "loss", interrupted_step)
    first = td.main(cfg)
    assert first["status"] == "interrupted" and first["signal"] == signal.SIGINT
    assert first["state"]["global_step"] == 1 and first["state"]["images_seen"] == 4
    monkeypatch.setattr(detect.DetectionTask, "loss", real)
    second = td.main(td.Config(resume=str(tmp_path / "r"), progress=False))
    assert second["status"] == "ok" and second["state"]["global_step"] == 2 and second["state"]["epoch"] == 1
    assert second["state"]["images_seen"] == 8  # each training image once


def test_maskrcnn_trains_on_the_folder_and_resnet_is_the_baseline(coco, tmp_path):
    r = script("--data-dir", str(coco), *SMALL[:4], "--strides", "8", "16", "--out-channels", "32",
               "--min-size", "64", "--max-size", "64", "--batch-size", "4", "--workers", "1", "--epochs", "1",
               "--limit-train", "4", "--limit-val", "3", "--detector", "maskrcnn", "--aug", "ssd",
               "--output", str(tmp_path / "m"))
    assert r.returncode == 0, r.stderr
    r = script("--data-dir", str(coco), "--model", "resnet18", "--strides", "8", "16", "--out-channels", "32",
               "--min-size", "64", "--max-size", "64", "--batch-size", "4", "--workers", "0", "--epochs", "1",
               "--limit-train", "4", "--limit-val", "3", "--output", str(tmp_path / "c"))
    assert r.returncode == 0, r.stderr
    assert json.loads((tmp_path / "c" / "summary.json").read_text())["state"]["global_step"] == 1


@pytest.fixture(scope="module")
def td():
    """The script as a module (it is not in the package), for in-process calls."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("train_detection", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    sys.modules["train_detection"] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    yield module
    del sys.modules["train_detection"]


def refused(td, capsys, argv: list[str]) -> str:
    """Run the command line in process; it must exit 2 with one line and no traceback."""
    try:
        code = td.command_line(argv)
    except SystemExit as e:  # argparse's own refusals
        code = e.code
    err = capsys.readouterr().err
    assert code == 2, err
    assert "Traceback" not in err and err.strip().splitlines()[-1].count("error") == 1
    return err


@pytest.mark.parametrize("args, message", [
    (["--data-dir", "{tmp}/none"], "no such folder"),
    (["--data-dir", "{coco}", "--train-split", "test"], "no annotation file"),
    (["--data-dir", "{bad}"], "is not a COCO instances file"),
    (["--data-dir", "{coco}", "--model", "resnet18", "--strides", "64"], "a ResNet's levels have strides"),
    (["--data-dir", "{coco}", "--model", "cnn_longrange"], "is a cnn preset"),
    (["--data-dir", "{coco}", "--model", "resnet18", "--pretrained"], "--pretrained apply to a ViT backbone"),
    (["--data-dir", "{coco}", "--strides", "16", "8"], "must be distinct and finest first"),
    (["--data-dir", "{coco}", "--strides", "8", "0"], "--strides must be > 0"),
    (["--data-dir", "{coco}", "--model-kwargs", "{{\"depht\": 2}}"], "depht"),
    (["--data-dir", "{coco}", "--output", "{coco}"], "is not a new or empty folder"),
    (["--data-dir", "{coco}", "--detector", "maskrcnn", "--train-split", "boxes"], "needs a 'segmentation'"),
    (["--data-dir", "{coco}", "--window-size", "100"], "--window-size 100 covers the whole token grid"),
    ([], "--data-dir is needed"),
])
def test_bad_input_is_one_line_exit_2_and_writes_nothing(td, coco, tmp_path, capsys, args, message):
    bad = tmp_path / "bad"
    (bad / "annotations").mkdir(parents=True)
    (bad / "train").mkdir()
    (bad / "annotations" / "instances_train.json").write_text(json.dumps({"images": [], "annotations": []}))
    args = [a.format(tmp=tmp_path, coco=coco, bad=bad) for a in args]
    before = sorted(p.name for p in tmp_path.iterdir())
    assert message in refused(td, capsys, [*args, "--epochs", "1", "--output", str(tmp_path / "o")]
                              if "--output" not in args else [*args, "--epochs", "1"])
    assert sorted(p.name for p in tmp_path.iterdir()) == before


def test_missing_images_are_named_before_anything_is_written(td, coco, tmp_path, capsys):
    import shutil

    broken = tmp_path / "broken"
    shutil.copytree(coco, broken)
    (broken / "val" / "im3.png").unlink()
    err = refused(td, capsys, ["--data-dir", str(broken), *SMALL, "--output", str(tmp_path / "o")])
    assert "image 103: im3.png is not in" in err
    assert not (tmp_path / "o").exists()


def test_the_shapes_example_writes_a_coco_folder_and_runs_through_the_script(tmp_path):
    r = subprocess.run([sys.executable, str(ROOT / "examples" / "detect_shapes.py"), "--train-images", "16",
                        "--val-images", "8", "--epochs", "1", "--budget", "0.05", "--no-figure",
                        "--work-dir", str(tmp_path), "--results", str(tmp_path / "r.json")],
                       capture_output=True, text=True, timeout=600, cwd=ROOT,
                       env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert r.returncode == 0, r.stderr
    ann = json.loads((tmp_path / "shapes" / "annotations" / "instances_val.json").read_text())
    assert len(ann["images"]) == 8 and [c["name"] for c in ann["categories"]] == ["circle", "square", "triangle",
                                                                                   "cross"]
    results = json.loads((tmp_path / "r.json").read_text())["results"]
    assert set(results) == {"vit", "resnet18"}
    assert all(-1 <= results[k]["final"]["map"] <= 1 for k in results)


def _mutate(split: str, change):
    def apply(root: Path) -> None:
        path = root / "annotations" / f"instances_{split}.json"
        data = json.loads(path.read_text())
        change(data, root)
        path.write_text(json.dumps(data))
    return apply


def _sixteen_bit(data, root) -> None:
    from PIL import Image

    pixels = torch.full((64, 64), 40000, dtype=torch.int32).numpy().astype("uint16")
    Image.fromarray(pixels).save(root / "val" / "im2.png")


@pytest.mark.parametrize("change, message", [
    (_mutate("val", lambda d, r: (r / "val" / "im4.png").write_bytes(b"not an image")), "image 104: im4.png is not an "
     "image that opens"),
    (_mutate("val", lambda d, r: d["annotations"][0].update(bbox=["1", "2", "3", "4"])), "bbox must be 4 numbers"),
    (_mutate("val", lambda d, r: d["annotations"][0].update(category_id="3")), "category_id '3' is not a listed"),
    (_mutate("train", lambda d, r: d["annotations"][1].pop("bbox")), "annotation 2: bbox must be 4 numbers"),
    (_mutate("train", lambda d, r: d["annotations"][1].update(bbox=[1, 2, 3])), "got [1, 2, 3]"),
    (_mutate("train", lambda d, r: d["images"][2].pop("file_name")), "image 102: needs a 'file_name'"),
    (_mutate("train", lambda d, r: d["images"][3].update(id=102)), "image id 102 is listed twice"),
    (_mutate("train", lambda d, r: d["annotations"][0].update(image_id=999)), "image_id 999 is not a listed image"),
    (_mutate("train", lambda d, r: d["images"][0].update(file_name="../../../etc/passwd")), "points outside"),
    (_mutate("train", lambda d, r: d["images"][1].update(width=65)), "is 64x64, the file states 65x64"),
    (_mutate("val", _sixteen_bit), "image 102: im2.png has I;16 samples; expected 8-bit images"),
    (_mutate("train", lambda d, r: [a.update(bbox=[70, 70, 5, 5]) for a in d["annotations"]]),
     "no annotated images in split 'train'"),
    (_mutate("val", lambda d, r: [a.update(bbox=[-9, 0, 5, 5]) for a in d["annotations"]]), "nothing to score"),
])
def test_bad_data_anywhere_in_either_split_is_refused_before_the_first_step(td, coco, tmp_path, capsys, change,
                                                                           message):
    import shutil

    broken = tmp_path / "broken"
    shutil.copytree(coco, broken)
    change(broken)
    err = refused(td, capsys, ["--data-dir", str(broken), *SMALL, "--output", str(tmp_path / "o")])
    assert message in err and not (tmp_path / "o").exists()


def test_boxes_crossing_the_edge_are_clamped_and_counted(td, coco, tmp_path):
    import shutil

    root = tmp_path / "c"
    shutil.copytree(coco, root)
    _mutate("train", lambda d, r: (d["annotations"][0].update(bbox=[60, 60, 10, 10]),
                                   d["annotations"][1].update(bbox=[64.5, 10, 5, 5])))(root)
    _, counts = check_coco(root / "annotations" / "instances_train.json", root / "train")
    assert counts == dict(clamped=2, dropped=1, crowd=1, images_without_boxes=1)


def test_a_failing_evaluation_leaves_the_epoch_s_checkpoint(td, coco, tmp_path, capsys, monkeypatch):
    def broken(*args, **kwargs):
        raise RuntimeError("the evaluation failed")

    monkeypatch.setattr(detect.DetectionTask, "evaluate", broken)
    out = tmp_path / "o"
    assert td.command_line(["--data-dir", str(coco), *SMALL, "--epochs", "1", "--output", str(out)]) == 1
    err = capsys.readouterr().err
    assert (out / "checkpoints" / "detector.pt").is_file() and "the last good checkpoint is kept" in err


def test_both_scripts_read_images_alike_upright_by_exif_and_cmyk_as_rgb(td, coco, tmp_path):
    """One reader (``vitattn.tasks.classify.data.read_image``) for the CIFAR folders and the COCO folders."""
    from PIL import Image

    from vitattn.tasks.classify.data import _decode_image, read_image

    tall = Image.new("RGB", (40, 64), (200, 20, 20))  # stored 40 wide, 64 high
    exif = Image.Exif()
    exif[0x0112] = 6  # "rotate 90 degrees clockwise to view": upright it is 64 wide, 40 high
    tall.save(tmp_path / "rot.jpg", exif=exif.tobytes())
    assert read_image(tmp_path / "rot.jpg").size == (64, 40)
    assert tuple(_decode_image((tmp_path / "rot.jpg").read_bytes(), "rot.jpg").shape) == (3, 40, 64)
    Image.new("CMYK", (8, 8), (0, 255, 255, 0)).save(tmp_path / "cmyk.jpg")
    assert read_image(tmp_path / "cmyk.jpg").mode == "RGB"

    root = tmp_path / "c"
    shutil.copytree(coco, root)
    shutil.copy(tmp_path / "rot.jpg", root / "val" / "rot.jpg")
    _mutate("val", lambda d, r: d["images"][2].update(file_name="rot.jpg", width=64, height=40))(root)
    split = load_split(root, "val", train=False)  # the stated size is the upright one: accepted
    image, _ = split.dataset[split.image_ids.index(102)]
    assert tuple(image.shape) == (3, 40, 64)


def test_a_config_json_edited_since_its_checkpoint_is_refused_on_resume(td, coco, tmp_path, capsys):
    out = tmp_path / "o"
    assert td.command_line(["--data-dir", str(coco), *SMALL, "--epochs", "1", "--output", str(out)]) == 0
    saved = json.loads((out / "config.json").read_text())
    (out / "config.json").write_text(json.dumps({**saved, "epochs": 3}))
    err = refused(td, capsys, ["--resume", str(out)])
    assert "config.json no longer matches detector.pt: epochs is 3 there and 1 in the checkpoint" in err


def test_torchrun_trains_on_two_gloo_processes_and_ends_with_equal_weights(coco, tmp_path):
    """The loop train_cifar.py runs, under torchrun: each rank a share of the images (the batch is
    global), the val images detected in shares and scored once, equal weights on both ranks."""
    out = tmp_path / "ddp"
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    r = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
                        str(SCRIPT), "--data-dir", str(coco), *SMALL, "--epochs", "2", "--limit-train", "8",
                        "--detector", "fcos", "--device", "cpu", "--model-ema-decay", "0.5", "--output", str(out)],
                       capture_output=True, text=True, timeout=600, env=env, cwd=ROOT)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-3000:]
    summary = json.loads((out / "summary.json").read_text())
    result = summary["result"]
    assert summary["world_size"] == result["world_size"] == 2 and result["batch_per_rank"] == 2
    assert result["ranks_agree"] is True and result["steps"] == 4  # 8 images, 4 per rank, 2 per step, 2 epochs
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [row["epoch"] for row in rows] == [1, 2] and "map_no_ema" in rows[-1]  # rank 0 alone writes
    ck = torch.load(out / "checkpoints" / "detector.pt", weights_only=True)
    assert len(ck["rng"]) == 2 and ck["state"]["done"]


def test_the_detectors_weights_are_drawn_from_the_seed(td):
    """--seed sets the detector's initial weights too (before, only the data order and the
    augmentation followed it, and two runs of one command trained different detectors)."""
    cfg = td.Config(data_dir="unused", model="vit_quick", detector="fcos", strides=(4, 8), out_channels=32, seed=3)
    a, b = detect.build_model(cfg, 3).state_dict(), detect.build_model(cfg, 3).state_dict()
    assert all(torch.equal(a[k], b[k]) for k in a)
    other = detect.build_model(td.Config(**{**cfg.__dict__, "seed": 4}), 3).state_dict()
    assert not all(torch.equal(a[k], other[k]) for k in a)
