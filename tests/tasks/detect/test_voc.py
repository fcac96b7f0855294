"""Pascal VOC folders as people label them (vitattn.tasks.detect.voc): both layouts read and
scored, what is odd counted, what is broken refused by file before anything is written."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

pytest.importorskip("pycocotools")
pytest.importorskip("torchvision")

from test_detect import SMALL, script  # noqa: E402

from vitattn.tasks.detect import voc  # noqa: E402

RACCOON = Path(__file__).resolve().parents[3].parent / "shared" / "data" / "raccoon"


def xml(name: str, size: tuple[int, int] | None, objects: list[tuple], extra: str = "") -> str:
    """A labelImg-style annotation: ``objects`` of (name, xmin, ymin, xmax, ymax[, difficult])."""
    parts = [f"<annotation>{extra}<folder>images</folder><filename>{name}</filename>"]
    if size:
        parts.append(f"<size><width>{size[0]}</width><height>{size[1]}</height><depth>3</depth></size>")
    for o in objects:
        difficult = o[5] if len(o) > 5 else 0
        parts.append(f"<object><name>{o[0]}</name><difficult>{difficult}</difficult><bndbox><xmin>{o[1]}</xmin>"
                     f"<ymin>{o[2]}</ymin><xmax>{o[3]}</xmax><ymax>{o[4]}</ymax></bndbox></object>")
    return "".join(parts) + "</annotation>"


def write_voc(root: Path, layout: str = "flat", n_train: int = 8, n_val: int = 4) -> Path:
    """A VOC folder of 64x64 JPEGs with one or two squares of 'cat' / 'dog', in ``layout``."""
    from PIL import Image

    ann, images, lists = (root / p for p in voc.LAYOUTS[layout])
    for d in (ann, images, lists):
        d.mkdir(parents=True, exist_ok=True)
    g = torch.Generator().manual_seed(0)
    for split, n in (("train", n_train), ("val", n_val)):
        stems = []
        for i in range(n):
            stem = f"{split}{i}"
            img = torch.full((64, 64, 3), 120, dtype=torch.uint8)
            objects = []
            for k in range(1 + i % 2):
                side = int(torch.randint(14, 24, (1,), generator=g))
                x, y = (int(v) for v in torch.randint(0, 64 - side, (2,), generator=g))
                cat = (i + k) % 2 == 0
                img[y:y + side, x:x + side] = torch.tensor([220, 40, 40] if cat else [40, 40, 220], dtype=torch.uint8)
                objects.append(("cat" if cat else "dog", x + 1, y + 1, x + side, y + side))
            Image.fromarray(img.numpy()).save(images / f"{stem}.jpg", quality=95)
            (ann / f"{stem}.xml").write_text(xml(f"{stem}.jpg", (64, 64), objects))
            stems.append(stem)
        (lists / f"{split}.txt").write_text("\n".join(stems) + "\n")
    return root


@pytest.mark.parametrize("layout", ["voc", "flat"])
def test_both_layouts_read_as_one_coco_numbering(tmp_path, layout):
    root = write_voc(tmp_path / layout, layout)
    names = voc.class_names(root, ["train", "val"])
    assert names == {"cat": 1, "dog": 2}  # sorted over every split: one numbering per folder
    data, images, odd = voc.check_voc(root, "train", names)
    assert len(data["images"]) == 8 and len(data["annotations"]) == 12 and images.is_dir()
    assert [c["name"] for c in data["categories"]] == ["cat", "dog"]
    assert all(v == 0 for v in odd.values())


def test_what_is_odd_is_handled_and_counted(tmp_path):
    """difficult (ignored: a crowd region), a box beyond the image (clamped), a <size> that
    disagrees (the image wins), an image without objects (kept), and EXIF: boxes drawn on the
    stored pixels turn with the image."""
    from PIL import Image

    root = write_voc(tmp_path / "f")
    ann, images = root / "annotations", root / "images"
    (ann / "train0.xml").write_text(xml("train0.jpg", (64, 64), [("cat", 5, 5, 20, 20, 1), ("dog", 30, 30, 80, 60)]))
    (ann / "train1.xml").write_text(xml("train1.jpg", (999, 999), [("cat", 1, 1, 10, 10)]))
    (ann / "train2.xml").write_text(xml("train2.jpg", (64, 64), []))
    # a 64 wide, 32 high image stored sideways: EXIF orientation 6 (turn 90 degrees clockwise)
    exif = Image.Exif()
    exif[0x0112] = 6
    Image.new("RGB", (64, 32), (120, 120, 120)).save(images / "train3.jpg", exif=exif)
    (ann / "train3.xml").write_text(xml("train3.jpg", (64, 32), [("dog", 1, 1, 11, 21)]))
    data, _, odd = voc.check_voc(root, "train", {"cat": 1, "dog": 2})
    assert odd == dict(difficult=1, clamped=1, size_disagrees=1, images_without_objects=1, exif_turned=1)
    by_image = {im["stem"]: im for im in data["images"]}
    assert (by_image["train3"]["width"], by_image["train3"]["height"]) == (32, 64)  # upright
    turned = [a for a in data["annotations"] if a["image_id"] == by_image["train3"]["id"]][0]
    assert turned["bbox"] == [11.0, 1.0, 20.0, 10.0]  # (x, y) -> (h - y, x): x 11-31, y 1-11
    difficult = [a for a in data["annotations"] if a["iscrowd"]]
    assert len(difficult) == 1 and difficult[0]["category_id"] == 1
    clamped = [a for a in data["annotations"] if a["image_id"] == by_image["train0"]["id"] and not a["iscrowd"]]
    assert clamped[0]["bbox"] == [30.0, 30.0, 34.0, 30.0]


BROKEN = {
    "truncated XML": (lambda r: (r / "annotations" / "train1.xml").write_text("<annotation><object><name>ca"),
                      "train1.xml: not well-formed XML"),
    "an entity": (lambda r: (r / "annotations" / "train1.xml").write_text(
        '<!DOCTYPE a [<!ENTITY x "xx">]><annotation>&x;</annotation>'), "train1.xml: declares a document type"),
    "an inverted box": (lambda r: (r / "annotations" / "train1.xml").write_text(
        xml("train1.jpg", (64, 64), [("cat", 30, 5, 20, 20)])), "train1.xml: object 1 (cat) has an inverted or empty"),
    "a zero-size box": (lambda r: (r / "annotations" / "train1.xml").write_text(
        xml("train1.jpg", (64, 64), [("cat", 5, 5, 5, 20)])), "inverted or empty box"),
    "a coordinate that is no number": (lambda r: (r / "annotations" / "train1.xml").write_text(
        xml("train1.jpg", (64, 64), [("cat", "five", 5, 20, 20)])), "<xmin> is 'five', not a number"),
    "an object without a name": (lambda r: (r / "annotations" / "train1.xml").write_text(
        xml("train1.jpg", (64, 64), [("", 5, 5, 20, 20)])), "train1.xml: object 1 has no <name>"),
    "an object without a box": (lambda r: (r / "annotations" / "train1.xml").write_text(
        "<annotation><filename>train1.jpg</filename><object><name>cat</name></object></annotation>"),
        "object 1 (cat) has no <bndbox>"),
    "a missing XML": (lambda r: (r / "annotations" / "train1.xml").unlink(), "train1.xml: the annotation file"),
    "a missing image": (lambda r: (r / "images" / "train1.jpg").unlink(), "no image for the listed stem 'train1'"),
    "a file that is no image": (lambda r: (r / "images" / "train1.jpg").write_bytes(b"not a jpeg"),
                                "train1.jpg: not an image that opens"),
    "an empty split": (lambda r: (r / "val.txt").write_text("\n"), "val.txt: the 'val' split lists no image"),
    "a missing split list": (lambda r: (r / "val.txt").unlink(), "val.txt: no list of the 'val' split"),
}


@pytest.mark.parametrize("case", list(BROKEN))
def test_a_broken_folder_exits_2_naming_the_file_with_nothing_written(tmp_path, case):
    root = write_voc(tmp_path / "voc")
    damage, message = BROKEN[case]
    damage(root)
    out = tmp_path / "run"
    r = script("--data-dir", str(root), *SMALL, "--epochs", "1", "--output", str(out), timeout=120)
    assert r.returncode == 2, r.stdout + r.stderr
    err = r.stderr.strip().splitlines()
    assert len(err) == 1 and message in err[0] and "Traceback" not in r.stderr, r.stderr
    assert not out.exists()


def test_a_voc_folder_trains_and_scores_by_class_name_through_the_script(tmp_path):
    root = write_voc(tmp_path / "voc", "voc")
    out = tmp_path / "run"
    r = script("--data-dir", str(root), *SMALL, "--epochs", "2", "--output", str(out), "--detector", "fcos")
    assert r.returncode == 0, r.stderr
    assert "train: 0 difficult, 0 clamped" in r.stdout
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [row["epoch"] for row in rows] == [1, 2] and set(rows[-1]["per_class_50"]) == {"cat", "dog"}
    assert -1 <= rows[-1]["map_50"] <= 1 and "map_small" in rows[-1]
    ck = torch.load(out / "checkpoints" / "detector.pt", weights_only=True)
    assert ck["class_names"] == ["background", "cat", "dog"]
    forced = script("--data-dir", str(root), *SMALL, "--epochs", "1", "--output", str(tmp_path / "c"),
                    "--format", "coco", timeout=120)
    assert forced.returncode == 2 and "instances_train.json" in forced.stderr


@pytest.mark.skipif(not RACCOON.is_dir(), reason="the raccoon photographs are not in ../shared/data")
def test_the_raccoon_folder_is_checked_whole_in_well_under_a_second():
    import time

    t = time.perf_counter()
    names = voc.class_names(RACCOON, ["train", "val"])
    counts = [len(voc.check_voc(RACCOON, s, names)[0]["annotations"]) for s in ("train", "val")]
    assert time.perf_counter() - t < 1.0 and names == {"raccoon": 1} and counts == [173, 44]


def test_a_train_cifar_run_starts_the_backbone_and_the_run_says_what_it_resampled(tmp_path, folder):
    """--initial-checkpoint takes the ViT a train_cifar.py run saved, built with its fields; the
    first lines say what was loaded and how its learned positions meet the detection grid."""
    from conftest import tiny

    import train_cifar as T

    cls = T.main(tiny(tmp_path / "cls", folder, epochs=1, model="vit", vit_preset="vit_quick"))
    weights = Path(cls["out"]) / "checkpoints" / "vit.safetensors"
    root = write_voc(tmp_path / "voc")
    args = SMALL[SMALL.index("--model") + 4:]  # no preset or fields: the checkpoint's
    args[args.index("--strides") + 1:args.index("--strides") + 3] = ["4", "8"]  # patch 4: strides 4 and 8
    r = script("--data-dir", str(root), "--model", "vit_quick", *args, "--epochs", "1", "--output",
               str(tmp_path / "det"), "--initial-checkpoint", str(weights), "--detector", "fcos")
    assert r.returncode == 0, r.stderr
    line = next(s for s in r.stdout.splitlines() if s.startswith("backbone from"))
    assert "vit_quick, trained on 32x32 images" in line and "80 tensors loaded" in line, line
    assert "the learned 8x8 position table, resampled to each image's grid as it runs" in line, line
    wrong = script("--data-dir", str(root), "--model", "vit_tiny_patch16_224", *args, "--epochs", "1", "--output",
                   str(tmp_path / "x"), "--initial-checkpoint", str(weights), timeout=120)
    assert wrong.returncode == 2 and "holds weights of vit_quick, not vit_tiny_patch16_224" in wrong.stderr
    assert not (tmp_path / "x").exists()


def test_the_constant_box_control_is_scored_by_the_same_evaluator(tmp_path):
    root = write_voc(tmp_path / "voc")
    out = tmp_path / "control"
    r = script("--data-dir", str(root), "--control", "--output", str(out), "--no-progress", timeout=120)
    assert r.returncode == 0, r.stderr
    summary = json.loads((out / "summary.json").read_text())
    x0, y0, x1, y1 = summary["result"]["final_box"]
    assert summary["control"] and 0 <= x0 < x1 <= 1 and 0 <= y0 < y1 <= 1
    result = summary["result"]
    assert 0 <= result["final_map_50"] <= 1 and set(result["final_per_class_50"]) == {"cat", "dog"}
