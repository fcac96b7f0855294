"""COCO in one place: a split of a COCO-format folder read once and checked once (the annotation
file parsed once, every image's header opened once) before the first step, as a torchvision
dataset with torchvision's detection augmentations; and detections scored with pycocotools, the
reference COCO evaluation.

References: torchvision's ``references/detection`` (COCO loading, augmentation policies,
evaluation with pycocotools); pycocotools ``cocoeval.py``.
"""

from __future__ import annotations

import contextlib
import io
import json
import math
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from ...training.errors import UsageError, preview
from ..images import read_image

AP_NAMES = ("map", "map_50", "map_75", "map_small", "map_medium", "map_large")  # COCOeval.stats[0:6]


@dataclass
class Split:
    dataset: torch.utils.data.Dataset  # (image float (3, H, W) in [0, 1], target dict)
    coco: Any  # pycocotools.coco.COCO of the split's annotation file
    image_ids: list[int]
    odd: dict[str, int]  # legal but odd: boxes clamped, boxes dropped, crowd regions, images without boxes


class CocoTargets:
    """The first transform: crowd regions out of the training targets (torchvision's references
    train on ``iscrowd == 0`` only), category ids to labels ``1..K``, and an image with no
    annotation given empty ``boxes`` / ``labels`` so every target has the same keys."""

    def __init__(self, label_of: dict[int, int], masks: bool) -> None:
        self.label_of, self.masks = label_of, masks

    def __call__(self, image, target: dict) -> tuple[Any, dict]:
        from torchvision import tv_tensors
        from torchvision.transforms.v2 import functional as TF

        h, w = TF.get_size(image)
        if "boxes" not in target:  # CocoDetection's wrapper returns only the id of an empty image
            target = {**target, "boxes": torch.zeros(0, 4), "labels": torch.zeros(0, dtype=torch.int64),
                      "iscrowd": [], **({"masks": torch.zeros(0, h, w, dtype=torch.uint8)} if self.masks else {})}
        keep = torch.tensor([not c for c in target["iscrowd"]], dtype=torch.bool)
        out = {"image_id": target["image_id"],
               "boxes": tv_tensors.BoundingBoxes(torch.as_tensor(target["boxes"])[keep], format="XYXY",
                                                 canvas_size=(h, w)),
               "labels": torch.tensor([self.label_of[int(c)] for c in target["labels"][keep]], dtype=torch.int64)}
        if self.masks:
            out["masks"] = tv_tensors.Mask(target["masks"][keep])
        return image, out


def augmentation(policy: str) -> list:
    """torchvision references' detection policies: ``hflip`` (their default), ``ssd`` (photometric
    distortion, zoom out, IoU crop, flip: for training from scratch on small data), ``none``."""
    from torchvision import tv_tensors
    from torchvision.transforms import v2

    if policy == "hflip":
        return [v2.RandomHorizontalFlip(0.5)]
    if policy == "ssd":  # zoom out fills with ImageNet's mean colour, masks with 0
        return [v2.RandomPhotometricDistort(), v2.RandomZoomOut(fill={tv_tensors.Image: (123, 117, 104), "others": 0}),
                v2.RandomIoUCrop(), v2.RandomHorizontalFlip(0.5)]
    return []


def _number(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


def check_coco(ann: Path, images: Path) -> tuple[dict, dict[str, int]]:
    """The annotation file read once and the whole split checked before the first step: its types, keys and ids
    (each image and annotation id once; every annotation's image and category known), every file
    name inside the image folder, and every image's header (it opens, 8-bit samples, the size the
    file states). Bad data raises a UsageError naming the file, the id and what is wrong. Returns
    the parsed file and what is legal but odd, as torchvision's references treat it: boxes crossing
    the image's edge (clamped to it), boxes empty once clamped (dropped), crowd regions, images
    without boxes."""
    from PIL import Image, UnidentifiedImageError

    def bad(what: str) -> UsageError:
        return UsageError(f"{ann}: {what}")

    try:
        data = json.loads(ann.read_bytes().decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise UsageError(f"{ann} is not valid JSON ({e})") from None
    if not isinstance(data, dict):
        raise bad(f"expected a JSON object with 'images', 'annotations' and 'categories', got {type(data).__name__}")
    lists = [k for k in ("images", "annotations", "categories") if not isinstance(data.get(k), list)]
    if lists:
        raise UsageError(f"{ann} is not a COCO instances file: {', '.join(repr(k) for k in lists)} must be lists")
    if not data["categories"]:
        raise UsageError(f"{ann} lists no categories")
    cats, sizes, root = set(), {}, images.resolve()
    for c in data["categories"]:
        if not isinstance(c, dict) or isinstance(c.get("id"), bool) or not isinstance(c.get("id"), int):
            raise bad(f"category {preview(c)}: needs an integer 'id'")
        if c["id"] in cats:
            raise bad(f"category id {c['id']} is listed twice")
        cats.add(c["id"])
    for im in data["images"]:
        if not isinstance(im, dict) or isinstance(im.get("id"), bool) or not isinstance(im.get("id"), int):
            raise bad(f"image {preview(im)}: needs an integer 'id'")
        name = im.get("file_name")
        if not isinstance(name, str) or not name:
            raise bad(f"image {im['id']}: needs a 'file_name' string, got {preview(name)}")
        if im["id"] in sizes:
            raise bad(f"image id {im['id']} is listed twice (file names {preview(sizes[im['id']][0])} and "
                      f"{preview(name)}); each image needs its own id")
        path = (images / name).resolve()
        if not path.is_relative_to(root):
            raise bad(f"image {im['id']}: file_name {preview(name)} points outside {images}")
        if not path.is_file():
            raise bad(f"image {im['id']}: {path.name} is not in {images}")
        try:
            with Image.open(path) as f:
                mode, size = f.mode, f.size
                if f.getexif().get(0x0112, 1) in (5, 6, 7, 8):  # EXIF orientation: read_image turns it upright
                    size = size[::-1]
        except (UnidentifiedImageError, OSError, Image.DecompressionBombError) as e:
            raise bad(f"image {im['id']}: {name} is not an image that opens ({e})") from None
        if mode.startswith(("I", "F")):  # 16- or 32-bit samples: reading them as RGB would clip to 255
            raise bad(f"image {im['id']}: {name} has {mode} samples; expected 8-bit images (RGB, grey or palette)")
        stated = (im.get("width"), im.get("height"))
        if None not in stated and tuple(stated) != size:
            raise bad(f"image {im['id']}: {name} is {size[0]}x{size[1]}, the file states {stated[0]}x{stated[1]}")
        sizes[im["id"]] = (name, size)
    counts = dict(clamped=0, dropped=0, crowd=0, images_without_boxes=0)
    seen, boxed = set(), set()
    for a in data["annotations"]:
        aid = a.get("id") if isinstance(a, dict) else None
        if isinstance(aid, bool) or not isinstance(aid, int):
            raise bad(f"annotation {preview(a)}: needs an integer 'id'")
        if aid in seen:
            raise bad(f"annotation id {aid} is listed twice")
        seen.add(aid)
        for key, known, what in (("image_id", sizes, "image"), ("category_id", cats, "category")):
            if a.get(key) not in known or isinstance(a.get(key), bool):
                raise bad(f"annotation {aid}: {key} {preview(a.get(key))} is not a listed {what} id")
        box = a.get("bbox")
        if not isinstance(box, list) or len(box) != 4 or not all(_number(v) for v in box):
            raise bad(f"annotation {aid}: bbox must be 4 numbers [x, y, width, height], got {preview(box)}")
        if a.get("iscrowd", 0) not in (0, 1):
            raise bad(f"annotation {aid}: iscrowd must be 0 or 1, got {preview(a.get('iscrowd'))}")
        if a.get("iscrowd", 0):
            counts["crowd"] += 1
            continue
        w, h = sizes[a["image_id"]][1]
        x0, y0, x1, y1 = box[0], box[1], box[0] + box[2], box[1] + box[3]
        cx0, cy0, cx1, cy1 = max(x0, 0), max(y0, 0), min(x1, w), min(y1, h)
        if (cx0, cy0, cx1, cy1) != (x0, y0, x1, y1):
            counts["clamped"] += 1
        if cx1 - cx0 < 1 or cy1 - cy0 < 1:
            counts["dropped"] += 1
        else:
            boxed.add(a["image_id"])
    counts["images_without_boxes"] = len(set(sizes) - boxed)
    return data, counts


def load_split(root: Path, split: str, *, train: bool, limit: int | None = None, masks: bool = False,
               aug: str = "none") -> Split:
    """One split of a COCO-format folder (``annotations/instances_<split>.json``, ``<split>/``):
    read and checked once (:func:`check_coco`), then :func:`make_split`. A missing folder or file
    is a UsageError that names what was expected."""
    root = Path(root)
    ann, images = root / "annotations" / f"instances_{split}.json", root / split
    if not root.is_dir():
        raise UsageError(f"--data-dir {root}: no such folder")
    for path, what in ((ann, "annotation file"), (images, "image folder")):
        if not path.exists():
            raise UsageError(f"--data-dir {root}: no {what} {path} (expected COCO's layout: annotations/"
                             f"instances_<split>.json and <split>/ holding its images)")
    data, odd = check_coco(ann, images)
    return make_split(data, images, str(ann), split, odd, train=train, limit=limit, masks=masks, aug=aug)


def make_split(data: dict, images: Path, source: str, split: str, odd: dict[str, int], *, train: bool,
               limit: int | None = None, masks: bool = False, aug: str = "none") -> Split:
    """A checked COCO dictionary (a COCO file's, or a VOC folder's made into one) as a torchvision
    dataset of its images in ``images`` (training: only those with a usable box, as torchvision's
    references) under ``aug``. An empty split and masks asked of boxes are UsageErrors naming
    ``source``."""
    from pycocotools.coco import COCO
    from torchvision.datasets import CocoDetection, wrap_dataset_for_transforms_v2
    from torchvision.transforms import v2

    with contextlib.redirect_stdout(io.StringIO()):  # pycocotools prints its progress
        coco = COCO()
        coco.dataset = data
        coco.createIndex()

    class Coco(CocoDetection):
        def __init__(self) -> None:  # the file read above, not again
            super(CocoDetection, self).__init__(str(images))
            self.coco, self.ids = coco, sorted(coco.imgs)

        def _load_image(self, id: int):  # train_cifar.py's reader: EXIF orientation, any 8-bit mode to RGB
            return read_image(images / self.coco.loadImgs(id)[0]["file_name"])

    ds = Coco()
    ids = list(ds.ids)
    if train:  # as torchvision's references: images without a usable box teach nothing to most detectors
        ids = [i for i in ids if any(usable(a, coco.imgs[i]) for a in coco.imgToAnns[i])]
    ids = ids[:limit]
    if not ids:
        raise UsageError(f"{source}: no {'annotated ' if train else ''}images in split {split!r}")
    if not any(usable(a, coco.imgs[i]) for i in ids for a in coco.imgToAnns[i]):
        raise UsageError(f"{source}: no box in split {split!r} is usable once clamped to its image: nothing to "
                         f"{'learn' if train else 'score'}")
    if masks and any("segmentation" not in a for i in ids for a in coco.imgToAnns[i]):
        raise UsageError(f"--detector maskrcnn learns masks: every annotation in {source} needs a 'segmentation'")
    steps = [CocoTargets({c: k + 1 for k, c in enumerate(sorted(coco.getCatIds()))}, masks), v2.ToImage(),
             *(augmentation(aug) if train else []), v2.ToDtype(torch.float32, scale=True)]
    if train:  # boxes clamped to the image, then those left (or made by augmentation) empty dropped
        steps += [v2.ClampBoundingBoxes(), v2.SanitizeBoundingBoxes()]
    ds.transforms = v2.Compose(steps)
    keys = ("image_id", "boxes", "labels", "iscrowd") + (("masks",) if masks else ())
    wrapped = wrap_dataset_for_transforms_v2(ds, target_keys=keys)
    position = {image_id: k for k, image_id in enumerate(ds.ids)}
    return Split(torch.utils.data.Subset(wrapped, [position[i] for i in ids]), coco, ids, odd)


def usable(a: dict, image: dict) -> bool:
    """A box that is no crowd region and keeps at least a pixel each way once clamped to its image."""
    x, y, w, h = a["bbox"]
    return (not a.get("iscrowd", 0) and min(x + w, image.get("width", x + w)) - max(x, 0) >= 1
            and min(y + h, image.get("height", y + h)) - max(y, 0) >= 1)


def collate(batch: list) -> tuple[list, list]:
    return tuple(zip(*batch))


def coco_eval(gt: Any, detections: list[dict[str, Any]], image_ids: Sequence[int] | None = None,
              max_dets: int = 100) -> dict[str, Any]:
    """pycocotools' box evaluation of ``detections`` (COCO result dicts: ``image_id``,
    ``category_id``, ``bbox`` as x, y, w, h, ``score``) against ``gt``, a ``pycocotools.coco.COCO``,
    on ``image_ids`` (default: all of ``gt``'s images).

    Returns ``AP_NAMES`` as COCO defines them (``map``: IoU 0.50:0.05:0.95; ``map_50``, ``map_75``;
    ``map_small`` / ``map_medium`` / ``map_large``: objects under 32^2, up to 96^2 and above 96^2
    pixels; -1 where no ground truth falls in the range), ``per_class`` (each category's AP over the
    IoU thresholds) and ``per_class_50`` (at IoU 0.5), for categories with ground truth. Crowd boxes
    and areas are read as ``gt`` gives them. No detections at all is AP 0 (pycocotools cannot load an empty list).
    """
    from pycocotools.cocoeval import COCOeval

    ids = sorted(gt.getImgIds() if image_ids is None else image_ids)
    has_gt = sorted({a["category_id"] for a in gt.loadAnns(gt.getAnnIds(imgIds=ids, iscrowd=False))})
    if not detections:
        return {**dict.fromkeys(AP_NAMES, 0.0), "per_class": dict.fromkeys(has_gt, 0.0),
                "per_class_50": dict.fromkeys(has_gt, 0.0)}
    with contextlib.redirect_stdout(io.StringIO()):  # pycocotools prints its progress
        ev = COCOeval(gt, gt.loadRes(list(detections)), iouType="bbox")
        ev.params.imgIds = ids
        ev.params.maxDets = [1, 10, max_dets]
        ev.evaluate()
        ev.accumulate()
        ev.summarize()
    prec = torch.as_tensor(ev.eval["precision"][:, :, :, 0, -1])  # (IoU thresholds, recall points, classes), all areas
    cats = list(ev.params.catIds)

    def mean(p: torch.Tensor) -> float:
        return float(p[p > -1].mean()) if (p > -1).any() else -1.0

    return {**{name: float(v) for name, v in zip(AP_NAMES, ev.stats[:6])},
            "per_class": {c: mean(prec[:, :, cats.index(c)]) for c in has_gt},
            "per_class_50": {c: mean(prec[0, :, cats.index(c)]) for c in has_gt}}


def coco_map(
    predictions: Sequence[dict[str, torch.Tensor]],
    targets: Sequence[dict[str, torch.Tensor]],
    max_dets: int = 100,
) -> dict[str, Any]:
    """COCO box mAP of torchvision-format detections by :func:`coco_eval`.

    ``predictions[i]`` has ``boxes`` ``(n, 4)`` in ``x1 y1 x2 y2``, ``scores``, ``labels``;
    ``targets[i]`` has ``boxes`` and ``labels`` (torchvision's detector format); an object's area
    is its box's. Returns ``AP_NAMES`` and ``per_class``, averaged over the classes that have
    ground truth. Needs pycocotools (``pip install 'vitattn[detection]'``).
    """
    try:
        from pycocotools.coco import COCO
    except ImportError as e:  # pragma: no cover - exercised only without the extra
        raise ImportError("coco_map needs pycocotools: pip install 'vitattn[detection]'") from e

    if len(predictions) != len(targets):
        raise ValueError(f"{len(predictions)} predictions for {len(targets)} targets")
    if not any(len(t["labels"]) for t in targets):
        raise ValueError("the targets hold no ground-truth boxes")
    images, gts, dets = [], [], []
    for i, (pred, tgt) in enumerate(zip(predictions, targets)):
        images.append({"id": i})
        for box, label in zip(xywh(tgt["boxes"]), tgt["labels"].tolist()):
            gts.append({"id": len(gts) + 1, "image_id": i, "category_id": int(label), "bbox": box,
                        "area": box[2] * box[3], "iscrowd": 0})
        dets += coco_results(i, pred)
    cats = sorted({a["category_id"] for a in gts} | {d["category_id"] for d in dets})
    with contextlib.redirect_stdout(io.StringIO()):
        gt = COCO()
        gt.dataset = {"images": images, "annotations": gts, "categories": [{"id": c} for c in cats]}
        gt.createIndex()
    return coco_eval(gt, dets, max_dets=max_dets)


def xywh(boxes: torch.Tensor) -> list[list[float]]:
    """``(n, 4)`` boxes ``x1 y1 x2 y2`` as COCO's ``[x, y, w, h]`` lists."""
    b = boxes.detach().double().cpu().reshape(-1, 4)
    return torch.cat([b[:, :2], b[:, 2:] - b[:, :2]], 1).tolist()


def coco_results(image_id: int, pred: dict[str, torch.Tensor], category_ids: Sequence[int] | None = None) -> list[dict]:
    """One image's torchvision detections as COCO result dicts; ``category_ids[label]`` maps the
    detector's labels back to the annotation file's ids (default: the labels are the ids)."""
    labels = pred["labels"].long().tolist()
    return [{"image_id": int(image_id), "category_id": int(category_ids[c] if category_ids is not None else c),
             "bbox": box, "score": float(s)}
            for box, s, c in zip(xywh(pred["boxes"]), pred["scores"].float().tolist(), labels)]
