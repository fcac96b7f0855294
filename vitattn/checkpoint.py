"""Files that survive a crash: atomic checkpoints (read on the CPU, checked against the run's
model), the run folder's lock, safetensors weights and JSON-lines metrics whose cut last line
is dropped."""

from __future__ import annotations

import contextlib
import errno
import json
import os
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

try:
    import fcntl  # the run folder's lock; POSIX only
except ImportError:  # pragma: no cover
    fcntl = None

import torch
from torch import nn

from .runtime import set_rng_states

# ---------------------------------------------------------------------------------------------
# Files that survive a crash
# ---------------------------------------------------------------------------------------------


class CheckpointError(RuntimeError):
    """A checkpoint that cannot be read; the message names it, and the file is left as it is."""


LOW_SPACE = 1 << 20  # bytes free under which a failed write is put down to a full disk


@contextlib.contextmanager
def writing(path: Path, tmp: Path | None = None):
    """Around a write of ``path`` (through ``tmp``): when it fails, the temp file is removed, and
    a full disk (``ENOSPC``, or torch's zip writer failing with under ``LOW_SPACE`` bytes free)
    raises a ``CheckpointError`` that says so, names the folder and says whether an earlier
    ``path`` is kept."""
    try:
        yield
    except (OSError, RuntimeError) as e:
        if tmp is not None:
            with contextlib.suppress(OSError):
                tmp.unlink()
        try:
            free = shutil.disk_usage(path.parent).free
        except OSError:
            free = None
        full = getattr(e, "errno", None) == errno.ENOSPC or (free is not None and free < LOW_SPACE)
        if not full:
            raise
        kept = f"the earlier {path.name} is kept" if path.exists() else f"no earlier {path.name} exists"
        raise CheckpointError(f"No space left on device in {path.parent} ({free or 0:,} bytes free) while writing "
                              f"{path.name}; {kept}. Free some space, then --resume the run.") from e


def save_atomic(obj: Any, path: Path) -> None:
    """``torch.save`` to a temp file, then rename: a crash never leaves half a checkpoint, and a
    failed write leaves no temp file (a full disk raises a ``CheckpointError`` saying so)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    with writing(path, tmp):
        torch.save(obj, tmp)
        os.replace(tmp, path)


def write_text_atomic(path: Path, text: str) -> None:
    path = Path(path)
    tmp = path.with_name(path.name + ".tmp")
    with writing(path, tmp):
        tmp.write_text(text)
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


@contextlib.contextmanager
def hold(out: Path, main_rank: bool):
    """Hold the run folder for this process (a lock on the folder itself: nothing is written), so
    a second ``--resume`` of it is refused while this one runs; the lock ends with the process."""
    if not main_rank or fcntl is None:
        yield
        return
    fd = os.open(out, os.O_RDONLY)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise CheckpointError(f"{out} is in use by another process running it; wait for it to end or stop "
                                  "it first") from None
        yield
    finally:
        os.close(fd)


def check_checkpoint(ck: dict, model: nn.Module, family: str, path: Path) -> None:
    """A checkpoint must hold this run's model: same family, same weights' names and shapes."""
    ours, theirs = model.state_dict(), ck["model"]
    wrong = [k for k in ours if k not in theirs or tuple(theirs[k].shape) != tuple(ours[k].shape)]
    wrong += [k for k in theirs if k not in ours]
    if ck.get("family", family) != family or wrong:
        raise CheckpointError(f"checkpoint {path} does not hold this run's {family} model (a {ck.get('family')} "
                              f"checkpoint; {len(wrong)} weights differ in name or shape, e.g. {wrong[:3]}); it was "
                              "left untouched")


def resume_checkpoint(path: Path, model: nn.Module, family: str) -> dict | None:
    """The checkpoint at ``path`` read and checked against ``model``; None when there is none."""
    if not Path(path).exists():
        return None
    ck = load_checkpoint(path)
    check_checkpoint(ck, model, family, path)
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


def append_jsonl(path: Path, row: dict) -> None:
    """One JSON line more (a cut line from a failed write is dropped by ``read_jsonl``)."""
    with writing(Path(path)), open(path, "a") as f:
        f.write(json.dumps(row) + "\n")


def read_jsonl(path: Path) -> list[dict]:
    """The rows of a JSON-lines file; an unterminated last line (a crash mid-write) is left out."""
    text = Path(path).read_text()
    lines = text.splitlines()
    if lines and not text.endswith("\n"):
        try:
            json.loads(lines[-1])
        except json.JSONDecodeError:
            lines.pop()
    return [json.loads(s) for s in lines if s.strip()]


def filter_jsonl(path: Path, keep: Callable[[dict], bool]) -> None:
    """Keep the rows of a JSON-lines file that ``keep`` accepts (written atomically); no file, nothing to do."""
    if Path(path).exists():
        write_text_atomic(path, "".join(json.dumps(r) + "\n" for r in read_jsonl(path) if keep(r)))
