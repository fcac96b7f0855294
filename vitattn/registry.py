"""Named presets in one table, and ``create_model`` / ``list_models``.

Each preset is a recipe: the model family, its config, and where the numbers come from.
"""

from __future__ import annotations

import fnmatch
from collections.abc import Sequence
from dataclasses import fields
from typing import Any

from torch import nn

from .bof import BagOfFeaturesConfig, BagOfLocalFeatures
from .cnn import CNNConfig, SmallCNN
from .constants import CIFAR10_MEAN, CIFAR10_STD, IMAGENET_MEAN, IMAGENET_STD, OPENAI_CLIP_MEAN, OPENAI_CLIP_STD
from .features import FeatureExtractor
from .vit import ViT, ViTConfig
from .weights import read_weights

_AIRBENCH = dict(head_scale=1 / 9, bn_weight=False, dirac_init=True)
# A mean over patch tokens with no norm after it (timm's '*_gap' ViTs) and fixed 2-D positions.
_GAP_SINCOS = dict(class_token=False, global_pool="avg", fc_norm=False, pos_embed="sincos2d")

# name: (family, config fields, what it is for)
PRESETS: dict[str, tuple[str, dict[str, Any], str]] = {
    # ImageNet sizes, identical to timm's models of the same name (and loading timm's weights).
    "vit_tiny_patch16_224": ("vit", dict(patch_size=16, embed_dim=192, depth=12, num_heads=3),
                             "timm's ViT-Ti/16 (DeiT-Ti, Touvron et al. 2021)"),
    "vit_small_patch16_224": ("vit", dict(patch_size=16, embed_dim=384, depth=12, num_heads=6),
                              "timm's ViT-S/16 (DeiT-S, Touvron et al. 2021)"),
    "vit_base_patch16_224": ("vit", dict(patch_size=16, embed_dim=768, depth=12, num_heads=12),
                             "timm's ViT-B/16 (Dosovitskiy et al. 2021)"),
    # The backbones people fine-tune today, each timm's model of the same name (and its weights).
    "vit_small_patch14_dinov2": ("vit", dict(img_size=518, patch_size=14, embed_dim=384, depth=12, num_heads=6,
                                             init_values=1e-5, num_classes=0),
                                 "timm's DINOv2 ViT-S/14 (Oquab et al. 2024): self-supervised features, no head"),
    "vit_small_patch14_reg4_dinov2": ("vit", dict(img_size=518, patch_size=14, embed_dim=384, depth=12, num_heads=6,
                                                  init_values=1e-5, reg_tokens=4, no_embed_class=True, num_classes=0),
                                      "timm's DINOv2 ViT-S/14 with 4 registers (Darcet et al. 2024), no head"),
    "deit3_small_patch16_224": ("vit", dict(patch_size=16, embed_dim=384, depth=12, num_heads=6, no_embed_class=True,
                                            init_values=1e-6),
                                "timm's DeiT-III ViT-S/16 (Touvron et al. 2022): positions on the patches only"),
    "vit_base_patch16_siglip_224": ("vit", dict(patch_size=16, embed_dim=768, depth=12, num_heads=12,
                                                class_token=False, global_pool="map", num_classes=0),
                                    "timm's SigLIP ViT-B/16 image tower (Zhai et al. 2023): attention-pool read-out"),
    "vit_little_patch16_reg1_gap_256": ("vit", dict(img_size=256, patch_size=16, embed_dim=320, depth=14, num_heads=5,
                                                    init_values=1e-5, mlp_ratio=5.6, class_token=False,
                                                    no_embed_class=True, reg_tokens=1, global_pool="avg"),
                                        "timm's ViT-Little/16 with 1 register and mean pooling (timm's SBB recipe)"),
    "vit_base_patch16_clip_224": ("vit", dict(patch_size=16, embed_dim=768, depth=12, num_heads=12, pre_norm=True,
                                              norm_eps=1e-5),
                                  "timm's CLIP ViT-B/16 image tower (Radford et al. 2021): a norm before the blocks"),
    "vit_base_patch16_clip_quickgelu_224": ("vit", dict(patch_size=16, embed_dim=768, depth=12, num_heads=12,
                                                        pre_norm=True, norm_eps=1e-5, act_layer="quick_gelu",
                                                        num_classes=512),
                                            "timm's CLIP ViT-B/16 with OpenAI's quick GELU, a 512-wide projection"),
    # The CIFAR-10 comparison (train_cifar.py's defaults), sized to train in minutes on a CPU.
    # Read out by the mean of the patch tokens with fixed 2-D sin-cos positions, as big_vision's
    # plain ViT (Beyer et al. 2022): it learns more in ten epochs than a class token over a learned
    # table (docs/small_data.md).
    "vit_cifar10": ("vit", dict(img_size=32, patch_size=4, embed_dim=128, depth=8, num_heads=4, mlp_ratio=4.0,
                                num_classes=10, class_token=False, global_pool="avg", pos_embed="sincos2d"),
                    "the CIFAR-10 ViT: 8x8 patches of 4 px, 2-D sin-cos positions, eight blocks of width 128, 4x "
                    "MLP, mean of the patch tokens, ~1.6M params"),
    "cnn_cifar10": ("cnn", dict(stem="whiten", stem_width=24, widths=(64, 128, 256), num_classes=10, **_AIRBENCH),
                    "the CIFAR-10 CNN: airbench's frozen 2x2 whitening stem, then three conv stages, ~1.2M params"),
    # The long-range study (train_cifar.py --dataset long-range): both read out by a mean over places.
    "vit_longrange": ("vit", dict(img_size=32, patch_size=4, embed_dim=192, depth=2, num_heads=3, mlp_ratio=2.0,
                                  num_classes=10, use_rot_pos_emb=True, **_GAP_SINCOS),
                      "the long-range ViT: two blocks, a 2-D sin-cos table and 2-D rotary codes on q and k, ~0.6M "
                      "params"),
    "cnn_longrange": ("cnn", dict(stem_width=32, widths=(64, 256, 256), num_classes=10, global_pool="avg",
                                  **_AIRBENCH),
                      "the long-range CNN: airbench94's network shape (Jordan 2024), ~2M params"),
    "bof_longrange": ("bof", dict(width=64, hidden=64, num_classes=2),
                      "the long-range control: two 3x3 convs, global mean + max pool, an MLP (BagNet-style local "
                      "features without their positions)"),
    # Small and fast: smoke tests and first runs.
    "vit_quick": ("vit", dict(img_size=32, patch_size=4, embed_dim=128, depth=6, num_heads=4, mlp_ratio=2.0,
                              num_classes=10), "a small CIFAR ViT for smoke tests and first runs, ~0.8M params"),
    "cnn_quick": ("cnn", dict(stem_width=24, widths=(32, 96, 96), num_classes=10, **_AIRBENCH),
                  "a small CIFAR CNN for smoke tests and first runs, ~0.3M params"),
}

_FAMILIES = {"vit": (ViT, ViTConfig), "cnn": (SmallCNN, CNNConfig), "bof": (BagOfLocalFeatures, BagOfFeaturesConfig)}

# the data each pretrained family was trained on, as timm's pretrained_cfg of the same name says
_DINOV2 = dict(mean=IMAGENET_MEAN, std=IMAGENET_STD, crop_pct=1.0)
_CLIP = dict(mean=OPENAI_CLIP_MEAN, std=OPENAI_CLIP_STD)
DATA = {"vit_small_patch14_dinov2": _DINOV2, "vit_small_patch14_reg4_dinov2": _DINOV2,
        "deit3_small_patch16_224": dict(mean=IMAGENET_MEAN, std=IMAGENET_STD),
        "vit_little_patch16_reg1_gap_256": dict(crop_pct=0.95),
        "vit_base_patch16_clip_224": dict(_CLIP, crop_pct=0.95),
        "vit_base_patch16_clip_quickgelu_224": dict(_CLIP, crop_pct=1.0)}


def list_models(pattern: str = "*") -> list[str]:
    """Preset names matching a shell-style pattern, sorted."""
    if not isinstance(pattern, str):
        raise TypeError(f"list_models takes a shell-style pattern such as 'vit_*', got {pattern!r}")
    return sorted(n for n in PRESETS if fnmatch.fnmatch(n, pattern))


def describe_models(pattern: str = "*", defaults: dict[str, dict[str, str]] | None = None) -> str:
    """One line per preset matching ``pattern``: name, family, parameters and what it is for,
    marked where ``defaults`` (e.g. ``{dataset: {family: preset}}``) makes it a default."""
    rows = []
    for name in list_models(pattern):
        family, _, purpose = PRESETS[name]
        params = sum(p.numel() for p in create_model(name).parameters())
        default = [k for k, d in (defaults or {}).items() if name in d.values()]
        rows.append(f"{name:44s} {family:4s} {params / 1e6:6.2f}M  {purpose}"
                    + (f" [default for {', '.join(default)}]" if default else ""))
    return "\n".join(rows) or f"no preset matches {pattern!r}"


def check_preset(name: str, families: Sequence[str] = ("vit", "cnn", "bof")) -> None:
    """Raise ``ValueError`` unless ``name`` is a preset of one of ``families``."""
    if name not in PRESETS:
        raise ValueError(f"unknown preset {name!r}; available: {', '.join(list_models())}")
    if PRESETS[name][0] not in families:
        raise ValueError(f"{name} is a {PRESETS[name][0]} preset, expected a {' or '.join(families)} one")


def get_config(name: str, **overrides: Any) -> ViTConfig | CNNConfig:
    """The config of a preset with overrides applied (unknown fields raise a ``TypeError``)."""
    if name not in PRESETS:
        raise ValueError(f"unknown model {name!r}; available: {', '.join(list_models())}")
    family, base, _ = PRESETS[name]
    cfg_cls = _FAMILIES[family][1]
    valid = {f.name for f in fields(cfg_cls)}
    unknown = sorted(set(overrides) - valid)
    if unknown:
        raise TypeError(f"{name} ({family}) has no option(s) {unknown}; valid: {sorted(valid)}")
    return cfg_cls(**{**base, **overrides})


# presets whose weights timm publishes under the same name
TIMM_TWINS = ("vit_tiny_patch16_224", "vit_small_patch16_224", "vit_base_patch16_224", "vit_small_patch14_dinov2",
              "vit_small_patch14_reg4_dinov2", "deit3_small_patch16_224", "vit_base_patch16_siglip_224",
              "vit_little_patch16_reg1_gap_256", "vit_base_patch16_clip_224", "vit_base_patch16_clip_quickgelu_224")


def create_model(name: str, pretrained: bool = False, *, pretrained_cfg_overlay: dict | None = None,
                 checkpoint_path: str | None = None, features_only: bool = False,
                 out_indices: int | Sequence[int] | None = None, **overrides: Any) -> nn.Module:
    """Build a preset, e.g. ``create_model('vit_tiny_patch16_224', num_classes=10)``, timm's way.

    ``pretrained=True`` loads timm's weights for a preset with a timm twin through timm's own
    loading (its hub cache when online; ``pretrained_cfg_overlay=dict(file=PATH)`` for a local
    ``.safetensors`` / ``.pth`` / ``.npz``) and converts them; ``checkpoint_path`` loads a vitattn
    checkpoint (``.safetensors``, or a ``.pt`` from ``train_cifar.py``) strictly. A file that
    says what it was trained as (:mod:`vitattn.weights`) builds that model (its config fields,
    ``overrides`` on top) and restores its data config: the mean, std, input size and label
    names its training used, which timm's ``resolve_data_config`` then reads.
    ``features_only=True`` returns a ``FeatureExtractor`` (the maps of ``out_indices``).
    """
    state, info = read_weights(checkpoint_path) if checkpoint_path is not None else (None, None)
    if info:
        overrides = {**saved_fields(name, info, checkpoint_path), **overrides}
    cfg = get_config(name, **overrides)
    if pretrained:
        model = _timm_pretrained(name, cfg, overrides, pretrained_cfg_overlay)
    else:
        model = _FAMILIES[PRESETS[name][0]][0](cfg)
        if isinstance(model, ViT) and PRESETS[name][1].get("img_size") == 32:  # the CIFAR presets' data
            model.pretrained_cfg.update(mean=CIFAR10_MEAN, std=CIFAR10_STD, interpolation="bilinear", crop_pct=1.0)
        model.pretrained_cfg.update(DATA.get(name, {}))
    model.pretrained_cfg["architecture"] = name  # timm's field: the model's name
    if state is not None:
        load_strict(model, state, checkpoint_path)
        restore_data_config(model, info)
    return FeatureExtractor(model, out_indices) if features_only else model


def saved_fields(name: str, info: dict, path) -> dict[str, Any]:
    """The config fields a weights file was trained with, checked against the preset asked for."""
    saved = info.get("architecture")
    if saved and saved != name:
        raise ValueError(f"checkpoint_path {path} holds weights of {saved}, not {name}: create_model({saved!r}, "
                         "checkpoint_path=...)")
    fields_ = info.get("config") or {}
    valid = {f.name for f in fields(_FAMILIES[PRESETS[name][0]][1])}
    unknown = sorted(set(fields_) - valid)
    if unknown:
        raise ValueError(f"checkpoint_path {path} was saved with config fields this version of vitattn does not "
                         f"have: {unknown}")
    return fields_


def restore_data_config(model: nn.Module, info: dict | None) -> None:
    """Put the data fields a weights file saved into the model's ``pretrained_cfg`` (those that
    still describe the built model: the input size and classes only where they agree)."""
    data = dict((info or {}).get("pretrained_cfg") or {})
    cfg = model.pretrained_cfg
    if "input_size" in data and tuple(data["input_size"]) != tuple(cfg["input_size"]):
        del data["input_size"]  # built at another size on purpose (an override): the model's own
    if data.get("num_classes", cfg["num_classes"]) != cfg["num_classes"]:
        data.pop("num_classes"), data.pop("label_names", None)
    cfg.update({k: tuple(v) if isinstance(v, list) and k != "label_names" else v for k, v in data.items()})


def _timm_pretrained(name: str, cfg: ViTConfig, overrides: dict[str, Any], overlay: dict | None) -> ViT:
    if name not in TIMM_TWINS:
        raise ValueError(f"no pretrained weights for {name}: timm publishes them for {', '.join(TIMM_TWINS)}; "
                         "use checkpoint_path= for a vitattn checkpoint")
    try:
        import timm
    except ImportError as e:
        raise ImportError("pretrained=True loads through timm: pip install 'vitattn[timm]'") from e
    from .timm_compat import from_timm, timm_kwargs

    kwargs = {k: v for k, v in timm_kwargs(cfg).items() if k in overrides}  # what the caller changed
    try:
        twin = timm.create_model(name, pretrained=True, pretrained_cfg_overlay=overlay, **kwargs)
    except Exception as e:  # offline, missing file, bad file: hub, OS and parsing errors of many types
        raise RuntimeError(f"pretrained weights for {name} could not be loaded ({type(e).__name__}: "
                           f"{str(e).splitlines()[0] if str(e) else ''}). Offline, give timm a local file: "
                           f"create_model({name!r}, pretrained=True, pretrained_cfg_overlay=dict(file='path/to/"
                           "model.safetensors'))") from e
    model = from_timm(twin)
    model.pretrained_cfg.update({k: v for k, v in twin.pretrained_cfg.items()
                                 if k in ("mean", "std", "interpolation", "crop_pct")})
    return model


def load_strict(model: nn.Module, state: dict, path) -> None:
    """Load a state dict strictly: every name and shape must match, else a ``ValueError`` naming the file."""
    try:
        model.load_state_dict(state, strict=True)
    except RuntimeError as e:
        raise ValueError(f"checkpoint_path {path} does not hold this model's weights: "
                         f"{str(e).splitlines()[1] if len(str(e).splitlines()) > 1 else e}") from e
