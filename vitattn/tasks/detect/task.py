"""Object detection on a COCO or Pascal VOC folder as a task of the training loop: the options of
``examples/train_detection.py``, the detector (a ViTDet pyramid on a vitattn ViT, or
torchvision's ResNet with an FPN), and the task itself (the sum of the detector's losses; COCO box
AP after each epoch), and ``detection_run``. The folder is read and checked by
:mod:`vitattn.tasks.detect.coco` or :mod:`vitattn.tasks.detect.voc` and scored by the former.

References: torchvision's ``references/detection`` (COCO loading, augmentation policies,
evaluation with pycocotools); Li et al. 2022 (ViTDet) for AdamW with weight decay 0.1.
"""

from __future__ import annotations

import dataclasses
import math
import os
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from ... import registry
from ...helpers import count_params, to_2tuple
from ...training import optim, runtime
from ...training.cli import check_fields, option, preset_kwargs, track
from ...training.errors import UsageError
from ...training.run import Run, build_run
from ...training.runtime import Dist, RunOptions, step_generator
from ...vitdet import (
    DETECTORS,
    SCALE_FACTORS,
    ViTDetBackbone,
    build_detector,
    fp32_heads,
)
from .coco import Split, coco_eval, coco_results, collate, load_split, make_split
from .voc import check_voc, class_names, find_layout

RESNETS = {"resnet18": 512, "resnet34": 512, "resnet50": 2048}  # torchvision trunks: channels of layer4


AUGMENTATIONS = ("hflip", "ssd", "none")  # torchvision references' --data-augmentation policies
FORMATS = ("auto", "coco", "voc")


@dataclass
class Config(RunOptions):
    data_dir: str | None = option(None, "a COCO folder (annotations/instances_<split>.json, <split>/ images) or a "
                                  "Pascal VOC one (Annotations/, JPEGImages/, ImageSets/Main/<split>.txt; or "
                                  "labelImg's annotations/, images/, <split>.txt)")
    format: str = option("auto", "the folder's format; 'auto' tells COCO and VOC apart by their files",
                         choices=FORMATS)
    train_split: str = option("train", "training split name")
    val_split: str = option("val", "evaluation split name")
    detector: str = option("fasterrcnn", "torchvision detector", choices=DETECTORS)
    model: str = option("vit_small_patch16_224", "backbone: a vitattn ViT preset (--list-models in train_cifar.py) "
                        "or torchvision's " + "/".join(RESNETS) + " with an FPN")
    model_kwargs: str = option("{}", "JSON of ViT config fields over the preset's (timm's --model-kwargs)")
    pretrained: bool = option(False, "start the ViT from timm's weights (its hub cache, or --pretrained-file)")
    pretrained_file: str | None = option(None, "local .safetensors / .pth / .npz file of timm's weights")
    initial_checkpoint: str | None = option(None, "start the ViT from a vitattn checkpoint (timm's name)")
    strides: tuple[int, ...] = option((4, 8, 16, 32), "pyramid strides, finest first; a pooled level at twice "
                                      "the last is added")
    out_channels: int = option(256, "pyramid width")
    window_size: int | None = option(None, "ViTDet window attention of this size in all blocks but every third")
    min_size: int = option(800, "the detector resizes images so the short side is this (torchvision's)")
    max_size: int = option(1333, "... and the long side at most this")
    aug: str = option("hflip", "training augmentation, as torchvision's references", choices=AUGMENTATIONS)
    epochs: int = option(12, "passes over the training images")
    batch_size: int = option(2, "images per step, global: split evenly over the processes of a torchrun")
    lr: float = option(1e-4, "AdamW peak learning rate")
    weight_decay: float = option(0.1, "weight decay (not on biases, norms, position tables)")
    warmup: float = option(0.02, "fraction of the run spent warming up the lr, in [0, 1); then cosine to 0")
    model_ema_decay: float = option(0.0, "keep and evaluate an exponential moving average of the weights with this "
                                         "decay (timm's --model-ema-decay), in [0, 1); 0 = off")
    grad_clip: float = option(1.0, "max gradient norm; 0 = off", aliases=("--clip-grad",))
    workers: int = option(min(8, os.cpu_count() or 1), "data loading processes (by default the CPUs, up to 8); "
                          "0 loads in this one", aliases=("-j",))
    limit_train: int | None = option(None, "use only the first N training images", unset="all")
    limit_val: int | None = option(None, "evaluate only the first N val images", unset="all")
    detections_per_img: int = option(100, "detections kept per image, as COCO scores them")
    score_thresh: float = option(0.05, "detections scoring below this are dropped before COCO scoring (torchvision's "
                                 "R-CNN default; its FCOS default, 0.2, would cut recall)")
    out: str | None = option(None, "run folder; must not hold a run", unset="runs/detection-<timestamp>",
                             aliases=("--output",))
    control: bool = option(False, "train nothing: score the constant-box control (the mean training box, relative "
                           "to each val image, score 1) with the same evaluator")
    picture: int = option(8, "val photographs drawn with their true and predicted boxes (predictions.png); 0 = none")

    # --help in the order a newcomer needs the options, the common ones first
    HELP_GROUPS = {
        "data": ("data_dir", "format", "train_split", "val_split", "limit_train", "limit_val", "aug", "workers"),
        "detector and backbone": ("detector", "model", "model_kwargs", "pretrained", "pretrained_file",
                                  "initial_checkpoint", "strides", "out_channels", "window_size", "min_size",
                                  "max_size", "control"),
        "budget, seed and run folder": ("epochs", "time_budget", "seed", "out", "resume"),
        "recipe": ("lr", "batch_size", "weight_decay", "warmup", "grad_clip", "model_ema_decay"),
        "precision and devices": ("amp", "amp_dtype", "device", "malloc"),
        "outputs and scoring": ("progress", "tensorboard", "picture", "detections_per_img", "score_thresh"),
    }
    POSITIVE = ("strides", "out_channels", "window_size", "min_size", "max_size", "epochs", "time_budget",
                "batch_size", "lr", "limit_train", "limit_val", "detections_per_img")
    NON_NEGATIVE = ("weight_decay", "grad_clip", "workers", "seed", "picture")
    FRACTION = ("warmup", "score_thresh", "model_ema_decay")

    def __post_init__(self) -> None:
        check_fields(self)
        if not self.resume and not self.data_dir:
            raise UsageError("--data-dir is needed: a COCO folder (annotations/instances_<split>.json, <split>/ "
                             "images) or a Pascal VOC one (Annotations/, JPEGImages/, ImageSets/Main/<split>.txt)")
        if self.model not in RESNETS and self.model not in registry.PRESETS:
            raise UsageError(f"--model {self.model!r} is neither a vitattn preset nor one of {tuple(RESNETS)}")
        if self.model in registry.PRESETS and registry.PRESETS[self.model][0] != "vit":
            raise UsageError(f"--model {self.model} is a {registry.PRESETS[self.model][0]} preset; the detection "
                             "backbone is a ViT preset or a torchvision ResNet")
        vit_only = [flag for flag, on in (("--pretrained", self.pretrained),
                                          ("--pretrained-file", self.pretrained_file),
                                          ("--initial-checkpoint", self.initial_checkpoint),
                                          ("--window-size", self.window_size),
                                          ("--model-kwargs", self.model_kwargs != "{}")) if on]
        if self.model in RESNETS and vit_only:
            raise UsageError(f"{', '.join(vit_only)} apply to a ViT backbone, not {self.model}")
        if list(self.strides) != sorted(set(self.strides)):
            raise UsageError(f"--strides must be distinct and finest first, got {list(self.strides)}")
        if self.model in RESNETS and not set(self.strides) <= {4, 8, 16, 32}:
            raise UsageError(f"a ResNet's levels have strides 4, 8, 16 and 32, got --strides {list(self.strides)}")
        if self.min_size > self.max_size:
            raise UsageError(f"--min-size must not exceed --max-size, got {self.min_size} > {self.max_size}")
        self.kwargs()  # a bad JSON or field stops the run before anything is written

    def kwargs(self) -> dict[str, Any]:
        preset = self.model if self.model in registry.PRESETS else None
        return preset_kwargs("--model-kwargs", self.model_kwargs, preset)


class ResNetFPN(nn.Module):
    """torchvision's ResNet trunk (random init, BatchNorm) with its FPN on the layers of the given
    strides and a max-pooled level: ``out_channels`` and ``strides`` as ``build_detector`` reads."""

    def __init__(self, name: str, strides: tuple[int, ...], out_channels: int) -> None:
        super().__init__()
        import torchvision
        from torchvision.models.detection.backbone_utils import BackboneWithFPN
        from torchvision.ops.feature_pyramid_network import LastLevelMaxPool

        layer = {4: 1, 8: 2, 16: 3, 32: 4}
        top = RESNETS[name]
        self.body = BackboneWithFPN(getattr(torchvision.models, name)(weights=None),
                                    {f"layer{layer[s]}": str(i) for i, s in enumerate(strides)},
                                    [top // 2 ** (4 - layer[s]) for s in strides], out_channels,
                                    extra_blocks=LastLevelMaxPool())
        self.out_channels = out_channels
        self.strides = {**{str(i): s for i, s in enumerate(strides)}, "pool": 2 * strides[-1]}

    def forward(self, x: torch.Tensor):
        return self.body(x)


def build_model(cfg: Config, num_classes: int) -> nn.Module:
    """The detector: a ViTDet pyramid on the ViT (or a ResNet + FPN) with ``cfg.strides``, its
    weights drawn from ``cfg.seed``."""
    torch.manual_seed(cfg.seed)
    if cfg.model in RESNETS:
        backbone = ResNetFPN(cfg.model, cfg.strides, cfg.out_channels)
    else:
        overlay = dict(file=cfg.pretrained_file) if cfg.pretrained_file else None
        windows = {"window_size": cfg.window_size} if cfg.window_size is not None else {}  # ViTDet's layout
        vit, started = initial_vit(cfg, windows) if cfg.initial_checkpoint else (registry.create_model(
            cfg.model, pretrained=cfg.pretrained or bool(overlay), pretrained_cfg_overlay=overlay,
            **{**cfg.kwargs(), **windows}), None)
        patch = vit.patch_embed.patch_size[0]
        grid = math.ceil(cfg.max_size / patch)  # the token grid's longest side at any image size
        if cfg.window_size is not None and cfg.window_size >= grid:
            raise UsageError(f"--window-size {cfg.window_size} covers the whole token grid (at most {grid}x{grid} "
                             f"with --max-size {cfg.max_size} and patch {patch}): that is global attention at a "
                             "higher cost; leave --window-size unset, or give one below " + str(grid))
        scales = [patch / s for s in cfg.strides]
        if not set(scales) <= set(SCALE_FACTORS):
            raise UsageError(f"--strides {list(cfg.strides)} with patch {patch}: ViTDet's pyramid makes strides "
                             f"{[int(patch / s) for s in SCALE_FACTORS if patch / s == int(patch / s)]} from it")
        backbone = ViTDetBackbone(vit, cfg.out_channels, scale_factors=scales)
    box = "box_" if cfg.detector in ("fasterrcnn", "maskrcnn") else ""  # the R-CNNs' names start with box_
    detector = build_detector(cfg.detector, backbone, num_classes, min_size=cfg.min_size, max_size=cfg.max_size,
                              **{f"{box}detections_per_img": cfg.detections_per_img,
                                 f"{box}score_thresh": cfg.score_thresh})
    detector = fp32_heads(detector) if cfg.amp else detector  # under the loop's autocast: boxes stay in fp32
    if cfg.model not in RESNETS:
        detector.initial_weights = started  # what the ViT started from, for the run's first lines
    return detector


def initial_vit(cfg: Config, windows: dict) -> tuple[nn.Module, dict]:
    """The ViT of ``--initial-checkpoint`` (a train_cifar.py run's weights): built with the fields
    it was trained with (``vitattn.weights``; the detection's own options on top), its weights
    loaded with a learned position table resampled to the new grid and a classifier of another
    size skipped (``load_weights``); returns it and what was loaded, resampled and skipped."""
    from ...weights import read_weights

    path = cfg.initial_checkpoint
    try:
        state, info = read_weights(path)
        fields = registry.saved_fields(cfg.model, info, path) if info else {}
        vit = registry.create_model(cfg.model, **{**fields, **cfg.kwargs(), **windows})
        saved = to_2tuple((info or {}).get("config", {}).get("img_size", vit.config.img_size))
        patch = vit.patch_embed.patch_size
        report = vit.load_weights(state, old_grid=(saved[0] // patch[0], saved[1] // patch[1]))
    except ValueError as e:
        raise UsageError(f"--initial-checkpoint: {e}") from None
    table = getattr(vit, "pos_embed", None)
    moved = table is not None and "pos_embed" in state and state["pos_embed"].shape != table.shape
    grid = f"{vit.grid_size[0]}x{vit.grid_size[1]}"
    positions = (f"the learned {grid} position table resampled to the new grid (bicubic)" if moved else
                 f"the learned {grid} position table, resampled to each image's grid as it runs (bicubic)"
                 if table is not None else "sin-cos positions, built for each grid")
    return vit, dict(path=str(path), preset=(info or {}).get("architecture") or cfg.model, trained_on=list(saved),
                     loaded=len(state) - len(report["skipped"]), positions=positions, skipped=report["skipped"])


UNCHECKED_ON_RESUME = ("resume", "out", "device", "workers", "progress", "data_dir", "malloc", "tensorboard")


def to_device(images: list, targets: list, dev: torch.device) -> tuple[list, list]:
    return ([im.to(dev, non_blocking=True) for im in images],
            [{k: v.to(dev) if torch.is_tensor(v) else v for k, v in t.items()} for t in targets])


class DetectionTask:
    """Detection as a task of ``loop``: this rank's share of the training split in a fixed
    permutation per ``(seed, epoch)`` (a resumed epoch skips what was trained on), the sum of the
    detector's losses, and COCO box AP on the val split after each epoch (ranks detect on their
    share of the val images; rank 0 scores them all with pycocotools)."""

    family = "detector"
    score = "map"
    counts_hits = False  # a detector's loss has no accuracy to count
    data_on_clock = False  # reading and decoding image files is not training: off the clock and the budget

    def __init__(self, train: Split, val: Split, category_ids: list[int], *, batch_size: int, workers: int,
                 seed: int, device: torch.device, ranks: Dist, max_dets: int = 100,
                 class_names: list[str] | None = None) -> None:
        self.train, self.val, self.category_ids = train, val, category_ids
        # label k's name (0: the background), as the run records it
        self.class_names = class_names or ["background", *(str(c) for c in category_ids[1:])]
        self.batch_size, self.workers, self.seed = batch_size, workers, seed
        self.device, self.ranks, self.max_dets = device, ranks, max_dets
        self.shard = len(train.dataset) // ranks.world  # equal shards: the ranks step in lockstep
        if self.shard < 1:
            raise UsageError(f"{len(train.dataset)} training image(s) cannot be shared by {ranks.world} processes")
        self.steps_per_epoch = math.ceil(self.shard / batch_size)
        self.last: dict[str, float] | None = None
        self.no_hits = torch.zeros((), device=device)  # what ``loss`` counts: made once, not per step

    def _loader(self, split: Split, order: list[int]) -> torch.utils.data.DataLoader:
        """Batches in ``order`` (positions in the split), in pinned memory for a GPU, so that their
        copies there do not make the host wait."""
        return torch.utils.data.DataLoader(split.dataset, batch_size=self.batch_size, sampler=order, shuffle=False,
                                           num_workers=self.workers, collate_fn=collate, persistent_workers=False,
                                           pin_memory=self.device.type == "cuda")

    def order(self, epoch: int) -> list[int]:
        """This rank's images of ``epoch``: a fixed permutation per ``(seed, epoch)``, cut to equal shards."""
        g = step_generator(self.seed, epoch)  # the classification batches' scheme: one per (seed, epoch)
        order = torch.randperm(len(self.train.dataset), generator=g)[: self.shard * self.ranks.world]
        return order[self.ranks.rank::self.ranks.world].tolist()

    def batches(self, epoch: int, start_step: int) -> Iterator[tuple[list, list]]:
        return iter(self._loader(self.train, self.order(epoch)[start_step * self.batch_size:]))

    def loss(self, net: nn.Module, batch: tuple[list, list]) -> tuple[torch.Tensor, torch.Tensor, int]:
        images, targets = to_device(*batch, self.device)
        loss = sum(net(images, targets).values())  # under the loop's autocast with --amp
        return loss, self.no_hits, len(images)

    def evaluate(self, model: nn.Module) -> dict[str, float]:
        return self._evaluate(model, f"[{self.family}] evaluation", line=False)  # the epoch's line follows

    @torch.no_grad()
    def _evaluate(self, model: nn.Module, desc: str, line: bool) -> dict[str, float]:
        """COCO box AP (pycocotools, against the val split's annotation file)."""
        was_training = model.training
        model.eval()
        detections = []
        mine = list(range(self.ranks.rank, len(self.val.dataset), self.ranks.world))
        for images, targets in track(self._loader(self.val, mine), desc, unit="batch", line=line):
            outputs = model([im.to(self.device) for im in images])
            for t, o in zip(targets, outputs):
                detections += coco_results(t["image_id"], {k: v.cpu() for k, v in o.items()}, self.category_ids)
        model.train(was_training)
        if self.ranks.world > 1:
            every: list = [None] * self.ranks.world
            dist.all_gather_object(every, detections)
            detections = [d for part in every for d in part]
        ap = [coco_eval(self.val.coco, detections, self.val.image_ids, max_dets=self.max_dets) if self.ranks.main
              else None]
        if self.ranks.world > 1:
            dist.broadcast_object_list(ap, src=0)
        name = dict(zip(self.category_ids, self.class_names))
        self.last = {**{k: v for k, v in ap[0].items() if not k.startswith("per_class")},
                     **{k: {name[c]: v for c, v in ap[0][k].items()} for k in ("per_class", "per_class_50")}}
        return self.last

    def final(self, model: nn.Module, desc: str) -> dict[str, Any]:
        """The last evaluation when it was of these weights (the kept ones are evaluated last)."""
        ev = self.last if self.last is not None else self._evaluate(model, desc, line=True)
        return {f"final_{k}": v for k, v in ev.items()}

    def log_line(self, metrics: dict[str, float]) -> str:
        return f"AP {metrics['map']:.4f} AP50 {metrics['map_50']:.4f}"


def folder_format(cfg: Config) -> str:
    """``cfg.format``, or for 'auto' the format the folder's files show: COCO's annotation files,
    else a VOC layout's folders."""
    if cfg.format != "auto":
        return cfg.format
    root = Path(cfg.data_dir)
    if not root.is_dir():
        raise UsageError(f"--data-dir {root}: no such folder")
    if any((root / "annotations").glob("instances_*.json")):
        return "coco"
    if find_layout(root) is not None:
        return "voc"
    raise UsageError(f"--data-dir {root}: neither COCO (annotations/instances_{cfg.train_split}.json) nor Pascal VOC "
                     "(Annotations/ and JPEGImages/, or annotations/ and images/); --format names it if it is one")


def load_splits(cfg: Config) -> tuple[Split, Split, list[str]]:
    """The training and val splits, read and checked whole, and the class names (label k's is
    ``names[k]``, 0 the background): a COCO file's category names, or the VOC folder's, sorted."""
    masks = cfg.detector == "maskrcnn"
    if folder_format(cfg) == "voc":
        if masks:
            raise UsageError("--detector maskrcnn learns masks; a VOC folder has boxes only")
        root = Path(cfg.data_dir)
        names = class_names(root, [cfg.train_split, cfg.val_split])
        splits = []
        for split, train in ((cfg.train_split, True), (cfg.val_split, False)):
            data, images, odd = check_voc(root, split, names)
            splits.append(make_split(data, images, f"{root} ({split})", split, odd, train=train,
                                     limit=cfg.limit_train if train else cfg.limit_val, aug=cfg.aug))
        return splits[0], splits[1], ["background", *sorted(names, key=names.get)]
    train, val = (load_split(cfg.data_dir, split, train=train, limit=cfg.limit_train if train else cfg.limit_val,
                             masks=masks, aug=cfg.aug)
                  for split, train in ((cfg.train_split, True), (cfg.val_split, False)))
    cats = train.coco.loadCats(sorted(train.coco.getCatIds()))
    return train, val, ["background", *(str(c.get("name", c["id"])) for c in cats)]


def detection_task(cfg: Config, device: torch.device, ranks: Dist) -> DetectionTask:
    """The folder's splits, loaded and checked whole, as a task; their categories must agree."""
    if cfg.batch_size % ranks.world:
        raise UsageError(f"--batch-size is the global batch and must split evenly over the {ranks.world} processes, "
                         f"got {cfg.batch_size}; use a multiple of {ranks.world}")
    train, val, names = load_splits(cfg)
    category_ids = [0, *sorted(train.coco.getCatIds())]  # label k -> category_ids[k]; 0 is the background
    if sorted(val.coco.getCatIds()) != category_ids[1:]:
        raise UsageError(f"the {cfg.train_split} and {cfg.val_split} annotation files list different categories")
    return DetectionTask(train, val, category_ids, batch_size=cfg.batch_size // ranks.world, workers=cfg.workers,
                         seed=cfg.seed, device=device, ranks=ranks, max_dets=cfg.detections_per_img,
                         class_names=names)


def detection_run(cfg: Config, task: DetectionTask, model: nn.Module, device: torch.device, ranks: Dist,
                  checkpoint_path, resumed: dict | None = None) -> Run:
    """``build_run`` for ``task`` as ``cfg`` says: AdamW without decay on biases, norms and position
    tables, warm-up then cosine, clipping and an EMA, for ``cfg.epochs`` or ``cfg.time_budget``
    minutes of steps; the checkpoint keeps the category ids."""
    opt = optim.create_optimizer(model, "adamw", lr=cfg.lr, weight_decay=cfg.weight_decay)
    return build_run(task, model, opt, resumed=resumed, checkpoint_path=checkpoint_path,
                     budget_s=cfg.time_budget * 60 if cfg.time_budget else None,
                     lr_at=lambda p: optim.get_lr(p, cfg.lr, cfg.warmup, "cosine"), grad_clip=cfg.grad_clip,
                     total_steps=cfg.epochs * task.steps_per_epoch, device=device, ranks=ranks, seed=cfg.seed,
                     amp_dtype=cfg.autocast_dtype(), ema_decay=cfg.model_ema_decay, config=dataclasses.asdict(cfg),
                     extra={"category_ids": task.category_ids, "class_names": task.class_names})


def describe_run(cfg: Config, model: nn.Module, task: DetectionTask, run: Run) -> list[str]:
    """The lines a run opens with: detector, backbone and size, the splits (and what in them was
    odd), the precision, and a warning when the CPU has no native bf16."""
    lines = [f"{cfg.detector} on {cfg.model}: {count_params(model) / 1e6:.1f}M parameters; {len(task.train.image_ids)} "
             f"train / {len(task.val.image_ids)} val images, {len(task.category_ids) - 1} categories; {run.precision} "
             f"on {run.device}, world size {run.ranks.world}"]
    for name, split in ((cfg.train_split, task.train), (cfg.val_split, task.val)):
        lines.append(f"{name}: " + ", ".join(f"{n} {what.replace('_', ' ')}" for what, n in split.odd.items()))
    started = getattr(model, "initial_weights", None)
    if started:
        lines.append(f"backbone from {started['path']} ({started['preset']}, trained on {started['trained_on'][0]}x"
                     f"{started['trained_on'][1]} images): {started['loaded']} tensors loaded; positions: "
                     f"{started['positions']}; skipped: {', '.join(started['skipped']) or 'none'}; its classifier "
                     "is dropped (the detector brings its own heads)")
    if runtime.precision_warning(run.device, cfg.autocast_dtype()):
        lines.append(f"warning: {runtime.precision_warning(run.device, cfg.autocast_dtype())}")
    return lines
