"""Fixtures shared by the test modules that train."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from test_data import write_folder


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
    """A small ImageFolder tree of three classes (tests/test_data.py's)."""
    return write_folder(tmp_path_factory.mktemp("data") / "cifar")
