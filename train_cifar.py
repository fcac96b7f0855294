"""Train a ViT and a small CNN on CIFAR-10 under the same budget, and measure their global context.

    python train_cifar.py --data-dir path/to/cifar --time-budget 30
    python train_cifar.py --dataset long-range --time-budget 3       # generated, no download
    torchrun --nproc_per_node=2 train_cifar.py ...                   # DistributedDataParallel

Top to bottom: configuration, data, models, the training loop, evaluation and report, ``main``
and the command line; the helpers come from vitattn's modules, named where used. A run writes
``config.json``, ``metrics.jsonl``, ``summary.json``, ``checkpoints/``, plots and ``report.md``
to ``--out``. With ``--time-budget MINUTES`` each model trains for that many minutes of steps
(evaluation excluded, as in airbench) on a schedule that runs on the budget's fraction used.

References: airbench (``airbench94.py``) for the layout and the CNN recipe; DeiT for the ViT's.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import math
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

import vitattn
from vitattn import checkpoint, cli, data, optim, report, runtime, train
from vitattn.cli import UsageError, option
from vitattn.helpers import to_2tuple
from vitattn.longrange import ATTRIBUTES, BACKGROUNDS, DISTANCE_EDGES, accuracy_by_distance, long_range_data
from vitattn.train import DATASET_RECIPES, DEFAULT_PRESETS, RECIPES, Recipe

# =============================================================================================
# 1. Configuration
# =============================================================================================


@dataclass
class Config(cli.overrides_of(Recipe, skip=("epochs",), note=" (default: the family's recipe)")):
    model: str = option("both", "which to train", choices=("vit", "cnn", "both"))
    vit_preset: str | None = option(None, "ViT preset (vitattn.list_models()); default: DEFAULT_PRESETS[dataset]")
    cnn_preset: str | None = option(None, "CNN preset; default: DEFAULT_PRESETS[dataset]")
    vit_kwargs: str = option("{}", "JSON of ViT config fields over the preset's, e.g. '{\"depth\": 2}' (timm's "
                             "--model-kwargs)")
    cnn_kwargs: str = option("{}", "JSON of CNN config fields over the preset's, e.g. '{\"widths\": [64, 256]}'")
    dataset: str = option("cifar10", "'long-range' is generated, no download", choices=("cifar10", "long-range"))
    data_dir: str = option("./data", "cifar-10-batches-py folder, ImageFolder tree, or .tar.gz of one")
    download: bool = option(False, "fetch CIFAR-10 through torchvision when --data-dir has none")
    long_range_task: str = option("alignment", "the long-range label: 'alignment' (one row or one column? only "
                                  "relating the two places tells), 'colour' / 'shape' (do the marks match? pooled "
                                  "detectors count it) or 'pointing' (does the arrow point at the plus?)",
                                  choices=ATTRIBUTES)
    long_range_background: str = option("plain", "what the long-range marks are drawn on: 'plain' (one grey level: "
                                        "finding the marks is trivial) or 'texture' (colour blobs, stripes and "
                                        "noise: finding a 3x3 mark is hard too)", choices=tuple(BACKGROUNDS))
    long_range_train: int = option(20_000, "images generated for training the long-range task")
    long_range_test: int = option(4_000, "images generated for testing it")
    limit_train: int | None = option(None, "use only the first N training images")
    limit_test: int | None = option(None, "use only the first N test images")
    epochs: float | None = option(None, "passes over the training set (default: the recipe's)")
    time_budget: float | None = option(None, "minutes of training steps per model; ends the run if reached first")
    flip: bool = option(True, "augmentation: random horizontal mirror")
    seed: int = option(0, "seed for weights, batches and augmentation")
    amp: bool = option(False, "mixed precision: forward and backward under autocast in --amp-dtype (timm's --amp)")
    amp_dtype: str = option("bfloat16", "autocast precision; float16 adds a gradient scaler (checkpointed)",
                            choices=tuple(runtime.AMP_DTYPES))
    bf16: bool = option(False, "alias of --amp --amp-dtype bfloat16")
    compile: bool = option(False, "torch.compile the model (after DDP wraps it, as PyTorch recommends)")
    device: str = option("auto", "'auto' (CUDA when present), 'cpu', 'cuda' (under torchrun: each rank's own GPU), "
                         "'cuda:1' (one process)")
    tf32: bool = option(True, "CUDA: TF32 matrix products and convolutions in fp32 runs (timm's default); "
                        "--no-tf32 for exact fp32")
    cudnn_benchmark: bool = option(True, "CUDA: let cuDNN time its convolution algorithms on first use and keep the "
                                   "fastest")
    channels_last: bool = option(True, "NHWC memory layout for the CNN")
    tta: bool = option(True, "also report final accuracy over mirrored and shifted views")
    eval_batch_size: int = option(500, "images per evaluation batch")
    out: str | None = option(None, "run folder (default: runs/<timestamp>); must not hold a run already",
                             aliases=("--output",))
    resume: str | None = option(None, "a run folder to continue, with the options it was started with")
    context_images: int | None = option(None, "test images for the global-context measures (default: 128, or "
                                        "the whole test set when smaller)")
    progress: bool = option(True, "tqdm progress bar")
    plots: bool = option(True, "write PNG plots (matplotlib)")

    POSITIVE = ("epochs", "time_budget", "lr", "bias_lr_scale", "batch_size", "eval_batch_size", "context_images",
                "long_range_train", "long_range_test", "limit_train", "limit_test")
    NON_NEGATIVE = ("weight_decay", "warmup_lr", "min_lr", "grad_clip", "translate", "cutout", "seed")
    FRACTION = ("warmup", "momentum", "beta2", "label_smoothing", "model_ema_decay")  # in [0, 1)

    def __post_init__(self) -> None:
        cli.check_fields(self)
        if self.bf16:
            if self.amp and self.amp_dtype != "bfloat16":
                raise UsageError(f"--bf16 means --amp --amp-dtype bfloat16, got --amp-dtype {self.amp_dtype} with it")
            self.amp, self.amp_dtype = True, "bfloat16"
        if self.seed >= 2**32:
            raise UsageError(f"--seed must be below 2**32, got {self.seed}")
        self.vit_preset = self.vit_preset or DEFAULT_PRESETS[self.dataset]["vit"]
        self.cnn_preset = self.cnn_preset or DEFAULT_PRESETS[self.dataset]["cnn"]
        for slot, families in (("vit", ("vit",)), ("cnn", ("cnn", "bof"))):  # the CNN slot takes its control too
            try:
                vitattn.registry.check_preset(getattr(self, f"{slot}_preset"), families)
            except ValueError as e:
                raise UsageError(f"--{slot}-preset: {e}") from None
            self.model_kwargs(slot)  # checked here, so a typo stops the run before anything is written
        for fam in self.models():
            self.recipe(fam)  # a Recipe checks itself
        if self.optimizer == "muon" and self.model != "vit":
            raise UsageError(f"--optimizer muon steps a ViT's block matrices; use it with --model vit, got --model "
                             f"{self.model}")

    def model_kwargs(self, family: str) -> dict[str, Any]:
        """``--vit-kwargs`` / ``--cnn-kwargs`` parsed and checked against the preset's config."""
        # replacing what the data decides would train another model than the one asked for
        return cli.preset_kwargs(f"--{family}-kwargs", getattr(self, f"{family}_kwargs"), self.preset(family),
                                 refuse=("img_size", "num_classes", "in_chans"),
                                 why="come from the data (its image size, classes and channels)")

    def autocast_dtype(self) -> torch.dtype | None:
        """The autocast precision, or None for fp32."""
        return runtime.AMP_DTYPES[self.amp_dtype] if self.amp else None

    def models(self) -> list[str]:
        return ["vit", "cnn"] if self.model == "both" else [self.model]

    def preset(self, family: str) -> str:
        return self.vit_preset if family == "vit" else self.cnn_preset

    def recipe(self, family: str) -> Recipe:
        """The family's recipe with the dataset's changes and this config's overrides applied."""
        base = dataclasses.replace(RECIPES[family], **DATASET_RECIPES.get(self.dataset, {}).get(family, {}))
        over = {f.name: getattr(self, f.name) for f in dataclasses.fields(Recipe)
                if f.name != "epochs" and getattr(self, f.name, None) is not None}
        return dataclasses.replace(base, **over)


# =============================================================================================
# 2. Data
# =============================================================================================


@dataclass
class Dataset:
    data: data.ImageData
    norm: data.Normalize  # per-channel statistics of the training images
    test_distance: torch.Tensor | None = None  # long-range: pixels between the marks, per test image


def load_dataset(cfg: Config, dev: torch.device | None = None) -> Dataset:
    """The images as uint8 tensors, on ``dev`` when it is an accelerator: batches are then indexed,
    augmented and normalised there, and the host does no per-image work (airbench)."""
    distance = None
    if cfg.dataset == "long-range":
        images, distance = long_range_data(cfg.long_range_train, cfg.long_range_test, seed=cfg.seed,
                                           attribute=cfg.long_range_task, background=cfg.long_range_background)
    else:
        images = data.load_cifar(cfg.data_dir, download=cfg.download)
    if cfg.limit_train:
        images.train_x, images.train_y = images.train_x[: cfg.limit_train], images.train_y[: cfg.limit_train]
    if cfg.limit_test:
        images.test_x, images.test_y = images.test_x[: cfg.limit_test], images.test_y[: cfg.limit_test]
        distance = None if distance is None else distance[: cfg.limit_test]
    if cfg.context_images is not None and cfg.context_images > len(images.test_x):
        raise UsageError(f"--context-images must be at most the {len(images.test_x)} test images, got "
                         f"{cfg.context_images}")
    norm = data.Normalize(*data.channel_stats(images.train_x))
    if dev is None or dev.type == "cpu":
        return Dataset(images, norm, distance)
    return Dataset(images.to(dev), norm.to(dev), distance)


# =============================================================================================
# 3. Models
# =============================================================================================


def build_model(family: str, cfg: Config, ds: Dataset, dev: torch.device, world: int) -> nn.Module:
    """The preset for the data's classes and image size (a ViT's position table is sized from the
    images), checked against the data before anything is written."""
    preset, images = cfg.preset(family), ds.data
    size = tuple(images.train_x.shape[-2:])
    kwargs = cfg.model_kwargs(family)
    over: dict[str, Any] = {**kwargs, "num_classes": len(images.classes)}
    if family == "vit":
        patch = to_2tuple(vitattn.get_config(preset, **kwargs).patch_size)
        if size[0] % patch[0] or size[1] % patch[1]:
            raise UsageError(f"the images are {size[0]}x{size[1]}, which {preset}'s {patch[0]}x{patch[1]} patches "
                             "do not tile; choose a ViT preset whose patch size divides the image size")
        over["img_size"] = size
    torch.manual_seed(cfg.seed)  # the same initial weights on every rank and every resume
    model = vitattn.create_model(preset, **over).to(dev)
    try:
        model.flops = train.flops_per_image(model, size)
    except (RuntimeError, ValueError) as e:
        raise UsageError(f"{preset} cannot take {size[0]}x{size[1]} images: {e}") from e
    cfg.recipe(family).check_data(family, size, len(images.train_x), world)
    if hasattr(model, "init_stem"):  # data-dependent stems (whitening) are set from 5,000 training images
        model.init_stem(ds.norm(images.train_x[:5000]))
    if family == "cnn" and cfg.channels_last:
        model = model.to(memory_format=torch.channels_last)
    return model


# =============================================================================================
# 4. The training loop
# =============================================================================================


@dataclass
class TrainState:
    """Where a run is; everything in it loads with ``torch.load(weights_only=True)``."""

    epoch: int = 0  # current epoch (0-based)
    step_in_epoch: int = 0  # batches of this epoch already taken
    global_step: int = 0
    train_seconds: float = 0.0  # time in training steps, summed over sessions
    images_seen: int = 0  # on this rank
    data_seconds: float = 0.0  # time making batches (index, augment, normalise)
    compile_seconds: float = 0.0  # --compile: each session's first step, kept off the clock and the budget
    loss_sum: float = 0.0  # over this epoch's steps so far
    correct_sum: int = 0
    count: int = 0
    best_acc: float = 0.0
    done: bool = False


@dataclass
class Run:
    """One model's training: what the loop reads and updates."""

    family: str
    model: nn.Module
    net: nn.Module  # the model as stepped: wrapped in DDP and / or compiled
    opt: torch.optim.Optimizer | optim.OptimizerChain
    recipe: Recipe
    loader: data.BatchLoader
    st: TrainState
    ckpt: Path
    total_steps: int | None
    budget_s: float | None
    channels_last: bool
    device: torch.device
    amp_dtype: torch.dtype | None  # autocast precision; None = fp32
    scaler: torch.amp.GradScaler  # fp16's loss scaling; a pass-through otherwise
    running: torch.Tensor  # (loss sum, correct) of the steps since the loop last read them, on the device
    ema: optim.ModelEma | None = None  # the averaged weights the run keeps, if any
    compiling: bool = False  # the next step compiles the model (--compile, first step of a session)
    config: dict | None = None  # the run's options, saved with each checkpoint (check_resumed compares them)

    def progress(self) -> float:
        return train.run_progress(self.st.global_step, self.total_steps, self.st.train_seconds, self.budget_s)

    def precision(self) -> str:
        return runtime.precision_name(self.amp_dtype, self.scaler.is_enabled())

    def images_per_s(self, world: int) -> float:
        return self.st.images_seen * world / max(self.st.train_seconds, 1e-9)

    def save(self, rng: list[dict], result: dict | None = None) -> None:
        """Write the checkpoint (rank 0), with every rank's random states (``runtime.all_rng_states``)."""
        extra = {"ema": self.ema.state_dict()} if self.ema is not None else {}
        if self.scaler.is_enabled():
            extra["scaler"] = self.scaler.state_dict()
        checkpoint.save_atomic({"model": self.model.state_dict(), "optimizer": self.opt.state_dict(),
                                "state": asdict(self.st), "rng": rng, "family": self.family,
                                "config": self.config, "result": result or {}, **extra}, self.ckpt)


def start_run(family: str, model: nn.Module, ck: dict | None, cfg: Config, ds: Dataset, out: Path,
              dev: torch.device, dd: runtime.Dist) -> Run:
    r = cfg.recipe(family)
    opt = optim.build_optimizer(model, r)
    ema = optim.model_ema(model, r.model_ema_decay) if r.model_ema_decay > 0 else None
    amp_dtype = cfg.autocast_dtype()
    scaler = torch.amp.GradScaler(dev.type, enabled=amp_dtype == torch.float16)
    st = TrainState()
    restored = False
    if ck is not None:  # read on the CPU (and checked) by main before anything was written
        restored = checkpoint.restore(ck, model, opt, scaler, dev, dd.rank)
        st = TrainState(**ck["state"])
        if ema is not None and not st.done:
            ema.load_state_dict(ck["ema"])
    if not restored:
        torch.manual_seed(cfg.seed + 17 * dd.rank)  # each rank's own dropout / drop-path stream
    augment = data.Augment(translate=r.translate, flip=cfg.flip, cutout=r.cutout, padding_mode=r.padding_mode)
    loader = data.BatchLoader(ds.data.train_x, ds.data.train_y, r.batch_size // dd.world, shuffle=True,
                              drop_last=True, augment=augment, seed=cfg.seed, rank=dd.rank, world_size=dd.world)
    epochs = cfg.epochs if cfg.epochs is not None else (None if cfg.time_budget else r.epochs)
    net = runtime.wrap_model(model, dd, dev, cfg.compile)
    return Run(family, model, net, opt, r, loader, st, out / "checkpoints" / f"{family}.pt",
               math.ceil(epochs * len(loader)) if epochs is not None else None,
               cfg.time_budget * 60 if cfg.time_budget else None, family == "cnn" and cfg.channels_last, dev,
               amp_dtype, scaler, torch.zeros(2, dtype=torch.float64, device=dev), ema, cfg.compile, asdict(cfg))


# Steps between reads of the running loss: each read waits for a GPU to drain its queue, and a
# torchrun's ranks agree on the clock, Ctrl-C and a NaN there, so they stop at the same step.
READ_EVERY = 50


def train_step(run: Run, xb: torch.Tensor, yb: torch.Tensor, norm: nn.Module) -> None:
    """One optimiser step on a uint8 batch on the device; its loss and hits are added to
    ``run.running`` on the device, so nothing here waits for a GPU."""
    r = run.recipe
    optim.set_lr(run.opt, r.lr_at(run.progress()))
    x = norm(xb)
    if run.channels_last:
        x = x.contiguous(memory_format=torch.channels_last)
    with runtime.autocast(x.device, run.amp_dtype):
        logits = run.net(x)
        loss = F.cross_entropy(logits.float(), yb, label_smoothing=r.label_smoothing)
    optim.backward_step(loss, run.opt, run.scaler, run.model.parameters(), r.grad_clip)
    if run.ema is not None:
        run.ema.update_parameters(run.model)
    # float64 sums of float32 losses are exact, so they do not depend on when they are read
    run.running += torch.stack([loss.detach().double() * len(yb), (logits.argmax(1) == yb).sum().double()])


def read_running(run: Run, bar) -> None:
    """Move the device's running sums into the train state (waits for a GPU)."""
    loss, correct = run.running.tolist()
    run.running.zero_()
    st = run.st
    st.loss_sum += loss
    st.correct_sum += int(correct)
    if bar is not None:
        bar.set_postfix(loss=f"{st.loss_sum / max(st.count, 1):.3f}", acc=f"{st.correct_sum / max(st.count, 1):.3f}",
                        img_s=f"{run.images_per_s(1):.0f}")


def check_stop(run: Run, dd: runtime.Dist, stop: runtime.StopFlag, pending_s: float) -> None:
    """Add ``pending_s`` of step time to the run's clock, then raise NonFiniteLoss or Interrupted
    when the loss read so far is not finite or Ctrl-C came. A torchrun's ranks agree first (the
    slowest clock, any NaN, any Ctrl-C), so their clocks, lr schedules and stops stay equal."""
    st = run.st
    seconds, nonfinite, stopping = st.train_seconds + pending_s, not math.isfinite(st.loss_sum), stop.set
    if dd.world > 1:
        flags = torch.tensor([seconds, nonfinite, stopping], dtype=torch.float64, device=run.device)
        seconds, nonfinite, stopping = runtime.all_reduce_(flags, dd, dist.ReduceOp.MAX).tolist()
    st.train_seconds = seconds
    if nonfinite:  # a NaN on any rank poisons the averaged gradients of all
        raise runtime.NonFiniteLoss(f"[{run.family}] loss is {st.loss_sum / max(st.count, 1)} by epoch {st.epoch} step "
                            f"{st.step_in_epoch}; stopping. The last good checkpoint is kept at "
                            f"{run.ckpt if run.ckpt.exists() else '(none yet)'}. Lower --lr or set --grad-clip.")
    if stopping:  # before the forward pass, which would move BatchNorm statistics
        raise runtime.Interrupted


def train_epoch(run: Run, norm: nn.Module, dd: runtime.Dist, stop: runtime.StopFlag, bar) -> None:
    """Steps until the epoch or the budget ends; raises Interrupted at a step boundary on Ctrl-C.
    A single process checks Ctrl-C and the budget at every step (host values only); a torchrun's
    ranks every ``READ_EVERY`` steps, and their clocks move only then."""
    st = run.st
    if st.step_in_epoch == 0:
        st.loss_sum, st.correct_sum, st.count = 0.0, 0, 0
    batches = run.loader.epoch(st.epoch, st.step_in_epoch)
    pending = 0.0  # step seconds not yet on the clock (a torchrun's, until its ranks agree)
    while st.step_in_epoch < len(run.loader):
        t0 = time.perf_counter()
        due = st.global_step % READ_EVERY == 0
        if due or (dd.world == 1 and stop.set):
            read_running(run, bar)
        if due or dd.world == 1:
            check_stop(run, dd, stop, pending)
            pending = 0.0
        if run.progress() >= 1.0:
            break
        xb, yb = next(batches)
        t1 = time.perf_counter()
        train_step(run, xb, yb, norm)
        st.global_step += 1
        st.step_in_epoch += 1
        st.count += len(yb)
        if run.compiling:  # compiling is not training: reported apart, and the budget is for steps
            run.compiling = False
            st.compile_seconds += time.perf_counter() - t0
        else:
            st.data_seconds += t1 - t0
            st.images_seen += len(yb)
            if dd.world == 1:
                st.train_seconds += time.perf_counter() - t0
            else:
                pending += time.perf_counter() - t0
        if bar is not None:
            bar.update((round(min(st.train_seconds, run.budget_s) / 60, 2) - bar.n) if run.budget_s else 1)
    t0 = time.perf_counter()
    read_running(run, bar)  # waits for the last steps' GPU work, which the clock must count
    check_stop(run, dd, stop, pending + time.perf_counter() - t0)


def end_epoch(run: Run, cfg: Config, ds: Dataset, out: Path, dev: torch.device, dd: runtime.Dist, log) -> None:
    """After an epoch (or the budget): evaluate, write a metrics line, checkpoint."""
    st = run.st
    ended = st.step_in_epoch >= len(run.loader)
    test = functools.partial(train.evaluate, norm=ds.norm, x=ds.data.test_x, y=ds.data.test_y,
                             batch_size=cfg.eval_batch_size, device=dev, dd=dd, channels_last=run.channels_last,
                             amp_dtype=run.amp_dtype)
    runtime.average_buffers(run.model, dd)  # each rank's BatchNorm statistics saw only its shard
    ev = test(run.model)
    raw = {}
    if run.ema is not None:  # test_acc is the kept model's, the EMA; the raw weights' is logged beside
        runtime.average_buffers(run.ema.module, dd)
        raw = {"test_loss_no_ema": ev["loss"], "test_acc_no_ema": ev["acc"]}
        ev = test(run.ema.module)
    st.best_acc = max(st.best_acc, ev["acc"])
    sums = torch.tensor([st.loss_sum, st.correct_sum, st.count], dtype=torch.float64, device=dev)
    sums = runtime.all_reduce_(sums, dd).tolist()
    line = dict(model=run.family, epoch=round(st.epoch + (1.0 if ended else st.step_in_epoch / len(run.loader)), 4),
                step=st.global_step, train_loss=float(sums[0] / max(sums[2], 1)),
                train_acc=float(sums[1] / max(sums[2], 1)), test_loss=ev["loss"], test_acc=ev["acc"],
                lr=run.recipe.lr_at(run.progress()), train_seconds=st.train_seconds,
                images_per_s=run.images_per_s(dd.world), data_share=st.data_seconds / max(st.train_seconds, 1e-9),
                **raw)
    if ended:
        st.epoch, st.step_in_epoch = st.epoch + 1, 0
    st.done = run.progress() >= 1.0
    rng = runtime.all_rng_states(dev, dd)  # a collective: every rank's streams go into rank 0's file
    if dd.main:
        checkpoint.append_jsonl(out / "metrics.jsonl", line)
        log(f"[{run.family}] epoch {line['epoch']:.2f}: train loss {line['train_loss']:.4f} acc "
            f"{line['train_acc']:.4f} | test loss {ev['loss']:.4f} acc {ev['acc']:.4f} | "
            f"{line['images_per_s']:.0f} img/s, {st.train_seconds:.0f} s")
        if not st.done:
            run.save(rng)


def train_model(family: str, model: nn.Module, ck: dict | None, cfg: Config, ds: Dataset, out: Path,
                dev: torch.device, dd: runtime.Dist, stop: runtime.StopFlag, log) -> dict:
    """Train one model (from its checkpoint when resuming); returns its result dict with the
    trained ``model``. Raises Interrupted / NonFiniteLoss after saving / keeping the checkpoint."""
    wall0 = time.perf_counter()
    run = start_run(family, model, ck, cfg, ds, out, dev, dd)
    if run.st.done:
        log(f"[{family}] already finished in {out}; skipping training")
        if dd.main:  # written anew from the checkpoint: a crash may have cut the first copy short
            checkpoint.save_safetensors(model, out / "checkpoints" / f"{family}.safetensors")
        return {**ck["result"], "model": model}
    if ck is not None:
        log(f"[{family}] resuming at epoch {run.st.epoch} step {run.st.step_in_epoch} ({run.st.train_seconds:.0f} s)")
    if dd.main:  # drop lines written after the checkpoint (all of this model's when none was written)
        step = run.st.global_step
        checkpoint.filter_jsonl(out / "metrics.jsonl", lambda m: m["model"] != family or m["step"] <= step)
    pipeline = data.pipeline_speed(run.loader, ds.norm) if dd.main else {}
    r = run.recipe
    log(f"[{family}] {cfg.preset(family)}: {train.count_params(model) / 1e6:.3f} M params, "
        f"{model.flops / 1e6:.1f} MFLOP/img; "
        f"{r.optimizer} lr {r.lr:g} wd {r.weight_decay:g} batch {r.batch_size} ({len(run.loader)} steps/epoch); "
        f"{run.precision()} on {dev}; pipeline alone {pipeline.get('augmented_images_per_s', 0):.0f} img/s")
    if runtime.precision_warning(dev, run.amp_dtype):
        log(f"[{family}] warning: {runtime.precision_warning(dev, run.amp_dtype)}")
    bar = (cli.progress_bar(family, run.total_steps, run.st.global_step, run.budget_s, run.st.train_seconds)
           if cfg.progress and dd.main else None)
    model.train()
    try:
        while run.progress() < 1.0:
            train_epoch(run, ds.norm, dd, stop, bar)
            end_epoch(run, cfg, ds, out, dev, dd, log)
    except runtime.Interrupted:  # every rank stops at the same step (check_stop), so all gather
        rng = runtime.all_rng_states(dev, dd)
        if dd.main:
            run.save(rng)
        raise
    finally:
        if bar is not None:
            bar.close()
    return finish(run, cfg, ds, out, dev, dd, pipeline, time.perf_counter() - wall0)


# =============================================================================================
# 5. Evaluation and report
# =============================================================================================


def finish(run: Run, cfg: Config, ds: Dataset, out: Path, dev: torch.device, dd: runtime.Dist, pipeline: dict,
           wall_s: float) -> dict:
    """The final test (with TTA and, on the long-range task, by distance), saved with the weights."""
    st, model = run.st, run.model
    metrics = [m for m in checkpoint.read_jsonl(out / "metrics.jsonl") if m["model"] == run.family] if dd.main else []
    raw = {}
    if run.ema is not None:  # the run keeps the averaged weights: they are tested, saved and measured
        if metrics:  # the last epoch's line already tested these raw weights
            raw["final_acc_no_ema"] = metrics[-1]["test_acc_no_ema"]
        model.load_state_dict(run.ema.module.state_dict())
    final = train.evaluate(model, ds.norm, ds.data.test_x, ds.data.test_y, batch_size=cfg.eval_batch_size, device=dev,
                           dd=dd, channels_last=run.channels_last, tta=cfg.tta, amp_dtype=run.amp_dtype)
    result = dict(family=run.family, preset=cfg.preset(run.family), params=train.count_params(model),
                  flops_per_image=model.flops, epochs=metrics[-1]["epoch"] if metrics else st.epoch,
                  steps=st.global_step, final_acc=final["acc"], best_acc=max(st.best_acc, final["acc"]),
                  final_loss=final["loss"], train_seconds=st.train_seconds, images_per_s=run.images_per_s(dd.world),
                  data_share=st.data_seconds / max(st.train_seconds, 1e-9), recipe=asdict(run.recipe),
                  batch_per_rank=run.loader.batch_size, world_size=dd.world, precision=run.precision(),
                  pipeline=pipeline, wall_seconds=wall_s, compile_seconds=st.compile_seconds, **raw)
    if dd.world > 1:  # DDP keeps the ranks' weights equal: checked, not assumed
        result["ranks_agree"] = runtime.ranks_agree(model, dd)
    if cfg.tta:
        result["final_acc_tta"], result["final_acc_tta_shift"] = final["acc_tta"], final["acc_tta_shift"]
    if ds.test_distance is not None:
        result["accuracy_by_distance"] = accuracy_by_distance(final["hits"], ds.test_distance,
                                                              DISTANCE_EDGES[cfg.long_range_task])
    rng = runtime.all_rng_states(dev, dd)
    if dd.main:
        run.save(rng, result)
        checkpoint.save_safetensors(model, out / "checkpoints" / f"{run.family}.safetensors")
    return {**result, "model": model}


def context_sample(cfg: Config, ds: Dataset) -> torch.Tensor:
    """The fixed test images the global-context measures look at (indices)."""
    n = cfg.context_images or min(128, len(ds.data.test_x))
    return torch.randperm(len(ds.data.test_x), generator=data.step_generator(cfg.seed, -1))[:n]


# =============================================================================================
# 6. main and the command line
# =============================================================================================


OLD_RUN_VALUES = {"long_range_background": "texture"}  # runs from before the option drew on the texture
REMOVED_OPTIONS = ("lookahead_decay",)  # measured and taken out (journal.md); a run that set one cannot go on


def main(config: Config) -> dict:
    """Train, measure and report; returns the summary dict with the trained modules under
    ``'modules'``. ``status`` is 'ok', 'interrupted' or 'nan' (those two raise nothing). Bad
    options, data or run folders raise UsageError / DataError / CheckpointError before anything is
    written."""
    t0 = time.perf_counter()
    cfg = cli.resumed_config(Config, config.resume, "train_cifar.py", progress=config.progress,
                             missing=OLD_RUN_VALUES, removed=REMOVED_OPTIONS) if config.resume else config
    dd, dev = runtime.place_process(cfg.device)
    if dev.type == "cuda":
        runtime.configure_cuda(cfg.tf32, cfg.cudnn_benchmark)
    out = cli.run_folder(cfg.out, cfg.resume)
    log = cli.console_log(cfg.progress) if dd.main else (lambda *a, **k: None)
    with contextlib.ExitStack() as folder:
        if cfg.resume:
            folder.enter_context(checkpoint.hold(out, dd.main))
        return run_all(cfg, dd, dev, out, log, folder, t0)


def run_all(cfg: Config, dd: runtime.Dist, dev: torch.device, out: Path, log, folder: contextlib.ExitStack,
            t0: float) -> dict:
    try:
        ds = load_dataset(cfg, dev)
        models = {fam: build_model(fam, cfg, ds, dev, dd.world) for fam in cfg.models()}
        ckpts = {fam: checkpoint.resume_checkpoint(out / "checkpoints" / f"{fam}.pt", m, fam)
                 for fam, m in models.items()}
        for fam, ck in ckpts.items():
            check_resumed(cfg, ck, out / "checkpoints" / f"{fam}.pt")
        if dd.main and not cfg.resume:  # everything checked: now the run folder is written
            cli.start_run_folder(out, cfg, folder)
        if dd.world > 1:
            dist.barrier()
        log(f"data: {ds.data.source}: {len(ds.data.train_x)} train / {len(ds.data.test_x)} test images, "
            f"{len(ds.data.classes)} classes; device {dev}, world size {dd.world}")
        results, modules, status = {}, {}, "ok"
        with runtime.StopFlag() as stop:
            for fam, model in models.items():
                try:
                    r = train_model(fam, model, ckpts[fam], cfg, ds, out, dev, dd, stop, log)
                except runtime.Interrupted:
                    log(f"interrupted: resumable checkpoint saved in {out / 'checkpoints'}; "
                        f"continue with: python train_cifar.py --resume {out}")
                    status = "interrupted"
                    break
                except runtime.NonFiniteLoss as e:
                    log(str(e))
                    status = "nan"
                    break
                modules[fam] = r.pop("model")
                results[fam] = r
        summary = {"status": status, "signal": stop.signum, "dataset": cfg.dataset, "data_source": ds.data.source,
                   "classes": list(ds.data.classes), "world_size": dd.world, "models": results,
                   "config": asdict(cfg), "environment": runtime.environment(dev), "out": str(out)}
        if status == "ok" and dd.main:
            summary["train_seconds_total"] = sum(r["train_seconds"] for r in results.values())
            summary["wall_seconds_total"] = time.perf_counter() - t0  # data, training, evaluation
            pick = context_sample(cfg, ds).to(ds.data.test_x.device)
            report.write_outputs(out, summary, modules, ds.data.test_x[pick], ds.data.test_y[pick], ds.data.classes,
                                 ds.norm, cfg.plots)
            log(f"wrote {out / 'report.md'}")
            for fam, r in results.items():
                log(f"[{fam}] final test accuracy {r['final_acc']:.4f} (best {r['best_acc']:.4f}), "
                    f"{r['epochs']:.2f} epochs in {r['train_seconds'] / 60:.1f} min, {r['images_per_s']:.0f} img/s")
        return {**summary, "modules": modules}
    finally:
        if dd.world > 1 and dist.is_initialized():
            dist.destroy_process_group()


# where and how a run executes and shows, not what it trains: a resume may move them (another machine)
UNCHECKED_ON_RESUME = ("resume", "out", "progress", "plots", "device", "data_dir", "download", "compile",
                       "channels_last", "eval_batch_size", "tta", "context_images", "tf32", "cudnn_benchmark")


def check_resumed(cfg: Config, ck: dict | None, path: Path) -> None:
    """``config.json`` must still say what the checkpoint was trained with (an earlier release's
    preset name counts as today's)."""
    def today(k: str, v: Any) -> Any:
        return vitattn.registry.DEPRECATED.get(v, (v,))[0] if k in ("vit_preset", "cnn_preset") else v

    if ck is not None:
        cli.check_resumed_config(cfg, ck.get("config"), path, UNCHECKED_ON_RESUME, today)


def parse_args(argv: list[str] | None = None) -> Config:
    """The command line, one option per ``Config`` field, its help from the field's metadata;
    timm's names are aliases where the meaning is the same (``--output``, ``--clip-grad``)."""
    p = cli.build_parser(Config, __doc__.split("\n\n")[0],
                         epilog="Options left unset take the model family's recipe (vitattn.train.RECIPES).")
    p.add_argument("--list-models", nargs="?", const="*", metavar="PATTERN",
                   help="print the presets (matching PATTERN, e.g. 'vit_*') with their size and purpose, and exit")
    first, _ = p.parse_known_args(argv)
    if first.list_models is not None:
        print(vitattn.registry.describe_models(first.list_models, DEFAULT_PRESETS))
        p.exit(0)
    return cli.parse_config(p, Config, argv, keep_on_resume=("progress",))


def command_line(argv: list[str] | None = None) -> int:
    """Exit status: 0 done, 1 a NaN loss, 2 bad options or files, 128 + the signal (130 for Ctrl-C,
    143 for SIGTERM) when stopped, with a resumable checkpoint once training has begun."""
    expected = (UsageError, data.DataError, checkpoint.CheckpointError)
    return cli.run_cli(main, parse_args(argv), "train_cifar.py", expected)


if __name__ == "__main__":
    sys.exit(command_line())
