"""Detect shapes on texture: a ViTDet backbone against a ResNet-18 one, same detector, same budget.

The data set is drawn here, so nothing is downloaded: each 128x128 image is a textured background
(`vitattn.tasks.classify.longrange.textured_background`: colour blobs, stripes and noise) with 2-5 filled shapes
of 4 classes (circle, square, triangle, cross), 12-40 px, overlapping little. It is written as a
COCO-format folder (``<work-dir>/shapes``: PNGs and ``annotations/instances_{train,val}.json``)
and each backbone trains on it by running ``examples/train_detection.py``, the script for a
user's own COCO folder, with the same detector (FCOS), pyramid strides (8, 16, 32), width, optimiser
and *wall-clock* budget of training steps (loading and evaluation outside it). Metrics: COCO box
AP from pycocotools, per epoch, in each run folder.

    python examples/detect_shapes.py                 # ~17 min on 2 cores
    python examples/detect_shapes.py --train-images 64 --val-images 16 --budget 0.2 --no-figure   # smoke run

Writes ``docs/results/detect_shapes.json`` (config, versions, hardware, results) and
``docs/img/detect_shapes.png`` (held-out images with both models' boxes).

References: Li et al. 2022 (ViTDet); Tian et al. 2019 (FCOS); airbench's layout (sections,
timing that excludes evaluation, results saved with their config).
"""

from __future__ import annotations

import argparse
import functools
import io
import json
import shutil
import subprocess
import sys
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from torchvision.ops import box_iou

from vitattn.tasks import detect
from vitattn.tasks.classify.longrange import textured_background
from vitattn.tasks.detect import Config as RunConfig
from vitattn.training.checkpoint import load_checkpoint
from vitattn.training.runtime import environment

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "examples" / "train_detection.py"
CLASSES = ("circle", "square", "triangle", "cross")  # category ids 1..4


# -- hyperparameters --------------------------------------------------------------------------
@dataclass
class Config:
    backbones: tuple[str, ...] = ("vit", "resnet18")
    budget_min: float = 380 / 60  # training minutes per backbone
    epochs: int = 100  # an upper bound: the budget ends the runs
    img_size: int = 128  # square images, pixels
    min_objects: int = 2
    max_objects: int = 5
    min_side: int = 12  # object size range, pixels
    max_side: int = 40
    train_images: int = 12_000
    val_images: int = 200
    batch_size: int = 16
    lr: float = 1e-3  # AdamW peak learning rate
    weight_decay: float = 0.05
    warmup: float = 0.05  # of the run, linear warm-up; then cosine to zero
    grad_clip: float = 1.0
    out_channels: int = 64  # pyramid width for both backbones
    strides: tuple[int, ...] = (8, 16)  # plus the pooled 32
    # the ViT: patch 8 gives a 16x16 grid (objects span 1.5-5 patches, as small COCO objects do
    # for ViTDet's patch 16 at 1024 px); pyramid branches x1 and x0.5 of its map
    vit: tuple[tuple[str, object], ...] = (("img_size", 128), ("patch_size", 8), ("embed_dim", 128), ("depth", 6),
                                           ("num_heads", 4), ("class_token", False), ("global_pool", "avg"))
    seed: int = 0

    def run_config(self, backbone: str, data: Path, out: Path) -> RunConfig:
        """The train_detection.py options of one backbone's run."""
        model = (dict(model="vit_tiny_patch16_224", model_kwargs=json.dumps(dict(self.vit)))
                 if backbone == "vit" else dict(model=backbone))
        return RunConfig(data_dir=str(data), detector="fcos", **model, strides=self.strides,
                         out_channels=self.out_channels, min_size=self.img_size, max_size=self.img_size, aug="none",
                         epochs=self.epochs, time_budget=self.budget_min, batch_size=self.batch_size, lr=self.lr,
                         weight_decay=self.weight_decay, warmup=self.warmup, grad_clip=self.grad_clip, workers=0,
                         device="cpu", seed=self.seed, progress=False, out=str(out))


# -- data -------------------------------------------------------------------------------------
@functools.cache
def pixel_grid(size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Row and column coordinates of the pixel centres, each ``(size, size)``."""
    return torch.meshgrid(torch.arange(size) + 0.5, torch.arange(size) + 0.5, indexing="ij")


def shape_mask(kind: int, cy: float, cx: float, r: float, size: int) -> torch.Tensor:
    """Boolean ``(size, size)`` mask of a shape of half-side ``r`` centred at ``(cy, cx)``."""
    yy, xx = pixel_grid(size)
    dy, dx = yy - cy, xx - cx
    if kind == 0:  # circle
        return dy**2 + dx**2 <= r**2
    if kind == 1:  # square
        return (dy.abs() <= r) & (dx.abs() <= r)
    if kind == 2:  # triangle pointing up: widens from the apex to the base
        return (dy.abs() <= r) & (dx.abs() <= (dy + r) / 2)
    bar = r / 3  # cross ('+')
    return ((dy.abs() <= r) & (dx.abs() <= bar)) | ((dx.abs() <= r) & (dy.abs() <= bar))


def make_image(g: torch.Generator, c: Config) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """One image ``(3, size, size)`` in [0, 1] and its target ``{'boxes' (n, 4) x1 y1 x2 y2,
    'labels' (n,) 1..4}``."""
    img = textured_background(1, c.img_size, g)[0] / 255
    n = int(torch.randint(c.min_objects, c.max_objects + 1, (1,), generator=g))
    boxes, labels = [], []
    for _ in range(20 * n):  # rejection sampling of places that overlap little
        if len(boxes) == n:
            break
        side = float(torch.randint(c.min_side, c.max_side + 1, (1,), generator=g))
        cy, cx = (torch.rand(2, generator=g) * (c.img_size - side) + side / 2).tolist()
        kind = int(torch.randint(len(CLASSES), (1,), generator=g))
        mask = shape_mask(kind, cy, cx, side / 2, c.img_size)
        ys, xs = mask.nonzero(as_tuple=True)
        box = torch.tensor([xs.min(), ys.min(), xs.max() + 1, ys.max() + 1], dtype=torch.float32)
        if boxes and box_iou(box[None], torch.stack(boxes)).max() > 0.1:
            continue
        colour = torch.rand(3, 1, generator=g)
        img[:, mask] = colour + 0.05 * torch.randn(3, int(mask.sum()), generator=g)
        boxes.append(box)
        labels.append(kind + 1)
    target = {"boxes": torch.stack(boxes), "labels": torch.tensor(labels, dtype=torch.int64)}
    return img.clamp(0, 1), target


def write_coco(root: Path, split: str, n: int, seed: int, c: Config) -> None:
    """``n`` images as PNGs in ``root/split`` and their boxes in ``root/annotations/instances_<split>.json``."""
    from PIL import Image

    g = torch.Generator().manual_seed(seed)
    (root / split).mkdir(parents=True, exist_ok=True)
    images, anns = [], []
    for i in range(n):
        img, target = make_image(g, c)
        name = f"{i:06d}.png"
        Image.fromarray((img * 255).round().byte().permute(1, 2, 0).numpy()).save(root / split / name)
        images.append({"id": i, "file_name": name, "height": c.img_size, "width": c.img_size})
        for (x1, y1, x2, y2), label in zip(target["boxes"].tolist(), target["labels"].tolist()):
            anns.append({"id": len(anns) + 1, "image_id": i, "category_id": label, "bbox": [x1, y1, x2 - x1, y2 - y1],
                         "area": (x2 - x1) * (y2 - y1), "iscrowd": 0})
    (root / "annotations").mkdir(exist_ok=True)
    cats = [{"id": k + 1, "name": name} for k, name in enumerate(CLASSES)]
    (root / "annotations" / f"instances_{split}.json").write_text(
        json.dumps({"images": images, "annotations": anns, "categories": cats}))


def shapes_folder(work: Path, c: Config) -> Path:
    """The data set as a COCO-format folder, written once per data config (its name says which)."""
    key = json.dumps([c.img_size, c.min_objects, c.max_objects, c.min_side, c.max_side, c.train_images,
                      c.val_images, c.seed])
    root = work / "shapes"
    if (root / "key.json").exists() and (root / "key.json").read_text() == key:
        return root
    write_coco(root, "train", c.train_images, c.seed + 1, c)
    write_coco(root, "val", c.val_images, c.seed + 1000, c)  # another seed: held out
    (root / "key.json").write_text(key)
    return root


# -- figure -----------------------------------------------------------------------------------
def figure(images: list, preds_by_name: dict[str, list], path: Path, thresh: float = 0.5) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names, n = list(preds_by_name), len(images)
    fig, axes = plt.subplots(len(names), n, figsize=(1.9 * n, 2.0 * len(names)), squeeze=False)
    colours = ("tab:red", "tab:blue", "tab:green", "tab:orange")
    for r, name in enumerate(names):
        for i in range(n):
            ax = axes[r, i]
            ax.imshow(images[i].permute(1, 2, 0).numpy())
            ax.set_xticks([])
            ax.set_yticks([])
            p = preds_by_name[name][i]
            for box, label, score in zip(p["boxes"], p["labels"], p["scores"]):
                if score < thresh:
                    continue
                x1, y1, x2, y2 = box.tolist()
                col = colours[int(label) - 1]
                ax.add_patch(plt.Rectangle((x1, y1), x2 - x1, y2 - y1, fill=False, color=col, lw=1.2))
                ax.text(x1, y1 - 1, f"{CLASSES[int(label) - 1][:3]} {score:.2f}", color=col, fontsize=5)
            if i == 0:
                ax.set_ylabel(name, fontsize=8)
    fig.suptitle(f"held-out images, predictions with score >= {thresh}", fontsize=8)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    buf = io.BytesIO()
    fig.savefig(buf, dpi=90)
    plt.close(fig)
    save_small_png(buf, path)


def save_small_png(src, path: Path, colours: int = 128) -> None:
    """Save a PNG with an adaptive palette: textures compress badly in full colour (keeps the
    docs' pictures under 200 KB)."""
    from PIL import Image

    Image.open(src).convert("RGB").quantize(colours).save(path, optimize=True)


# -- main -------------------------------------------------------------------------------------
def train_run(cfg: RunConfig) -> dict:
    """``train_detection.py`` run as a program with ``cfg``'s options (a ``-c`` file beside the run
    folder); its summary, with the weights the run kept loaded into a detector under ``'model'``."""
    import yaml

    out = Path(cfg.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    options = out.parent / f"{out.name}.yaml"
    options.write_text(yaml.safe_dump({k: list(v) if isinstance(v, tuple) else v for k, v in asdict(cfg).items()}))
    if subprocess.run([sys.executable, str(SCRIPT), "-c", str(options)], cwd=ROOT).returncode:
        raise SystemExit(f"{SCRIPT.name} -c {options} failed; its run folder is {out}")
    resumed = load_checkpoint(out / "checkpoints" / "detector.pt")
    model = detect.build_model(cfg, len(resumed["category_ids"]))
    model.load_state_dict(resumed["model"])
    return {**json.loads((out / "summary.json").read_text()), "model": model}


@torch.no_grad()
def predict(model, root: Path, n: int) -> tuple[list, list]:
    """The first ``n`` val images and the model's detections on them."""
    from PIL import Image
    from torchvision.transforms.v2.functional import pil_to_tensor

    model.eval()
    images = [pil_to_tensor(Image.open(root / "val" / f"{i:06d}.png")).float() / 255 for i in range(n)]
    return images, model(images)


def main(c: Config, work: Path, figure_path: Path | None = None, results_path: Path | None = None) -> dict:
    root = shapes_folder(work, c)
    results, preds_by_name, images = {}, {}, None
    for name in c.backbones:
        out = work / "runs" / name
        if out.exists():
            shutil.rmtree(out)  # a fresh run each time: the budget is the experiment
        summary = train_run(c.run_config(name, root, out))
        if summary["status"] != "ok":
            raise SystemExit(f"{name}: the run stopped ({summary['status']}); its folder is {out}")
        print(f"{name}: {summary['state']['global_step']} steps, AP {summary['final']['map']:.3f}, "
              f"AP50 {summary['final']['map_50']:.3f}", flush=True)
        results[name] = {k: summary[k] for k in ("final", "state", "params", "images_per_s")}
        results[name]["backbone_params"] = sum(p.numel() for p in summary["model"].backbone.parameters())
        images, preds_by_name[name] = predict(summary["model"], root, 5)
    report = {"config": asdict(c), "results": results, "env": environment(torch.device("cpu"))}
    if figure_path is not None:
        figure(images, preds_by_name, figure_path)
    if results_path is not None:
        results_path.parent.mkdir(parents=True, exist_ok=True)
        results_path.write_text(json.dumps(report, indent=2))
    return report


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--budget", type=float, default=Config.budget_min, help="training minutes per backbone")
    ap.add_argument("--epochs", type=int, default=Config.epochs, help="at most this many epochs per backbone")
    ap.add_argument("--train-images", type=int, default=Config.train_images)
    ap.add_argument("--val-images", type=int, default=Config.val_images)
    ap.add_argument("--backbones", nargs="+", default=list(Config.backbones), choices=["vit", "resnet18"])
    ap.add_argument("--work-dir", type=Path, default=ROOT / "runs" / "detect_shapes",
                    help="where the COCO folder and the runs go")
    ap.add_argument("--no-figure", action="store_true")
    ap.add_argument("--results", type=Path, default=ROOT / "docs" / "results" / "detect_shapes.json")
    a = ap.parse_args()
    cfg = Config(budget_min=a.budget, epochs=a.epochs, train_images=a.train_images, val_images=a.val_images,
                 backbones=tuple(a.backbones))
    torch.set_num_threads(min(2, torch.get_num_threads()))
    main(cfg, a.work_dir, None if a.no_figure else ROOT / "docs" / "img" / "detect_shapes.png", a.results)
