"""Patches as tokens: an image is cut into a grid of fixed patches, each flattened into a word.

Shapes: images ``B C H W``; patch grid ``gh gw``; tokens ``B N D`` with ``N = gh * gw``.

References: Dosovitskiy et al. 2021, "An Image is Worth 16x16 Words" (ViT); MAE's
``patchify`` / ``unpatchify`` pair (He et al. 2022).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from einops import rearrange, repeat
from torch import nn

from .helpers import Size2, check_input_dtype, is_tracing, to_2tuple

# torch.fx (torchvision's create_feature_extractor) records these as calls instead of tracing into
# them: einops and the input checks read shapes, which are proxies while tracing
for _leaf in ("rearrange", "repeat", "check_image", "check_input_dtype", "pad_to_patches", "shift_diagonally"):
    torch.fx.wrap(_leaf)


def check_image(x: torch.Tensor, patch_size: Size2, in_chans: int | None = None) -> None:
    """Raise a ``ValueError`` saying what was expected and what came."""
    if x.ndim != 4:
        raise ValueError(
            f"expected a 4-D image batch (B, C, H, W), got a {x.ndim}-D tensor of shape {tuple(x.shape)}"
        )
    if in_chans is not None and x.shape[1] != in_chans:
        raise ValueError(f"expected {in_chans} input channels, got {x.shape[1]} (shape {tuple(x.shape)})")
    for name, size, p in (("height", x.shape[2], patch_size[0]), ("width", x.shape[3], patch_size[1])):
        if size % p:
            raise ValueError(f"image {name} {size} is not divisible by patch size {p}")


def pad_to_patches(x: torch.Tensor, patch_size: Size2) -> torch.Tensor:
    """Pad the bottom and right edges of images ``(B, C, H, W)`` up to multiples of the patch."""
    pad_h, pad_w = (-x.shape[-2]) % patch_size[0], (-x.shape[-1]) % patch_size[1]
    return F.pad(x, (0, pad_w, 0, pad_h)) if pad_h or pad_w else x


def patchify(images: torch.Tensor, patch_size: int | Size2) -> torch.Tensor:
    """``(B, C, H, W) -> (B, N, C*p1*p2)``, patches in row-major grid order.

    Each patch is flattened channel-first, ``(c p1 p2)``, which is exactly the layout of a
    ``Conv2d(C, D, kernel=stride=patch)`` weight, so ``patchify(x) @ w.flatten(1).T`` equals the
    convolution. Pure: the input is not modified.
    """
    p1, p2 = to_2tuple(patch_size)
    check_image(images, (p1, p2))
    return rearrange(images, "b c (gh p1) (gw p2) -> b (gh gw) (c p1 p2)", p1=p1, p2=p2)


def unpatchify(
    patches: torch.Tensor, grid: Size2, patch_size: int | Size2, in_chans: int = 3
) -> torch.Tensor:
    """``(B, N, C*p1*p2) -> (B, C, H, W)``: the exact inverse of :func:`patchify`."""
    p1, p2 = to_2tuple(patch_size)
    gh, gw = grid
    if patches.ndim != 3 or patches.shape[1] != gh * gw or patches.shape[2] != in_chans * p1 * p2:
        raise ValueError(
            f"expected patches of shape (B, {gh * gw}, {in_chans * p1 * p2}) for grid {grid}, "
            f"patch {(p1, p2)} and {in_chans} channels, got {tuple(patches.shape)}"
        )
    return rearrange(patches, "b (gh gw) (c p1 p2) -> b c (gh p1) (gw p2)", gh=gh, gw=gw, p1=p1, p2=p2)


def resample_patch_weight(weight: torch.Tensor, patch_size: Size2) -> torch.Tensor:
    """A patch projection ``(D, C, p1, p2)`` for patches of another size: FlexiViT's rule, the
    kernel ``w'`` with ``<resize(x), w'> = <x, w>`` for every patch ``x``, i.e. ``w`` times the
    pseudo-inverse of the bicubic resize written as a matrix (timm's ``resample_patch_embed``).

    References: Beyer et al. 2023, "FlexiViT".
    """
    (h, w), new = weight.shape[-2:], tuple(patch_size)
    if (h, w) == new:
        return weight
    basis = rearrange(torch.eye(h * w, device=weight.device), "k (h w) -> k 1 h w", h=h)
    resize = rearrange(F.interpolate(basis, size=new, mode="bicubic", antialias=True, align_corners=False),
                       "k 1 h w -> (h w) k")  # (new pixels, old pixels)
    out = rearrange(weight.float(), "d c h w -> d c (h w)") @ torch.linalg.pinv(resize)
    return rearrange(out, "d c (h w) -> d c h w", h=new[0]).to(weight.dtype)


class PatchEmbed(nn.Module):
    """``(B, C, H, W) -> (B, N, D)`` plus the grid ``(gh, gw)``.

    The projection is stored as ``proj``, a ``Conv2d`` with kernel = stride = patch, so timm's
    ``patch_embed.proj.weight`` loads unchanged. Two paths compute it and a test holds them equal:
    the convolution (``fast=True``, the default: one kernel, and the layout timm's weights load
    into) and the readable ``patchify`` + matrix product (docs/performance.md compares them).

    Args:
        img_size: nominal input size; only used to size learned position tables.
        patch_size: patch height and width (a pair for non-square patches).
        in_chans: input channels.
        embed_dim: token width ``D``.
        dynamic_img_pad: pad the right/bottom edges up to a multiple of the patch instead of
            raising on sizes that do not divide.
        bias: bias in the projection.
    """

    def __init__(
        self,
        img_size: int | Size2 = 224,
        patch_size: int | Size2 = 16,
        in_chans: int = 3,
        embed_dim: int = 768,
        *,
        dynamic_img_pad: bool = False,
        bias: bool = True,
    ) -> None:
        super().__init__()
        self.img_size = to_2tuple(img_size)
        self.patch_size = to_2tuple(patch_size)
        self.in_chans = in_chans
        self.embed_dim = embed_dim
        self.dynamic_img_pad = dynamic_img_pad
        self.grid_size = self.grid_for(self.img_size)
        self.num_patches = self.grid_size[0] * self.grid_size[1]
        self.proj = nn.Conv2d(in_chans, embed_dim, kernel_size=self.patch_size, stride=self.patch_size, bias=bias)

    def set_input_size(self, img_size: Size2, patch_size: Size2) -> None:
        """Take images of ``img_size`` in patches of ``patch_size``: a new patch's projection is
        the old one resampled (:func:`resample_patch_weight`)."""
        if tuple(patch_size) != self.patch_size:
            old = self.proj
            self.proj = nn.Conv2d(self.in_chans, self.embed_dim, kernel_size=patch_size, stride=patch_size,
                                  bias=old.bias is not None, device=old.weight.device, dtype=old.weight.dtype)
            with torch.no_grad():
                self.proj.weight.copy_(resample_patch_weight(old.weight, patch_size))
                if old.bias is not None:
                    self.proj.bias.copy_(old.bias)
            self.proj.requires_grad_(old.weight.requires_grad).train(old.training)
            self.patch_size = tuple(patch_size)
        self.img_size = tuple(img_size)
        self.grid_size = self.grid_for(self.img_size)
        self.num_patches = self.grid_size[0] * self.grid_size[1]

    def grid_for(self, img_size: Size2) -> Size2:
        """The patch grid an image of ``img_size`` gives (rounded up when padding is on)."""
        (h, w), (p1, p2) = img_size, self.patch_size
        if self.dynamic_img_pad:
            return (-(-h // p1), -(-w // p2))
        return (h // p1, w // p2)

    def prepare(self, x: torch.Tensor) -> tuple[torch.Tensor, Size2]:
        """Images padded (with ``dynamic_img_pad``) and checked, and their patch grid."""
        if self.dynamic_img_pad:
            x = pad_to_patches(x, self.patch_size)
        check_image(x, self.patch_size, self.in_chans)
        check_input_dtype(x, self.proj.weight)
        grid = self.grid_size if is_tracing() else (x.shape[2] // self.patch_size[0], x.shape[3] // self.patch_size[1])
        return x, grid

    def forward(self, x: torch.Tensor, fast: bool = True) -> tuple[torch.Tensor, Size2]:
        x, grid = self.prepare(x)
        if fast:
            x = rearrange(self.proj(x), "b d gh gw -> b (gh gw) d")
        else:
            x = F.linear(patchify(x, self.patch_size), self.proj.weight.flatten(1), self.proj.bias)
        return x, grid


def shift_diagonally(images: torch.Tensor, shift: Size2) -> torch.Tensor:
    """``(B, C, H, W) -> (B, 5C, H, W)``: the images and four copies moved by ``shift`` pixels
    towards each corner (zeros come in at the border), stacked on the channel axis."""
    sy, sx = shift
    copies = [images]
    for dy, dx in ((-sy, -sx), (-sy, sx), (sy, -sx), (sy, sx)):
        # pad on one side, crop the other: content moves by (dy, dx)
        padded = F.pad(images, (max(dx, 0), max(-dx, 0), max(dy, 0), max(-dy, 0)))
        h, w = images.shape[-2:]
        copies.append(padded[..., max(-dy, 0): max(-dy, 0) + h, max(-dx, 0): max(-dx, 0) + w])
    return torch.cat(copies, dim=1)


class ShiftedPatchEmbed(PatchEmbed):
    """Shifted patch tokenisation (SPT): ``(B, C, H, W) -> (B, N, D)`` plus the grid.

    Each patch also sees half a patch beyond its edges: the image and four copies shifted by half
    a patch towards the corners are cut into the same patches, and each (5 x C x p1 x p2) patch is
    layer-normed and projected (``proj``, a linear layer). A 4-px patch of a 32-px image then
    carries the context a token would otherwise need attention to fetch.

    References: Lee, Lee and Song 2021, "Vision Transformer for Small-Size Datasets".
    """

    def __init__(self, img_size: int | Size2 = 224, patch_size: int | Size2 = 16, in_chans: int = 3,
                 embed_dim: int = 768, *, dynamic_img_pad: bool = False, bias: bool = True) -> None:
        nn.Module.__init__(self)  # PatchEmbed's sizes, without its convolution
        self.img_size, self.patch_size = to_2tuple(img_size), to_2tuple(patch_size)
        self.in_chans, self.embed_dim, self.dynamic_img_pad = in_chans, embed_dim, dynamic_img_pad
        self.grid_size = self.grid_for(self.img_size)
        self.num_patches = self.grid_size[0] * self.grid_size[1]
        patch_dim = 5 * in_chans * self.patch_size[0] * self.patch_size[1]
        self.norm = nn.LayerNorm(patch_dim, eps=1e-6)
        self.proj = nn.Linear(patch_dim, embed_dim, bias=bias)

    def set_input_size(self, img_size: Size2, patch_size: Size2) -> None:
        if tuple(patch_size) != self.patch_size:
            raise ValueError("shifted patches project a fixed patch width: their patch size cannot change")
        super().set_input_size(img_size, patch_size)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, Size2]:
        x, grid = self.prepare(x)
        p1, p2 = self.patch_size
        x = shift_diagonally(x, (max(p1 // 2, 1), max(p2 // 2, 1)))
        return self.proj(self.norm(patchify(x, self.patch_size))), grid


class PatchDropout(nn.Module):
    """In training, keep a random ``1 - prob`` of each image's patch tokens (at least one) and all
    its prefix tokens: ``(B, P + N, D) -> (B, P + K, D)``; in eval the identity. Fewer tokens make
    a step cheaper and act as a regulariser (timm's ``patch_drop_rate``; its draw, so a seeded
    run keeps the same tokens as timm's).

    References: Liu et al. 2022, "PatchDropout"; Li et al. 2023, FLIP.
    """

    def __init__(self, prob: float, num_prefix_tokens: int) -> None:
        super().__init__()
        if not 0.0 <= prob < 1.0:
            raise ValueError(f"patch_drop_rate must be in [0, 1), got {prob}")
        self.prob, self.num_prefix_tokens = prob, num_prefix_tokens

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.training or self.prob == 0.0:
            return x
        prefix, patches = x[:, :self.num_prefix_tokens], x[:, self.num_prefix_tokens:]
        b, n = patches.shape[:2]
        keep = torch.randn(b, n, device=x.device).argsort(dim=-1)[:, :max(1, int(n * (1.0 - self.prob)))]
        patches = patches.gather(1, repeat(keep, "b k -> b k d", d=patches.shape[-1]))
        return torch.cat([prefix, patches], dim=1)

    def extra_repr(self) -> str:
        return f"prob={self.prob}"
