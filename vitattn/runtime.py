"""Where and how a run executes: the stop-signal flag (Ctrl-C, SIGTERM), devices and random
states, autocast and native bf16, the distributed helpers, and the run's environment."""

from __future__ import annotations

import contextlib
import os
import platform
import signal
import subprocess
import sys
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from .cli import Signalled, UsageError


@dataclass
class Dist:
    """This process's place in a distributed run (a single process by default)."""

    rank: int = 0
    world: int = 1
    local_rank: int = 0

    @property
    def main(self) -> bool:
        return self.rank == 0


def all_reduce_(t: torch.Tensor, dd: Dist, op=None) -> torch.Tensor:
    """Sum (or ``op``) ``t`` over ranks in place; a no-op in a single process."""
    if dd.world > 1:
        dist.all_reduce(t, op=op or dist.ReduceOp.SUM)
    return t



# ---------------------------------------------------------------------------------------------
# Ctrl-C, devices, processes
# ---------------------------------------------------------------------------------------------


class Interrupted(Exception):
    """Ctrl-C or SIGTERM reached a training loop at a step boundary (raised after it saved a checkpoint)."""


class NonFiniteLoss(FloatingPointError):
    """The loss became NaN or inf; the last good checkpoint is kept."""


STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM)  # Ctrl-C, and what kill, schedulers and containers send


class StopFlag:
    """SIGINT or SIGTERM sets a flag that the loop checks between steps (``signum`` says which came);
    a second one raises ``Signalled`` at once."""

    def __init__(self) -> None:
        self.signum: int | None = None
        self._old: dict[int, Any] = {}

    @property
    def set(self) -> bool:
        return self.signum is not None

    def __enter__(self) -> StopFlag:
        if threading.current_thread() is threading.main_thread():
            for s in STOP_SIGNALS:
                if signal.getsignal(s) is not None:
                    self._old[s] = signal.signal(s, self._handle)
        return self

    def _handle(self, signum, frame) -> None:
        if self.set:
            raise Signalled(signum)
        self.signum = signum
        print(f"\n{signal.Signals(signum).name}: saving a resumable checkpoint after this step (send it again to "
              "abort)", file=sys.stderr, flush=True)

    def __exit__(self, *exc) -> None:
        for s, old in self._old.items():
            signal.signal(s, old)


def pick_device(name: str, local_rank: int = 0) -> torch.device:
    """``'auto'`` is CUDA (this rank's GPU) when present, else the CPU; other names as torch reads them.
    Raises a ``ValueError`` for a name torch does not know or a CUDA device that is not there."""
    if name == "auto":
        return torch.device(f"cuda:{local_rank}") if torch.cuda.is_available() else torch.device("cpu")
    try:
        dev = torch.device(name)
    except RuntimeError as e:
        raise ValueError(f"device {name!r} is not a device torch knows (expected auto, cpu, cuda, cuda:N)") from e
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"device {name!r} asked for, but this machine has no CUDA device; use --device cpu")
    return dev


def rng_states(device: torch.device) -> dict[str, torch.Tensor]:
    """The random states a training step draws from: the CPU's, and ``device``'s when it is a GPU
    (dropout and drop-path draw there)."""
    states = {"cpu": torch.get_rng_state()}
    if device.type == "cuda":
        states["cuda"] = torch.cuda.get_rng_state(device)
    return states


def set_rng_states(states: dict[str, torch.Tensor], device: torch.device) -> None:
    """Restore ``rng_states``; a checkpoint written on the CPU resumed on a GPU keeps the GPU's seed."""
    torch.set_rng_state(states["cpu"].cpu())
    if device.type == "cuda" and "cuda" in states:
        torch.cuda.set_rng_state(states["cuda"].cpu(), device)


AMP_DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16}


def native_bf16(device: torch.device | str) -> bool:
    """Whether ``device`` multiplies bf16 in hardware: a CUDA GPU that says so, or a CPU with the
    ``avx512_bf16`` or ``amx_bf16`` flags (Linux). Elsewhere bf16 products are emulated, many
    times slower than fp32 (docs/performance.md)."""
    device = torch.device(device)
    if device.type == "cuda":
        return torch.cuda.is_bf16_supported()
    if device.type != "cpu":
        return False
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                return bool({"avx512_bf16", "amx_bf16"} & set(line.split(":", 1)[1].split()))
    return False


def precision_name(amp_dtype: torch.dtype | None, grad_scaler: bool = False) -> str:
    """What a run's arithmetic is, in words: 'fp32', 'bfloat16 autocast', 'float16 autocast + grad scaler'."""
    if amp_dtype is None:
        return "fp32"
    return f"{str(amp_dtype).removeprefix('torch.')} autocast" + (" + grad scaler" if grad_scaler else "")


def precision_warning(device: torch.device, dtype: torch.dtype | None) -> str | None:
    """A warning when ``dtype`` is bf16 on a device without native bf16 products, else None."""
    if dtype != torch.bfloat16 or native_bf16(device):
        return None
    return (f"{device} has no native bf16 (no avx512_bf16 / amx_bf16 flags), so bf16 products are emulated and run "
            "many times slower than fp32 (docs/performance.md); drop --amp for fp32")


def autocast(device: torch.device | str, dtype: torch.dtype | None) -> contextlib.AbstractContextManager:
    """``torch.autocast`` in ``dtype`` on ``device``, or nothing for ``None`` (fp32)."""
    if dtype is None:
        return contextlib.nullcontext()
    return torch.autocast(torch.device(device).type, dtype=dtype)


def setup_distributed(device: torch.device) -> Dist:
    """Join the process group that ``torchrun`` describes in the environment (gloo on CPU,
    nccl on CUDA); a single process when there is none."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world <= 1:
        return Dist()
    if not dist.is_initialized():
        dist.init_process_group("nccl" if device.type == "cuda" else "gloo")
    return Dist(dist.get_rank(), dist.get_world_size(), int(os.environ.get("LOCAL_RANK", "0")))


def place_process(name: str) -> tuple[Dist, torch.device]:
    """This process's place in a torchrun (one process when there is none) and its device:
    ``name`` ('auto', 'cpu', 'cuda', 'cuda:1', ...) taken at the local rank, made CUDA's current.
    A device that is not there raises ``UsageError`` (the script's ``--device`` was wrong)."""
    try:
        dd = setup_distributed(pick_device(name, int(os.environ.get("LOCAL_RANK", "0"))))
        device = pick_device(name, dd.local_rank)
    except ValueError as e:
        raise UsageError(str(e)) from None
    if device.type == "cuda":
        torch.cuda.set_device(device)
    return dd, device


def wrap_model(model: nn.Module, dd: Dist, device: torch.device, compile: bool = False) -> nn.Module:
    """The module a training step calls: ``model`` in DistributedDataParallel across a torchrun's
    ranks, then compiled (compiling the DDP module lets its optimiser split graphs at buckets)."""
    if dd.world > 1:
        model = nn.parallel.DistributedDataParallel(model, device_ids=[device.index] if device.type == "cuda" else None)
    return torch.compile(model) if compile else model


def average_buffers(model: nn.Module, dd: Dist) -> None:
    """Average floating buffers (BatchNorm statistics) over ranks, so that every rank evaluates
    and saves one and the same model."""
    if dd.world == 1:
        return
    for b in model.buffers():
        if b.is_floating_point():
            dist.all_reduce(b)
            b /= dd.world


def environment(device: torch.device, repo: Path | None = None) -> dict:
    """What ran this: device, CPU, library versions, and the git commit of ``repo`` (by default
    the folder holding the package, i.e. the checkout of an editable install)."""
    from . import __version__

    env = {"device": str(device), "python": platform.python_version(), "torch": torch.__version__,
           "vitattn": __version__, "platform": platform.platform(), "threads": torch.get_num_threads(),
           "cpu_count": os.cpu_count()}
    if device.type == "cuda":
        env["gpu"] = torch.cuda.get_device_name(device)
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                env["cpu"] = line.split(":", 1)[1].strip()
                break
    for mod in ("torchvision", "timm", "einops", "matplotlib"):
        with contextlib.suppress(ImportError):
            env[mod] = __import__(mod).__version__
    try:
        git = ["git", "-C", str(repo or Path(__file__).resolve().parents[1])]
        env["git_commit"] = subprocess.run([*git, "rev-parse", "HEAD"], capture_output=True, text=True,
                                           timeout=10).stdout.strip() or None
        env["git_dirty"] = bool(subprocess.run([*git, "status", "--porcelain", "--untracked-files=no"],
                                               capture_output=True, text=True, timeout=10).stdout.strip())
    except (OSError, subprocess.SubprocessError):
        env["git_commit"] = None
    return env
