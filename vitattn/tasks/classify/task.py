"""Image classification as a task of the training loop: a batch of uint8 images (augmented and
normalised on the device), cross-entropy with label smoothing (and DeiT's hard distillation),
accuracy with test-time augmentation, accuracy by distance on the long-range task; a group of
seeds as one task; and ``classification_run``, the task's run as ``train_cifar.py`` sets it up.

References: airbench (``airbench94.py``: normalisation on the fly, six-view test-time
augmentation); DeiT for the ViT's recipe (``recipes.py``).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from ...helpers import count_params
from ...training import optim, runtime, stack
from ...training.cli import track
from ...training.run import Run, build_run
from ...training.runtime import Dist, all_reduce_
from .batches import Augment, BatchLoader
from .longrange import DISTANCE_EDGES, accuracy_by_distance
from .options import Config
from .setup import Dataset, Teacher, one_model


def _tta_probs(model: nn.Module, xb: torch.Tensor, logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """airbench's views: the image and its mirror (``pair``), and both shifted one pixel up-left
    and down-right with reflect padding, each with its mirror (``four``)."""
    pair = (logits.softmax(1) + model(xb.flip(3)).float().softmax(1)) / 2
    padded = F.pad(xb, (1, 1, 1, 1), mode="reflect")
    shifted = torch.cat([padded[..., :-2, :-2], padded[..., 2:, 2:]])
    four = model(torch.cat([shifted, shifted.flip(3)])).float().softmax(1).view(4, len(xb), -1).mean(0)
    return pair, four


@torch.no_grad()
def evaluate(model: nn.Module, norm: nn.Module, x: torch.Tensor, y: torch.Tensor, *, batch_size: int = 500,
             device: torch.device | str = "cpu", ranks: Dist | None = None, channels_last: bool = False,
             tta: bool = False, desc: str = "evaluation", line: bool = False) -> dict:
    """Test loss, accuracy and the per-image hits of uint8 images ``x`` (ranks split them and sum).

    With ``tta`` also ``acc_tta`` (softmax averaged over each image and its mirror) and
    ``acc_tta_shift`` (airbench's six views, its ``tta_level=2``: half weight on that pair, half
    on the two one-pixel shifts and their mirrors). ``acc`` is always the plain accuracy. In a run
    it shows as a phase ``desc`` (``cli.track``; with ``line``, a line with its duration).
    Under autocast (the loop's, with --amp) the model runs in its precision, the scores in fp32.
    Sums stay on ``device`` (what NCCL reduces) and are read once at the end, so a GPU is not
    stalled after every batch.
    """
    ranks = ranks or Dist()
    device = torch.device(device)
    was_training = model.training
    model.eval()
    idx = torch.arange(ranks.rank, len(x), ranks.world, device=x.device)
    sums = torch.zeros(5, dtype=torch.float64, device=device)  # loss, correct, flip-TTA, 6-view, count
    hits = torch.zeros(len(x), dtype=torch.int32, device=device)
    for j in track(idx.split(batch_size), desc, unit="batch", line=line):
        xb = norm(x[j].to(device))
        if channels_last:
            xb = xb.contiguous(memory_format=torch.channels_last)
        yb = y[j].to(device)
        logits = model(xb).float()
        ok = logits.argmax(1) == yb
        sums[0] += F.cross_entropy(logits, yb, reduction="sum")
        sums[1] += ok.sum()
        sums[4] += len(j)
        hits[j.to(device)] = ok.int()
        if tta:
            pair, four = _tta_probs(model, xb, logits)
            sums[2] += (pair.argmax(1) == yb).sum()
            sums[3] += ((pair + four).argmax(1) == yb).sum()
    model.train(was_training)
    all_reduce_(sums, ranks)
    all_reduce_(hits, ranks)
    loss, correct, flip, views, count = (sums / sums[4]).tolist()
    out = {"loss": loss, "acc": correct, "hits": hits.bool().cpu()}
    if tta:
        out["acc_tta"], out["acc_tta_shift"] = flip, views
    return out


class ClassifyTask:
    """Classification as a task of ``loop``: batches of uint8 images from a ``BatchLoader``
    (augmented and normalised on the device), cross-entropy with label smoothing, test loss and
    accuracy after each epoch, and at the end accuracy with test-time augmentation (``tta``) and,
    given each test image's ``test_distance`` and the bins' ``distance_edges``, by distance."""

    score = "test_acc"
    data_on_clock = True  # indexing and augmenting the batch on the device is part of the step (airbench)
    counts_hits = True

    def __init__(self, family: str, loader: BatchLoader, norm: nn.Module, test_x: torch.Tensor,
                 test_y: torch.Tensor, *, device: torch.device, ranks: Dist, label_smoothing: float = 0.0,
                 channels_last: bool = False, eval_batch_size: int = 500,
                 tta: bool = True, test_distance: torch.Tensor | None = None,
                 distance_edges: tuple[int, ...] = (), teacher: nn.Module | None = None) -> None:
        self.family, self.loader, self.norm = family, loader, norm
        self.test_x, self.test_y, self.device, self.ranks = test_x, test_y, device, ranks
        self.label_smoothing, self.channels_last = label_smoothing, channels_last
        self.eval_batch_size, self.tta = eval_batch_size, tta
        self.test_distance, self.distance_edges = test_distance, distance_edges
        self.teacher = teacher
        self.steps_per_epoch, self.batch_size = len(loader), loader.batch_size

    def batches(self, epoch: int, start_step: int) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        return self.loader.epoch(epoch, start_step)

    def inputs(self, xb: torch.Tensor) -> torch.Tensor:
        """A batch of uint8 images as the model takes them: normalised, in its memory layout."""
        x = self.norm(xb)
        return x.contiguous(memory_format=torch.channels_last) if self.channels_last else x

    def loss_of(self, logits, x: torch.Tensor, yb: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The loss and the hits of a batch's logits (a pair from a distilled model in training)."""
        if self.teacher is None:
            loss = F.cross_entropy(logits.float(), yb, label_smoothing=self.label_smoothing)
        else:  # DeiT's hard distillation: half the loss on the labels, half on the teacher's
            with torch.no_grad():
                taught = self.teacher(x).argmax(1)
            logits, dist = logits if isinstance(logits, tuple) else (logits, logits)
            loss = (F.cross_entropy(logits.float(), yb, label_smoothing=self.label_smoothing)
                    + F.cross_entropy(dist.float(), taught)) / 2
            logits = (logits + dist) / 2
        return loss, (logits.argmax(1) == yb).sum()

    def loss(self, net: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor, int]:
        xb, yb = batch
        x = self.inputs(xb)
        return *self.loss_of(net(x), x, yb), len(yb)  # net runs under the loop's autocast with --amp

    def _evaluate(self, model: nn.Module, tta: bool, desc: str, line: bool) -> dict:
        return evaluate(model, self.norm, self.test_x, self.test_y, batch_size=self.eval_batch_size,
                        device=self.device, ranks=self.ranks, channels_last=self.channels_last, tta=tta,
                        desc=desc, line=line)

    def evaluate(self, model: nn.Module) -> dict[str, float]:
        ev = self._evaluate(model, False, f"[{self.family}] evaluation", line=False)  # the epoch's line follows
        return {"test_loss": ev["loss"], "test_acc": ev["acc"]}

    def final(self, model: nn.Module, desc: str) -> dict[str, Any]:
        views = f" of {len(self.test_x)} images x 6 views (test-time augmentation)" if self.tta else ""
        ev = self._evaluate(model, self.tta, desc + views, line=True)
        out = {"final_acc": ev["acc"], "final_loss": ev["loss"]}
        if self.tta:
            out["final_acc_tta"], out["final_acc_tta_shift"] = ev["acc_tta"], ev["acc_tta_shift"]
        if self.test_distance is not None:
            out["accuracy_by_distance"] = accuracy_by_distance(ev["hits"], self.test_distance, self.distance_edges)
        return out

    def log_line(self, metrics: dict[str, float]) -> str:
        return f"test loss {metrics['test_loss']:.4f} acc {metrics['test_acc']:.4f}"


class GroupTask:
    """Several seeds' classification as one task of ``loop``, for a ``stack.SeedStack``: each step
    takes every seed's own batch (``tasks[s]``, the task of its solo run), runs them through the
    stack at once and returns one loss and hit count per seed; the loop evaluates seed ``s`` with
    ``tasks[s]``."""

    score, data_on_clock, counts_hits = ClassifyTask.score, ClassifyTask.data_on_clock, ClassifyTask.counts_hits

    def __init__(self, tasks: Sequence[ClassifyTask]) -> None:
        self.tasks = list(tasks)
        self.family = self.tasks[0].family
        self.steps_per_epoch, self.batch_size = self.tasks[0].steps_per_epoch, self.tasks[0].batch_size

    def batches(self, epoch: int, start_step: int) -> Iterator[tuple[tuple[torch.Tensor, torch.Tensor], ...]]:
        return zip(*(t.batches(epoch, start_step) for t in self.tasks))

    def loss(self, net: nn.Module, batch) -> tuple[torch.Tensor, torch.Tensor, int]:
        xs = [t.inputs(xb) for t, (xb, _) in zip(self.tasks, batch)]
        out = net(xs)  # (S, B, classes), or a pair of them
        per_seed = zip(*(o.unbind(0) for o in out)) if isinstance(out, tuple) else out.unbind(0)
        parts = [t.loss_of(o, x, yb) for t, o, x, (_, yb) in zip(self.tasks, per_seed, xs, batch)]
        return torch.stack([p[0] for p in parts]), torch.stack([p[1] for p in parts]), len(batch[0][1])

    def log_line(self, metrics: dict[str, float]) -> str:
        return self.tasks[0].log_line(metrics)


def classify_task(family: str, cfg: Config, ds: Dataset, device: torch.device, ranks: Dist,
                  teacher: nn.Module | None = None) -> ClassifyTask:
    """The task of training ``family`` as ``cfg`` says on ``ds``: this rank's shard of the
    training images in batches of its recipe, augmented as it says."""
    r = cfg.recipe(family)
    augment = Augment(translate=r.translate, flip=cfg.flip, cutout=r.cutout, padding_mode=r.padding_mode,
                      fill=ds.norm.mean)
    loader = BatchLoader(ds.data.train_x, ds.data.train_y, r.batch_size // ranks.world, shuffle=True,
                              drop_last=True, augment=augment, seed=cfg.seed, rank=ranks.rank, world_size=ranks.world)
    return ClassifyTask(family, loader, ds.norm, ds.data.test_x, ds.data.test_y, device=device, ranks=ranks,
                        label_smoothing=r.label_smoothing,
                        channels_last=family == "cnn" and cfg.channels_last, eval_batch_size=cfg.eval_batch_size,
                        tta=cfg.tta, test_distance=ds.test_distance,
                        distance_edges=DISTANCE_EDGES.get(cfg.long_range_task, ()), teacher=teacher)


def classification_run(family: str, model: nn.Module, cfg: Config, ds: Dataset | Sequence[Dataset],
                       device: torch.device, ranks: Dist, checkpoint_path: Path, resumed: dict | None = None,
                       teacher: nn.Module | Sequence[nn.Module] | None = None) -> Run:
    """``run.build_run`` for ``family`` as ``cfg`` says: its recipe's optimiser, schedule, clipping
    and EMA, for ``cfg.epochs`` (or the recipe's) or ``cfg.time_budget`` minutes of steps; with a
    ``teacher``, a distilled model trains its two heads apart. For a ``stack.SeedStack`` ``model``,
    ``ds`` and ``teacher`` hold one per seed (``load_datasets``, ``load_teachers``) and the run
    trains every seed on one clock with one optimiser over the stacked weights."""
    r = cfg.recipe(family)
    group = cfg.seed_list()
    if isinstance(model, stack.SeedStack):
        teachers = teacher if teacher is not None else [None] * len(group)
        task = GroupTask([classify_task(family, cfg.for_seed(k), d, device, ranks, t)
                          for k, d, t in zip(group, ds, teachers)])
        steps = task.tasks[0].steps_per_epoch
    else:
        task = classify_task(family, cfg, ds, device, ranks, teacher)
        steps = task.steps_per_epoch
    if teacher is not None and getattr(one_model(model), "dist_token", None) is not None:
        for m in (model.template, model.runner) if isinstance(model, stack.SeedStack) else (model,):
            m.set_distilled_training(True)
    epochs = cfg.epochs if cfg.epochs is not None else (None if cfg.time_budget else r.epochs)
    stepped = model.module if isinstance(model, stack.SeedStack) else model
    opt = optim.create_optimizer(stepped, **r.optimizer_kwargs(), lead=stack.lead_dims(model))
    return build_run(task, model, opt, resumed=resumed, checkpoint_path=checkpoint_path, lr_at=r.lr_at,
                          grad_clip=r.grad_clip, total_steps=math.ceil(epochs * steps) if epochs is not None else None,
                          budget_s=cfg.time_budget * 60 if cfg.time_budget else None, device=device, ranks=ranks,
                          seed=cfg.seed, amp_dtype=cfg.autocast_dtype(), ema_decay=r.model_ema_decay,
                          compile=cfg.compile, config=dataclasses.asdict(cfg), group=group)


def describe_run(family: str, model: nn.Module, cfg: Config, run: Run, pipeline: dict,
                 teacher: Teacher | None) -> list[str]:
    """The lines a run opens with: the model, its recipe and precision, the batch pipeline's
    speed alone, a precision warning, the teacher."""
    r = cfg.recipe(family)
    group = f" x {len(cfg.seed_list())} seeds ({cfg.seeds}, {model.mode})" if cfg.seeds else ""
    lines = [f"[{family}] {cfg.preset(family)}{group}: {count_params(one_model(model)) / 1e6:.3f} M params, "
             f"{model.flops / 1e6:.1f} MFLOP/img; {r.optimizer} lr {r.lr:g} wd {r.weight_decay:g} batch {r.batch_size} "
             f"({run.task.steps_per_epoch} steps/epoch); {run.precision} on {run.device}; pipeline alone "
             f"{pipeline.get('augmented_images_per_s', 0):.0f} img/s"]
    if cfg.time_budget:
        views = " (6 views each)" if cfg.tta else ""
        lines.append(f"[{family}] --time-budget {cfg.time_budget:g} min counts training steps only: each epoch's "
                     f"evaluation, the final one{views} and the context measures come on top")
    if runtime.precision_warning(run.device, cfg.autocast_dtype()):
        lines.append(f"[{family}] warning: {runtime.precision_warning(run.device, cfg.autocast_dtype())}")
    if teacher:
        lines.append(f"[{family}] teacher: {teacher.info['preset']} of {teacher.info['run']} "
                     f"({teacher.info['final_acc']:.4f} in {teacher.info['train_seconds'] / 60:.1f} min of training)")
    return lines
