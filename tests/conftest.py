"""What the test modules share: fixtures, tiny data sets written to disk, a tiny run's config, and
the parts of a run's metrics that depend on the computation."""

from __future__ import annotations

import io
import json
import os
import pickle
import shutil
import tarfile
from pathlib import Path

import pytest
import torch

import train_cifar as T


@pytest.fixture(scope="session", autouse=True)
def decode_cache(tmp_path_factory):
    """Decoded data sets are cached for the tests' session only, not in the user's ~/.cache."""
    os.environ["VITATTN_CACHE"] = str(tmp_path_factory.mktemp("vitattn-cache"))


def have_cxx() -> bool:
    return any(shutil.which(c) for c in (os.environ.get("CXX", "g++"), "g++", "clang++", "c++"))


needs_cxx = pytest.mark.skipif(not have_cxx(), reason="inductor needs a C++ compiler (g++/clang++) on CPU")


@pytest.fixture(scope="module")
def one_thread():
    """Tiny batches run fastest on one thread, and two threads on a busy 2-core machine spin-wait
    (3x slower here); the setting is restored for the other test modules."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


@pytest.fixture(scope="module")
def folder(tmp_path_factory) -> Path:
    """A small ImageFolder tree of three classes (write_folder)."""
    return write_folder(tmp_path_factory.mktemp("data") / "cifar")


CLASSES = ("cat", "dog", "frog")


def make_images(n_per_class: int, seed: int, classes=CLASSES, size: int = 32) -> tuple[torch.Tensor, torch.Tensor]:
    """Easy, class-coloured uint8 images ``(n, 3, size, size)``: each class has its own tint."""
    g = torch.Generator().manual_seed(seed)
    y = torch.arange(len(classes)).repeat_interleave(n_per_class)
    tint = torch.tensor([[200, 40, 40], [40, 200, 40], [40, 40, 200], [200, 200, 40], [40, 200, 200]],
                        dtype=torch.float32)[: len(classes)]
    x = tint[y][:, :, None, None] + 40 * torch.randn(len(y), 3, size, size, generator=g)
    return x.clamp(0, 255).to(torch.uint8), y


def png_bytes(img: torch.Tensor) -> bytes:
    from PIL import Image

    buf = io.BytesIO()
    Image.fromarray(img.permute(1, 2, 0).numpy()).save(buf, format="PNG")
    return buf.getvalue()


def write_folder(root: Path, n_train: int = 12, n_test: int = 4, classes=CLASSES, size: int = 32) -> Path:
    """An ImageFolder tree ``root/{train,test}/<class>/NNNN.png`` (``n_*`` images per class)."""
    for split, n, seed in (("train", n_train, 0), ("test", n_test, 1)):
        x, y = make_images(n, seed, classes, size)
        for i, (img, label) in enumerate(zip(x, y)):
            f = root / split / classes[label] / f"{i:04d}.png"
            f.parent.mkdir(parents=True, exist_ok=True)
            f.write_bytes(png_bytes(img))
    return root


def write_tar(path: Path, n_train: int = 12, n_test: int = 4, classes=CLASSES) -> Path:
    """A ``.tar.gz`` of an ImageFolder tree (with a leading folder, as exports often have)."""
    with tarfile.open(path, "w:gz") as tar:
        for split, n, seed in (("train", n_train, 0), ("test", n_test, 1)):
            x, y = make_images(n, seed, classes)
            for i, (img, label) in enumerate(zip(x, y)):
                data = png_bytes(img)
                info = tarfile.TarInfo(f"cifar/{split}/{classes[label]}/{i:04d}.png")
                info.size = len(data)
                tar.addfile(info, io.BytesIO(data))
    return path


def write_batches(root: Path, n_train: int = 12, n_test: int = 4, classes=CLASSES) -> Path:
    """torchvision's ``cifar-10-batches-py`` layout: five train batches, a test batch, meta."""
    folder = root / "cifar-10-batches-py"
    folder.mkdir(parents=True)
    x, y = make_images(n_train, 0, classes)
    order = torch.randperm(len(y), generator=torch.Generator().manual_seed(0))
    x, y = x[order], y[order]
    for b, j in enumerate(torch.arange(len(y)).chunk(5), start=1):
        with open(folder / f"data_batch_{b}", "wb") as f:
            pickle.dump({"data": x[j].reshape(len(j), -1).numpy(), "labels": y[j].tolist()}, f)
    tx, ty = make_images(n_test, 1, classes)
    with open(folder / "test_batch", "wb") as f:
        pickle.dump({"data": tx.reshape(len(ty), -1).numpy(), "labels": ty.tolist()}, f)
    with open(folder / "batches.meta", "wb") as f:
        pickle.dump({"label_names": list(classes)}, f)
    return root


SCORE_KEYS = ("model", "epoch", "step", "train_loss", "train_acc", "test_loss", "test_acc", "lr")


def tiny(tmp_path: Path, data_dir, **kw) -> T.Config:
    base = dict(data_dir=str(data_dir), out=str(tmp_path / "run"), model="cnn", cnn_preset="cnn_quick",
                epochs=3, batch_size=12, lr=0.05, progress=False, plots=False)
    return T.Config(**{**base, **kw})


def metrics(out) -> list[dict]:
    return [json.loads(s) for s in (Path(out) / "metrics.jsonl").read_text().splitlines()]


def scores(rows: list[dict]) -> list[tuple]:
    """The parts of a metrics line that depend on the computation, not on the clock."""
    return [tuple(r[k] for k in SCORE_KEYS) for r in rows]


def run_train_cifar(capsys, *argv) -> tuple[int, str]:
    extra = ["--no-progress"] if "--resume" in argv else ["--no-progress", "--no-plots"]
    code = T.command_line([str(a) for a in argv] + extra)
    io = capsys.readouterr()
    assert "Traceback" not in io.err + io.out
    return code, io.err
