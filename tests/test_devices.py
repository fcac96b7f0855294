"""The main job on an accelerator, checked without one.

No GPU is needed: the run's device is a stand-in, torch's ``meta`` device under a
``FakeTensorMode`` (tensors with shapes, dtypes and devices but no values). Every op that mixes
a tensor on the stand-in with one on the CPU fails there as it would on CUDA, so a batch, a
checkpoint or a reduction left on the host is caught. Reading a value gives 1 (``False`` for a
flag), so the loop runs on; what the run computes is checked on the CPU by tests/test_train.py.
The host keeps real tensors where a real run has them: decoded images, freshly built models,
checkpoints read from disk.
"""

from __future__ import annotations

import signal
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode, unset_fake_temporarily

import train_cifar as T

aten = torch.ops.aten
STAND_IN = torch.device("meta")


class StandIn(FakeTensorMode):
    """Fake tensors whose reads give 1 (a flag reads ``False``)."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func is aten._local_scalar_dense.default:
            return False if args[0].dtype == torch.bool else 1.0 if args[0].is_floating_point() else 1
        return super().__torch_dispatch__(func, types, args, kwargs)


def on_host(fn):
    """``fn`` run with real tensors, as the host runs it in a real job."""
    def wrapped(*args, **kwargs):
        with unset_fake_temporarily():
            return fn(*args, **kwargs)
    return wrapped


def keep_on_host(monkeypatch) -> None:
    """Decoding, model building and checkpoint reading run on the host with real tensors; files
    and report text (no device work) are not written from fake values."""
    original_tolist = torch.Tensor.tolist

    def tolist(t):
        if isinstance(t, FakeTensor) or t.is_meta:
            with unset_fake_temporarily():
                return torch.zeros(t.shape, dtype=torch.float64).tolist()
        return original_tolist(t)

    monkeypatch.setattr(torch.Tensor, "tolist", tolist)
    monkeypatch.setattr(T.data, "load_cifar", on_host(T.data.load_cifar))
    monkeypatch.setattr(T.vitattn, "create_model", on_host(T.vitattn.create_model))
    monkeypatch.setattr(T.checkpoint, "load_checkpoint", on_host(T.checkpoint.load_checkpoint))
    monkeypatch.setattr(T.train, "flops_per_image", lambda model, size: 0)  # counts on its own meta copy
    for name in ("save_atomic", "save_safetensors"):
        monkeypatch.setattr(T.checkpoint, name, lambda *a, **k: None)
    monkeypatch.setattr(T.report, "write_report", lambda *a, **k: None)


@pytest.fixture
def stand_in(monkeypatch):
    keep_on_host(monkeypatch)
    with StandIn(allow_non_fake_inputs=True) as mode:
        yield mode


def config(tmp_path: Path, folder: Path, **kw) -> T.Config:
    base = dict(data_dir=str(folder), out=str(tmp_path / "run"), model="both", cnn_preset="cnn_quick",
                vit_preset="vit_quick", epochs=2, batch_size=12, lr=0.05, progress=False, plots=False,
                context_images=8, device="meta", channels_last=False)  # fake tensors do not change layout
    return T.Config(**{**base, **kw})


def test_the_stand_in_catches_a_batch_left_on_the_host(stand_in):
    norm = T.data.Normalize().to(STAND_IN)
    with pytest.raises(RuntimeError, match="device"):
        norm(torch.zeros(2, 3, 4, 4, dtype=torch.uint8))


@pytest.mark.parametrize("amp", [{}, dict(amp=True, amp_dtype="bfloat16"), dict(amp=True, amp_dtype="float16")],
                         ids=["fp32", "bf16", "fp16"])
def test_a_fresh_run_keeps_data_model_and_sums_on_the_device(tmp_path, folder, stand_in, amp, monkeypatch):
    if amp:  # autocast has no meta backend: the CPU's is taken, which leaves meta ops as they are
        cpu_autocast = T.runtime.autocast
        for module in (T.runtime, T.train):
            monkeypatch.setattr(module, "autocast", lambda device, dtype: cpu_autocast("cpu", dtype))
    s = T.main(config(tmp_path, folder, tta=True, **amp))
    assert s["status"] == "ok" and set(s["models"]) == {"vit", "cnn"}
    assert next(s["modules"]["vit"].parameters()).device == STAND_IN


def test_a_run_resumes_on_the_device_from_a_checkpoint_read_on_the_host(tmp_path, folder, monkeypatch):
    cfg = config(tmp_path, folder, model="cnn", device="cpu", epochs=3)
    calls = {"n": 0}
    cross_entropy = T.F.cross_entropy

    def interrupt(*args, **kw):
        calls["n"] += 1
        if calls["n"] == 5:
            signal.raise_signal(signal.SIGINT)
        return cross_entropy(*args, **kw)

    monkeypatch.setattr(T.F, "cross_entropy", interrupt)
    assert T.main(cfg)["status"] == "interrupted"
    monkeypatch.setattr(T.F, "cross_entropy", cross_entropy)
    saved = (Path(cfg.out) / "config.json").read_text().replace('"device": "cpu"', '"device": "meta"')
    (Path(cfg.out) / "config.json").write_text(saved)
    keep_on_host(monkeypatch)
    with StandIn(allow_non_fake_inputs=True):
        s = T.main(T.Config(resume=cfg.out, progress=False))
    assert s["status"] == "ok"


def test_two_ranks_reduce_only_tensors_on_the_device(tmp_path, folder, stand_in, monkeypatch):
    """NCCL reduces GPU tensors only ("No backend type associated with device type cpu"); the fake
    process group takes anything, so every collective is checked here as NCCL would."""
    from torch.testing._internal.distributed.fake_pg import FakeStore

    reduced = []

    def nccl_like(t, *args, **kwargs):
        if t.device != STAND_IN:
            raise RuntimeError(f"No backend type associated with device type {t.device.type}")
        reduced.append(tuple(t.shape))

    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=2)
    try:
        monkeypatch.setattr(dist, "all_reduce", nccl_like)
        monkeypatch.setattr(T.nn.parallel, "DistributedDataParallel", lambda m, **k: m)  # DDP: tests/test_train.py
        monkeypatch.setenv("WORLD_SIZE", "2")
        s = T.main(config(tmp_path, folder))
    finally:
        if dist.is_initialized():  # main leaves the group when it ends
            dist.destroy_process_group()
    assert s["status"] == "ok" and s["world_size"] == 2
    assert (3,) in reduced and (5,) in reduced  # the epoch's and the evaluation's sums, at least


def test_the_package_and_its_muon_need_no_torch_optim_muon():
    """pyproject's torch floor is older than ``torch.optim.Muon`` (2.9): nothing may need it."""
    import subprocess
    import sys

    code = ("import torch; del torch.optim.Muon\n"
            "import vitattn, train_cifar\n"
            "from vitattn.train import RECIPES, build_optimizer\n"
            "m = vitattn.create_model('vit_quick', num_classes=3)\n"
            "opt = build_optimizer(m, RECIPES['vit'])\n"
            "m(torch.randn(2, 3, 32, 32)).sum().backward(); opt.step(); print(type(opt.optimizers[0]).__name__)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                         cwd=Path(__file__).resolve().parents[1])
    assert out.returncode == 0 and out.stdout.strip() == "Muon", out.stderr
