"""Stand-ins for an accelerator, for tests on a machine without one.

``StandIn``: torch's ``meta`` device under a ``FakeTensorMode`` plays the GPU (tensors with shapes,
dtypes and devices but no values). Every op that mixes a tensor on it with one on the CPU fails as
it would on CUDA; a random op whose generator is not on its device fails as CUDA's does ("Expected
a 'cuda' device type for generator"); and the traffic between host and device is counted: copies
to the device, copies to the host, and reads of a value (``.item()``, ``int()``, ``.tolist()``),
each of which makes a real host wait for the GPU. Reading a value gives 1 (``False`` for a flag).

``FakeCuda``: ``torch.cuda``'s device API for a machine with ``count`` GPUs, checking its
arguments as torch's own functions do (read from torch/cuda/__init__.py, torch/cuda/random.py and
torch/_utils.py ``_get_device_index``); ``fake_nccl`` refuses two ranks on one GPU as NCCL does,
and ``fake_ddp`` takes ``device_ids`` as DistributedDataParallel resolves them.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch._subclasses.fake_tensor import FakeTensorMode

aten = torch.ops.aten
STAND_IN = torch.device("meta")


@dataclass
class Traffic:
    to_device: int = 0  # host -> device copies
    to_host: int = 0  # device -> host copies
    reads: int = 0  # a device value read by the host (.item(), int(), bool(), .tolist())

    def total(self) -> int:
        return self.to_device + self.to_host + self.reads


def _device(func, args, kwargs) -> torch.device | None:
    if "device" in kwargs and kwargs["device"] is not None:
        return torch.device(kwargs["device"])
    return args[0].device if args and isinstance(args[0], torch.Tensor) else None


class StandIn(FakeTensorMode):
    """Fake tensors on ``meta`` as the GPU, whose reads give 1 and whose traffic is counted."""

    def __init__(self, **kwargs) -> None:
        super().__init__(allow_non_fake_inputs=True, **kwargs)
        self.traffic = Traffic()
        self.device_seeds: set[int] = set()  # initial seeds of the generators that live on the stand-in

    def device_generator(self, original):
        """``runtime.step_generator`` for the stand-in: a meta generator cannot be made, so a CPU one is
        made and remembered as the device's (by its seed, which the dispatcher sees)."""
        def make(seed: int, *keys: int, device="cpu") -> torch.Generator:
            if torch.device(device) != STAND_IN:
                return original(seed, *keys, device=device)
            g = original(seed, *keys, device="cpu")
            self.device_seeds.add(g.initial_seed())
            return g
        return make

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is aten._local_scalar_dense.default:
            if args[0].device == STAND_IN:
                self.traffic.reads += 1
            return False if args[0].dtype == torch.bool else 1.0 if args[0].is_floating_point() else 1
        gen = kwargs.get("generator")
        if gen is not None:  # as at::check_generator on CUDA: the generator must be on the op's device
            on = _device(func, args, kwargs)
            gen_on = "cuda" if gen.initial_seed() in self.device_seeds else "cpu"
            if (on == STAND_IN) != (gen_on == "cuda"):
                raise RuntimeError(f"Expected a '{'cuda' if on == STAND_IN else 'cpu'}' device type for generator "
                                   f"but found '{gen_on}'")
        if func in (aten._to_copy.default, aten.copy_.default):
            src = args[0] if func is aten._to_copy.default else args[1]
            dst = _device(func, args, kwargs) if func is aten._to_copy.default else args[0].device
            if isinstance(src, torch.Tensor) and dst is not None and src.device != dst:
                if dst == STAND_IN:
                    self.traffic.to_device += 1
                elif src.device == STAND_IN:
                    self.traffic.to_host += 1
        return super().__torch_dispatch__(func, types, args, kwargs)


# ---------------------------------------------------------------------------------------------
# torch.cuda, NCCL and DDP as they check their arguments
# ---------------------------------------------------------------------------------------------


@dataclass
class FakeCuda:
    """``torch.cuda``'s device API on a machine with ``count`` GPUs (none real)."""

    count: int = 2
    current: int = 0
    set_calls: list = field(default_factory=list)
    states: dict = field(default_factory=dict)

    NAMES = ("is_available", "device_count", "set_device", "current_device", "get_rng_state", "set_rng_state",
             "is_bf16_supported", "get_device_name")

    def install(self, monkeypatch) -> FakeCuda:
        for name in self.NAMES:
            monkeypatch.setattr(torch.cuda, name, getattr(self, name))
        return self

    def is_available(self) -> bool:
        return True

    def device_count(self) -> int:
        return self.count

    def is_bf16_supported(self, including_emulation: bool = True) -> bool:
        return True

    def get_device_name(self, device=None) -> str:
        return f"stand-in GPU {self.index(device, optional=True)}"

    def index(self, device, optional: bool) -> int:
        """torch._utils._get_device_index as torch.cuda calls it, then the ordinal check CUDA makes."""
        if isinstance(device, str):
            device = torch.device(device)
        idx = None
        if isinstance(device, torch.device):
            if device.type != "cuda":
                raise ValueError(f"Expected a cuda device, but got: {device}")
            idx = device.index
        elif isinstance(device, int):
            idx = device
        if idx is None:
            if not optional:
                raise ValueError(f"Expected a torch.device with a specified index or an integer, but got:{device}")
            idx = self.current
        if not 0 <= idx < self.count:
            raise RuntimeError("CUDA error: invalid device ordinal")
        return idx

    def set_device(self, device) -> None:  # torch.cuda.set_device: _get_device_index(device), not optional
        self.current = self.index(device, optional=False)
        self.set_calls.append(self.current)

    def current_device(self) -> int:
        return self.current

    def get_rng_state(self, device="cuda") -> torch.Tensor:  # an index-less device means the current one
        idx = self.index(device, optional=True)
        return self.states.setdefault(idx, torch.full((16,), idx, dtype=torch.uint8)).clone()

    def set_rng_state(self, new_state: torch.Tensor, device="cuda") -> None:
        idx = self.index(device, optional=True)
        if new_state.dtype != torch.uint8 or new_state.device.type != "cpu":
            raise TypeError(f"expected a CPU torch.ByteTensor, got {new_state.dtype} on {new_state.device}")
        self.states[idx] = new_state.clone()


def fake_nccl(bound: dict[int, int], rank: int):
    """``dist.init_process_group`` for NCCL: binds this rank to its ``device_id`` GPU and refuses a
    GPU another rank of the group holds (NCCL's "Duplicate GPU detected")."""
    def init(backend: str, *, device_id: torch.device | None = None, **kwargs) -> None:
        if backend != "nccl":
            raise AssertionError(f"a CUDA run must use NCCL, got {backend}")
        if device_id is None or device_id.type != "cuda" or device_id.index is None:
            raise ValueError(f"device_id must be a CUDA device with an index, got {device_id}")
        for other, gpu in bound.items():
            if gpu == device_id.index and other != rank:
                raise RuntimeError(f"Duplicate GPU detected : rank {rank} and rank {other} both on CUDA device "
                                   f"{gpu}")
        bound[rank] = device_id.index
    return init


def fake_ddp(cuda: FakeCuda, seen: list):
    """DistributedDataParallel's reading of ``device_ids`` for a CUDA module: one element, resolved
    with ``_get_device_index(x, True)`` (so ``None`` silently means the current GPU, which is why the
    caller must never pass it), and that GPU must be the process's."""
    def ddp(module, device_ids=None, **kwargs):
        if device_ids is None or len(device_ids) != 1:
            raise ValueError(f"device_ids can only be None or contain a single element, got {device_ids}")
        if device_ids[0] is None:
            raise AssertionError("device_ids=[None]: DDP would take the current GPU, whichever that is")
        idx = cuda.index(device_ids[0], optional=True)
        if idx != cuda.current:
            raise RuntimeError(f"DDP on cuda:{idx} while this process's current GPU is cuda:{cuda.current}")
        seen.append(idx)
        return module
    return ddp
