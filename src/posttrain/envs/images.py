"""PNG encoding for environment renders (CAD views, scene layouts): pixels in, `ImagePart` out.
Headless (Pillow only); does not draw anything itself."""

from __future__ import annotations

import io

import numpy as np

from posttrain.types import ImagePart


def encode_png(pixels: np.ndarray) -> bytes:
    """PNG bytes of an `HxW` (grey) or `HxWx3`/`HxWx4` uint8 array."""
    from PIL import Image

    arr = np.asarray(pixels)
    if arr.dtype != np.uint8 or arr.ndim not in (2, 3) or (arr.ndim == 3 and arr.shape[2] not in (3, 4)):
        raise ValueError(f"expected an HxW, HxWx3 or HxWx4 uint8 array, got {arr.dtype} {arr.shape}")
    buf = io.BytesIO()
    Image.fromarray(arr).save(buf, format="PNG", optimize=False)
    return buf.getvalue()


def image_part(pixels: np.ndarray, description: str) -> ImagePart:
    return ImagePart(encode_png(pixels), description)
