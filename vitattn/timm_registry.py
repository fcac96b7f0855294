"""vitattn's presets in timm's registry: after ``import vitattn``, ``timm.create_model`` builds them.

Each preset is registered as ``<preset>_vitattn`` (``timm.create_model("vit_cifar10_vitattn")``),
a name timm cannot have, with its data config as timm's pretrained config, so timm's own tools
(``train.py``, ``validate.py``, ``resolve_data_config``, its model tests) take vitattn's models as
they take timm's. The preset's name comes first because timm's tools sort models by it (its model
tests treat ``vit_*`` and ``deit*`` as transformers, with token outputs). timm is never imported
for this: ``import vitattn`` registers at once when timm is already loaded, and otherwise as soon
as timm is imported (:func:`register_when_imported`).
"""

from __future__ import annotations

import importlib.abc
import importlib.util
import sys
from typing import Any

SUFFIX = "_vitattn"
default_cfgs: dict[str, dict[str, Any]] = {}  # what timm's register_model reads beside an entry point


def entry_point(preset: str):
    """timm's kind of model function for ``preset``, named ``<preset>_vitattn``."""
    def build(pretrained: bool = False, pretrained_cfg: Any = None, pretrained_cfg_overlay: dict | None = None,
              cache_dir: Any = None, **kwargs: Any):
        from .registry import create_model

        # timm's create_model passes its config and cache along; ours come from the preset
        return create_model(preset, pretrained=pretrained, pretrained_cfg_overlay=pretrained_cfg_overlay, **kwargs)

    build.__name__ = build.__qualname__ = preset + SUFFIX
    build.__module__ = __name__
    build.__doc__ = f"vitattn's preset {preset} (vitattn.create_model({preset!r}, ...))."
    return build


def register(timm_module: Any = None) -> list[str]:
    """Register every preset with timm; returns the names. Its data config is built on the meta
    device (no weights drawn), so this costs milliseconds."""
    import torch
    from timm.models import register_model

    from .registry import PRESETS, create_model

    names = []
    for preset in PRESETS:
        with torch.device("meta"):
            cfg = dict(create_model(preset).pretrained_cfg)
        cfg.pop("architecture", None)
        default_cfgs[preset + SUFFIX] = {k: list(v) if k == "label_names" else v for k, v in cfg.items()}
        register_model(entry_point(preset))
        names.append(preset + SUFFIX)
    return names


class _AfterTimm(importlib.abc.MetaPathFinder):
    """Runs :func:`register` right after ``timm`` itself is imported, wherever that happens."""

    def find_spec(self, name: str, path: Any = None, target: Any = None):
        if name != "timm":
            return None
        sys.meta_path.remove(self)  # once; and so the lookup below finds the real package
        spec = importlib.util.find_spec("timm")
        if spec is None or spec.loader is None:
            return spec
        run = spec.loader.exec_module

        def exec_module(module) -> None:
            run(module)
            register(module)

        spec.loader.exec_module = exec_module
        return spec


def register_when_imported() -> None:
    """Register now if timm is loaded, else when it is (nothing happens without timm installed)."""
    if "timm" in sys.modules:
        register()
    elif importlib.util.find_spec("timm") is not None and not any(isinstance(f, _AfterTimm) for f in sys.meta_path):
        sys.meta_path.insert(0, _AfterTimm())

