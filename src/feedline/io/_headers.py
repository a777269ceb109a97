"""What an encoded image declares about itself, read before anything is allocated for it.

A few hundred bytes can declare a picture of billions of pixels (a decompression bomb: a
389 KB TIFF of 20,000 x 20,000 pixels), and a flipped length byte can make a decoder allocate
for data that is not there. The decoders would allocate first and fail later; these functions
read the declared size of every format OpenCV decodes (JPEG's comes from libjpeg-turbo) and
check a PNG's chunk lengths against the bytes there, so that
:func:`~feedline.io.decode_image` refuses such input before it decodes.
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
    """``(height, width)`` that an image's header declares; ``None``: no format known here.

    Reads PNG, WebP, BMP, GIF, TIFF (and BigTIFF), the Netpbm family (PBM, PGM, PPM, PAM,
    PFM), Radiance HDR, Sun raster, JPEG 2000 and AVIF (its largest declared picture).

    Raises:
        ValueError: The header of a recognised format is cut short or garbled.

    """
    head = raw[:32].tobytes()
    try:
        if head.startswith(_PNG_MAGIC):
            width, height = struct.unpack(">II", head[16:24])
            return height, width
        if head[:4] == b"RIFF" and head[8:12] == b"WEBP":
            return _webp_size(head)
        if head[:2] == b"BM":
            if struct.unpack("<I", head[14:18])[0] == 12:  # OS/2: 16-bit sizes
                width, height = struct.unpack("<HH", head[18:22])
            else:
                width, height = struct.unpack("<ii", head[18:26])
            return abs(height), abs(width)
        if head[:6] in (b"GIF87a", b"GIF89a"):
            width, height = struct.unpack("<HH", head[6:10])
            return height, width
        if head[:4] in (b"II*\x00", b"MM\x00*", b"II+\x00", b"MM\x00+"):
            return _tiff_size(raw, "<" if head[0] == 0x49 else ">")
        if head[:1] == b"P" and head[1:2] in b"1234567Ff" and head[1:2]:
            return _netpbm_size(raw[:_TEXT_HEADER].tobytes())
        if head.startswith((b"#?RADIANCE", b"#?RGBE")):
            return _radiance_size(raw[:_TEXT_HEADER].tobytes())
        if head[:4] == b"\x59\xa6\x6a\x95":  # Sun raster
            width, height = struct.unpack(">II", head[4:12])
            return height, width
        if head[:4] == b"\xff\x4f\xff\x51":  # a JPEG 2000 codestream: its SIZ marker
            x, y, x0, y0 = struct.unpack(">IIII", head[8:24])
            return max(y - y0, 0), max(x - x0, 0)
        if head[:12] == b"\x00\x00\x00\x0cjP  \r\n\x87\n":  # a JP2 file: its ihdr box
            return _box_size(raw[:_BOX_HEADER].tobytes(), b"ihdr", ">II", flipped=False)
        if head[4:8] == b"ftyp" and b"avi" in head[8:32]:  # AVIF: each ispe property
            return _box_size(raw[:_BOX_HEADER].tobytes(), b"ispe", ">4xII", flipped=True)
    except (struct.error, IndexError, KeyError, ValueError) as error:
        raise ValueError(
            f"the image header is cut short or garbled ({raw.size} bytes): {error!r}"
        ) from None
    return None


_TEXT_HEADER = 4096
"""Bytes of a text header (Netpbm, Radiance) read for its size: comments included."""

_BOX_HEADER = 1 << 16
"""Bytes of a JPEG 2000 or AVIF file searched for the box that declares its size."""

_MOST_IFD_ENTRIES = 4096


def _tiff_size(raw: np.ndarray[Any, Any], order: str) -> tuple[int, int]:
    # The first directory's ImageWidth (256) and ImageLength (257): the page OpenCV decodes.
    def read(fmt: str, at: int) -> tuple[int, ...]:
        size = struct.calcsize(order + fmt)
        return struct.unpack(order + fmt, raw[at : at + size].tobytes())

    big = read("H", 2)[0] == 43
    offset = read("8xQ" if big else "4xI", 0)[0]
    count = read("Q" if big else "H", offset)[0]
    entry, start = (20, offset + 8) if big else (12, offset + 2)
    found: dict[int, int] = {}
    for k in range(min(count, _MOST_IFD_ENTRIES)):
        tag, kind = read("HH", start + k * entry)
        if tag in (256, 257):
            value = start + k * entry + (12 if big else 8)
            fmt = {3: "H", 4: "I", 16: "Q"}.get(kind)
            if fmt is None:
                raise struct.error
            found[tag] = read(fmt, value)[0]
        if len(found) == 2:
            return found[257], found[256]
    raise ValueError("the TIFF declares no ImageWidth and ImageLength in its first directory")


def _netpbm_size(head: bytes) -> tuple[int, int]:
    # P1-P6 and PFM: the magic, then width and height as text (``#`` comments between).
    # PAM (P7): WIDTH and HEIGHT lines.
    if head[1:2] == b"7":
        fields = dict(
            line.split(None, 1) for line in head.splitlines()[1:] if len(line.split()) == 2
        )
        return int(fields[b"HEIGHT"]), int(fields[b"WIDTH"])
    words = [w for line in head[2:].splitlines() for w in line.split(b"#", 1)[0].split()]
    return int(words[1]), int(words[0])


def _radiance_size(head: bytes) -> tuple[int, int]:
    # Lines of settings up to an empty one, then the resolution: "-Y 480 +X 640" (or another
    # orientation of the two axes).
    lines = head.split(b"\n")
    line = lines[lines.index(b"", 1) + 1].split()
    sizes = {line[0][1:2]: int(line[1]), line[2][1:2]: int(line[3])}
    return sizes[b"Y"], sizes[b"X"]


def _box_size(head: bytes, kind: bytes, fmt: str, flipped: bool) -> tuple[int, int]:
    # The largest size that any ``kind`` box declares (two 32-bit numbers after its type):
    # the picture, or one of its parts, none of which may pass the limit.
    sizes = []
    at = head.find(kind)
    while at >= 4:
        a, b = struct.unpack(fmt, head[at + 4 : at + 4 + struct.calcsize(fmt)])
        sizes.append((b, a) if flipped else (a, b))
        at = head.find(kind, at + 4)
    if not sizes:
        raise ValueError(f"the image declares no size (no {kind.decode()} box)")
    return max(sizes, key=lambda hw: hw[0] * hw[1])


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
