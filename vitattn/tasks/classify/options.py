"""The options of ``train_cifar.py``: one ``Config`` field per option, with its help, checked as a
whole before anything is read or written; the recipe options come from ``recipes.Recipe``.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

import torch

from ... import registry
from ...training import cli, runtime, seeds, stack
from ...training.cli import option
from ...training.errors import UsageError
from .longrange import ATTRIBUTES, BACKGROUNDS
from .recipes import DEFAULT_PRESETS, Recipe, recipe_for


@dataclass
class Config(runtime.RunOptions, cli.overrides_of(Recipe, skip=("epochs",))):
    model: str = option("both", "which to train", choices=("vit", "cnn", "both"))
    vit_preset: str | None = option(None, "ViT preset (--list-models)")
    cnn_preset: str | None = option(None, "CNN preset (--list-models)")
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
    limit_train: int | None = option(None, "use only N training images, taken from the classes in turn", unset="all")
    limit_test: int | None = option(None, "use only N test images, taken from the classes in turn", unset="all")
    epochs: float | None = option(None, "passes over the training set, unless --time-budget ends the run first")
    flip: bool = option(True, "augmentation: random horizontal mirror")
    teacher: str | None = option(None, "a finished train_cifar.py run folder whose CNN the ViT also learns from "
                                 "(DeiT's hard distillation: the CNN labels each augmented batch as the ViT sees it; "
                                 "the ViT gets a distillation token unless --vit-kwargs sets \"distilled\": false); "
                                 "needs --model vit")
    seeds: str | None = option(None, "several seeds trained at once in one process, one copy of each model per "
                               "seed: '0,1,2,3', '0-7' or '0-3,8'; seed k trains as --seed k would (its weights, data "
                               "order and augmentation), and the summary gives each figure's mean, std, min and max "
                               "over the seeds; --seed N is --seeds N", unset="one seed, --seed")
    seed_batching: str = option("auto", "how a group of seeds runs its forward passes: 'loop' (each seed in turn; "
                                "the faster on a CPU, measured), 'vmap' (all seeds in one call of each layer, "
                                "torch.func.vmap, for a GPU) or 'auto' (vmap on CUDA, loop elsewhere)",
                                choices=("auto", *stack.MODES))
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
    out: str | None = option(None, "run folder; must not hold a run already", unset="runs/<timestamp>",
                             aliases=("--output",))
    context_images: int | None = option(None, "test images for the global-context measures",
                                        unset="128, or the whole test set when smaller")
    plots: bool = option(True, "write PNG plots (matplotlib)")

    # --help in the order a newcomer needs the options, the common ones first
    HELP_GROUPS = {
        "data and task": ("data_dir", "dataset", "limit_train", "limit_test", "download", "long_range_task",
                          "long_range_background", "long_range_train", "long_range_test"),
        "models": ("model", "vit_preset", "cnn_preset", "vit_kwargs", "cnn_kwargs", "teacher"),
        "budget, seeds and run folder": ("epochs", "time_budget", "seeds", "seed", "out", "resume", "seed_batching"),
        "recipe (each model family's own unless given)": (
            "optimizer", "lr", "batch_size", "weight_decay", "warmup", "decay", "label_smoothing", "grad_clip",
            "translate", "flip", "cutout", "padding_mode", "momentum", "beta2", "bias_lr_scale", "model_ema_decay",
            "warmup_lr", "min_lr"),
        "precision, devices and speed": ("amp", "amp_dtype", "bf16", "device", "compile", "tf32", "cudnn_benchmark",
                                         "channels_last", "malloc", "eval_batch_size"),
        "outputs": ("progress", "plots", "tensorboard", "tta", "context_images"),
    }
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
