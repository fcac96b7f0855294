"""CIFAR-style image data: three layouts decoded once into uint8 tensors and cached, and the
per-channel normalisation a model is trained (and saved) with.

    source (cifar-10-batches-py | ImageFolder tree | .tar.gz of a tree)
      -> load_cifar         decode once, cache (N, 3, H, W) uint8 + labels        -> ImageData
      -> Normalize          float, per-channel mean / std (channel_stats of the training images)

Batches and their augmentation are :mod:`vitattn.tasks.classify.batches`.
"""

from __future__ import annotations

import dataclasses
import hashlib
import io
import os
import pickle
import tarfile
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from ...constants import CIFAR10_CLASSES, CIFAR10_MEAN, CIFAR10_STD
from ...training.cli import track
from ...training.errors import DataError
from ..images import IMAGE_SUFFIXES, read_image

CACHE_VERSION = 1  # bump when the cache layout changes


def how_to_supply(path: str | os.PathLike) -> str:
    return (
        f"no CIFAR-10 data found at {str(path)!r}. Supply it in one of these ways:\n"
        "  1. --data-dir DIR holding torchvision's 'cifar-10-batches-py' folder; add --download to fetch it\n"
        "     through torchvision (needs internet)\n"
        "  2. --data-dir DIR holding an ImageFolder tree: DIR/train/<class>/*.png|jpg and DIR/test/<class>/...\n"
        "  3. --data-dir FILE.tar.gz: an archive of such a tree\n"
        "  or use --dataset long-range, which is generated on the fly and needs no download."
    )


@dataclass
class ImageData:
    """A split-pair of images as tensors: ``train_x`` ``(N, 3, H, W)`` uint8, ``train_y`` ``(N,)`` int64."""

    train_x: torch.Tensor
    train_y: torch.Tensor
    test_x: torch.Tensor
    test_y: torch.Tensor
    classes: tuple[str, ...]
    source: str = ""

    def __post_init__(self) -> None:
        for name in ("train", "test"):
            x, y = getattr(self, f"{name}_x"), getattr(self, f"{name}_y")
            if x.dtype != torch.uint8 or x.ndim != 4 or x.shape[1] != 3:
                raise ValueError(f"{name}_x: expected uint8 (N, 3, H, W), got {x.dtype} {tuple(x.shape)}")
            if y.shape != (x.shape[0],):
                raise ValueError(f"{name}_y: expected ({x.shape[0]},) labels, got {tuple(y.shape)}")

    def to(self, device: torch.device | str) -> ImageData:
        """The same images and labels on ``device`` (CIFAR-10 is 180 MB as uint8)."""
        moved = {k: getattr(self, k).to(device) for k in ("train_x", "train_y", "test_x", "test_y")}
        return dataclasses.replace(self, **moved)


def _decode_image(data: bytes, name: str) -> torch.Tensor:
    """Encoded bytes -> ``(3, H, W)`` uint8 (``read_image``)."""
    im = read_image(io.BytesIO(data), name)
    w, h = im.size
    return torch.frombuffer(bytearray(im.tobytes()), dtype=torch.uint8).view(h, w, 3).permute(2, 0, 1)


def _stack(images: list[torch.Tensor], names: list[str], what: str) -> torch.Tensor:
    if not images:
        raise DataError(f"{what}: no images found")
    size = images[0].shape
    for im, name in zip(images, names):
        if im.shape != size:
            raise DataError(f"image {name} is {tuple(im.shape[1:])} but {names[0]} is {tuple(size[1:])}; "
                            "all images must share one size")
    return torch.stack(images)


def _collect(items: list[tuple[str, str, str, bytes]], source: str) -> ImageData:
    """``(split, class, bytes)`` items (with their names) -> ImageData with sorted class names."""
    by_split: dict[str, list[tuple[str, str, bytes]]] = {"train": [], "test": []}
    for split, cls, name, data in items:
        by_split[split].append((cls, name, data))
    classes = tuple(sorted({c for c, _, _ in by_split["train"]}))
    test_classes = set(c for c, _, _ in by_split["test"])
    if not classes or not by_split["test"]:
        raise DataError(f"{source}: expected train/<class>/*.png|jpg and test/<class>/..., "
                        f"found {len(by_split['train'])} train and {len(by_split['test'])} test images")
    if len(classes) < 2:
        raise DataError(f"{source}: expected at least 2 classes to tell apart, found {len(classes)} ({classes[0]})")
    if not test_classes <= set(classes):
        raise DataError(f"{source}: test classes {sorted(test_classes - set(classes))} are not in train")
    index = {c: i for i, c in enumerate(classes)}
    out = {}
    for split, rows in by_split.items():
        rows.sort(key=lambda r: r[1])  # file order independent of the archive / directory order
        names = [r[1] for r in rows]
        decoded = [_decode_image(d, n) for _, n, d in track(rows, f"decoding {len(rows)} {split} images", unit="img")]
        out[f"{split}_x"] = _stack(decoded, names, f"{source} {split}")
        out[f"{split}_y"] = torch.tensor([index[c] for c, _, _ in rows], dtype=torch.int64)
    return ImageData(classes=classes, source=source, **out)


def _split_class(rel: str) -> tuple[str, str] | None:
    """``'[prefix/]train/cat/1.png' -> ('train', 'cat')``; None for anything else."""
    parts = Path(rel).parts
    if len(parts) < 3 or Path(rel).suffix.lower() not in IMAGE_SUFFIXES:
        return None
    split, cls = parts[-3], parts[-2]
    return (split, cls) if split in ("train", "test") else None


def read_image_folder(root: Path) -> ImageData:
    items = []
    for split in ("train", "test"):
        for d in sorted(p for p in (root / split).iterdir() if p.is_dir()):
            if not any(f.suffix.lower() in IMAGE_SUFFIXES for f in d.iterdir()):
                raise DataError(f"class folder {d} holds no images ({', '.join(IMAGE_SUFFIXES)}); remove it or "
                                "fill it, so that the class list is what you meant")
        for f in sorted((root / split).glob("*/*")):
            sc = _split_class(str(f.relative_to(root)))
            if sc is not None:
                items.append((*sc, str(f), f.read_bytes()))
    return _collect(items, str(root))


def read_tar(path: Path) -> ImageData:
    items = []
    try:
        with tarfile.open(path, "r:*") as tar:
            for m in tar:
                sc = _split_class(m.name) if m.isfile() else None
                if sc is not None:
                    items.append((*sc, f"{path}:{m.name}", tar.extractfile(m).read()))
    except (tarfile.TarError, EOFError, OSError) as e:
        raise DataError(f"cannot read archive {path}: {e}") from e
    return _collect(items, str(path))


class _CifarUnpickler(pickle.Unpickler):
    """Unpickles what a CIFAR batch holds (dicts, lists, strings, bytes, numbers, numpy arrays of
    numbers) and refuses every other class, so a data file cannot run code as it loads."""

    ARRAYS = {("numpy.core.multiarray", "_reconstruct"), ("numpy._core.multiarray", "_reconstruct"),
              ("numpy", "ndarray"), ("numpy", "dtype")}

    def find_class(self, module: str, name: str):
        if (module, name) in self.ARRAYS:
            return super().find_class(module, name)
        raise pickle.UnpicklingError(f"refused to load {module}.{name}: a CIFAR batch holds only arrays, lists and "
                                     "numbers")


def _load_cifar_pickle(fh) -> dict:
    d = _CifarUnpickler(fh, encoding="latin1").load()
    if not isinstance(d, dict):
        raise pickle.UnpicklingError(f"expected a dict, got {type(d).__name__}")
    data = d.get("data")
    if data is not None and getattr(getattr(data, "dtype", None), "kind", "u") not in "biuf":
        raise pickle.UnpicklingError(f"'data' holds {data.dtype} values, not numbers")
    return d


def read_cifar_batches(folder: Path) -> ImageData:
    """torchvision's ``cifar-10-batches-py``: pickled dicts of ``data`` (N, 3072) and ``labels``,
    read by an unpickler that admits nothing but their contents."""
    def load(name: str) -> tuple[torch.Tensor, torch.Tensor]:
        f = folder / name
        try:
            with open(f, "rb") as fh:
                d = _load_cifar_pickle(fh)
            x = torch.as_tensor(d["data"], dtype=torch.uint8).reshape(-1, 3, 32, 32)
            y = torch.as_tensor(d["labels"], dtype=torch.int64)
        except (OSError, pickle.UnpicklingError, KeyError, EOFError, RuntimeError, ValueError) as e:
            raise DataError(f"cannot read CIFAR batch file {f}: {e}") from e
        return x, y

    train = [load(f"data_batch_{i}") for i in range(1, 6)]
    test_x, test_y = load("test_batch")
    classes = CIFAR10_CLASSES
    meta = folder / "batches.meta"
    if meta.exists():
        try:
            with open(meta, "rb") as fh:
                classes = tuple(_load_cifar_pickle(fh)["label_names"])
        except (OSError, pickle.UnpicklingError, KeyError, EOFError, TypeError) as e:
            raise DataError(f"cannot read CIFAR class names {meta}: {e}") from e
    return ImageData(torch.cat([x for x, _ in train]), torch.cat([y for _, y in train]), test_x, test_y,
                     classes, str(folder))


def find_source(path: str | os.PathLike) -> tuple[str, Path]:
    """``(layout, path)`` with layout ``'batches' | 'folder' | 'tar'``; raises DataError if none."""
    p = Path(path)
    if p.is_file() and (p.name.endswith((".tar.gz", ".tgz", ".tar"))):
        return "tar", p
    if p.is_dir():
        for cand in (p, p / "cifar-10-batches-py"):
            if (cand / "data_batch_1").is_file():
                return "batches", cand
        if (p / "train").is_dir() and (p / "test").is_dir():
            return "folder", p
        for have, missing in (("train", "test"), ("test", "train")):
            if (p / have).is_dir() and not (p / missing).is_dir():
                raise DataError(f"{p} has a {have}/ folder but no {missing}/ folder; an ImageFolder tree needs "
                                f"both: {p}/train/<class>/*.png|jpg and {p}/test/<class>/...")
        tars = sorted(q for q in p.iterdir() if q.name.endswith((".tar.gz", ".tgz")))
        if len(tars) == 1:
            return "tar", tars[0]
    raise DataError(how_to_supply(path))


def fingerprint(source: Path) -> str:
    """What the cache of ``source`` keys on, read without touching every image: an archive's size
    and mtime; a folder's files at its top (the batch files) by size and mtime, and its folders two
    levels down (splits, classes) by mtime and number of entries, which change whenever an image is
    added, removed or renamed. An image rewritten in place under its old name is not seen: delete
    the cache (the run's first line names it)."""
    st = source.stat()
    if not source.is_dir():
        return f"{st.st_size}|{st.st_mtime_ns}"
    splits = sorted(p for p in source.iterdir() if p.is_dir())
    dirs = [source, *splits, *sorted(c for p in splits for c in p.iterdir() if c.is_dir())]
    parts = [f"{d.relative_to(source)}:{d.stat().st_mtime_ns}:{sum(1 for _ in os.scandir(d))}" for d in dirs]
    parts += [f"{f.name}:{f.stat().st_size}:{f.stat().st_mtime_ns}" for f in sorted(source.iterdir()) if f.is_file()]
    return "|".join(parts)


def cache_path(source: Path) -> Path:
    """Where the decoded tensors of ``source`` live: under ``$VITATTN_CACHE`` (default
    ``~/.cache/vitattn/``), never inside or beside the data, named by the source's path and
    keyed on its :func:`fingerprint`."""
    where = hashlib.sha1(str(source.resolve()).encode()).hexdigest()[:8]
    key = hashlib.sha1(f"{fingerprint(source)}|{CACHE_VERSION}".encode()).hexdigest()[:12]
    name = f"{source.resolve().name or 'root'}-{where}-{key}.pt"
    return Path(os.environ.get("VITATTN_CACHE", Path.home() / ".cache" / "vitattn")) / name


def load_cifar(path: str | os.PathLike = "./data", *, download: bool = False, cache: bool = True) -> ImageData:
    """Decode a CIFAR-style source once and cache it; later calls load the cache (< 1 s)."""
    try:
        layout, src = find_source(path)
    except DataError:
        if not download:
            raise
        try:
            import torchvision
        except ImportError as e:
            raise DataError("--download needs torchvision (pip install 'vitattn[train]')\n"
                            + how_to_supply(path)) from e
        try:
            torchvision.datasets.CIFAR10(str(path), train=True, download=True)
        except Exception as e:  # network errors come in many types; report them as missing data
            raise DataError(f"download failed ({e}).\n" + how_to_supply(path)) from e
        layout, src = find_source(path)
    cp = cache_path(src) if cache else None
    if cp is not None and cp.exists():
        d = torch.load(cp, weights_only=True)
        return ImageData(d["train_x"], d["train_y"], d["test_x"], d["test_y"], tuple(d["classes"]), str(src))
    data = {"batches": read_cifar_batches, "folder": read_image_folder, "tar": read_tar}[layout](src)
    if cp is not None:
        try:
            cp.parent.mkdir(parents=True, exist_ok=True)
            tmp = cp.with_name(cp.name + f".tmp{os.getpid()}")
            torch.save({"train_x": data.train_x, "train_y": data.train_y, "test_x": data.test_x,
                        "test_y": data.test_y, "classes": list(data.classes)}, tmp)
            os.replace(tmp, cp)  # atomic: a reader never sees half a cache
            stem = cp.name.rsplit("-", 1)[0]  # one cache per source: an older key's file goes
            for old in cp.parent.glob(f"{stem}-*.pt"):
                if old != cp:
                    old.unlink(missing_ok=True)
        except OSError:
            pass  # a cache we cannot write only costs the decode next time
    return data


def class_balanced(labels: torch.Tensor, n: int) -> torch.Tensor:
    """Indices of ``n`` images taken from the classes in turn (the first image of each class, then the
    second of each, ...), in their original order: a subset of a class-sorted folder keeps every class,
    where the first ``n`` images would hold only the first classes."""
    order = torch.argsort(labels, stable=True)
    counts = torch.bincount(labels)
    rank = torch.empty_like(order)  # each image's place within its class
    rank[order] = torch.arange(len(labels)) - (counts.cumsum(0) - counts)[labels[order]]
    return torch.argsort(rank * len(counts) + labels)[:n].sort().values


def channel_stats(x: torch.Tensor) -> tuple[tuple[float, ...], tuple[float, ...]]:
    """Per-channel mean and std of uint8 images ``(N, C, H, W)``, in [0, 1], in chunks."""
    s = torch.zeros(x.shape[1], dtype=torch.float64)
    sq = torch.zeros_like(s)
    for chunk in x.split(4096):
        c = chunk.double() / 255
        s += c.sum((0, 2, 3))
        sq += (c * c).sum((0, 2, 3))
    n = x.shape[0] * x.shape[2] * x.shape[3]
    mean = s / n
    std = (sq / n - mean**2).clamp_min(1e-12).sqrt()
    return tuple(mean.tolist()), tuple(std.tolist())


class Normalize(nn.Module):
    """uint8 ``(B, C, H, W)`` -> float ``(x / 255 - mean) / std``, on the module's device; mean and
    std per channel in [0, 1] (``channel_stats`` of the training images, or CIFAR-10's)."""

    def __init__(self, mean=CIFAR10_MEAN, std=CIFAR10_STD) -> None:
        super().__init__()
        self.mean, self.std = tuple(map(float, mean)), tuple(map(float, std))  # what a model's data config says
        self.register_buffer("scale", 1 / (255 * torch.tensor(std)).view(1, -1, 1, 1), persistent=False)
        self.register_buffer("shift", -(torch.tensor(mean) / torch.tensor(std)).view(1, -1, 1, 1), persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.addcmul(self.shift, x.float(), self.scale)
