"""What a detection run shows besides its AP: the control every study must beat, and a picture
of val photographs with their true and predicted boxes.

The control predicts one box per image, the mean training box in coordinates relative to the
image (score 1, the most frequent class), and is scored by the same evaluator: on a data set of
one large object per photograph it already scores, and a detector is worth what it adds to it.
"""

from __future__ import annotations

from collections import Counter
from pathlib import Path
from typing import Any

import torch
from torch import nn

from .coco import Split, coco_eval


def mean_box(train: Split) -> tuple[list[float], int]:
    """The training boxes' mean ``[x0, y0, x1, y1]`` relative to their images, and the most
    frequent category id (ignored regions left out)."""
    coco, sums, cats = train.coco, torch.zeros(4, dtype=torch.float64), Counter()
    n = 0
    for image_id in train.image_ids:
        im = coco.imgs[image_id]
        for a in coco.imgToAnns[image_id]:
            if a.get("iscrowd", 0):
                continue
            x, y, w, h = a["bbox"]
            sums += torch.tensor([x / im["width"], y / im["height"], (x + w) / im["width"], (y + h) / im["height"]],
                                 dtype=torch.float64)
            cats[a["category_id"]] += 1
            n += 1
    return (sums / max(n, 1)).tolist(), cats.most_common(1)[0][0]


def constant_box_control(train: Split, val: Split, max_dets: int = 100) -> dict[str, Any]:
    """COCO AP of one constant box per val image (``mean_box`` of the training split, score 1)."""
    (x0, y0, x1, y1), category = mean_box(train)
    detections = []
    for image_id in val.image_ids:
        im = val.coco.imgs[image_id]
        w, h = im["width"], im["height"]
        detections.append({"image_id": image_id, "category_id": category, "score": 1.0,
                           "bbox": [x0 * w, y0 * h, (x1 - x0) * w, (y1 - y0) * h]})
    return {"box": [x0, y0, x1, y1], **coco_eval(val.coco, detections, val.image_ids, max_dets=max_dets)}


@torch.no_grad()
def draw_predictions(model: nn.Module, val: Split, class_names: list[str], path: Path, device: torch.device,
                     n: int = 8, threshold: float = 0.3, top: int = 3) -> Path:
    """``n`` val photographs with their true boxes (green) and their ``top`` predictions scoring at
    least ``threshold`` (orange, with class and score), as one PNG."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.patches import Rectangle

    was_training = model.training
    model.eval()
    cols = min(4, n)
    rows = -(-n // cols)
    fig, axes = plt.subplots(rows, cols, figsize=(3.2 * cols, 3.0 * rows), squeeze=False)
    for ax, k in zip(axes.flat, range(n)):
        image, target = val.dataset[k]
        pred = model([image.to(device)])[0]
        ax.imshow(image.permute(1, 2, 0).clamp(0, 1).numpy())
        for box in target["boxes"].tolist():
            ax.add_patch(Rectangle(box[:2], box[2] - box[0], box[3] - box[1], fill=False, color="lime", lw=2))
        best = pred["scores"].argsort(descending=True)[:top]
        for box, score, label in zip(pred["boxes"][best].tolist(), pred["scores"][best].tolist(),
                                     pred["labels"][best].tolist()):
            if score < threshold:
                continue
            ax.add_patch(Rectangle(box[:2], box[2] - box[0], box[3] - box[1], fill=False, color="orange", lw=1.5,
                                   ls="--"))
            ax.text(box[0], box[1], f"{class_names[label]} {score:.2f}", color="black", fontsize=7,
                    bbox=dict(facecolor="orange", alpha=0.8, pad=1, lw=0))
        ax.set_axis_off()
    for ax in list(axes.flat)[n:]:
        ax.set_axis_off()
    fig.suptitle(f"val images: true boxes (green), the {top} best predictions scoring {threshold} or more (orange)",
                 fontsize=10)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=90, metadata={"Software": None})
    plt.close(fig)
    model.train(was_training)
    return path
