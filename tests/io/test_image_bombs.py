"""Tiny files that declare huge pictures, or lie about their lengths, are refused before any
allocation: a ValueError naming the limit, and bounded memory."""

from __future__ import annotations

import struct
import subprocess
import sys
import textwrap
import zlib

import numpy as np
import pytest

cv2 = pytest.importorskip("cv2")
simplejpeg = pytest.importorskip("simplejpeg")

from feedline.io import MAX_IMAGE_PIXELS, decode_image, image_size  # noqa: E402

from .._system import starts_processes  # noqa: E402


def _noise(h: int, w: int) -> np.ndarray:
    return np.random.default_rng(0).integers(0, 256, (h, w, 3), dtype=np.uint8)


def jpeg_declaring(height: int, width: int) -> bytes:
    data = bytearray(simplejpeg.encode_jpeg(_noise(16, 16), quality=80))
    sof = data.index(b"\xff\xc0")
    data[sof + 5 : sof + 9] = struct.pack(">HH", height, width)
    return bytes(data)


def png(h: int = 64, w: int = 64) -> bytes:
    ok, encoded = cv2.imencode(".png", _noise(h, w))
    assert ok
    return encoded.tobytes()


def png_declaring(height: int, width: int) -> bytes:
    data = bytearray(png(8, 8))
    data[16:24] = struct.pack(">II", width, height)
    data[29:33] = struct.pack(">I", zlib.crc32(bytes(data[12:29])))  # a valid IHDR
    return bytes(data)


def png_with_flipped_length() -> bytes:
    data = bytearray(png())
    idat = data.index(b"IDAT") - 4
    data[idat] ^= 0x40  # the high byte of IDAT's length: a gigabyte more than there is
    return bytes(data)


def webp_declaring(height: int, width: int) -> bytes:
    payload = b"VP8X" + struct.pack("<I", 10) + b"\x00" * 4
    payload += (width - 1).to_bytes(3, "little") + (height - 1).to_bytes(3, "little")
    payload += b"\x00" * 4  # 34 bytes in all, like the campaign's
    return b"RIFF" + struct.pack("<I", 4 + len(payload)) + b"WEBP" + payload


def encoded(ext: str, h: int = 20, w: int = 30) -> bytes:
    """A picture of ``h`` x ``w`` in the format OpenCV writes for ``ext``."""
    picture: np.ndarray = _noise(h, w)
    if ext in (".pfm", ".hdr"):
        picture = picture.astype(np.float32) / 255
    elif ext in (".pgm", ".pbm"):
        picture = picture[..., 0]
    ok, data = cv2.imencode(ext, picture)
    assert ok
    return data.tobytes()


def tiff_declaring(height: int, width: int) -> bytes:
    # OpenCV's small TIFF, its first directory's width and length (LONG or SHORT) made large.
    data = bytearray(encoded(".tiff"))
    offset = struct.unpack("<I", data[4:8])[0]
    (count,) = struct.unpack("<H", data[offset : offset + 2])
    for k in range(count):
        at = offset + 2 + 12 * k
        (tag,) = struct.unpack("<H", data[at : at + 2])
        if tag in (256, 257):
            value = width if tag == 256 else height
            data[at + 2 : at + 12] = struct.pack("<HII", 4, 1, value)
    return bytes(data)


def sun_raster_declaring(height: int, width: int) -> bytes:
    data = bytearray(encoded(".ras"))
    data[4:12] = struct.pack(">II", width, height)
    return bytes(data)


def box_declaring(ext: str, box: bytes, height: int, width: int) -> bytes:
    # JPEG 2000's ihdr (height, width) or AVIF's ispe (width, height), made large.
    data = bytearray(encoded(ext, 64, 64))
    at = data.index(box) + 4 + (4 if box == b"ispe" else 0)
    sizes = (height, width) if box == b"ihdr" else (width, height)
    data[at : at + 8] = struct.pack(">II", *sizes)
    return bytes(data)


BOMBS = {
    "jpeg 20000x20000": lambda: jpeg_declaring(20000, 20000),
    "jpeg 65500x65500": lambda: jpeg_declaring(65500, 65500),
    "png 30000x30000": lambda: png_declaring(30000, 30000),
    "webp 16384x16384": lambda: webp_declaring(16384, 16384),
    "tiff 20000x20000": lambda: tiff_declaring(20000, 20000),
    "ppm 20000x20000": lambda: b"P6\n# made by hand\n20000 20000\n255\n" + bytes(3000),
    "pam 20000x20000": lambda: (
        b"P7\nWIDTH 20000\nHEIGHT 20000\nDEPTH 3\nMAXVAL 255\nTUPLTYPE RGB\nENDHDR\n" + bytes(3000)
    ),
    "pfm 20000x20000": lambda: b"PF\n20000 20000\n-1\n" + bytes(3000),
    "hdr 20000x20000": lambda: (
        b"#?RADIANCE\nFORMAT=32-bit_rle_rgbe\n\n-Y 20000 +X 20000\n" + bytes(3000)
    ),
    "sun raster 20000x20000": lambda: sun_raster_declaring(20000, 20000),
    "jp2 20000x20000": lambda: box_declaring(".jp2", b"ihdr", 20000, 20000),
    "avif 20000x20000": lambda: box_declaring(".avif", b"ispe", 20000, 20000),
}


@pytest.mark.parametrize("name", sorted(BOMBS))
def test_a_picture_over_the_pixel_limit_is_refused_naming_it(name: str) -> None:
    data = BOMBS[name]()
    assert len(data) < 16384
    with pytest.raises(ValueError, match=f"limit of {MAX_IMAGE_PIXELS:,}"):
        decode_image(data)
    with pytest.raises(ValueError, match="max_pixels"):
        decode_image(data, size=(224, 224))


def test_the_limit_is_pillows_and_can_be_set_or_lifted() -> None:
    from PIL import Image

    assert MAX_IMAGE_PIXELS == Image.MAX_IMAGE_PIXELS
    data = png(100, 100)
    with pytest.raises(ValueError, match="limit of 5,000"):
        decode_image(data, max_pixels=5000)
    assert decode_image(data, max_pixels=None).shape == (100, 100, 3)
    assert decode_image(data, max_pixels=10_000).shape == (100, 100, 3)
    with pytest.raises(ValueError, match="max_pixels must be"):
        decode_image(data, max_pixels=0)


def test_a_png_chunk_longer_than_the_data_is_refused() -> None:
    with pytest.raises(ValueError, match=r"chunk b'IDAT'.*past the end"):
        decode_image(png_with_flipped_length())


FORMATS = [".tiff", ".ppm", ".pgm", ".pbm", ".pam", ".pfm", ".hdr", ".ras", ".avif", ".gif"]


@pytest.mark.parametrize("ext", FORMATS)
def test_every_format_opencv_decodes_is_held_to_the_limit_by_its_header(ext: str) -> None:
    data = encoded(ext)
    assert image_size(data) == (20, 30)  # read from the header
    assert decode_image(data).shape[:2] == (20, 30)
    with pytest.raises(ValueError, match="limit of 599"):
        decode_image(data, max_pixels=599)


def test_jpeg_2000_files_and_codestreams_are_held_to_the_limit() -> None:
    from PIL import Image

    picture = Image.fromarray(_noise(20, 30))
    for jp2 in (True, False):
        buffer = __import__("io").BytesIO()
        picture.save(buffer, "JPEG2000", no_jp2=not jp2)
        assert image_size(buffer.getvalue()) == (20, 30)
        with pytest.raises(ValueError, match="limit of 599"):
            decode_image(buffer.getvalue(), max_pixels=599)


def test_a_format_whose_size_is_not_read_is_refused_unless_the_limit_is_lifted() -> None:
    data = b"\x76\x2f\x31\x01" + bytes(60)  # OpenEXR's magic: OpenCV here does not decode it
    with pytest.raises(ValueError, match=r"not recognised.*max_pixels=None"):
        decode_image(data)
    with pytest.raises(ValueError, match="could not decode"):  # OpenCV's own refusal
        decode_image(data, max_pixels=None)


def test_an_os2_bitmap_header_is_read_as_16_bit_sizes() -> None:
    # BITMAPCOREHEADER (12 bytes): 16-bit width and height, 24-bit pixels in rows of 4 bytes.
    width, height = 4, 2
    pixels = bytes(range(24))
    header = struct.pack("<IHHHH", 12, width, height, 1, 24)
    data = b"BM" + struct.pack("<IHHI", 26 + len(pixels), 0, 0, 26) + header + pixels
    assert image_size(data) == (2, 4)
    assert decode_image(data).shape == (2, 4, 3)


def test_image_size_reads_headers_without_decoding() -> None:
    assert image_size(png_declaring(30000, 20000)) == (30000, 20000)
    assert image_size(webp_declaring(16384, 100)) == (16384, 100)
    _, bmp = cv2.imencode(".bmp", _noise(7, 9))
    assert image_size(bmp.tobytes()) == (7, 9)


@starts_processes
def test_every_bomb_costs_little_memory() -> None:
    # In a fresh process: the peak resident size, after a normal decode warmed everything up,
    # grows by less than 300 MB over all the bombs (it grew by up to 12 GB before the limit).
    script = textwrap.dedent(
        f"""
        import resource, sys
        sys.path.insert(0, {str(__import__("pathlib").Path(__file__).parents[2])!r})
        from tests.io import test_image_bombs as t
        from feedline.io import decode_image
        decode_image(t.png(256, 256), size=(224, 224))
        decode_image(t.jpeg_declaring(16, 16), size=(8, 8))
        bombs = [make() for make in t.BOMBS.values()] + [t.png_with_flipped_length()]
        before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        for data in bombs:
            for size in (None, (224, 224)):
                try:
                    decode_image(data, size=size)
                except ValueError:
                    pass
                else:
                    raise SystemExit("decoded a bomb")
        grown = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before
        print(grown)
        """
    )
    done = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=120, check=False
    )
    assert done.returncode == 0, done.stderr
    grown_kib = int(done.stdout.split()[-1])
    assert grown_kib < 300 * 1024, f"peak memory grew by {grown_kib / 1024:.0f} MiB"
