"""``python -m vitattn.run_timm SCRIPT [ARGS...]``: one of timm's own scripts (``train.py``,
``validate.py``, ``inference.py`` from timm's repository) run with vitattn's presets in timm's
registry (``<preset>_vitattn``, :mod:`vitattn.timm_registry`), as ``python SCRIPT ARGS`` runs it."""

from __future__ import annotations

import runpy
import sys
from pathlib import Path


def main(argv: list[str] | None = None) -> int:
    """``python -m vitattn.run_timm SCRIPT [ARGS...]``: run one of timm's scripts (``train.py``,
    ``validate.py``, ``inference.py``, from timm's repository) with vitattn's presets registered,
    as ``python SCRIPT ARGS`` would run it."""
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] in ("-h", "--help"):
        print("usage: python -m vitattn.run_timm SCRIPT [ARGS...]\n\nRuns one of timm's scripts (train.py, "
              "validate.py, inference.py) with vitattn's presets in timm's registry as <preset>_vitattn,\n"
              "e.g. python -m vitattn.run_timm train.py DATA --model vit_cifar10_vitattn --epochs 1")
        return 0 if argv else 2
    if not Path(argv[0]).is_file():
        print(f"error: expected a script of timm's (train.py, validate.py), got {argv[0]!r}: no such file",
              file=sys.stderr)
        return 2
    import vitattn  # noqa: F401  (registers the presets when the script imports timm)

    sys.argv = list(argv)
    runpy.run_path(argv[0], run_name="__main__")
    return 0


if __name__ == "__main__":
    sys.exit(main())
