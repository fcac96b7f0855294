"""Where and how a run executes: the stop-signal flag (Ctrl-C, SIGTERM), devices and random
states, autocast and native bf16, the distributed helpers, and the run's environment."""

from __future__ import annotations

import contextlib
import ctypes
import hashlib
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

from .cli import option
from .errors import Signalled, UsageError


@dataclass
class Dist:
    """This process's place in a distributed run (a single process by default)."""

    rank: int = 0
    world: int = 1
    local_rank: int = 0

    @property
    def main(self) -> bool:
        return self.rank == 0


def all_reduce_(t: torch.Tensor, ranks: Dist, op=None) -> torch.Tensor:
    """Sum (or ``op``) ``t`` over ranks in place; a no-op in a single process."""
    if ranks.world > 1:
        dist.all_reduce(t, op=op or dist.ReduceOp.SUM)
    return t


# ---------------------------------------------------------------------------------------------
# Ctrl-C, devices, processes
# ---------------------------------------------------------------------------------------------


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


def pick_device(name: str, local_rank: int = 0, world: int = 1) -> torch.device:
    """The device this process trains on, always with an index for CUDA (``torch.cuda.set_device``,
    DDP's ``device_ids`` and the random states need one). ``'auto'`` is CUDA when present, else the
    CPU; ``'cuda'`` is this rank's GPU (``cuda:<local rank>``); ``'cuda:N'`` is GPU N for a single
    process. Under torchrun each rank owns its local GPU, so an explicit index with several
    processes, which would put every rank on one GPU (NCCL refuses that), is refused. Raises a
    ``ValueError`` for a name torch does not know or a CUDA device that is not there."""
    if name == "auto":
        name = "cuda" if torch.cuda.is_available() else "cpu"
    try:
        dev = torch.device(name)
    except RuntimeError as e:
        raise ValueError(f"device {name!r} is not a device torch knows (expected auto, cpu, cuda, cuda:N)") from e
    if dev.type != "cuda":
        return dev
    if not torch.cuda.is_available():
        raise ValueError(f"device {name!r} asked for, but this machine has no CUDA device; use --device cpu")
    if dev.index is not None and world > 1:
        raise ValueError(f"device {name!r} names one GPU for {world} processes; under torchrun each rank takes its "
                         "local GPU: use --device cuda (or auto)")
    index = local_rank if dev.index is None else dev.index
    if index >= torch.cuda.device_count():
        raise ValueError(f"device cuda:{index} asked for, but this machine has {torch.cuda.device_count()} CUDA "
                         f"device(s) (cuda:0 to cuda:{torch.cuda.device_count() - 1})")
    return torch.device("cuda", index)


def stream_seed(seed: int, rank: int) -> int:
    """The seed of rank ``rank``'s dropout / drop-path stream in a run of ``seed`` (< 2**32): ``seed``
    itself on rank 0, and distinct for every (seed, rank) pair, within torch.manual_seed's 64 bits."""
    return seed + rank * 2**32


def rng_states(device: torch.device) -> dict[str, torch.Tensor]:
    """The random states a training step draws from: the CPU's, and ``device``'s when it is a GPU
    (dropout and drop-path draw there)."""
    states = {"cpu": torch.get_rng_state()}
    if device.type == "cuda":
        states["cuda"] = torch.cuda.get_rng_state(device)
    return states


def all_rng_states(device: torch.device, ranks: Dist, model: nn.Module | None = None) -> list[dict]:
    """Every rank's ``rng_states``, in rank order, on every rank (a collective: all ranks call it),
    so the checkpoint rank 0 writes gives each rank its own dropout stream back; with a stack of
    seeds (``model.streams``), each seed's stream too."""
    states: dict = rng_states(device)
    streams = getattr(model, "streams", None)
    if streams is not None:
        states["streams"] = [{k: v.cpu() for k, v in s.items()} for s in streams]
    if ranks.world == 1:
        return [states]
    gathered: list = [None] * ranks.world
    dist.all_gather_object(gathered, {k: v.cpu() if torch.is_tensor(v) else v for k, v in states.items()})
    return gathered


def set_rng_states(states: dict, device: torch.device, model: nn.Module | None = None) -> None:
    """Restore ``rng_states`` (and a stack's per-seed ``streams``, into ``model``); a checkpoint
    written on the CPU resumed on a GPU keeps the GPU's seed."""
    torch.set_rng_state(states["cpu"].cpu())
    if device.type == "cuda" and "cuda" in states:
        torch.cuda.set_rng_state(states["cuda"].cpu(), device)
    if model is not None and "streams" in states and hasattr(model, "streams"):
        model.streams = [{k: v.cpu() for k, v in s.items()} for s in states["streams"]]


# ---------------------------------------------------------------------------------------------
# Batches: a per-epoch permutation, this rank's shard, seeded per step
# ---------------------------------------------------------------------------------------------
def step_generator(seed: int, *keys: int, device: torch.device | str = "cpu") -> torch.Generator:
    """A generator on ``device`` for one ``(seed, epoch, step, rank, ...)``: resumable at any step,
    no state. Seeding a GPU's generator is a host operation: nothing waits for the GPU. CPU and
    GPU generators draw different numbers from one seed, so a run's batches depend on its device
    (and on nothing else)."""
    g = torch.Generator(device=device)
    g.manual_seed(int(hashlib.blake2b(repr((seed, *keys)).encode(), digest_size=7).hexdigest(), 16))
    return g


AMP_DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass
class RunOptions:
    """The options every training script has, declared once: how long a run trains, in what
    precision, on which device, from which seed, shown how, resumed from where. Each script's
    config adds its own (``classify.Config``, ``detect.Config``)."""

    time_budget: float | None = option(None, "minutes of training steps per model (evaluation, test-time "
                                       "augmentation and the report come after it); ends the run if reached first",
                                       unset="none: --epochs ends the run")
    amp: bool = option(False, "mixed precision: forward and backward under autocast in --amp-dtype (timm's --amp); "
                       "a detector's heads and boxes stay in fp32")
    amp_dtype: str = option("bfloat16", "autocast precision; float16 adds a gradient scaler (checkpointed)",
                            choices=tuple(AMP_DTYPES))
    device: str = option("auto", "'auto' (CUDA when present), 'cpu', 'cuda' (under torchrun: each rank's own GPU), "
                         "'cuda:1' (one process)")
    seed: int = option(0, "seed for weights, data order and augmentation")
    progress: bool = option(True, "tqdm progress bar")
    tensorboard: bool = option(True, "TensorBoard curves in <out>/tensorboard (tensorboard --logdir runs), where the "
                               "tensorboard package is installed")
    resume: str | None = option(None, "a run folder to continue, with the options it was started with",
                                unset="a new run")
    malloc: str = option("keep", "glibc's malloc: 'keep' freed memory for the next step (no mmap, no trim; "
                         "faster, the process keeps its peak) or 'system' (glibc's defaults)",
                         choices=("keep", "system"))

    def autocast_dtype(self) -> torch.dtype | None:
        """The autocast precision, or None for fp32."""
        return AMP_DTYPES[self.amp_dtype] if self.amp else None


M_TRIM_THRESHOLD, M_MMAP_MAX = -1, -4  # glibc's malloc.h


def keep_freed_memory() -> bool:
    """Have glibc's malloc keep freed memory for the next request: large buffers come from the
    heap, not from fresh mmaps, and the heap is never trimmed. A training step frees and asks again
    for the same activation buffers; by default each one is mapped anew, and the kernel zeroes its
    pages at every step (the figures are in docs/performance.md). Process-wide and for good, so the
    scripts' sessions call it (``--malloc keep``), never the library. False where the C library is
    not glibc."""
    if platform.libc_ver()[0] != "glibc":
        return False
    mallopt = ctypes.CDLL(None).mallopt
    return bool(mallopt(M_MMAP_MAX, 0)) and bool(mallopt(M_TRIM_THRESHOLD, 2**31 - 1))


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
    if not dist.is_initialized():  # NCCL bound to this rank's GPU from the start (device_id)
        if device.type == "cuda":
            dist.init_process_group("nccl", device_id=device)
        else:
            dist.init_process_group("gloo")
    return Dist(dist.get_rank(), dist.get_world_size(), int(os.environ.get("LOCAL_RANK", "0")))


def place_process(name: str) -> tuple[Dist, torch.device]:
    """This process's place in a torchrun (one process when there is none) and its device
    (``pick_device``), made CUDA's current before the process group starts, so that NCCL binds
    each rank to its own GPU. A device that is not there raises ``UsageError`` (the script's
    ``--device`` was wrong)."""
    world, local_rank = int(os.environ.get("WORLD_SIZE", "1")), int(os.environ.get("LOCAL_RANK", "0"))
    try:
        device = pick_device(name, local_rank, world)
    except ValueError as e:
        raise UsageError(str(e)) from None
    if device.type == "cuda":
        torch.cuda.set_device(device)
    return setup_distributed(device), device


def configure_cuda(tf32: bool = True, benchmark: bool = True) -> None:
    """The settings every GPU trainer sets (timm, airbench): TF32 matrix products and convolutions
    (fp32 inputs, 10-bit mantissa products, fp32 sums) and cuDNN's autotuner, which picks the
    fastest convolution for each shape on its first use. Both off for bit-exact fp32."""
    torch.backends.cuda.matmul.allow_tf32 = tf32
    torch.backends.cudnn.allow_tf32 = tf32
    torch.backends.cudnn.benchmark = benchmark


def wrap_model(model: nn.Module, ranks: Dist, device: torch.device, compile: bool = False) -> nn.Module:
    """The module a training step calls: ``model`` in DistributedDataParallel across a torchrun's
    ranks, then compiled (compiling the DDP module lets its optimiser split graphs at buckets)."""
    if ranks.world > 1:
        if device.type == "cuda" and device.index is None:
            raise ValueError(f"DDP on CUDA needs the rank's GPU index, got {device} (use pick_device)")
        model = nn.parallel.DistributedDataParallel(model, device_ids=[device.index] if device.type == "cuda" else None)
    return torch.compile(model) if compile else model


def average_buffers(model: nn.Module, ranks: Dist) -> None:
    """Average floating buffers (BatchNorm statistics) over ranks, so that every rank evaluates
    and saves one and the same model."""
    if ranks.world == 1:
        return
    for b in model.buffers():
        if b.is_floating_point():
            dist.all_reduce(b)
            b /= ranks.world


def ranks_agree(model: nn.Module, ranks: Dist) -> bool:
    """Whether every rank holds the same weights and buffers (a collective): each rank's
    fingerprint, float64 sums of its floating tensors and of their squares, compared by MIN and MAX."""
    if ranks.world == 1:
        return True
    tensors = [t for t in model.state_dict().values() if t.is_floating_point()]
    low = torch.stack([torch.stack([t.double().sum(), t.double().square().sum()]) for t in tensors]).flatten()
    high = low.clone()
    dist.all_reduce(low, op=dist.ReduceOp.MIN)
    dist.all_reduce(high, op=dist.ReduceOp.MAX)
    return bool((low == high).all())


def environment(device: torch.device, repo: Path | None = None) -> dict:
    """What ran this: device, CPU, library versions, and the git commit of ``repo`` (by default
    the folder holding the package, i.e. the checkout of an editable install)."""
    from .. import __version__

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
        git = ["git", "-C", str(repo or Path(__file__).resolve().parents[2])]
        env["git_commit"] = subprocess.run([*git, "rev-parse", "HEAD"], capture_output=True, text=True,
                                           timeout=10).stdout.strip() or None
        env["git_dirty"] = bool(subprocess.run([*git, "status", "--porcelain", "--untracked-files=no"],
                                               capture_output=True, text=True, timeout=10).stdout.strip())
    except (OSError, subprocess.SubprocessError):
        env["git_commit"] = None
    return env
