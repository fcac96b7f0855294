"""vitattn: vision transformers built from patch attention, written to be read.

    import vitattn
    model = vitattn.create_model("vit_tiny_patch16_224", num_classes=10)
    logits = model(images)                     # (B, 10)
    maps = model.get_attention_maps(images)    # one (B, heads, N, N) per block

The model API is exported here, and ``import vitattn`` loads the models alone. The rest loads
when first used, needing only torch (torchvision, pycocotools and matplotlib load when a function
needs them): ``vitattn.training`` (data, the training loop, checkpoints, the report: its own
docstring lists its modules, detection as a training task among them), ``vitattn.context`` (how
far layers look), ``vitattn.vitdet`` (ViTDet backbones for torchvision's detectors);
``vitattn.init`` (JAX's init, the whitening basis) and ``vitattn.constants`` (CIFAR-10's classes
and statistics) load with the models.
"""

import importlib

from . import constants, init, scores, window
from .attention import SCORES, Attention, AttentionConfig, MultiHeadAttention, window_mask
from .block import Block, DropPath, LayerScale, Mlp
from .cnn import CNNConfig, SmallCNN, whitening_filters
from .patch_embed import PatchEmbed, patchify, unpatchify
from .pos_embed import apply_rope, resample_abs_pos_embed, rope_2d, rotate_qk, sincos_1d, sincos_2d
from .registry import PRESETS, create_model, get_config, list_models
from .timm_compat import from_timm, to_timm, to_timm_state_dict
from .timm_registry import register_when_imported
from .vit import ViT, ViTConfig

__version__ = "0.4.1"

register_when_imported()  # timm.create_model("<preset>_vitattn") once timm is loaded: no import of timm here

_ON_USE = ("context", "training", "vitdet")


def __getattr__(name: str):
    """``vitattn.training``, ``vitattn.context`` and ``vitattn.vitdet``, imported on first use."""
    if name in _ON_USE:
        return importlib.import_module(f"{__name__}.{name}")
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")

__all__ = [
    "SCORES", "Attention", "AttentionConfig", "Block", "CNNConfig", "DropPath", "LayerScale", "Mlp",
    "MultiHeadAttention", "PRESETS",
    "PatchEmbed", "SmallCNN", "ViT", "ViTConfig", "create_model", "from_timm", "get_config", "list_models",
    "apply_rope", "patchify", "rotate_qk", "resample_abs_pos_embed", "rope_2d", "sincos_1d", "sincos_2d", "to_timm",
    "to_timm_state_dict",
    "unpatchify", "whitening_filters", "window_mask",
    "constants", "context", "init", "scores", "training", "vitdet", "window",
]
