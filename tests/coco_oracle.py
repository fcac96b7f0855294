"""A hand-written COCO box mAP, kept only as a test oracle for ``vitattn.tasks.detect.coco.coco_map``
(which calls pycocotools): two independent implementations that must agree.

pycocotools' rules, without crowd boxes or area ranges: per image and class the ``max_dets``
best detections; in order of score each matches the unmatched ground truth of its class it
overlaps most, if the IoU reaches the threshold; AP is the 101-point interpolated precision.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import torch
from torchvision.ops import box_iou


def average_precision(scores: torch.Tensor, matched: torch.Tensor, num_gt: int) -> float:
    """COCO's 101-point interpolated AP of one class at one IoU threshold.

    ``scores`` and ``matched`` (bool: the detection is a true positive) list every detection
    of the class over all images; ``num_gt`` counts its ground-truth boxes. Precision is made
    monotone (the envelope) and read at recall 0, 0.01, ..., 1; a recall never reached reads 0.
    """
    if num_gt <= 0:
        raise ValueError(f"average precision needs at least one ground-truth box, got {num_gt}")
    order = torch.sort(scores, descending=True, stable=True).indices
    tp = matched[order].double().cumsum(0)
    fp = (~matched[order]).double().cumsum(0)
    recall = tp / num_gt
    precision = tp / (tp + fp).clamp(min=1)
    precision = torch.flip(torch.cummax(torch.flip(precision, [0]), 0).values, [0])  # envelope
    points = torch.linspace(0, 1, 101, dtype=torch.float64)
    idx = torch.searchsorted(recall, points, side="left")
    read = torch.cat([precision, precision.new_zeros(1)])  # index len(precision): recall not reached
    return float(read[idx].mean())


def coco_map_reference(
    predictions: Sequence[dict[str, torch.Tensor]],
    targets: Sequence[dict[str, torch.Tensor]],
    iou_thresholds: Sequence[float] | None = None,
    max_dets: int = 100,
) -> dict[str, Any]:
    """COCO-style box mAP over IoU 0.50:0.05:0.95 (``'map'``), and at IoU 0.5 / 0.75.

    ``predictions[i]`` has ``boxes`` ``(n, 4)``, ``scores``, ``labels``; ``targets[i]`` has
    ``boxes`` and ``labels``. Per image the ``max_dets`` best detections count. Each
    detection, in order of score, matches the unmatched ground truth of its class it overlaps
    most if the IoU reaches the threshold (pycocotools' rule, no crowd boxes or area ranges).
    AP is averaged over the classes that have ground truth (``'per_class'``: over thresholds).
    """
    if len(predictions) != len(targets):
        raise ValueError(f"{len(predictions)} predictions for {len(targets)} targets")
    ious = tuple(iou_thresholds) if iou_thresholds is not None else tuple(0.5 + 0.05 * i for i in range(10))
    classes = sorted({int(c) for t in targets for c in t["labels"].tolist()})
    if not classes:
        raise ValueError("the targets hold no ground-truth boxes")
    ap = torch.zeros(len(ious), len(classes), dtype=torch.float64)
    for ci, c in enumerate(classes):
        scores_c, matched_c = [], [[] for _ in ious]
        num_gt = 0
        for pred, tgt in zip(predictions, targets):
            gt = tgt["boxes"][tgt["labels"] == c].double().reshape(-1, 4)
            keep = pred["labels"] == c
            boxes, scores = pred["boxes"][keep].double().reshape(-1, 4), pred["scores"][keep].double()
            order = torch.sort(scores, descending=True, stable=True).indices[:max_dets]
            boxes, scores = boxes[order], scores[order]
            num_gt += len(gt)
            scores_c.append(scores)
            iou = box_iou(boxes, gt)
            for ti, thr in enumerate(ious):
                taken = torch.zeros(len(gt), dtype=torch.bool)
                hit = torch.zeros(len(boxes), dtype=torch.bool)
                for d in range(len(boxes)):
                    cand = iou[d].masked_fill(taken, -1.0)
                    if len(gt) and cand.max() >= thr - 1e-10:
                        j = int(cand.argmax())
                        taken[j] = hit[d] = True
                matched_c[ti].append(hit)
        scores_all = torch.cat(scores_c)
        for ti in range(len(ious)):
            ap[ti, ci] = average_precision(scores_all, torch.cat(matched_c[ti]), num_gt)
    def at(thr: float) -> float:
        hits = [i for i, t in enumerate(ious) if math.isclose(t, thr)]
        return float(ap[hits[0]].mean()) if hits else float("nan")

    return {"map": float(ap.mean()), "map_50": at(0.5), "map_75": at(0.75),
            "per_class": {c: float(ap[:, ci].mean()) for ci, c in enumerate(classes)}}
