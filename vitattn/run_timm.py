"""``python -m vitattn.run_timm SCRIPT [ARGS...]``: one of timm's own scripts (``train.py``,
``validate.py``, ``inference.py`` from timm's repository) run with vitattn's presets in timm's
registry (``<preset>_vitattn``, :mod:`vitattn.timm_registry`), as ``python SCRIPT ARGS`` runs it;
``-m MODULE [ARGS...]`` as ``python -m MODULE``, e.g. timm's test suite under ``-m pytest``."""

from __future__ import annotations

import importlib.util
import runpy
import sys
from pathlib import Path

USAGE = ("usage: python -m vitattn.run_timm SCRIPT [ARGS...]\n       python -m vitattn.run_timm -m MODULE [ARGS...]\n\n"
         "Runs one of timm's scripts (train.py, validate.py, inference.py), or a module as python -m does\n"
         "(pytest, for timm's tests/test_models.py), with vitattn's presets in timm's registry as <preset>_vitattn,\n"
         "e.g. python -m vitattn.run_timm train.py DATA --model vit_cifar10_vitattn --epochs 1\n"
         "     python -m vitattn.run_timm -m pytest tests/test_models.py -k '_vitattn and not torchscript'")


def main(argv: list[str] | None = None) -> int:
    """``python -m vitattn.run_timm SCRIPT [ARGS...]``: run one of timm's scripts (``train.py``,
    ``validate.py``, ``inference.py``, from timm's repository) with vitattn's presets registered,
    as ``python SCRIPT ARGS`` would run it; ``-m MODULE [ARGS...]`` as ``python -m MODULE ARGS``."""
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] in ("-h", "--help"):
        print(USAGE)
        return 0 if argv else 2
    as_module = argv[0] == "-m"
    module = argv[1] if as_module and len(argv) > 1 else None
    if as_module and not importable(module):
        print(f"error: -m expected a module python can import (e.g. pytest), got {module!r}", file=sys.stderr)
        return 2
    if not as_module and not Path(argv[0]).is_file():
        print(f"error: expected a script of timm's (train.py, validate.py), got {argv[0]!r}: no such file",
              file=sys.stderr)
        return 2
    import vitattn  # noqa: F401  (registers the presets when the script imports timm)

    if as_module:
        sys.argv = argv[1:]
        runpy.run_module(module, run_name="__main__", alter_sys=True)
    else:
        sys.argv = list(argv)
        runpy.run_path(argv[0], run_name="__main__")
    return 0


def importable(module: str | None) -> bool:
    try:
        return bool(module) and importlib.util.find_spec(module) is not None
    except ImportError:  # a dotted name whose parent is missing, or a relative one
        return False


if __name__ == "__main__":
    sys.exit(main())
