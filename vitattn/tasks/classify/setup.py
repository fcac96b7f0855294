"""What a classification run is built from, each checked before anything is written: the data set
(CIFAR-10 or the long-range task, one per seed where each seed draws its own), the models for it
(a ``stack.SeedStack`` for several seeds) with the data config they are saved with, a group's
memory, the teacher of a distilled ViT, and the fixed test images of the global-context measures.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from ... import registry
from ...helpers import flops_per_image, to_2tuple
from ...training import runtime, seeds, stack
from ...training.errors import UsageError
from .data import ImageData, Normalize, channel_stats, class_balanced, load_cifar
from .longrange import long_range_data
from .options import Config


@dataclass
class Dataset:
    data: ImageData
    norm: Normalize  # per-channel statistics of the training images
    test_distance: torch.Tensor | None = None  # long-range: pixels between the marks, per test image


def load_dataset(cfg: Config, dev: torch.device | None = None) -> Dataset:
    """The images of ``cfg.dataset`` as uint8 tensors, on ``dev`` when it is an accelerator: batches
    are then indexed, augmented and normalised there, and the host does no per-image work (airbench)."""
    distance = None
    if cfg.dataset == "long-range":
        images, distance = long_range_data(cfg.long_range_train, cfg.long_range_test, seed=cfg.seed,
                                           attribute=cfg.long_range_task, background=cfg.long_range_background)
    else:
        images = load_cifar(cfg.data_dir, download=cfg.download)
    if cfg.limit_train:
        keep = class_balanced(images.train_y, cfg.limit_train)
        images.train_x, images.train_y = images.train_x[keep], images.train_y[keep]
    if cfg.limit_test:
        keep = class_balanced(images.test_y, cfg.limit_test)
        images.test_x, images.test_y = images.test_x[keep], images.test_y[keep]
        distance = None if distance is None else distance[keep]
    if cfg.context_images is not None and cfg.context_images > len(images.test_x):
        raise UsageError(f"--context-images must be at most the {len(images.test_x)} test images, got "
                         f"{cfg.context_images}")
    norm = Normalize(*channel_stats(images.train_x))
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
    ``stack.SeedStack`` of them for several (``cfg.batching``)."""
    group = cfg.seed_list()
    models = [build_model(family, cfg.for_seed(k), ds, dev, world) for k, ds in zip(group, datasets)]
    if len(models) == 1:
        return models[0]
    mode = cfg.batching(dev)
    if mode == "vmap" and stack.stochastic(models[0]):  # vmap draws every seed's dropout from one stream
        if cfg.seed_batching != "auto":
            raise UsageError(f"--seed-batching vmap: the {family} has dropout or drop path, whose random numbers vmap "
                             "draws for all seeds from one stream, so no seed would train as its solo run; use "
                             "--seed-batching loop (each seed in turn, each with its own stream)")
        mode = "loop"
    group_model = stack.SeedStack(models, group, mode)
    group_model.flops = models[0].flops
    return group_model


MEMORY_MARGIN = 1.5  # peak memory over what autograd saves plus the tensors kept: temporaries of the backward


def check_memory(cfg: Config, ds: Dataset, dev: torch.device, world: int = 1) -> None:
    """Refuse (UsageError), before anything is written or trained and before the group's data and
    models are made, a group of seeds whose step would not fit in ``dev``'s free memory: per seed,
    the activations autograd keeps for a batch (measured on two images of ``ds``, the first seed's
    data, on one model of each family: ``stack.saved_bytes``), the weights with their gradient,
    optimiser state and EMA, times ``MEMORY_MARGIN``, and the seed's own images where each seed
    has its own (the long-range task)."""
    group = cfg.seed_list()
    if len(group) == 1:
        return
    free = stack.free_bytes(dev)
    images = sum(t.numel() * t.element_size() for t in (ds.data.train_x, ds.data.test_x)) \
        if cfg.dataset == "long-range" else 0
    for family in cfg.models():
        r, one = cfg.recipe(family), build_model(family, cfg.for_seed(group[0]), ds, dev, world)
        x = ds.norm(ds.data.train_x[:2].to(dev))  # two images as the task feeds them (ClassifyTask.inputs)
        if family == "cnn" and cfg.channels_last:
            x = x.contiguous(memory_format=torch.channels_last)
        with runtime.autocast(dev, cfg.autocast_dtype()):
            activations = stack.saved_bytes(one, x) / 2 * (r.batch_size // world)
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
    return model.template if isinstance(model, stack.SeedStack) else model


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
    return torch.randperm(num_test, generator=runtime.step_generator(seed, -1))[:n]


def context_samples(cfg: Config, datasets: Sequence[Dataset]) -> list:
    """Each seed's fixed test images for the global-context measures (``report.Sample``)."""
    from .report import Sample

    out = []
    for k, d in zip(cfg.seed_list(), datasets):
        pick = context_sample(k, cfg.context_images, len(d.data.test_x)).to(d.data.test_x.device)
        out.append(Sample(d.data.test_x[pick], d.data.test_y[pick], d.norm))
    return out
