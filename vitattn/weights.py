"""A model's weights on disk together with what they were trained with.

Weights alone forget the data they learned from: a model trained on inputs normalised by its own
training set's statistics, reloaded and fed through ``timm.data.resolve_data_config``, would get
the preset's constants instead. So a saved file carries, besides the tensors, the model's
``pretrained_cfg`` (mean, std, input size, classes, label names), its preset (timm's
``architecture``) and its config fields; :func:`read_weights` gives them back and
``vitattn.create_model(name, checkpoint_path=...)`` builds the model they describe.

    .safetensors    tensors + metadata {"vitattn": JSON of describe(model)}
    .pt / .pth      a dict: train_cifar.py's checkpoint ({"model": ..., "model_info": ...}) or a plain state dict

References: timm's ``pretrained_cfg`` fields; safetensors' string metadata.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import torch
from torch import nn

META_KEY = "vitattn"
# the pretrained_cfg entries that describe the data a model learned from (timm's field names)
DATA_FIELDS = ("input_size", "mean", "std", "interpolation", "crop_pct", "num_classes", "label_names")


def describe(model: nn.Module) -> dict[str, Any]:
    """What a model's weights need beside them: its preset (``pretrained_cfg['architecture']``),
    config fields and the data fields of its ``pretrained_cfg``; JSON-ready."""
    cfg = getattr(model, "pretrained_cfg", {}) or {}
    config = model.config.to_dict() if hasattr(getattr(model, "config", None), "to_dict") else None
    data = {k: list(v) if isinstance(v, tuple) else v for k, v in cfg.items() if k in DATA_FIELDS and v is not None}
    return {"architecture": cfg.get("architecture"), "config": config, "pretrained_cfg": data}


def save_weights(model: nn.Module, path: str | os.PathLike, tmp: str | os.PathLike | None = None) -> None:
    """The model's weights as ``.safetensors`` with :func:`describe` as metadata, written to ``tmp``
    (the caller renames it) or to ``path``."""
    from safetensors.torch import save_file

    tensors = {k: v.detach().contiguous().cpu() for k, v in model.state_dict().items()}
    save_file(tensors, str(tmp or path), metadata={META_KEY: json.dumps(describe(model))})


def read_weights(path: str | os.PathLike) -> tuple[dict[str, torch.Tensor], dict[str, Any] | None]:
    """``(state_dict, info)`` of a ``.safetensors`` file or a torch checkpoint; ``info`` is what
    :func:`describe` saved, or ``None`` for a file without it (weights saved elsewhere). Raises a
    ``ValueError`` naming the file when it cannot be read as weights."""
    path = Path(path)
    try:
        if path.suffix == ".safetensors":
            from safetensors import safe_open

            with safe_open(str(path), framework="pt") as f:
                meta = f.metadata() or {}
                state = {k: f.get_tensor(k) for k in f.keys()}  # noqa: SIM118 (safe_open has no iteration)
            info = json.loads(meta[META_KEY]) if META_KEY in meta else None
        else:
            loaded = torch.load(path, map_location="cpu", weights_only=True)
            is_checkpoint = isinstance(loaded, dict) and isinstance(loaded.get("model"), dict)
            state = loaded["model"] if is_checkpoint else loaded
            info = loaded.get("model_info") if is_checkpoint else None
    except Exception as e:  # missing, truncated or foreign files fail in many ways
        raise ValueError(f"checkpoint_path {path}: cannot read weights from it ({type(e).__name__}: "
                         f"{str(e).splitlines()[0] if str(e) else ''})") from e
    if not isinstance(state, dict) or not all(isinstance(v, torch.Tensor) for v in state.values()):
        raise ValueError(f"checkpoint_path {path}: expected a state dict of tensors, got {type(state).__name__}")
    if info is not None and not isinstance(info, dict):
        raise ValueError(f"checkpoint_path {path}: its vitattn metadata is not a JSON object")
    return state, info
