"""Detect shapes on texture: a ViTDet backbone against a ResNet-18 one, same detector, same budget.

The data set is drawn on the fly, so nothing is downloaded: each 128x128 image is a textured
background (`vitattn.longrange.textured_background`: colour blobs, stripes and noise) with 2-5
filled shapes of 4 classes (circle, square, triangle, cross), 12-40 px, overlapping little.
The training stream never repeats; the held-out split is a fixed set of images from another seed.

Both backbones feed the same torchvision detector (FCOS by default, or Faster R-CNN) built by
``vitattn.detection.build_detector`` with the same pyramid strides (4, 8, 16, 32), width, anchors
and optimiser, and each trains for the same *wall-clock* budget of training steps (forward,
backward, update; the learning-rate schedule runs on the fraction of the budget spent, so both
end their schedule). Drawing the data and the evaluation are outside the budget. Metrics: COCO
mAP (IoU 0.50:0.95) and mAP@0.5 with ``vitattn.detection.coco_map``.

    python examples/detect_shapes.py                 # ~14 min on 2 cores
    python examples/detect_shapes.py --budget 20 --val-images 16 --no-figure      # smoke run

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
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from torch import nn
from torchvision.ops import box_iou

import vitattn
from vitattn.detection import ViTDetBackbone, build_detector, coco_map, train_detector
from vitattn.longrange import textured_background
from vitattn.train import count_params, environment

ROOT = Path(__file__).resolve().parent.parent
CLASSES = ("circle", "square", "triangle", "cross")  # labels 1..4; 0 is the background


# -- hyperparameters --------------------------------------------------------------------------
@dataclass
class Config:
    detector: str = "fcos"  # 'fcos' or 'fasterrcnn'
    backbones: tuple[str, ...] = ("vit", "resnet18")
    budget_s: float = 380.0  # training wall-clock seconds per backbone
    img_size: int = 128  # square images, pixels
    min_objects: int = 2
    max_objects: int = 5
    min_side: int = 12  # object size range, pixels
    max_side: int = 40
    batch_size: int = 16
    val_images: int = 200
    lr: float = 1e-3  # AdamW peak learning rate
    weight_decay: float = 0.05
    warmup_frac: float = 0.05  # of the budget, linear warm-up; then cosine to zero
    grad_clip: float = 1.0
    out_channels: int = 64  # pyramid width for both backbones
    # the ViT: patch 8 gives a 16x16 grid (objects span 1.5-5 patches, as small COCO objects do
    # for ViTDet's patch 16 at 1024 px); branches x1, x0.5 and the pool level: strides 8, 16, 32
    vit_patch: int = 8
    vit_scales: tuple[float, ...] = (1.0, 0.5)
    vit_dim: int = 128
    vit_depth: int = 6
    vit_heads: int = 4
    vit_window: int | None = None  # the 16x16 grid is small: global attention is cheap here
    vit_pos_embed: str = "learn"  # 'learn' (timm's default) or 'sincos2d' (fixed, MAE / SimpleViT)
    seed: int = 0
    threads: int = 2


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
    """One image and its target ``{'boxes' (n, 4) x1 y1 x2 y2, 'labels' (n,)}``."""
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


def make_batch(g: torch.Generator, c: Config, n: int):
    images, targets = zip(*(make_image(g, c) for _ in range(n)))
    return list(images), list(targets)


# -- models -----------------------------------------------------------------------------------
class ResNetPyramid(nn.Module):
    """torchvision's ResNet-18 trunk (random init, BatchNorm) with torchvision's FPN on layer2 and
    layer3, strides 8 and 16, and a max-pooled 32: the same levels as the ViT pyramid below."""

    def __init__(self, out_channels: int) -> None:
        super().__init__()
        from torchvision.models import resnet18
        from torchvision.models.detection.backbone_utils import BackboneWithFPN
        from torchvision.ops.feature_pyramid_network import LastLevelMaxPool

        self.body = BackboneWithFPN(resnet18(weights=None), {"layer2": "0", "layer3": "1"}, [128, 256],
                                    out_channels, extra_blocks=LastLevelMaxPool())
        self.out_channels = out_channels
        self.strides = {"0": 8, "1": 16, "pool": 32}

    def forward(self, x: torch.Tensor):
        return self.body(x)


def make_backbone(name: str, c: Config) -> nn.Module:
    if name == "resnet18":
        return ResNetPyramid(c.out_channels)
    vit = vitattn.ViT(img_size=c.img_size, patch_size=c.vit_patch, embed_dim=c.vit_dim, depth=c.vit_depth,
                      num_heads=c.vit_heads, num_classes=0, global_pool="avg", class_token=False,
                      pos_embed=c.vit_pos_embed)
    return ViTDetBackbone(vit, c.out_channels, scale_factors=c.vit_scales, window_size=c.vit_window)


def make_detector(backbone: nn.Module, c: Config) -> nn.Module:
    kw = dict(min_size=c.img_size, max_size=c.img_size, image_mean=[0.5] * 3, image_std=[0.25] * 3)
    if c.detector == "fcos":
        kw.update(score_thresh=0.05, detections_per_img=100)
    else:
        kw.update(box_score_thresh=0.05, box_detections_per_img=100, rpn_pre_nms_top_n_test=300,
                  rpn_post_nms_top_n_test=300, box_batch_size_per_image=128)
    return build_detector(c.detector, backbone, len(CLASSES) + 1, **kw)


# -- training ---------------------------------------------------------------------------------
def train(model: nn.Module, c: Config) -> dict:
    g = torch.Generator().manual_seed(c.seed + 1)  # the same training stream for every backbone
    stats = train_detector(model, lambda: make_batch(g, c, c.batch_size), budget_s=c.budget_s, lr=c.lr,
                           weight_decay=c.weight_decay, warmup=c.warmup_frac, grad_clip=c.grad_clip)
    return {**stats, "images_seen": stats["steps"] * c.batch_size}


@torch.no_grad()
def evaluate(model: nn.Module, val: tuple[list, list], c: Config) -> tuple[dict, list]:
    model.eval()
    images, targets = val
    preds = []
    for i in range(0, len(images), 32):
        preds += model(images[i:i + 32])
    return coco_map(preds, targets), preds


# -- figure -----------------------------------------------------------------------------------
def figure(val, preds_by_name: dict[str, list], path: Path, n: int = 5, thresh: float = 0.5) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(preds_by_name)
    fig, axes = plt.subplots(len(names), n, figsize=(1.9 * n, 2.0 * len(names)), squeeze=False)
    colours = ("tab:red", "tab:blue", "tab:green", "tab:orange")
    for r, name in enumerate(names):
        for i in range(n):
            ax = axes[r, i]
            ax.imshow(val[0][i].permute(1, 2, 0).numpy())
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
def main(c: Config, figure_path: Path | None = None, results_path: Path | None = None) -> dict:
    torch.set_num_threads(c.threads)
    val = make_batch(torch.Generator().manual_seed(c.seed + 1000), c, c.val_images)
    results, preds_by_name = {}, {}
    for name in c.backbones:
        torch.manual_seed(c.seed)
        model = make_detector(make_backbone(name, c), c)
        params = count_params(model.backbone)
        print(f"{name}: {c.detector}, backbone {params / 1e6:.2f}M parameters, budget {c.budget_s:.0f}s", flush=True)
        t0 = time.perf_counter()
        stats = train(model, c)
        t1 = time.perf_counter()
        metrics, preds = evaluate(model, val, c)
        stats.update(backbone_params=params, eval_s=time.perf_counter() - t1, wall_s=time.perf_counter() - t0,
                     map=metrics["map"], map_50=metrics["map_50"], map_75=metrics["map_75"],
                     ap_per_class={CLASSES[k - 1]: v for k, v in metrics["per_class"].items()})
        print(f"{name}: {stats['steps']} steps, mAP {stats['map']:.3f}, mAP@0.5 {stats['map_50']:.3f}, "
              f"loss {stats['loss_first']:.3f} -> {stats['loss_last']:.3f}", flush=True)
        results[name] = stats
        preds_by_name[name] = preds
    report = {
        "config": asdict(c), "results": results,
        "env": environment(torch.device("cpu")),
    }
    if figure_path is not None:
        figure(val, preds_by_name, figure_path)
    if results_path is not None:
        results_path.parent.mkdir(parents=True, exist_ok=True)
        results_path.write_text(json.dumps(report, indent=2))
    return report


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--detector", default=Config.detector, choices=["fcos", "fasterrcnn"])
    ap.add_argument("--budget", type=float, default=Config.budget_s, help="training seconds per backbone")
    ap.add_argument("--val-images", type=int, default=Config.val_images)
    ap.add_argument("--backbones", nargs="+", default=list(Config.backbones), choices=["vit", "resnet18"])
    ap.add_argument("--window", type=int, default=None, help="ViT window size (default: global attention)")
    ap.add_argument("--pos-embed", default=Config.vit_pos_embed, choices=["learn", "sincos2d"])
    ap.add_argument("--no-figure", action="store_true")
    ap.add_argument("--out", type=Path, default=ROOT / "docs" / "results" / "detect_shapes.json")
    a = ap.parse_args()
    cfg = Config(detector=a.detector, budget_s=a.budget, val_images=a.val_images, backbones=tuple(a.backbones),
                 vit_window=a.window, vit_pos_embed=a.pos_embed)
    main(cfg, None if a.no_figure else ROOT / "docs" / "img" / "detect_shapes.png", a.out)
