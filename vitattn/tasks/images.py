"""Reading one image file the way every task reads it."""

from __future__ import annotations

import io
import os

from ..training.errors import DataError

IMAGE_SUFFIXES = (".png", ".jpg", ".jpeg", ".bmp", ".webp")


def read_image(source: str | os.PathLike | io.BytesIO, name: str | None = None):
    """One image as an 8-bit RGB ``PIL.Image``, the way both training scripts read images: turned
    upright by its EXIF orientation, palette, grey, CMYK and alpha converted to RGB; 16- or
    32-bit samples, which converting would clip to 255, refused. A file that will not decode, or
    a decompression bomb, raises a ``DataError`` naming it (``name``, or the path)."""
    from PIL import Image, ImageOps, UnidentifiedImageError

    name = name or str(source)
    try:
        with Image.open(source) as im:
            if im.mode.startswith(("I", "F")):
                raise DataError(f"image {name} has {im.mode} samples; expected 8-bit images (RGB, grey or palette)")
            return ImageOps.exif_transpose(im).convert("RGB")
    except Image.DecompressionBombError as e:
        raise DataError(f"image {name} is refused: {e}") from e
    except (UnidentifiedImageError, OSError, ValueError, SyntaxError) as e:
        raise DataError(f"corrupt or unreadable image {name}: {e}") from e
