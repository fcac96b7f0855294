"""Image classification (CIFAR-10, the long-range task) as a task of the training loop: the
options of ``train_cifar.py``, the data on the device, the model for it, and the task itself
(a batch of uint8 images, cross-entropy with label smoothing, accuracy with test-time
augmentation, accuracy by distance on the long-range task).

References: airbench (``airbench94.py``: normalisation on the fly, six-view test-time
augmentation); DeiT for the ViT's recipe (``recipes.py``).
"""

from __future__ import annotations

import dataclasses
import json
import math
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from .. import registry
from ..helpers import count_params, flops_per_image, to_2tuple
from . import cli, data, loop, optim, runtime, seeds
from .cli import option
from .errors import UsageError
from .longrange import ATTRIBUTES, BACKGROUNDS, DISTANCE_EDGES, accuracy_by_distance, long_range_data
from .recipes import DEFAULT_PRESETS, Recipe, recipe_for
from .runtime import Dist, all_reduce_
from .seeds import MODES as SEED_MODES

# ---------------------------------------------------------------------------------------------
# Options
# ---------------------------------------------------------------------------------------------


@dataclass
class Config(runtime.RunOptions, cli.overrides_of(Recipe, skip=("epochs",))):
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
    limit_train: int | None = option(None, "use only N training images, taken from the classes in turn")
    limit_test: int | None = option(None, "use only N test images, taken from the classes in turn")
    epochs: float | None = option(None, "passes over the training set, unless --time-budget ends the run first")
    flip: bool = option(True, "augmentation: random horizontal mirror")
    teacher: str | None = option(None, "a finished train_cifar.py run folder whose CNN the ViT also learns from "
                                 "(DeiT's hard distillation: the CNN labels each augmented batch as the ViT sees it; "
                                 "the ViT gets a distillation token unless --vit-kwargs sets \"distilled\": false); "
                                 "needs --model vit")
    seeds: str | None = option(None, "several seeds trained at once in one process, one copy of each model per "
                               "seed: '0,1,2,3', '0-7' or '0-3,8'; seed k trains as --seed k would (its weights, data "
                               "order and augmentation), and the summary gives each figure's mean, std, min and max "
                               "over the seeds; --seed N is --seeds N")
    seed_batching: str = option("auto", "how a group of seeds runs its forward passes: 'loop' (each seed in turn; "
                                "the faster on a CPU, measured), 'vmap' (all seeds in one call of each layer, "
                                "torch.func.vmap, for a GPU) or 'auto' (vmap on CUDA, loop elsewhere)",
                                choices=("auto", *SEED_MODES))
    bf16: bool = option(False, "alias of --amp --amp-dtype bfloat16")
    compile: bool = option(False, "torch.compile the training step: the model (after DDP wraps it, as PyTorch "
                                  "recommends) and the update after its backward pass (clipping, optimiser, EMA)")
    tf32: bool = option(True, "CUDA: TF32 matrix products and convolutions in fp32 runs (timm's default); "
                        "--no-tf32 for exact fp32")
    cudnn_benchmark: bool = option(True, "CUDA: let cuDNN time its convolution algorithms on first use and keep the "
                                   "fastest")
    channels_last: bool = option(True, "NHWC memory layout for the CNN")
    tta: bool = option(True, "also report final accuracy over mirrored and shifted views")
    eval_batch_size: int = option(500, "images per evaluation batch")
    out: str | None = option(None, "run folder (default: runs/<timestamp>); must not hold a run already",
                             aliases=("--output",))
    context_images: int | None = option(None, "test images for the global-context measures (default: 128, or "
                                        "the whole test set when smaller)")
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
        if self.seed >= seeds.MAX_SEED:
            raise UsageError(f"--seed must be below 2**32, got {self.seed}")
        if self.seeds is not None:  # one canonical form: several seeds, or a single --seed
            group = seeds.parse_seeds(self.seeds)
            if self.seed not in (0, group[0]):
                raise UsageError(f"--seed {self.seed} and --seeds {self.seeds} together: give one of them (--seed N "
                                 "is --seeds N)")
            self.seed, self.seeds = group[0], seeds.seeds_label(group) if len(group) > 1 else None
        self.vit_preset = self.vit_preset or DEFAULT_PRESETS[self.dataset]["vit"]
        self.cnn_preset = self.cnn_preset or DEFAULT_PRESETS[self.dataset]["cnn"]
        for slot, families in (("vit", ("vit",)), ("cnn", ("cnn", "bof"))):  # the CNN slot takes its control too
            try:
                registry.check_preset(getattr(self, f"{slot}_preset"), families)
            except ValueError as e:
                raise UsageError(f"--{slot}-preset: {e}") from None
            self.model_kwargs(slot)  # checked here, so a typo stops the run before anything is written
        for fam in self.models():
            self.recipe(fam)  # a Recipe checks itself
        if self.teacher is not None and self.model != "vit":
            raise UsageError(f"--teacher trains a ViT from a CNN run's labels; use it with --model vit, got --model "
                             f"{self.model}")
        if self.optimizer == "muon" and self.model != "vit":
            raise UsageError(f"--optimizer muon steps a ViT's block matrices; use it with --model vit, got --model "
                             f"{self.model}")

    def model_kwargs(self, family: str) -> dict[str, Any]:
        """``--vit-kwargs`` / ``--cnn-kwargs`` parsed and checked against the preset's config."""
        # replacing what the data decides would train another model than the one asked for
        return cli.preset_kwargs(f"--{family}-kwargs", getattr(self, f"{family}_kwargs"), self.preset(family),
                                 refuse=("img_size", "num_classes", "in_chans"),
                                 why="come from the data (its image size, classes and channels)")

    def seed_list(self) -> tuple[int, ...]:
        """The seeds this run trains, in order."""
        return seeds.parse_seeds(self.seeds) if self.seeds else (self.seed,)

    def for_seed(self, seed: int) -> Config:
        """This config as the solo run of ``seed`` (what a group trains as its seed ``seed``)."""
        return dataclasses.replace(self, seed=seed, seeds=None)

    def batching(self, device: torch.device) -> str:
        """How a group of seeds runs (``seed_batching``, with 'auto' resolved for ``device``)."""
        return self.seed_batching if self.seed_batching != "auto" else "vmap" if device.type == "cuda" else "loop"

    def models(self) -> list[str]:
        return ["vit", "cnn"] if self.model == "both" else [self.model]

    def preset(self, family: str) -> str:
        return self.vit_preset if family == "vit" else self.cnn_preset

    def recipe(self, family: str) -> Recipe:
        """The family's recipe with the dataset's changes and this config's overrides applied."""
        base = recipe_for(family, self.dataset)
        over = {f.name: getattr(self, f.name) for f in dataclasses.fields(Recipe)
                if f.name != "epochs" and getattr(self, f.name, None) is not None}
        return dataclasses.replace(base, **over)


# ---------------------------------------------------------------------------------------------
# Data and model
# ---------------------------------------------------------------------------------------------


@dataclass
class Dataset:
    data: data.ImageData
    norm: data.Normalize  # per-channel statistics of the training images
    test_distance: torch.Tensor | None = None  # long-range: pixels between the marks, per test image


def load_dataset(cfg: Config, dev: torch.device | None = None) -> Dataset:
    """The images of ``cfg.dataset`` as uint8 tensors, on ``dev`` when it is an accelerator: batches
    are then indexed, augmented and normalised there, and the host does no per-image work (airbench)."""
    distance = None
    if cfg.dataset == "long-range":
        images, distance = long_range_data(cfg.long_range_train, cfg.long_range_test, seed=cfg.seed,
                                           attribute=cfg.long_range_task, background=cfg.long_range_background)
    else:
        images = data.load_cifar(cfg.data_dir, download=cfg.download)
    if cfg.limit_train:
        keep = data.class_balanced(images.train_y, cfg.limit_train)
        images.train_x, images.train_y = images.train_x[keep], images.train_y[keep]
    if cfg.limit_test:
        keep = data.class_balanced(images.test_y, cfg.limit_test)
        images.test_x, images.test_y = images.test_x[keep], images.test_y[keep]
        distance = None if distance is None else distance[keep]
    if cfg.context_images is not None and cfg.context_images > len(images.test_x):
        raise UsageError(f"--context-images must be at most the {len(images.test_x)} test images, got "
                         f"{cfg.context_images}")
    norm = data.Normalize(*data.channel_stats(images.train_x))
    if dev is None or dev.type == "cpu":
        return Dataset(images, norm, distance)
    return Dataset(images.to(dev), norm.to(dev), distance)


def build_model(family: str, cfg: Config, ds: Dataset, dev: torch.device, world: int = 1) -> nn.Module:
    """The family's preset for the data's classes and image size (a ViT's position table is sized
    from the images), with its forward FLOPs per image in ``model.flops``; the preset and the
    family's recipe are checked against the data (over ``world`` processes) before anything is
    written. The weights depend on ``cfg.seed`` only: every rank and every resume starts alike."""
    preset, kwargs, images = cfg.preset(family), cfg.model_kwargs(family), ds.data
    size = tuple(images.train_x.shape[-2:])
    over: dict[str, Any] = {**kwargs, "num_classes": len(images.classes)}
    if family == "vit":
        patch = to_2tuple(registry.get_config(preset, **kwargs).patch_size)
        if size[0] % patch[0] or size[1] % patch[1]:
            raise UsageError(f"the images are {size[0]}x{size[1]}, which {preset}'s {patch[0]}x{patch[1]} patches "
                             "do not tile; choose a ViT preset whose patch size divides the image size")
        over["img_size"] = size
        if cfg.teacher is not None:
            over.setdefault("distilled", True)
    torch.manual_seed(cfg.seed)
    model = registry.create_model(preset, **over).to(dev)
    # what the weights learned from, saved with them (vitattn.weights): timm's data tools then feed them alike
    model.pretrained_cfg.update(input_size=(images.train_x.shape[1], *size), mean=ds.norm.mean, std=ds.norm.std,
                                interpolation="bilinear", crop_pct=1.0, num_classes=len(images.classes),
                                label_names=list(images.classes))
    try:
        model.flops = flops_per_image(model, size)
    except (RuntimeError, ValueError) as e:
        raise UsageError(f"{preset} cannot take {size[0]}x{size[1]} images: {e}") from e
    cfg.recipe(family).check_data(family, size, len(images.train_x), world)
    if hasattr(model, "init_stem"):  # data-dependent stems (whitening) are set from 5,000 training images
        model.init_stem(ds.norm(images.train_x[:5000]))
    if family == "cnn" and cfg.channels_last:
        model = model.to(memory_format=torch.channels_last)
    return model


def load_datasets(cfg: Config, dev: torch.device | None = None, first: Dataset | None = None) -> list[Dataset]:
    """One dataset per seed of ``cfg.seed_list()``: CIFAR-10's is one and the same for all; the
    long-range task is generated from each seed, as its solo run generates it. ``first``: the
    first seed's, already loaded."""
    first = first or load_dataset(cfg.for_seed(cfg.seed_list()[0]), dev)
    if cfg.dataset != "long-range":
        return [first] * len(cfg.seed_list())
    return [first] + [load_dataset(cfg.for_seed(k), dev) for k in cfg.seed_list()[1:]]


def build_models(family: str, cfg: Config, datasets: Sequence[Dataset], dev: torch.device, world: int = 1
                 ) -> nn.Module:
    """``build_model`` for each seed of ``cfg``, on its dataset: the model itself for one seed, a
    ``seeds.SeedStack`` of them for several (``cfg.batching``)."""
    group = cfg.seed_list()
    models = [build_model(family, cfg.for_seed(k), ds, dev, world) for k, ds in zip(group, datasets)]
    if len(models) == 1:
        return models[0]
    mode = cfg.batching(dev)
    if mode == "vmap" and seeds.stochastic(models[0]):  # vmap draws every seed's dropout from one stream
        if cfg.seed_batching != "auto":
            raise UsageError(f"--seed-batching vmap: the {family} has dropout or drop path, whose random numbers vmap "
                             "draws for all seeds from one stream, so no seed would train as its solo run; use "
                             "--seed-batching loop (each seed in turn, each with its own stream)")
        mode = "loop"
    stack = seeds.SeedStack(models, group, mode)
    stack.flops = models[0].flops
    return stack


MEMORY_MARGIN = 1.5  # peak memory over what autograd saves plus the tensors kept: temporaries of the backward


def check_memory(cfg: Config, ds: Dataset, dev: torch.device, world: int = 1) -> None:
    """Refuse (UsageError), before anything is written or trained and before the group's data and
    models are made, a group of seeds whose step would not fit in ``dev``'s free memory: per seed,
    the activations autograd keeps for a batch (measured on two images of ``ds``, the first seed's
    data, on one model of each family: ``seeds.saved_bytes``), the weights with their gradient,
    optimiser state and EMA, times ``MEMORY_MARGIN``, and the seed's own images where each seed
    has its own (the long-range task)."""
    group = cfg.seed_list()
    if len(group) == 1:
        return
    free = seeds.free_bytes(dev)
    images = sum(t.numel() * t.element_size() for t in (ds.data.train_x, ds.data.test_x)) \
        if cfg.dataset == "long-range" else 0
    for family in cfg.models():
        r, one = cfg.recipe(family), build_model(family, cfg.for_seed(group[0]), ds, dev, world)
        task = classify_task(family, cfg.for_seed(group[0]), ds, dev, Dist())
        x = task.inputs(ds.data.train_x[:2].to(dev))
        with runtime.autocast(dev, cfg.autocast_dtype()):
            activations = seeds.saved_bytes(one, x) / 2 * (r.batch_size // world)
        tensors = sum(t.numel() * t.element_size() for t in one.state_dict().values())
        per_seed = MEMORY_MARGIN * (activations + tensors * (4 + (r.model_ema_decay > 0))) + images
        if per_seed * len(group) > free:
            gib = 2**30
            raise UsageError(f"--seeds {cfg.seeds}: {len(group)} seeds of the {family} need about "
                             f"{per_seed * len(group) / gib:.1f} GiB ({per_seed / gib:.2f} GiB each: activations of "
                             f"{r.batch_size // world} images and the weights with their gradients and optimiser "
                             f"state{', and its own images' if images else ''}), more than the {free / gib:.1f} GiB "
                             f"free on {dev}; train at most {max(int(free // per_seed), 1)} seeds at a time")


def one_model(model: nn.Module) -> nn.Module:
    """A model of what ``model`` trains: itself, or for a stack of seeds its tensorless template."""
    return model.template if isinstance(model, seeds.SeedStack) else model


@dataclass
class Teacher:
    """A trained CNN that labels the ViT's batches (:class:`ClassifyTask`), and where it came from."""

    model: nn.Module
    info: dict[str, Any]  # its run folder, preset, accuracy and training time, for the summary


def weights_file(family: str, seed: int | None = None) -> str:
    """Where a run folder keeps a model's final weights: ``checkpoints/<family>.safetensors``, or
    one file per seed, ``checkpoints/<family>_seed<k>.safetensors``, in a run of several seeds."""
    return f"checkpoints/{family}.safetensors" if seed is None else f"checkpoints/{family}_seed{seed}.safetensors"


def load_teacher(cfg: Config, ds: Dataset, dev: torch.device) -> Teacher:
    """The CNN of the finished run folder ``cfg.teacher``, frozen, in eval mode, on ``dev``; refused
    (UsageError) unless that run trained a CNN to the end on the same dataset and classes. From a
    run of several seeds, the CNN of ``cfg.seed`` (which it must have trained)."""
    run = Path(cfg.teacher)
    what = f"--teacher {cfg.teacher}"
    try:
        summary = json.loads((run / "summary.json").read_text())
        result = summary["models"]["cnn"]
        saved = summary["config"]
    except FileNotFoundError:
        raise UsageError(f"{what}: no summary.json there; expected the folder of a finished train_cifar.py run "
                         "that trained a CNN") from None
    except (json.JSONDecodeError, UnicodeDecodeError, KeyError, TypeError) as e:
        raise UsageError(f"{what}: summary.json names no trained CNN ({type(e).__name__}: {e})") from None
    if summary.get("dataset") != cfg.dataset or list(summary.get("classes", [])) != list(ds.data.classes):
        raise UsageError(f"{what}: its CNN learned {summary.get('dataset')!r} with classes {summary.get('classes')}; "
                         f"this run is {cfg.dataset!r} with {list(ds.data.classes)}")
    group = result.get("seeds") if isinstance(result, dict) else None
    if group:
        if cfg.seed not in group:
            raise UsageError(f"{what}: its CNNs are of seeds {seeds.seeds_label(group)}; seed {cfg.seed} needs its "
                             "own teacher: train the ViT on those seeds, or the CNN on this one")
        result = result["per_seed"][group.index(cfg.seed)]
    weights = run / weights_file("cnn", cfg.seed if group else None)
    if not weights.is_file():
        raise UsageError(f"{what}: no {weights.relative_to(run)} there; the run did not finish its CNN")
    from safetensors.torch import load_file

    over = {**json.loads(saved.get("cnn_kwargs") or "{}"), "num_classes": len(ds.data.classes)}
    model = registry.create_model(saved["cnn_preset"], **over)
    try:
        model.load_state_dict(load_file(str(weights)))
    except (RuntimeError, OSError) as e:
        raise UsageError(f"{what}: {weights.name} does not fit {saved['cnn_preset']} ({e})") from None
    model = model.to(dev).eval().requires_grad_(False)
    if cfg.channels_last:
        model = model.to(memory_format=torch.channels_last)
    info = dict(run=str(run), preset=saved["cnn_preset"], kwargs=saved.get("cnn_kwargs") or "{}",
                final_acc=result.get("final_acc"), epochs=result.get("epochs"),
                train_seconds=result.get("train_seconds"),
                hardware=summary.get("environment", {}).get("gpu") or summary.get("environment", {}).get("cpu"))
    return Teacher(model, info)


def load_teachers(cfg: Config, datasets: Sequence[Dataset], dev: torch.device) -> list[Teacher]:
    """``load_teacher`` for each seed of ``cfg``: each ViT learns from the CNN its solo run would."""
    return [load_teacher(cfg.for_seed(k), ds, dev) for k, ds in zip(cfg.seed_list(), datasets)]


def context_sample(seed: int, n: int | None, num_test: int) -> torch.Tensor:
    """The fixed test images the global-context measures look at (indices): ``n`` of them, by
    default 128 or all when fewer."""
    n = n or min(128, num_test)
    return torch.randperm(num_test, generator=data.step_generator(seed, -1))[:n]


def context_samples(cfg: Config, datasets: Sequence[Dataset]) -> list:
    """Each seed's fixed test images for the global-context measures (``report.Sample``)."""
    from .report import Sample

    out = []
    for k, d in zip(cfg.seed_list(), datasets):
        pick = context_sample(k, cfg.context_images, len(d.data.test_x)).to(d.data.test_x.device)
        out.append(Sample(d.data.test_x[pick], d.data.test_y[pick], d.norm))
    return out


# ---------------------------------------------------------------------------------------------
# Evaluation and the task
# ---------------------------------------------------------------------------------------------


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
             tta: bool = False) -> dict:
    """Test loss, accuracy and the per-image hits of uint8 images ``x`` (ranks split them and sum).

    With ``tta`` also ``acc_tta`` (softmax averaged over each image and its mirror) and
    ``acc_tta_shift`` (airbench's six views, its ``tta_level=2``: half weight on that pair, half
    on the two one-pixel shifts and their mirrors). ``acc`` is always the plain accuracy.
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
    for j in idx.split(batch_size):
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
    """Classification as a task of ``loop``: batches of uint8 images from a ``data.BatchLoader``
    (augmented and normalised on the device), cross-entropy with label smoothing, test loss and
    accuracy after each epoch, and at the end accuracy with test-time augmentation (``tta``) and,
    given each test image's ``test_distance`` and the bins' ``distance_edges``, by distance."""

    score = "test_acc"
    data_on_clock = True  # indexing and augmenting the batch on the device is part of the step (airbench)
    counts_hits = True

    def __init__(self, family: str, loader: data.BatchLoader, norm: nn.Module, test_x: torch.Tensor,
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

    def _evaluate(self, model: nn.Module, tta: bool) -> dict:
        return evaluate(model, self.norm, self.test_x, self.test_y, batch_size=self.eval_batch_size,
                        device=self.device, ranks=self.ranks, channels_last=self.channels_last, tta=tta)

    def evaluate(self, model: nn.Module) -> dict[str, float]:
        ev = self._evaluate(model, False)
        return {"test_loss": ev["loss"], "test_acc": ev["acc"]}

    def final(self, model: nn.Module) -> dict[str, Any]:
        ev = self._evaluate(model, self.tta)
        out = {"final_acc": ev["acc"], "final_loss": ev["loss"]}
        if self.tta:
            out["final_acc_tta"], out["final_acc_tta_shift"] = ev["acc_tta"], ev["acc_tta_shift"]
        if self.test_distance is not None:
            out["accuracy_by_distance"] = accuracy_by_distance(ev["hits"], self.test_distance, self.distance_edges)
        return out

    def log_line(self, metrics: dict[str, float]) -> str:
        return f"test loss {metrics['test_loss']:.4f} acc {metrics['test_acc']:.4f}"


class GroupTask:
    """Several seeds' classification as one task of ``loop``, for a ``seeds.SeedStack``: each step
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
    augment = data.Augment(translate=r.translate, flip=cfg.flip, cutout=r.cutout, padding_mode=r.padding_mode,
                           fill=ds.norm.mean)
    loader = data.BatchLoader(ds.data.train_x, ds.data.train_y, r.batch_size // ranks.world, shuffle=True,
                              drop_last=True, augment=augment, seed=cfg.seed, rank=ranks.rank, world_size=ranks.world)
    return ClassifyTask(family, loader, ds.norm, ds.data.test_x, ds.data.test_y, device=device, ranks=ranks,
                        label_smoothing=r.label_smoothing,
                        channels_last=family == "cnn" and cfg.channels_last, eval_batch_size=cfg.eval_batch_size,
                        tta=cfg.tta, test_distance=ds.test_distance,
                        distance_edges=DISTANCE_EDGES.get(cfg.long_range_task, ()), teacher=teacher)


def build_run(family: str, model: nn.Module, cfg: Config, ds: Dataset | Sequence[Dataset], device: torch.device,
              ranks: Dist, checkpoint_path: Path, resumed: dict | None = None,
              teacher: nn.Module | Sequence[nn.Module] | None = None) -> loop.Run:
    """``loop.build_run`` for ``family`` as ``cfg`` says: its recipe's optimiser, schedule, clipping
    and EMA, for ``cfg.epochs`` (or the recipe's) or ``cfg.time_budget`` minutes of steps; with a
    ``teacher``, a distilled model trains its two heads apart. For a ``seeds.SeedStack`` ``model``,
    ``ds`` and ``teacher`` hold one per seed (``load_datasets``, ``load_teachers``) and the run
    trains every seed on one clock with one optimiser over the stacked weights."""
    r = cfg.recipe(family)
    group = cfg.seed_list()
    if isinstance(model, seeds.SeedStack):
        teachers = teacher if teacher is not None else [None] * len(group)
        task = GroupTask([classify_task(family, cfg.for_seed(k), d, device, ranks, t)
                          for k, d, t in zip(group, ds, teachers)])
        steps = task.tasks[0].steps_per_epoch
    else:
        task = classify_task(family, cfg, ds, device, ranks, teacher)
        steps = task.steps_per_epoch
    if teacher is not None and getattr(one_model(model), "dist_token", None) is not None:
        for m in (model.template, model.runner) if isinstance(model, seeds.SeedStack) else (model,):
            m.set_distilled_training(True)
    epochs = cfg.epochs if cfg.epochs is not None else (None if cfg.time_budget else r.epochs)
    stepped = model.module if isinstance(model, seeds.SeedStack) else model
    opt = optim.create_optimizer(stepped, **r.optimizer_kwargs(), lead=seeds.lead_dims(model))
    return loop.build_run(task, model, opt, resumed=resumed, checkpoint_path=checkpoint_path, lr_at=r.lr_at,
                          grad_clip=r.grad_clip, total_steps=math.ceil(epochs * steps) if epochs is not None else None,
                          budget_s=cfg.time_budget * 60 if cfg.time_budget else None, device=device, ranks=ranks,
                          seed=cfg.seed, amp_dtype=cfg.autocast_dtype(), ema_decay=r.model_ema_decay,
                          compile=cfg.compile, config=dataclasses.asdict(cfg), group=group)


def describe_run(family: str, model: nn.Module, cfg: Config, run: loop.Run, pipeline: dict,
                 teacher: Teacher | None) -> list[str]:
    """The lines a run opens with: the model, its recipe and precision, the batch pipeline's
    speed alone, a precision warning, the teacher."""
    r = cfg.recipe(family)
    group = f" x {len(cfg.seed_list())} seeds ({cfg.seeds}, {model.mode})" if cfg.seeds else ""
    lines = [f"[{family}] {cfg.preset(family)}{group}: {count_params(one_model(model)) / 1e6:.3f} M params, "
             f"{model.flops / 1e6:.1f} MFLOP/img; {r.optimizer} lr {r.lr:g} wd {r.weight_decay:g} batch {r.batch_size} "
             f"({run.task.steps_per_epoch} steps/epoch); {run.precision} on {run.device}; pipeline alone "
             f"{pipeline.get('augmented_images_per_s', 0):.0f} img/s"]
    if runtime.precision_warning(run.device, cfg.autocast_dtype()):
        lines.append(f"[{family}] warning: {runtime.precision_warning(run.device, cfg.autocast_dtype())}")
    if teacher:
        lines.append(f"[{family}] teacher: {teacher.info['preset']} of {teacher.info['run']} "
                     f"({teacher.info['final_acc']:.4f} in {teacher.info['train_seconds'] / 60:.1f} min of training)")
    return lines
