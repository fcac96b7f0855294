"""Real-data checks on the CIFAR-10 JPEG copy in ../shared/data (skipped cleanly where it is absent)."""

from pathlib import Path

import pytest
import torch

import vitattn
from vitattn.tasks.classify import data as D

ARCHIVE = Path(__file__).resolve().parents[2] / "shared" / "data" / "cifar10-jpeg.tar.gz"

pytestmark = [
    pytest.mark.data,
    pytest.mark.slow,
    pytest.mark.skipif(not ARCHIVE.exists(), reason=f"CIFAR-10 copy not found at {ARCHIVE}"),
]

CLASSES = ("airplane", "automobile", "bird", "cat", "deer", "dog", "frog", "horse", "ship", "truck")


@pytest.fixture(scope="module")
def cifar():
    return D.load_cifar(ARCHIVE)


def test_the_copy_decodes_to_cifar10(cifar):
    assert cifar.classes == CLASSES
    assert cifar.train_x.shape == (50000, 3, 32, 32) and cifar.test_x.shape == (10000, 3, 32, 32)
    assert torch.bincount(cifar.train_y).tolist() == [5000] * 10
    assert torch.bincount(cifar.test_y).tolist() == [1000] * 10
    # real photographs, not blank or constant decodes: per-channel means (every class) near CIFAR-10's
    mean = cifar.train_x[::10].float().mean(dim=(0, 2, 3)) / 255
    assert torch.allclose(mean, torch.tensor(vitattn.constants.CIFAR10_MEAN), atol=0.03), mean


def test_cifar_presets_run_on_real_batches(cifar):
    torch.manual_seed(0)
    x = D.Normalize()(cifar.test_x[:16])
    for name in ("vit_cifar10", "vit_quick", "cnn_cifar10", "cnn_longrange"):
        model = vitattn.create_model(name).eval()
        if hasattr(model, "init_stem"):
            model.init_stem(D.Normalize()(cifar.train_x[:5000]))
        with torch.no_grad():
            logits = model(x)
        assert logits.shape == (16, 10) and torch.isfinite(logits).all(), name
