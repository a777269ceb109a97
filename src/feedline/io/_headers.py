"""What an encoded image declares about itself, read before anything is allocated for it.

A few hundred bytes can declare a picture of billions of pixels (a decompression bomb), and a
flipped length byte can make a decoder allocate for data that is not there. The decoders would
allocate first and fail later; these functions read the declared size (PNG, WebP, BMP, GIF;
JPEG's comes from libjpeg-turbo) and check a PNG's chunk lengths against the bytes there, so
that :func:`~feedline.io.decode_image` refuses such input before it decodes.
"""

from __future__ import annotations

import struct
from typing import Any

import numpy as np

__all__ = ["MAX_IMAGE_PIXELS", "check_pixels", "check_png_chunks", "declared_size"]

MAX_IMAGE_PIXELS = 89_478_485
"""The default limit on a decoded picture's pixels: Pillow's (a quarter of a GiB of 3-byte
pixels). ``decode_image(..., max_pixels=None)`` lifts it."""

_PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def declared_size(raw: np.ndarray[Any, Any]) -> tuple[int, int] | None:
    """``(height, width)`` from the header of a PNG, WebP, BMP or GIF; ``None`` otherwise.

    Raises:
        ValueError: The header of a recognised format is cut short.

    """
    head = raw[:32].tobytes()
    try:
        if head.startswith(_PNG_MAGIC):
            width, height = struct.unpack(">II", head[16:24])
            return height, width
        if head[:4] == b"RIFF" and head[8:12] == b"WEBP":
            return _webp_size(head)
        if head[:2] == b"BM":
            width, height = struct.unpack("<ii", head[18:26])
            return abs(height), abs(width)
        if head[:6] in (b"GIF87a", b"GIF89a"):
            width, height = struct.unpack("<HH", head[6:10])
            return height, width
    except struct.error:
        raise ValueError(f"the image header is cut short ({raw.size} bytes)") from None
    return None


def _webp_size(head: bytes) -> tuple[int, int] | None:
    chunk = head[12:16]
    if chunk == b"VP8X":  # extended: 24-bit canvas sizes minus one
        width = int.from_bytes(head[24:27], "little") + 1
        height = int.from_bytes(head[27:30], "little") + 1
        if len(head) < 30:
            raise struct.error
        return height, width
    if chunk == b"VP8L":  # lossless: 14-bit sizes minus one after the signature byte
        (bits,) = struct.unpack("<I", head[21:25])
        return ((bits >> 14) & 0x3FFF) + 1, (bits & 0x3FFF) + 1
    if chunk == b"VP8 ":  # lossy: 14-bit sizes after the frame tag and start code
        width, height = struct.unpack("<HH", head[26:30])
        return height & 0x3FFF, width & 0x3FFF
    return None


def check_pixels(height: int, width: int, max_pixels: int | None) -> None:
    """Refuse a picture of more than ``max_pixels`` pixels (``None``: no limit)."""
    if max_pixels is not None and height * width > max_pixels:
        raise ValueError(
            f"the image declares {height}x{width} = {height * width:,} pixels, more than the "
            f"limit of {max_pixels:,} (max_pixels=; Pillow's MAX_IMAGE_PIXELS by default): a "
            "decompression bomb or a corrupt header. Pass a larger max_pixels, or None, to "
            "decode it anyway"
        )


def check_png_chunks(raw: np.ndarray[Any, Any]) -> None:
    """Check that every chunk of a PNG lies within its bytes, up to ``IEND``.

    A chunk whose length points past the end of the data (a flipped length byte) makes
    libpng allocate for it before it finds the data missing.

    Raises:
        ValueError: A chunk runs past the end of the data.

    """
    size, at = int(raw.size), len(_PNG_MAGIC)
    while at + 8 <= size:
        head = raw[at : at + 8].tobytes()
        length, kind = int.from_bytes(head[:4], "big"), head[4:]
        end = at + 12 + length
        if length > 0x7FFFFFFF or end > size:
            raise ValueError(
                f"corrupt PNG: chunk {kind!r} at byte {at} declares {length:,} bytes, past the "
                f"end of the {size:,} bytes there"
            )
        if kind == b"IEND":
            return
        at = end
