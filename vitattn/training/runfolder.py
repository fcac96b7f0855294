"""The run folder: created once everything is checked, held by one process (a lock), resumed
with the options it was started with, and written through files that survive a crash (atomic
renames; JSON lines read whole). Its checkpoints are :mod:`vitattn.training.checkpoint`."""

from __future__ import annotations

import contextlib
import dataclasses
import errno
import json
import os
import shutil
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

try:
    import fcntl  # the run folder's lock; POSIX only
except ImportError:  # pragma: no cover
    fcntl = None


from .errors import CheckpointError, UsageError, preview

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


@contextlib.contextmanager
def atomic(path: Path):
    """Write ``path`` through the temp file this yields, renamed over it at the end: a crash never
    leaves half a file, and a failed write leaves no temp file (``writing``)."""
    path = Path(path)
    tmp = path.with_name(path.name + ".tmp")
    with writing(path, tmp):
        yield tmp
        os.replace(tmp, path)


def write_text_atomic(path: Path, text: str) -> None:
    with atomic(path) as tmp:
        tmp.write_text(text)


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


def append_jsonl(path: Path, row: dict) -> None:
    """One JSON line more (a cut line from a failed write is dropped by ``read_jsonl``)."""
    with writing(Path(path)), open(path, "a") as f:
        f.write(json.dumps(row) + "\n")


def read_jsonl(path: Path, keys: tuple[str, ...] = ()) -> list[dict]:
    """The rows of a JSON-lines file, each an object with ``keys``; an unterminated last line (a
    crash mid-write) is left out. Any other line that is not such an object raises a
    ``CheckpointError`` naming the file and the line: the file is a run's record, which nothing
    may silently drop or read wrong."""
    text = Path(path).read_text()
    lines = text.splitlines()
    if lines and not text.endswith("\n"):
        try:
            json.loads(lines[-1])
        except json.JSONDecodeError:
            lines.pop()
    rows = []
    for i, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
            if not isinstance(row, dict) or not set(keys) <= set(row):
                raise ValueError(f"expected a JSON object with {', '.join(keys) or 'fields'}, got {preview(row)}")
        except ValueError as e:  # JSONDecodeError is one
            raise CheckpointError(f"{path} line {i} is damaged ({e}); it is the run's record of its epochs: repair "
                                  "that line or delete it, then resume again (lines after the last checkpoint are "
                                  "written anew)") from None
        rows.append(row)
    return rows


METRICS_KEYS = ("model", "step")  # what every line of a run's metrics.jsonl holds


def check_metrics(out: Path) -> None:
    """A resumed run's ``metrics.jsonl`` must read whole before anything is written (``read_jsonl``)."""
    if (Path(out) / "metrics.jsonl").exists():
        read_jsonl(Path(out) / "metrics.jsonl", METRICS_KEYS)


def filter_jsonl(path: Path, keep: Callable[[dict], bool]) -> None:
    """Keep the rows of a JSON-lines file that ``keep`` accepts (written atomically); no file, nothing to do."""
    if Path(path).exists():
        write_text_atomic(path, "".join(json.dumps(r) + "\n" for r in read_jsonl(path) if keep(r)))


def resumed_config(cls: type, run: str, script: str, **keep: Any) -> Any:
    """The config saved in the run folder ``run`` (its ``config.json``), as ``cls``, with ``resume``
    and ``out`` set to the folder and the fields in ``keep`` taken from this command line. A config
    that ``cls`` does not take (an option or preset this version does not have) is refused."""
    folder = Path(run)
    if not folder.is_dir():
        raise UsageError(f"--resume {run}: no such run folder")
    try:
        saved = json.loads((folder / "config.json").read_text())
        if not isinstance(saved, dict):
            raise TypeError(f"expected a JSON object, got {type(saved).__name__}")
        known = {f.name: f for f in dataclasses.fields(cls)}
        saved = {k: tuple(v) if isinstance(v, list) and known.get(k) and known[k].type.startswith("tuple") else v
                 for k, v in saved.items()}
        return cls(**{**saved, "resume": str(folder), "out": str(folder), **keep})
    except FileNotFoundError:
        raise UsageError(f"--resume {run}: no config.json there; expected a folder written by {script}") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise UsageError(f"--resume {run}: config.json is not valid JSON ({e}); nothing was changed") from None
    except (TypeError, UsageError) as e:
        raise UsageError(f"--resume {run}: config.json does not describe a run ({e})") from None


def check_resumed_config(cfg: Any, saved: dict | None, checkpoint: Path, unchecked: tuple[str, ...] = (),
                         normalize: Callable[[str, Any], Any] = lambda k, v: v) -> None:
    """Raise a UsageError when a resumed run's config (its folder's ``config.json``) differs from
    the options its checkpoint was saved with, ``saved``, in a field not in ``unchecked``: an
    edited batch size or number of epochs would otherwise train another run under the old name.
    ``normalize(field, value)`` maps equivalent values to one (a checkpoint without options
    passes)."""
    if not saved:
        return
    now = dataclasses.asdict(cfg)

    def same(k: str) -> bool:
        a, b = normalize(k, now[k]), normalize(k, saved[k])
        return a == b or (isinstance(a, tuple) and list(a) == b)

    differ = [k for k in now if k not in unchecked and k in saved and not same(k)]
    if differ:
        k = differ[0]
        raise UsageError(f"--resume {cfg.resume}: config.json no longer matches {Path(checkpoint).name}: {k} is "
                         f"{preview(now[k])} there and {preview(saved[k])} in the checkpoint"
                         + (f" (and {len(differ) - 1} more)" if len(differ) > 1 else "")
                         + "; restore config.json, or start a new run")


def run_folder(out: str | None, resume: str | None, prefix: str = "") -> Path:
    """The run folder: ``out`` (default ``runs/<prefix><timestamp>``), which must be new or empty
    unless resuming, and creatable. Nothing is created here."""
    folder = Path(out or f"runs/{prefix}{time.strftime('%Y%m%d-%H%M%S')}")
    if not resume and folder.exists() and (not folder.is_dir() or any(folder.iterdir())):
        raise UsageError(f"--out {folder} is not a new or empty folder; continue a run there with --resume {folder} "
                         "or choose another --out")
    parent = next(p for p in (folder, *folder.absolute().parents) if p.exists())
    if not parent.is_dir() or not os.access(parent, os.W_OK):
        raise UsageError(f"--out {folder} cannot be created: {parent} is not a writable folder")
    return folder


def create_run_folder(out: Path, config: Any, stack: contextlib.ExitStack) -> None:
    """Create the run folder checked by :func:`run_folder`, hold it for the run's life (its lock,
    entered on ``stack``) and write ``config.json``; called once everything else is checked."""
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise UsageError(f"--out {out} cannot be created ({e})") from None
    stack.enter_context(hold(out, True))
    write_text_atomic(out / "config.json", json.dumps({**dataclasses.asdict(config), "out": str(out)}, indent=1))


