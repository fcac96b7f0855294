"""A plain ViT as the backbone of torchvision's detectors (ViTDet).

ViTDet's point is that a detector does not need a hierarchical backbone: from the *last* map of
a plain ViT (stride = patch size, 16) a *simple feature pyramid* of parallel branches makes the
multi-scale maps a detector wants::

    last block tokens -> map (B, D, gh, gw), stride 16
      x4   ConvT 2x2 -> LN -> GELU -> ConvT 2x2   (B, D/4, 4gh, 4gw)   stride 4    '0'
      x2   ConvT 2x2                              (B, D/2, 2gh, 2gw)   stride 8    '1'
      x1   identity                               (B, D,    gh,  gw)   stride 16   '2'
      x1/2 max-pool 2x2                           (B, D, gh/2, gw/2)   stride 32   '3'
      each branch -> conv 1x1 -> LN -> conv 3x3 -> LN                 (B, out_channels, ...)
      max-pool(1, stride 2) of the coarsest level                                stride 64   'pool'

The level names and strides are those of torchvision's ``resnet_fpn_backbone``, so the
detectors' default RoI poolers and anchor generators fit. Window attention (a block option of
``vitattn.attention``) keeps the cost linear in the image area; ViTDet uses 14x14 windows with
global attention in every third block, which propagates information across windows.

References: Li, Mao, Girshick, He 2022, "Exploring Plain Vision Transformer Backbones for Object
Detection" (ViTDet), detectron2 ``modeling/backbone/vit.py`` (``SimpleFeaturePyramid``);
torchvision ``models/detection``; COCO evaluation, pycocotools ``cocoeval.py``.
"""

from __future__ import annotations

import dataclasses
from collections import OrderedDict
from collections.abc import Sequence
from typing import Any

import torch
import torch.nn.functional as F
from einops import rearrange
from torch import nn

from .vit import ViT, vitdet_window_blocks  # noqa: F401 (ViTDet's layout, re-exported)

DETECTORS = ("fasterrcnn", "maskrcnn", "retinanet", "fcos")
SCALE_FACTORS = (4.0, 2.0, 1.0, 0.5)  # the branches ViTDet defines


# -- the simple feature pyramid ---------------------------------------------------------------
class LayerNorm2d(nn.Module):
    """LayerNorm over the channels of each pixel: ``(B, C, H, W) -> (B, C, H, W)``."""

    def __init__(self, channels: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(channels))
        self.bias = nn.Parameter(torch.zeros(channels))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = rearrange(x, "b c h w -> b h w c")
        x = F.layer_norm(x, x.shape[-1:], self.weight, self.bias, self.eps)
        return rearrange(x, "b h w c -> b c h w")


def _resample_branch(dim: int, scale: float) -> tuple[nn.Module, int]:
    """The stride-changing part of one pyramid branch and the width it outputs."""
    if scale == 4.0:
        return nn.Sequential(
            nn.ConvTranspose2d(dim, dim // 2, 2, stride=2), LayerNorm2d(dim // 2), nn.GELU(),
            nn.ConvTranspose2d(dim // 2, dim // 4, 2, stride=2),
        ), dim // 4
    if scale == 2.0:
        return nn.ConvTranspose2d(dim, dim // 2, 2, stride=2), dim // 2
    if scale == 1.0:
        return nn.Identity(), dim
    if scale == 0.5:
        # ceil_mode: an odd grid keeps its last row/column, as a stride-2 convolution would.
        return nn.MaxPool2d(2, stride=2, ceil_mode=True), dim
    raise ValueError(f"unsupported scale factor {scale}; expected one of {SCALE_FACTORS}")


class ViTDetBackbone(nn.Module):
    """A vitattn ViT as a multi-scale detection backbone:
    ``(B, C, H, W) -> OrderedDict{name: (B, out_channels, H / stride, W / stride)}``.

    The ViT is taken over and adapted in place: it accepts any image size (learned positions are
    resampled on the fly), its classifier head, ``fc_norm`` and attention pool are removed, and
    patch dropout is off; prefix tokens (class, registers) attend but leave no map. Window attention
    is the ViT's own config (``window_size``, ``window_block_indexes``; ViTDet's layout by
    default). Images whose sides are not multiples of the patch are padded at the
    bottom/right (torchvision's transform already pads batches to multiples of 32).

    Args:
        vit: any vitattn ``ViT`` (a preset, ``from_timm``, or one trained here); square patches.
        out_channels: width of every pyramid level (torchvision reads ``backbone.out_channels``).
        scale_factors: branches relative to the ViT's map, a subset of ``(4, 2, 1, 0.5)``,
            finest first; with patch 16 they give strides 4, 8, 16, 32 (with DINOv2's patch 14,
            ``(2, 1, 0.5)`` gives 7, 14, 28, or ``vit.set_input_size(patch_size=16)`` first).
        top_block: add a ``'pool'`` level, max-pooled (kernel 1, stride 2) from the coarsest.
        final_norm: apply the ViT's final LayerNorm to the last block's tokens (it was trained
            with them in classification weights).

    Attributes: ``out_channels``, ``strides`` (``{name: stride}``), ``featmap_names``.
    """

    def __init__(
        self,
        vit: ViT,
        out_channels: int = 256,
        *,
        scale_factors: Sequence[float] = SCALE_FACTORS,
        top_block: bool = True,
        final_norm: bool = True,
    ) -> None:
        super().__init__()
        if not isinstance(vit, ViT):
            raise TypeError(f"ViTDetBackbone takes a vitattn ViT, got {type(vit).__name__}")
        ph, pw = vit.patch_embed.patch_size
        if ph != pw:
            raise ValueError(f"ViTDetBackbone needs square patches to give one stride per level, got {ph}x{pw}")
        scale_factors = tuple(float(s) for s in scale_factors)
        if list(scale_factors) != sorted(scale_factors, reverse=True) or len(set(scale_factors)) != len(scale_factors):
            raise ValueError(f"scale_factors must be distinct and finest first, got {scale_factors}")
        if 4.0 in scale_factors and vit.embed_dim % 4:
            raise ValueError(f"scale factor 4 needs embed_dim divisible by 4, got {vit.embed_dim}")
        vit.dynamic_img_size = True
        vit.config = dataclasses.replace(vit.config, dynamic_img_size=True)
        # Classification-only parts would get no gradient (and trip DDP): the head, the LayerNorm
        # after pooling of avg-pool models and an attention pool (SigLIP's). Detectors bring their
        # own heads. Patch dropout would leave no whole grid for the pyramid: a detector sees every patch.
        vit.reset_classifier(0)
        vit.fc_norm, vit.attn_pool, vit.patch_drop = nn.Identity(), None, nn.Identity()
        self.vit = vit
        self.final_norm = final_norm
        self.out_channels = out_channels
        self.patch_size = ph

        self.branches = nn.ModuleList()
        self.strides: dict[str, int] = OrderedDict()
        for i, scale in enumerate(scale_factors):
            resample, width = _resample_branch(vit.embed_dim, scale)
            self.branches.append(nn.Sequential(
                resample,
                nn.Conv2d(width, out_channels, 1, bias=False), LayerNorm2d(out_channels),
                nn.Conv2d(out_channels, out_channels, 3, padding=1, bias=False), LayerNorm2d(out_channels),
            ))
            stride = ph / scale
            if stride != int(stride):
                raise ValueError(f"patch {ph} with scale factor {scale} gives a fractional stride {stride}")
            self.strides[str(i)] = int(stride)
        self.top_block = top_block
        if top_block:
            self.strides["pool"] = 2 * self.strides[str(len(scale_factors) - 1)]
        self.featmap_names = [k for k in self.strides if k != "pool"]
        self._init_pyramid()

    def _init_pyramid(self) -> None:
        # detectron2's c2_msra_fill for the pyramid convolutions, as ViTDet.
        for m in self.branches.modules():
            if isinstance(m, nn.Conv2d | nn.ConvTranspose2d):
                nn.init.kaiming_normal_(m.weight, mode="fan_out", nonlinearity="relu")
                if m.bias is not None:
                    nn.init.zeros_(m.bias)

    def forward_map(self, x: torch.Tensor) -> torch.Tensor:
        """``(B, C, H, W) -> (B, D, gh, gw)``: the ViT's last map, stride = patch size."""
        p = self.patch_size
        pad_h, pad_w = (-x.shape[-2]) % p, (-x.shape[-1]) % p
        if pad_h or pad_w:
            x = F.pad(x, (0, pad_w, 0, pad_h))
        (y,) = self.vit.forward_intermediates(x, indices=[-1], norm=self.final_norm, output_fmt="NCHW",
                                              intermediates_only=True)
        return y

    def forward(self, x: torch.Tensor) -> OrderedDict[str, torch.Tensor]:
        y = self.forward_map(x)
        out = OrderedDict((name, branch(y)) for name, branch in zip(self.featmap_names, self.branches))
        if self.top_block:
            out["pool"] = F.max_pool2d(out[self.featmap_names[-1]], kernel_size=1, stride=2)
        return out

    # -- weights ----------------------------------------------------------------------------
    def load_vit_weights(
        self, weights: nn.Module | dict[str, torch.Tensor], old_grid: tuple[int, int] | None = None
    ) -> dict[str, list[str]]:
        """Load classification weights into the ViT; the pyramid keeps its initialisation.

        ``weights`` is a vitattn ``ViT``, a timm ``VisionTransformer`` or either's state dict
        (the keys are the same). A position table for another resolution is resampled to this
        ViT's grid (``old_grid`` defaults to the source model's grid, or a square); the
        classifier head (and ``fc_norm``, the norm after pooling, and an attention pool) is dropped.
        Returns ``{'missing', 'unexpected', 'skipped'}``: the skipped keys are those of the head,
        ``fc_norm`` and ``attn_pool``; missing or unexpected keys raise a ``ValueError``.
        """
        if isinstance(weights, nn.Module):
            if old_grid is None and hasattr(weights, "patch_embed"):
                old_grid = tuple(weights.patch_embed.grid_size)
            weights = weights.state_dict()
        dropped = [k for k in weights if k.startswith(("fc_norm.", "attn_pool."))]  # removed in __init__
        report = self.vit.load_weights({k: v for k, v in weights.items() if k not in dropped},
                                       old_grid=old_grid, strict=True)
        report["skipped"] += dropped
        return report


# -- the detectors ----------------------------------------------------------------------------
def _anchor_sizes(kind: str, strides: Sequence[int]) -> tuple[tuple[float, ...], ...]:
    """Anchor sizes per level in torchvision's proportions to the stride."""
    if kind in ("fasterrcnn", "maskrcnn"):  # 32..512 at strides 4..64
        return tuple((8 * s,) for s in strides)
    if kind == "retinanet":  # 32..512 at strides 8..128, three octave scales
        return tuple(tuple(4 * s * 2 ** (k / 3) for k in range(3)) for s in strides)
    return tuple((s,) for s in strides)  # fcos: one point per location, size = stride


def build_detector(
    kind: str,
    vit: ViT | nn.Module,
    num_classes: int,
    *,
    out_channels: int | None = None,
    anchor_sizes: Sequence[Sequence[float]] | None = None,
    **detector_kwargs: Any,
) -> nn.Module:
    """A torchvision detector with a ViTDet backbone, ready to train.

    ``kind`` is one of ``DETECTORS``. ``vit`` is a ViT (wrapped in :class:`ViTDetBackbone` with
    ``out_channels``, default 256) or a backbone already built: a
    ``ViTDetBackbone`` or any module returning an ``OrderedDict`` of maps with ``out_channels``
    and ``strides`` (``{name: stride}``, finest first, ``'pool'`` last as in torchvision's FPN).

    ``num_classes`` is torchvision's: object classes + 1, with labels ``1..num_classes-1`` (0 is
    the background for the R-CNNs and never a target for RetinaNet / FCOS). Anchors follow
    torchvision's size / stride proportions unless ``anchor_sizes`` (one tuple per level) is
    given; RoI poolers read the pyramid's levels. Other keyword arguments go to the detector
    (``min_size``, ``max_size``, ``image_mean``, ``box_detections_per_img``, ...).
    """
    from torchvision.models.detection import FCOS, FasterRCNN, MaskRCNN, RetinaNet
    from torchvision.models.detection.anchor_utils import AnchorGenerator
    from torchvision.ops import MultiScaleRoIAlign

    if kind not in DETECTORS:
        raise ValueError(f"unknown detector {kind!r}; expected one of {DETECTORS}")
    if isinstance(vit, ViT):
        backbone = ViTDetBackbone(vit, out_channels or 256)
    else:
        if out_channels is not None:
            raise ValueError("out_channels belongs to ViTDetBackbone(...); got it with a backbone already built")
        if not (hasattr(vit, "out_channels") and hasattr(vit, "strides")):
            raise ValueError(f"expected a vitattn ViT or a backbone with out_channels and strides, got "
                             f"{type(vit).__name__}")
        backbone = vit
    strides = list(backbone.strides.values())
    sizes = tuple(tuple(s) for s in anchor_sizes) if anchor_sizes is not None else _anchor_sizes(kind, strides)
    if len(sizes) != len(strides):
        raise ValueError(f"{len(sizes)} anchor size tuples for {len(strides)} pyramid levels {list(backbone.strides)}")
    ratios = (1.0,) if kind == "fcos" else (0.5, 1.0, 2.0)
    anchors = AnchorGenerator(sizes, (ratios,) * len(sizes))
    if kind == "fcos":
        if backbone.out_channels % 32:
            raise ValueError(f"FCOS's head normalises with GroupNorm(32, channels): out_channels must be a "
                             f"multiple of 32, got {backbone.out_channels}")
        return FCOS(backbone, num_classes, anchor_generator=anchors, **detector_kwargs)
    if kind == "retinanet":
        return RetinaNet(backbone, num_classes, anchor_generator=anchors, **detector_kwargs)
    names = [k for k in backbone.strides if k != "pool"]
    box_pool = MultiScaleRoIAlign(names, output_size=7, sampling_ratio=2)
    if kind == "fasterrcnn":
        return FasterRCNN(backbone, num_classes, rpn_anchor_generator=anchors, box_roi_pool=box_pool,
                          **detector_kwargs)
    mask_pool = MultiScaleRoIAlign(names, output_size=14, sampling_ratio=2)
    return MaskRCNN(backbone, num_classes, rpn_anchor_generator=anchors, box_roi_pool=box_pool,
                    mask_roi_pool=mask_pool, **detector_kwargs)


# -- mixed precision --------------------------------------------------------------------------
class Float32(nn.Module):
    """``module`` handing fp32 on, whatever autocast is on around it. ``inside=True``: it runs in
    fp32 too (autocast off, floating inputs in tensors, lists, dicts or torchvision's ``ImageList``
    cast to fp32); ``inside=False``: it runs in the surrounding autocast's precision and its
    outputs are cast to fp32. Its parameters, buffers and children are ``module``'s, under the same
    names (a checkpoint loads either way), and so are its other attributes.

    A detector under mixed precision (:func:`fp32_heads`): the training loop runs the whole forward
    pass under autocast; the backbone computes in it, while anchors, box regression and decoding,
    NMS and scoring need fp32 (bf16 keeps 8 significant bits: a coordinate of 1333 px rounds to 8 px)."""

    def __init__(self, module: nn.Module, inside: bool = True) -> None:
        super().__init__()
        object.__setattr__(self, "wrapped", module)  # not a child: its children are this module's own
        object.__setattr__(self, "inside", inside)
        self._parameters, self._buffers, self._modules = module._parameters, module._buffers, module._modules

    def __getattr__(self, name: str):
        try:
            return super().__getattr__(name)
        except AttributeError:
            return getattr(object.__getattribute__(self, "wrapped"), name)

    def train(self, mode: bool = True) -> Float32:
        self.wrapped.training = mode  # the flag torchvision's heads read; the children are shared
        return super().train(mode)

    def forward(self, *args, **kwargs):
        if not self.inside:
            return _to_fp32(self.wrapped(*args, **kwargs))
        with torch.autocast(next(self.parameters()).device.type, enabled=False):
            return self.wrapped(*_to_fp32(args), **_to_fp32(kwargs))


def _to_fp32(x):
    if torch.is_tensor(x):
        return x.float() if x.is_floating_point() else x
    if isinstance(x, (list, tuple)) and not hasattr(x, "_fields"):
        return type(x)(_to_fp32(v) for v in x)
    if isinstance(x, dict):
        return type(x)((k, _to_fp32(v)) for k, v in x.items())
    if type(x).__name__ == "ImageList":  # torchvision's batch of padded images and their sizes
        return type(x)(_to_fp32(x.tensors), x.image_sizes)
    return x


def fp32_heads(detector: nn.Module) -> nn.Module:
    """The detector for mixed precision (:class:`Float32`): its backbone computes in the loop's
    autocast and hands fp32 maps on; its heads (an R-CNN's ``rpn`` and ``roi_heads``, RetinaNet's
    and FCOS's ``head``) run in fp32. Names and weights unchanged. Returns ``detector``."""
    detector.backbone = Float32(detector.backbone, inside=False)
    for name in ("rpn", "roi_heads", "head"):
        if isinstance(getattr(detector, name, None), nn.Module):
            setattr(detector, name, Float32(getattr(detector, name)))
    return detector
