"""The command line of a training script, from one dataclass.

Each option is declared once, as a field of the script's config dataclass with its help text
(:func:`option`); :func:`build_parser` turns the fields into argparse options, ``-c FILE`` reads a
YAML of defaults (timm's ``train.py`` habit) and :func:`exit_status` maps what can go wrong to one
line and an exit status: 2 for bad options, data or run folders (nothing written), 1 for a
failure mid-run (with the command that resumes it), 128 + the signal when stopped.

``train_cifar.py`` and ``examples/train_detection.py`` are built on it.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import math
import os
import signal
import sys
import time
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import Any, TypeVar

from .errors import Signalled, UsageError, preview


def option(default: Any = dataclasses.MISSING, help: str = "", **meta: Any) -> Any:
    """A config field with its ``--help`` text; ``choices``, ``aliases`` (other flags) and, for a
    ``None`` default, ``unset`` (what leaving it out means, for --help) in ``meta``."""
    return dataclasses.field(default=default, metadata={"help": help, **meta})


def overrides_of(cls: type, skip: tuple[str, ...] = (), note: str = "") -> type:
    """A dataclass with a field ``name: T | None = None`` for each field of the dataclass ``cls``
    (less ``skip``), its help (plus ``note``), choices and aliases copied: options that, when
    given, override what ``cls`` holds. A script's config inherits it, so each option is declared
    once, in ``cls``."""
    fields_ = [(f.name, f"{f.type} | None", dataclasses.field(
        default=None, metadata={**f.metadata, "help": f.metadata.get("help", "") + note}))
        for f in dataclasses.fields(cls) if f.name not in skip]
    return dataclasses.make_dataclass(f"{cls.__name__}Options", fields_)


def preset_kwargs(flag: str, text: str, preset: str | None, refuse: tuple[str, ...] = (),
                  why: str = "") -> dict[str, Any]:
    """A ``--*-kwargs`` option (timm's ``--model-kwargs``): a JSON object of config fields over
    ``preset``'s, checked against its config; keys in ``refuse`` are refused, saying ``why``."""
    try:
        kwargs = json.loads(text)
    except json.JSONDecodeError as e:
        raise UsageError(f"{flag} must be a JSON object, got {text!r} ({e})") from None
    if not isinstance(kwargs, dict):
        raise UsageError(f"{flag} must be a JSON object of config fields, got {text!r}")
    refused = sorted(set(refuse) & set(kwargs))
    if refused:
        raise UsageError(f"{flag}: {', '.join(refused)} {why}; drop them from {flag}")
    if preset is not None:
        from ..registry import get_config

        try:
            get_config(preset, **kwargs)
        except (TypeError, ValueError) as e:
            raise UsageError(f"{flag}: {e}") from None
    return kwargs


def check_fields(cfg: Any) -> None:
    """Raise a UsageError for a field outside its choices, a fraction for a whole number, a
    non-finite number, or a value outside the class's ``POSITIVE`` (> 0), ``NON_NEGATIVE`` (>= 0)
    and ``FRACTION`` ([0, 1)) sets of field names."""
    positive, non_negative, fraction = (getattr(cfg, k, ()) for k in ("POSITIVE", "NON_NEGATIVE", "FRACTION"))
    for f in dataclasses.fields(cfg):
        v, flag = getattr(cfg, f.name), "--" + f.name.replace("_", "-")
        if v is not None and "choices" in f.metadata and v not in f.metadata["choices"]:
            raise UsageError(f"{flag} must be one of {f.metadata['choices']}, got {v!r}")
        if v == "" and "str" in f.type:
            raise UsageError(f"{flag} needs a value, got an empty string")
        for x in v if isinstance(v, tuple) else (v,):  # a tuple field's values each
            if x is None or isinstance(x, bool | str):
                continue
            if "int" in f.type and "float" not in f.type and not isinstance(x, int):
                raise UsageError(f"{flag} must be a whole number, got {x!r}")
            if isinstance(x, float) and not math.isfinite(x):
                raise UsageError(f"{flag} must be a finite number, got {x!r}")
            if (f.name in positive and not x > 0) or (f.name in non_negative and not x >= 0) or \
                    (f.name in fraction and not 0 <= x < 1):
                want = "> 0" if f.name in positive else ">= 0" if f.name in non_negative else "in [0, 1)"
                raise UsageError(f"{flag} must be {want}, got {x!r}")


def default_text(f: dataclasses.Field, flag: str, defaults: dict[str, str]) -> str:
    """An option's default as a user would type it: ``defaults[name]`` where given (what a ``None``
    stands for), a flag's on or off form, a tuple's values, else the value."""
    if f.name in defaults:
        return defaults[f.name]
    if f.type == "bool":
        return flag if f.default else "--no-" + flag[2:]
    if f.default is None:
        return f.metadata.get("unset", "none")  # what leaving it out means
    return " ".join(map(str, f.default)) if isinstance(f.default, tuple) else str(f.default)


def build_parser(cls: type, description: str, epilog: str | None = None,
                 defaults: dict[str, str] | None = None) -> argparse.ArgumentParser:
    """An option per field of the dataclass ``cls`` (``--snake-case`` of its name, then its
    aliases), typed by the annotation, booleans as ``--x`` / ``--no-x``; plus ``-c/--config``. Each
    help ends with its default, said once, as a value the user would type (:func:`default_text`).
    ``cls.HELP_GROUPS`` (title -> field names) puts the options in groups, in that order, the
    common ones first; a field it does not name goes last, under "other"."""
    defaults = defaults or {}
    p = argparse.ArgumentParser(description=description, epilog=epilog)
    fields_ = {f.name: f for f in dataclasses.fields(cls)}
    named = {name for names in getattr(cls, "HELP_GROUPS", {}).values() for name in names}
    groups = [*getattr(cls, "HELP_GROUPS", {}).items(), ("other", tuple(n for n in fields_ if n not in named))]
    last = groups[-2][0] if len(groups) > 1 else "other"  # the outputs: -c FILE goes with them
    for title, names in groups:
        if not names and title != last:
            continue
        g = p.add_argument_group(title)
        if title == last:
            g.add_argument("-c", "--config", metavar="FILE", help="YAML of option values, used as defaults")
        for name in names:
            f = fields_[name]
            flags = ["--" + f.name.replace("_", "-"), *f.metadata.get("aliases", ())]
            help_ = f"{f.metadata['help']} (default: {default_text(f, flags[0], defaults)})"
            if f.type == "bool":
                g.add_argument(*flags, action=argparse.BooleanOptionalAction, default=f.default, help=help_)
                continue
            nargs = "+" if f.type.startswith("tuple") else None
            kind = float if "float" in f.type else int if "int" in f.type else str
            g.add_argument(*flags, dest=f.name, type=kind, nargs=nargs, default=f.default,
                           choices=f.metadata.get("choices"),
                           metavar=None if "choices" in f.metadata else f.name.upper(), help=help_)
    return p


_UNSET = object()  # a value no option parses to: what the command line did not give


def parse_config(p: argparse.ArgumentParser, cls: type, argv: list[str] | None,
                 keep_on_resume: tuple[str, ...] = (), one_option: tuple[tuple[str, ...], ...] = ()) -> Any:
    """Parse ``argv`` into ``cls``: ``-c FILE`` values become defaults that the command line
    overrides; fields grouped in ``one_option`` (``--seed`` and ``--seeds``) count as one option,
    so one of them on the command line also overrides the file's value of the others. With
    ``--resume`` no other option may change (a resumed run keeps its own, and silently ignoring
    new ones would be wrong work) except those in ``keep_on_resume``. A config that ``cls``
    refuses (a UsageError) is a usage error of the parser: exit 2, one line."""
    first, _ = p.parse_known_args(argv)
    fields_ = {f.name: f for f in dataclasses.fields(cls)}
    file = config_file_defaults(p, first.config, cls) if first.config else {}
    given = {k for k, v in vars(p.parse_args(argv, argparse.Namespace(
        **{a.dest: _UNSET for a in p._actions if a.dest != "help"}))).items() if v is not _UNSET}
    for group in one_option:
        if given & set(group):
            for k in set(group) - given:
                file.pop(k, None)  # the command line's own form of the option wins over the file's other form
    p.set_defaults(**file)
    args = {k: tuple(v) if isinstance(v, list) else v for k, v in vars(p.parse_args(argv)).items()}
    args = {k: v for k, v in args.items() if k in fields_}
    if args.get("resume"):
        changed = sorted(k for k, v in args.items() if k not in ("resume", *keep_on_resume)
                         and v != fields_[k].default)
        if changed:
            p.error(f"--resume continues a run with the options it was started with; drop "
                    f"{', '.join('--' + k.replace('_', '-') for k in changed)}")
    try:
        return cls(**args)
    except UsageError as e:
        p.error(str(e))


YAML_MAX_NODES = 10_000  # a config file is a few dozen values; aliases may not expand past this


def _expanded_nodes(node, sizes: dict[int, int | None]) -> int:
    """How many nodes ``node`` becomes once its aliases are expanded, counted on the composed
    graph (where an alias is a shared node), so a file of aliases is measured without expanding it."""
    import yaml

    key = id(node)
    if key in sizes:
        if sizes[key] is None:
            raise ValueError("an alias refers to a node that contains it")
        return sizes[key]
    sizes[key] = None
    if isinstance(node, yaml.SequenceNode):
        n = 1 + sum(_expanded_nodes(c, sizes) for c in node.value)
    elif isinstance(node, yaml.MappingNode):
        n = 1 + sum(_expanded_nodes(k, sizes) + _expanded_nodes(v, sizes) for k, v in node.value)
    else:
        n = 1
    sizes[key] = n
    return n


def _type_ok(annotation: str, value: Any) -> bool:
    """Whether a YAML value is of a config field's type, strictly: ``true`` is no number and a
    number no flag; ``null`` only where the field allows None; a list only for a tuple field."""
    kinds = [t.strip() for t in annotation.split("|")]
    if value is None:
        return "None" in kinds
    for kind in kinds:
        if kind.startswith("tuple") and isinstance(value, list):
            inner = kind[kind.index("[") + 1:].split(",")[0].strip()
            return all(_type_ok(inner, v) for v in value)
        if kind == "bool" and isinstance(value, bool):
            return True
        if kind == "int" and isinstance(value, int) and not isinstance(value, bool):
            return True
        if kind == "float" and isinstance(value, (int, float)) and not isinstance(value, bool):
            return True
        if kind == "str" and isinstance(value, str):
            return True
    return False


def _loader():
    """PyYAML's SafeLoader reading floats as YAML 1.2 does: ``1e-3`` is a number (YAML 1.1, which
    PyYAML follows, wants ``1.0e-3`` and reads ``1e-3`` as a string)."""
    import re

    import yaml

    class Loader(yaml.SafeLoader):
        pass

    Loader.add_implicit_resolver("tag:yaml.org,2002:float", re.compile(
        r"^[-+]?(?:[0-9][0-9_]*(?:\.[0-9_]*)?|\.[0-9_]+)[eE][-+]?[0-9]+$"), list("-+0123456789."))
    return Loader


def config_file_defaults(p: argparse.ArgumentParser, path: str, cls: type) -> dict[str, Any]:
    """``-c FILE``: a YAML mapping of option names (``lr`` or ``--lr`` style) to values, each of
    its option's type. The file must be UTF-8 text whose aliases expand to at most
    ``YAML_MAX_NODES`` nodes (checked before anything is expanded)."""
    import yaml

    try:
        text = Path(path).read_bytes().decode("utf-8")
    except OSError as e:
        p.error(f"-c {path}: cannot read it ({e.strerror or e})")
    except UnicodeDecodeError as e:
        p.error(f"-c {path}: expected UTF-8 text, got a byte {e.object[e.start]:#04x} at offset {e.start} that is not")
    try:
        node = yaml.compose(text, Loader=_loader())
        size = _expanded_nodes(node, {}) if node is not None else 0
        if size > YAML_MAX_NODES:
            raise ValueError(f"its aliases expand to {size:,} values, more than {YAML_MAX_NODES:,}")
        values = yaml.load(text, Loader=_loader()) or {}  # noqa: S506 (a SafeLoader)
    except (yaml.YAMLError, ValueError, RecursionError) as e:
        why = str(e).splitlines()[0][:200] if str(e) else type(e).__name__
        p.error(f"-c {path}: cannot read it as a config: {why}")
    if not isinstance(values, dict):
        p.error(f"-c {path}: expected a mapping of option names to values, got {type(values).__name__}")
    fields_ = {f.name: f for f in dataclasses.fields(cls)}
    out = {str(k).lstrip("-").replace("-", "_"): v for k, v in values.items()}
    unknown = sorted(set(out) - set(fields_))
    if unknown:
        p.error(f"-c {path}: unknown option(s) {preview(unknown)}; see --help")
    for k, v in out.items():
        if not _type_ok(str(fields_[k].type), v):
            p.error(f"-c {path}: {k} must be {fields_[k].type}, got {preview(v)} ({type(v).__name__})")
        if isinstance(v, list):
            out[k] = tuple(v)
    return out


def console_log(progress: bool) -> Callable[..., None]:
    """Print a line; with a progress bar, above it (``tqdm.write``), so lines never land on the bar."""
    if not progress:
        return lambda *parts: print(*parts, flush=True)
    from tqdm import tqdm

    return lambda *parts: tqdm.write(" ".join(str(p) for p in parts), file=sys.stdout)


# How a long phase shows (``phase``, ``track``): set by a run's session; silent in library use.
_PHASES: dict[str, Any] = {"log": None, "bar": False}
T = TypeVar("T")


def show_phases(log: Callable[..., None] | None, bar: bool) -> None:
    """Make every long phase show: a tqdm bar with its estimate (``bar``, in a terminal only) and,
    through ``log``, one line with its duration when it ends (what a log file or CI keeps).
    ``log=None`` silences them, as outside a run."""
    _PHASES.update(log=log, bar=bar)


@contextlib.contextmanager
def phase(desc: str, total: int | None = None, unit: str = "it", line: bool = True, min_s: float = 0.0):
    """A long phase of a run: yields its tqdm bar (``bar.update(n)``; a no-op when not shown), then
    logs ``desc: 12.3 s`` (with ``line``, and when it took ``min_s`` or more)."""
    from tqdm import tqdm

    log, start = _PHASES["log"], time.perf_counter()
    with tqdm(total=total, desc=desc, unit=unit, leave=False, disable=None if log and _PHASES["bar"] else True) as bar:
        yield bar
    took = time.perf_counter() - start
    if log is not None and line and took >= min_s:
        log(f"{desc}: {took:.1f} s")


def track(items: Iterable[T], desc: str, total: int | None = None, unit: str = "it", line: bool = True) -> Iterator[T]:
    """``items`` iterated as a :func:`phase` (the bar's total is ``len(items)`` where it has one)."""
    total = total if total is not None else len(items) if hasattr(items, "__len__") else None
    with phase(desc, total, unit, line) as bar:
        for item in items:
            yield item
            bar.update(1)


def progress_bar(desc: str, total_steps: int | None, step: int, budget_s: float | None, seconds: float):
    """A tqdm bar over the steps or, with a time budget, over its minutes (the budget is what
    ends such a run, so that is what the total and the ETA count)."""
    from tqdm import tqdm

    if budget_s:
        return tqdm(total=round(budget_s / 60, 2), initial=round(seconds / 60, 2), desc=desc, unit="min", disable=None,
                    bar_format="{l_bar}{bar}| {n:.1f}/{total:.1f} min [{elapsed}<{remaining}{postfix}]")
    return tqdm(total=total_steps, initial=step, desc=desc, unit="step", disable=None)


def _stop_before_training(signum, frame):
    raise Signalled(signum)


def exit_status(main: Callable[[Any], dict], cfg: Any, script: str, expected: tuple[type[Exception], ...]) -> int:
    """Run ``main(cfg)`` and return the exit status: 0 done, 1 a NaN loss or a failure mid-run
    (one line with the command that resumes; ``VITATTN_TRACEBACK=1`` shows the trace), 2 an
    ``expected`` error (bad options, data, folders: one line, nothing written), 128 + the signal
    (130 Ctrl-C, 143 SIGTERM) when stopped. ``main`` returns a summary whose ``status`` is 'ok',
    'interrupted' (with ``signal``) or 'nan'."""
    old = signal.signal(signal.SIGTERM, _stop_before_training)  # the default ends the process without a word
    try:
        summary = main(cfg)
    except expected as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except Signalled as e:
        print(f"stopped by {signal.Signals(e.signum).name}: before training began, or sent twice; the last "
              "checkpoint (if any) is kept", file=sys.stderr)
        return 128 + e.signum
    except KeyboardInterrupt:
        print("stopped by SIGINT before training began; nothing to resume", file=sys.stderr)
        return 130
    except Exception as e:
        if os.environ.get("VITATTN_TRACEBACK"):
            raise
        out = getattr(e, "run_folder", None) or cfg.resume or cfg.out
        made = out is not None and (Path(out) / "config.json").is_file()  # a folder that --resume can take
        saved = made and any(Path(out).glob("checkpoints/*.pt"))
        where = (f"; the last good checkpoint is kept: python {script} --resume {out}" if saved else
                 f"; no checkpoint was written yet (python {script} --resume {out} starts it again)" if made else
                 "; nothing was written: run the same command again")
        print(f"error: the run failed: {type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}{where}",
              file=sys.stderr)
        return 1
    finally:
        signal.signal(signal.SIGTERM, old)
    if summary["status"] == "interrupted":
        return 128 + summary["signal"]
    return {"ok": 0, "nan": 1}[summary["status"]]
