"""A run's checkpoints: written atomically, read on the CPU and checked against the run's model
before anything loads, restored with every rank's (and every seed's) random streams; and the final
weights as safetensors with what they were trained with (``vitattn.weights``).
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import torch
from torch import nn

from .errors import CheckpointError
from .runfolder import atomic
from .runtime import set_rng_states


# -- checkpoints ------------------------------------------------------------------------------------
def save_atomic(obj: Any, path: Path) -> None:
    """``torch.save`` through a temp file (``atomic``; a full disk raises a ``CheckpointError``)."""
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    with atomic(path) as tmp:
        torch.save(obj, tmp)


def load_checkpoint(path: Path) -> dict:
    """``torch.load(weights_only=True)`` onto the CPU, whatever device saved it: ``load_state_dict``
    moves weights and optimiser state to the model's device, and random states must stay CPU
    tensors. An unreadable file raises a ``CheckpointError`` naming it."""
    try:
        loaded = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as e:  # a damaged file surfaces as zip, pickle, EOF or OS errors, depending on where
        raise CheckpointError(f"checkpoint {path} is unreadable ({type(e).__name__}: {str(e).splitlines()[0]}); "
                              "it was left untouched. Move it away to train that model afresh.") from e
    if not isinstance(loaded, dict) or not {"model", "optimizer", "state"} <= set(loaded):
        raise CheckpointError(f"checkpoint {path} is not a training checkpoint (expected model, optimizer and "
                              "state entries); it was left untouched.")
    return loaded


def check_checkpoint(loaded: dict, model: nn.Module, family: str, path: Path) -> None:
    """A checkpoint must hold this run's model: same family, same weights' names and shapes."""
    ours, theirs = model.state_dict(), loaded["model"]
    wrong = [k for k in ours if k not in theirs or tuple(theirs[k].shape) != tuple(ours[k].shape)]
    wrong += [k for k in theirs if k not in ours]
    if loaded.get("family", family) != family or wrong:
        raise CheckpointError(f"checkpoint {path} does not hold this run's {family} model (a {loaded.get('family')} "
                              f"checkpoint; {len(wrong)} weights differ in name or shape, e.g. {wrong[:3]}); it was "
                              "left untouched")


def resume_checkpoint(path: Path, model: nn.Module, family: str, state: type | None = None) -> dict | None:
    """The checkpoint at ``path`` read and checked against ``model`` (and, given the dataclass of
    the loop's ``state``, that its state has no field the loop does not know); None when there is none."""
    if not Path(path).exists():
        return None
    loaded = load_checkpoint(path)
    check_checkpoint(loaded, model, family, path)
    unknown = sorted(set(loaded["state"]) - {f.name for f in dataclasses.fields(state)}) if state is not None else []
    if unknown:
        raise CheckpointError(f"checkpoint {path} was written by another version of the training loop (its state "
                              f"has {', '.join(unknown)}); it was left untouched. Start a new run.")
    return loaded


def restore(loaded: dict, model: nn.Module, opt: Any, scaler: torch.amp.GradScaler, device: torch.device,
            rank: int = 0) -> bool:
    """Load a checkpoint's weights, optimiser state, fp16 loss scale and this rank's random streams
    (``loaded['rng']`` holds one entry per rank, ``runtime.all_rng_states``). Returns False when the
    checkpoint has no random state for ``rank`` (a run resumed with more processes than it had):
    the caller seeds that rank afresh."""
    model.load_state_dict(loaded["model"])
    opt.load_state_dict(loaded["optimizer"])
    if scaler.is_enabled() and "scaler" in loaded:
        scaler.load_state_dict(loaded["scaler"])
    if rank >= len(loaded["rng"]):
        return False
    set_rng_states(loaded["rng"][rank], device, model)
    return True


def save_safetensors(model: nn.Module, path: Path) -> None:
    """The model's weights as a ``.safetensors`` file (atomic), for loading without pickle, with
    what they were trained with (``vitattn.weights``)."""
    from ..weights import save_weights

    with atomic(path) as tmp:
        save_weights(model, path, tmp)
