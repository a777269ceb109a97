"""Decode image bytes to HWC uint8 arrays, resized, straight into a slot of a batch buffer.

JPEG goes through libjpeg-turbo (``simplejpeg``); PNG, WebP, BMP and what else OpenCV reads go
through ``cv2.imdecode``; resizing is ``cv2.resize``. All three release the GIL while they work,
so a pipeline stage that calls :func:`decode_image` scales with threads.

Two modes, chosen by measurement (see ``feedline bench images`` and the package README):

* ``"fast"`` (default): when the target is at most half the source on both sides, libjpeg-turbo
  decodes at a reduced DCT scale (1/2, 1/4 or 1/8: only powers of two, since the other factors
  cost more than a full decode on ImageNet-sized pictures), so no full-size array is ever made.
  When the picture is then shrunk by 1.5x or more, libjpeg-turbo's fast integer IDCT and plain
  chroma upsampling are used too (about 0.15 ms less per ImageNet picture; the shrink averages
  their small errors away). The antialiasing filter is the cheaper box (below).
* ``"exact"``: a full-size, full-precision decode, then the exact antialiasing filter below.
  It is the reference the fast mode is measured against (see the tests and ``feedline bench
  decode``).

Resizing is bilinear with antialiasing (``antialias=False`` turns it off). A bilinear sample
alone averages only the two nearest source pixels, so a shrink by ``r`` aliases; Pillow filters
with a triangle of half-width ``r`` instead. Here each axis shrunk by 1.2x or more is first
filtered so that filter plus bilinear sample spread a pixel about as far as Pillow's triangle
(see :func:`_prefilter`): in ``"exact"`` mode with a kernel of exactly the missing variance
(about 45 dB from Pillow's ``resize`` on ImageNet-like pictures); in ``"fast"`` mode with the
nearest odd box (OpenCV's ``blur``, a running sum: about 0.1 ms cheaper, about 39 dB). A plain
bilinear ``cv2.resize`` is 29 dB. EXIF orientation is ignored, as Pillow's ``Image.open`` does.
"""

from __future__ import annotations

import contextlib
import functools
import math
import os
from collections.abc import Iterator
from typing import Any, Literal

import numpy as np

from feedline.errors import ConfigurationError

from ._headers import MAX_IMAGE_PIXELS, check_pixels, check_png_chunks, declared_size
from .arrays import Buffer

__all__ = ["decode_image", "image_size"]

ImageMode = Literal["fast", "exact"]
_MODES = ("fast", "exact")
_JPEG_MAGIC = b"\xff\xd8\xff"
_INSTALL_HINT = "decode_image needs simplejpeg and OpenCV: pip install 'feedline[image]'"


_cv2_serial = False


def _libs() -> tuple[Any, Any]:
    global _cv2_serial
    try:
        import cv2
        import simplejpeg
    except ImportError as exc:  # pragma: no cover - depends on the environment
        raise ImportError(f"{_INSTALL_HINT} ({exc})") from exc
    if not _cv2_serial:
        # Each OpenCV call on its calling thread: feedline runs many pictures at once on
        # threads of its own, which OpenCV's pool would only compete with; and a process
        # forked while that pool's thread works inherits its lock held, so that the child's
        # first blur or resize waits for good (seen: a DataLoader worker forked just after
        # the same process decoded pictures).
        cv2.setNumThreads(1)
        _cv2_serial = True
    return simplejpeg, cv2


_FORMATS = (
    "JPEG, PNG, WebP, BMP, GIF, TIFF, PBM/PGM/PPM/PAM/PFM, Radiance HDR, Sun raster, "
    "JPEG 2000, AVIF"
)


def _as_array(data: Buffer) -> np.ndarray[Any, Any]:
    if isinstance(data, np.ndarray):
        if data.dtype != np.uint8 or data.ndim != 1:
            raise TypeError(
                f"expected the encoded bytes of an image, got an array of {data.dtype} with shape "
                f"{data.shape}; pass bytes, a memoryview or a 1-D uint8 array"
            )
        # The decoders read len(data) bytes from the first one: a strided view (data[::-1])
        # would have them read other memory. Its bytes are copied in order.
        return np.ascontiguousarray(data)
    try:
        return np.frombuffer(data, dtype=np.uint8)
    except BufferError:
        return np.frombuffer(bytes(memoryview(data)), dtype=np.uint8)  # strided: copied
    except TypeError:
        raise TypeError(
            f"expected the encoded bytes of an image (bytes, bytearray, memoryview, mmap or a "
            f"1-D uint8 array), got {type(data).__name__}"
        ) from None


def _check_size(size: tuple[int, int] | None) -> tuple[int, int] | None:
    if size is None:
        return None
    ok = (
        isinstance(size, tuple | list)
        and len(size) == 2
        and all(isinstance(s, int | np.integer) and not isinstance(s, bool) and s > 0 for s in size)
    )
    if not ok:
        raise ConfigurationError(
            f"size must be (height, width) with two positive integers, got {size!r}"
        )
    return int(size[0]), int(size[1])


def _check_out(out: np.ndarray[Any, Any], shape: tuple[int, int, int]) -> None:
    if not isinstance(out, np.ndarray):
        raise TypeError(f"out must be a numpy array (a slot of a batch buffer), got {type(out)}")
    if out.shape != shape or out.dtype != np.uint8:
        raise ValueError(
            f"out has shape {out.shape} and dtype {out.dtype}, but this image decodes to "
            f"{shape} uint8; pass size={shape[:2]} or a slot of that shape"
        )
    if not out.flags.c_contiguous or not out.flags.writeable:
        raise ValueError(
            "out must be C-contiguous and writable (a slot batch[i] of a C-contiguous batch is)"
        )


def _jpeg_header(sj: Any, raw: np.ndarray[Any, Any]) -> tuple[int, int, str]:
    try:
        height, width, colorspace, _ = sj.decode_jpeg_header(raw)
    except ValueError as exc:
        raise ValueError(f"not a valid JPEG: {exc}") from None
    return int(height), int(width), str(colorspace)


def _reduction(height: int, width: int, size: tuple[int, int]) -> int:
    """The largest DCT scale denominator (1, 2, 4, 8) that keeps both sides >= the target."""
    k = 1
    while k < 8 and -(-height // (2 * k)) >= size[0] and -(-width // (2 * k)) >= size[1]:
        k *= 2
    return k


class _Scratch:
    """Reusable uint8 buffers for one decode's intermediate pictures, by slot name."""

    __slots__ = ("_buffers",)

    def __init__(self) -> None:
        self._buffers: dict[str, np.ndarray[Any, Any]] = {}

    def array(self, slot: str, shape: tuple[int, ...]) -> np.ndarray[Any, Any]:
        """A uint8 array of ``shape`` in buffer ``slot`` (grown on demand, at least 1 MiB)."""
        nbytes = int(np.prod(shape))
        buffer = self._buffers.get(slot)
        if buffer is None or buffer.size < nbytes:
            buffer = self._buffers[slot] = np.empty(max(nbytes, 1 << 20), np.uint8)
        return buffer[:nbytes].reshape(shape)

    def nbytes(self) -> int:
        """The size of its largest buffer."""
        return max((b.size for b in self._buffers.values()), default=0)


class _ScratchPool:
    """Scratch buffers lent to decodes, so that intermediate pictures are not fresh arrays.

    Half a megabyte allocated and freed per picture means page faults and ``mmap``/``munmap``
    calls, which serialise threads on the process's memory map (measured: 2-thread scaling
    1.62x with fresh arrays, 1.80x with reused ones). The buffers are lent per call rather than
    kept per thread: a loader with 128 fetching threads would otherwise keep 128 sets alive
    (2 MiB or more each) and allocate them again for every new set of threads. At most
    ``keep`` idle sets are kept, and none with a buffer over ``max_bytes`` (a burst of huge
    pictures does not stay resident); more decodes at once allocate more sets, briefly.

    No lock: ``list.pop`` and ``list.append`` are atomic, so a fork in the middle of a call
    cannot leave the child a lock held forever; the only race lets the pool keep a set or
    two over ``keep``.
    """

    def __init__(self, keep: int, max_bytes: int = 16 << 20) -> None:
        self.keep = keep
        self.max_bytes = max_bytes
        self._idle: list[_Scratch] = []

    @contextlib.contextmanager
    def borrow(self) -> Iterator[_Scratch]:
        """Lend a set of buffers for the duration of one decode."""
        try:
            scratch = self._idle.pop()
        except IndexError:
            scratch = _Scratch()
        try:
            yield scratch
        finally:
            if len(self._idle) < self.keep and scratch.nbytes() <= self.max_bytes:
                self._idle.append(scratch)


_SCRATCH = _ScratchPool(keep=max(4, 2 * (os.cpu_count() or 1)))


def _prefilter(ratio: float, exact: bool) -> np.ndarray[Any, Any] | None:
    """The 1-D kernel that, followed by a bilinear shrink by ``ratio``, filters like Pillow.

    Pillow's antialiased bilinear filter is a triangle of half-width ``ratio`` source pixels,
    sampled at the output's position: variance ``(ratio**2 - 1) / 6 + t (1 - t)`` for an
    output that falls at fraction ``t`` between two source pixels. A bilinear sample at the
    same position has variance ``t (1 - t)``, so the prefilter supplies the rest,
    ``v = (ratio**2 - 1) / 6``, whatever the phase (at integer ratios every output has the
    same ``t``; over the others it averages 1/6). That is the continuous triangle's figure:
    Pillow's weights, sampled at whole pixels, spread up to a few percent less at small
    non-integer ratios (3% at 1.2x), and exactly as much at integer ones.

    * ``exact``: a kernel of variance ``v``. Up to ``v = 2/3`` that is ``[a, 1, a]`` with
      ``a = v / (2 (1 - v))`` (``a = 1``: the 3-pixel box); above, the widest odd box that does
      not exceed ``v`` plus one fractional tap at each end.
    * fast: a box (OpenCV's ``blur``: a running sum, the cheapest filter it has) of the odd
      width nearest ``sqrt(12 v + 1)``, the width of a box of variance ``v``; below width 3
      (shrinks under about 1.6x) the 3-tap kernel. With the bilinear sample it spreads a pixel
      between about half and twice as far as Pillow does: cheap, and about 39 dB from Pillow
      on ImageNet-like pictures where the exact kernel is about 45.

    Returns ``None`` when the shrink is too small to alias (under 1.2x).
    """
    if ratio < 1.2:
        return None
    v = (ratio * ratio - 1.0) / 6.0
    if not exact:
        width = 2 * math.floor((math.sqrt(12.0 * v + 1.0) - 1.0) / 2.0 + 0.5) + 1
        if width >= 3:
            return np.full(width, 1.0 / width, np.float32)
    if v <= 2.0 / 3.0:
        a = v / (2.0 * (1.0 - v))
        weights = [a, 1.0, a]
    else:
        half = int((math.sqrt(12.0 * v + 1.0) - 1.0) / 2.0)  # widest box 2*half+1 within v
        inner = sum(x * x for x in range(-half, half + 1))
        k = 2 * half + 1
        f = (v * k - inner) / (2.0 * ((half + 1) ** 2 - v))  # end taps bring it to v
        weights = [f] + [1.0] * k + [f]
    kernel = np.array(weights, np.float64)
    result: np.ndarray[Any, Any] = (kernel / kernel.sum()).astype(np.float32)
    return result


def _is_box(kernel: np.ndarray[Any, Any] | None) -> bool:
    return kernel is None or bool(np.all(kernel == kernel[0]))


@functools.lru_cache(maxsize=4096)
def _prefilters(src_h: int, src_w: int, dst_h: int, dst_w: int, exact: bool) -> tuple[str, Any]:
    """How to prefilter a ``src`` picture before shrinking it to ``dst``.

    ``("none", None)``, ``("box", (kx, ky))`` (widths for ``cv2.blur``) or ``("sep", (kx, ky))``
    (read-only kernels for ``cv2.sepFilter2D``). Cached: datasets repeat a few picture sizes.
    """
    kx = _prefilter(src_w / dst_w, exact)
    ky = _prefilter(src_h / dst_h, exact)
    if kx is None and ky is None:
        return "none", None
    if _is_box(kx) and _is_box(ky):  # OpenCV's running-sum box filter: the cheapest
        return "box", (1 if kx is None else kx.size, 1 if ky is None else ky.size)
    one = np.ones(1, np.float32)
    kernels = (one if kx is None else kx, one if ky is None else ky)
    for kernel in kernels:
        kernel.flags.writeable = False
    return "sep", kernels


def _resize(
    cv2: Any,
    src: np.ndarray[Any, Any],
    dst: np.ndarray[Any, Any],
    antialias: bool,
    exact: bool,
    scratch: _Scratch,
) -> None:
    """Bilinear resize of ``src`` into ``dst`` (both HWC uint8), antialiased if asked."""
    height, width = dst.shape[:2]
    single = dst.shape[2] == 1
    if single and src.ndim == 3:
        src = src[:, :, 0]
    target = dst[:, :, 0] if single else dst
    if antialias:
        how, filters = _prefilters(src.shape[0], src.shape[1], height, width, exact)
        if how != "none":
            blurred = scratch.array("blurred", src.shape)
            if how == "box":
                src = cv2.blur(src, filters, dst=blurred)
            else:
                src = cv2.sepFilter2D(src, -1, *filters, dst=blurred)
    result = cv2.resize(src, (width, height), dst=target, interpolation=cv2.INTER_LINEAR)
    if not np.shares_memory(result, dst):  # pragma: no cover - OpenCV honours dst of this shape
        target[...] = result


def _finish(
    cv2: Any,
    image: np.ndarray[Any, Any],
    size: tuple[int, int] | None,
    out: np.ndarray[Any, Any] | None,
    antialias: bool,
    exact: bool,
    scratch: _Scratch,
) -> np.ndarray[Any, Any]:
    if image.ndim == 2:
        image = image[:, :, None]
    height, width = size if size is not None else image.shape[:2]
    shape = (height, width, image.shape[2])
    if out is None:
        if image.shape == shape:
            return image
        out = np.empty(shape, np.uint8)
    else:
        _check_out(out, shape)
    if image.shape == shape:
        if not np.shares_memory(image, out):
            np.copyto(out, image)
    else:
        _resize(cv2, image, out, antialias, exact, scratch)
    return out


def _decode_jpeg(
    raw: np.ndarray[Any, Any],
    size: tuple[int, int] | None,
    mode: str,
    grayscale: bool,
    out: np.ndarray[Any, Any] | None,
    antialias: bool,
    scratch: _Scratch,
    max_pixels: int | None,
) -> np.ndarray[Any, Any]:
    sj, cv2 = _libs()
    height, width, _ = _jpeg_header(sj, raw)
    check_pixels(height, width, max_pixels)
    k = _reduction(height, width, size) if size is not None and mode == "fast" else 1
    dh, dw = -(-height // k), -(-width // k)
    channels = 1 if grayscale else 3
    colorspace = "GRAY" if grayscale else "RGB"
    resized = size is not None and size != (dh, dw)
    # The fast IDCT and chroma upsampling err by a level or two; a shrink by 1.5x or more
    # averages that away (a smaller one would pass it through).
    fast = mode == "fast" and size is not None and 2 * dh >= 3 * size[0] and 2 * dw >= 3 * size[1]
    buffer = None
    if not resized and out is not None:
        _check_out(out, (dh, dw, channels))
        buffer = out  # decoded straight into the caller's slot
    elif resized:
        buffer = scratch.array("decoded", (dh, dw, channels))  # resized into out after
    try:
        image = sj.decode_jpeg(
            raw,
            colorspace,
            fastdct=fast,
            fastupsample=fast,
            min_height=dh if k > 1 else 0,
            min_width=dw if k > 1 else 0,
            buffer=buffer,
        )
    except ValueError as exc:
        raise ValueError(f"could not decode the JPEG ({height}x{width}): {exc}") from None
    exact = mode == "exact"
    return _finish(cv2, image.reshape(dh, dw, channels), size, out, antialias, exact, scratch)


def decode_image(
    data: Buffer,
    *,
    size: tuple[int, int] | None = None,
    mode: ImageMode = "fast",
    grayscale: bool = False,
    antialias: bool = True,
    out: np.ndarray[Any, Any] | None = None,
    max_pixels: int | None = MAX_IMAGE_PIXELS,
) -> np.ndarray[Any, Any]:
    """Decode an encoded image to an ``(H, W, C)`` uint8 array, resized if asked, into ``out``.

    Releases the GIL for the decode and the resize. Thread-safe and stateless.

    Args:
        data: The encoded bytes (JPEG, PNG, WebP, BMP, GIF, TIFF and the other formats
            OpenCV reads, see ``max_pixels``): bytes, bytearray, memoryview, mmap or a 1-D
            uint8 array. Not copied (a strided view is).
        size: ``(height, width)`` to resize to (aspect ratio not kept), or ``None`` for the
            image's own size.
        mode: ``"fast"`` decodes large JPEGs at a reduced DCT scale (and with libjpeg-turbo's
            fast IDCT when a shrink follows) and antialiases with a box filter; ``"exact"``
            always decodes at full size and precision and antialiases with a kernel matched
            to Pillow's (45 dB from it on ImageNet-like pictures, against 39 for ``"fast"``).
            Other formats decode the same either way; only the antialiasing differs.
        grayscale: One channel (luma) instead of RGB; the result is ``(H, W, 1)``.
        antialias: Filter over the source pixels each output pixel covers when shrinking by
            1.2x or more (like Pillow and torchvision). ``False`` samples bilinearly, like a
            plain ``cv2.resize``: about 0.2 ms less per ImageNet picture, with some aliasing.
        out: Where to write the result, e.g. ``batch[i]`` of a batch from
            :class:`~feedline.io.BufferPool`: a C-contiguous uint8 array of the result's
            shape. Nothing outside it is written.
        max_pixels: Refuse a picture that declares more pixels than this (default: Pillow's
            ``MAX_IMAGE_PIXELS``, about 89 million), read from its header before anything is
            allocated; ``None`` lifts the limit. The headers of JPEG, PNG, WebP, BMP, GIF,
            TIFF, the Netpbm formats, Radiance HDR, Sun raster, JPEG 2000 and AVIF are read;
            another format is refused unless ``max_pixels`` is ``None`` (OpenCV's own limit,
            2**30 pixels, then holds).

    Returns:
        The image, RGB (or luma) in HWC order: ``out`` itself when given.

    Raises:
        ValueError: The bytes are not a decodable image (the message says why), the picture
            is larger than ``max_pixels``, a PNG chunk runs past the end of the data, or
            ``out`` does not have the result's shape.
        ConfigurationError: ``size`` or ``mode`` is invalid.

    Example::

        batch = pool.acquire()                      # (32, 224, 224, 3) uint8
        decode_image(jpeg_bytes, size=(224, 224), out=batch[i])

    """
    if mode not in _MODES:
        raise ConfigurationError(f"mode must be 'fast' or 'exact', got {mode!r}")
    size = _check_size(size)
    if max_pixels is not None and (
        isinstance(max_pixels, bool) or not isinstance(max_pixels, int) or max_pixels < 1
    ):
        raise ConfigurationError(f"max_pixels must be an int >= 1 or None, got {max_pixels!r}")
    raw = _as_array(data)
    if raw.size == 0:
        raise ValueError("cannot decode an image from empty bytes")
    if raw[:3].tobytes() == _JPEG_MAGIC:
        with _SCRATCH.borrow() as scratch:
            return _decode_jpeg(raw, size, mode, grayscale, out, antialias, scratch, max_pixels)
    declared = declared_size(raw)
    if declared is not None:
        check_pixels(*declared, max_pixels)
        if raw[:4].tobytes() == b"\x89PNG":
            check_png_chunks(raw)
    elif max_pixels is not None:  # its size unknown: OpenCV would allocate whatever it says
        raise ValueError(
            f"could not decode {raw.size} bytes starting {raw[:8].tobytes()!r} as an image: "
            f"the format is not recognised ({_FORMATS}); for another format OpenCV decodes, "
            "pass max_pixels=None (no limit on its size)"
        )
    _, cv2 = _libs()
    flags = (cv2.IMREAD_GRAYSCALE if grayscale else cv2.IMREAD_COLOR_RGB) | (
        cv2.IMREAD_IGNORE_ORIENTATION
    )
    try:
        image = cv2.imdecode(raw, flags)
    except cv2.error as exc:
        image, reason = None, str(exc).strip().splitlines()[-1]
    else:
        reason = "the format is not recognised or the data is corrupt"
    if image is None:
        head = raw[:8].tobytes()
        raise ValueError(
            f"could not decode {raw.size} bytes starting {head!r} as an image: {reason}; "
            f"supported: {_FORMATS}"
        )
    with _SCRATCH.borrow() as scratch:
        return _finish(cv2, image, size, out, antialias, mode == "exact", scratch)


def image_size(data: Buffer) -> tuple[int, int]:
    """Return ``(height, width)`` of an encoded image, reading only its header where possible.

    Useful to allocate buffers before decoding. JPEG headers are parsed by libjpeg-turbo; those
    of the other formats :func:`decode_image` reads here; another format is decoded, within
    the default ``max_pixels`` (OpenCV has no header-only call).

    Raises:
        ValueError: The bytes are not a decodable image.

    """
    raw = _as_array(data)
    if raw[:3].tobytes() == _JPEG_MAGIC:
        sj, _ = _libs()
        height, width, _ = _jpeg_header(sj, raw)
        return height, width
    declared = declared_size(raw)
    if declared is not None:
        return declared
    shape = decode_image(raw).shape
    return int(shape[0]), int(shape[1])
