"""Checkpoints: written atomically, read on the CPU and checked against the run's model before
anything loads, restored with every rank's random streams; the final weights as safetensors."""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path
from typing import Any

import torch
from torch import nn

from .errors import CheckpointError
from .runfolder import writing
from .runtime import set_rng_states


def save_atomic(obj: Any, path: Path) -> None:
    """``torch.save`` to a temp file, then rename: a crash never leaves half a checkpoint, and a
    failed write leaves no temp file (a full disk raises a ``CheckpointError`` saying so)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    with writing(path, tmp):
        torch.save(obj, tmp)
        os.replace(tmp, path)


def load_checkpoint(path: Path) -> dict:
    """``torch.load(weights_only=True)`` onto the CPU, whatever device saved it: ``load_state_dict``
    moves weights and optimiser state to the model's device, and random states must stay CPU
    tensors. An unreadable file raises a ``CheckpointError`` naming it."""
    try:
        ck = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as e:  # a damaged file surfaces as zip, pickle, EOF or OS errors, depending on where
        raise CheckpointError(f"checkpoint {path} is unreadable ({type(e).__name__}: {str(e).splitlines()[0]}); "
                              "it was left untouched. Move it away to train that model afresh.") from e
    if not isinstance(ck, dict) or not {"model", "optimizer", "state"} <= set(ck):
        raise CheckpointError(f"checkpoint {path} is not a training checkpoint (expected model, optimizer and "
                              "state entries); it was left untouched.")
    return ck


def check_checkpoint(ck: dict, model: nn.Module, family: str, path: Path) -> None:
    """A checkpoint must hold this run's model: same family, same weights' names and shapes."""
    ours, theirs = model.state_dict(), ck["model"]
    wrong = [k for k in ours if k not in theirs or tuple(theirs[k].shape) != tuple(ours[k].shape)]
    wrong += [k for k in theirs if k not in ours]
    if ck.get("family", family) != family or wrong:
        raise CheckpointError(f"checkpoint {path} does not hold this run's {family} model (a {ck.get('family')} "
                              f"checkpoint; {len(wrong)} weights differ in name or shape, e.g. {wrong[:3]}); it was "
                              "left untouched")


def resume_checkpoint(path: Path, model: nn.Module, family: str, state: type | None = None) -> dict | None:
    """The checkpoint at ``path`` read and checked against ``model`` (and, given the dataclass of
    the loop's ``state``, that its state has no field the loop does not know); None when there is none."""
    if not Path(path).exists():
        return None
    ck = load_checkpoint(path)
    check_checkpoint(ck, model, family, path)
    unknown = sorted(set(ck["state"]) - {f.name for f in dataclasses.fields(state)}) if state is not None else []
    if unknown:
        raise CheckpointError(f"checkpoint {path} was written by another version of the training loop (its state "
                              f"has {', '.join(unknown)}); it was left untouched. Start a new run.")
    return ck


def restore(ck: dict, model: nn.Module, opt: Any, scaler: torch.amp.GradScaler, device: torch.device,
            rank: int = 0) -> bool:
    """Load a checkpoint's weights, optimiser state, fp16 loss scale and this rank's random streams
    (``ck['rng']`` holds one entry per rank, ``runtime.all_rng_states``). Returns False when the
    checkpoint has no random state for ``rank`` (a run resumed with more processes than it had):
    the caller seeds that rank afresh."""
    model.load_state_dict(ck["model"])
    opt.load_state_dict(ck["optimizer"])
    if scaler.is_enabled() and "scaler" in ck:
        scaler.load_state_dict(ck["scaler"])
    if rank >= len(ck["rng"]):
        return False
    set_rng_states(ck["rng"][rank], device)
    return True


def save_safetensors(model: nn.Module, path: Path) -> None:
    """The model's weights as a ``.safetensors`` file (atomic), for loading without pickle."""
    from safetensors.torch import save_file

    path = Path(path)
    tmp = path.with_name(path.name + ".tmp")
    with writing(path, tmp):
        save_file({k: v.detach().contiguous().cpu() for k, v in model.state_dict().items()}, str(tmp))
        os.replace(tmp, path)
