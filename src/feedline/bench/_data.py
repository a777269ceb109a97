"""Deterministic synthetic data for the benchmarks, generated once and cached on disk.

Pictures are built to compress like photographs, since a JPEG decoder's speed depends on it:
a 1/f ("pink") luminance field, as natural scenes have, with weaker and smoother colour
fields, a few textured objects with sharp edges, and a little sensor grain. Encoded at quality
90, an ImageNet-like picture (about 500x375) weighs about 110 KB, like ImageNet's own.
"""

from __future__ import annotations

import functools
import os
import re
from pathlib import Path
from typing import Any

import numpy as np

__all__ = [
    "GENERATED",
    "cache_dir",
    "jpeg_files",
    "jpeg_source",
    "natural_image",
    "read_all",
    "user_jpegs",
]

# Side lengths drawn for ImageNet-like pictures: ImageNet's median is 500x375 (or 375x500).
_IMAGENET_WIDTHS = (400, 600)
_ASPECTS = (0.62, 0.85)
_QUALITY = 90


_JPEG_SUFFIXES = (".jpg", ".jpeg")
_USER_SCAN_LIMIT = 4096  # files of a user's folder looked at, at most (ImageNet has 1.3 M)


def user_jpegs(directory: str | Path | None) -> list[Path]:
    """The user's own JPEGs under ``directory`` (recursively, sorted), if it holds any.

    Folders the benchmarks generate (:data:`GENERATED`) do not count. At most the first 4096
    files found are returned, so that a whole dataset is not listed. A folder is scanned
    once per process: every scenario asks.
    """
    if directory is None or not Path(directory).is_dir():
        return []
    return list(_scan(str(Path(directory).resolve())))


@functools.lru_cache(maxsize=8)
def _scan(directory: str) -> tuple[Path, ...]:
    root = Path(directory)
    found: list[Path] = []
    for folder, subfolders, files in os.walk(root):
        if Path(folder) == root:
            subfolders[:] = [s for s in subfolders if not _generated(s)]
        subfolders.sort()
        for name in sorted(files):
            if name.lower().endswith(_JPEG_SUFFIXES):
                found.append(Path(folder) / name)
                if len(found) >= _USER_SCAN_LIMIT:
                    return tuple(found)
    return tuple(found)


GENERATED = re.compile(r"(jpeg-\w+|random-\d+|npz|shards)-v\d+|spdl-ffmpeg")
"""The folders the benchmarks generate their data in, under the cache root."""


def _generated(name: str) -> bool:
    return GENERATED.fullmatch(name) is not None


def _readable(paths: list[Path], progress: Any) -> list[Path]:
    # The user's files whose JPEG header reads; the others are left out, and said so.
    from feedline.io import image_size

    good = []
    for path in paths:
        try:
            image_size(path.read_bytes())
        except (OSError, ValueError) as error:
            if progress is not None:
                progress(f"leaving out {path}: {error}")
            continue
        good.append(path)
    if paths and not good:
        raise ValueError(f"none of the JPEGs under {paths[0].parent} could be read")
    return good


def jpeg_source(directory: str | Path | None) -> str:
    """A note saying which pictures the image scenarios use."""
    if user_jpegs(directory):
        return f"pictures: your JPEGs from {directory} (the first ones, sorted by path)"
    return "pictures: generated ImageNet-like JPEGs (deterministic, cached)"


def cache_dir(override: str | Path | None = None) -> Path:
    """Where generated data lives: ``override``, ``$FEEDLINE_BENCH_DATA`` or ~/.cache.

    A folder of the user's own JPEGs is never written to: generated data then goes to the
    default place.
    """
    if override is not None and not user_jpegs(override):
        return Path(override)
    env = os.environ.get("FEEDLINE_BENCH_DATA")
    if env:
        return Path(env)
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "feedline" / "bench"


def _field(rng: np.random.Generator, height: int, width: int, beta: float) -> Any:
    fy = np.fft.fftfreq(height)[:, None]
    fx = np.fft.rfftfreq(width)[None, :]
    f = np.sqrt(fy**2 + fx**2)
    f[0, 0] = 1.0
    phase = rng.uniform(0.0, 2 * np.pi, f.shape)
    x = np.fft.irfft2(np.exp(1j * phase) / f**beta, s=(height, width))
    return (x - x.mean()) / x.std()


def natural_image(rng: np.random.Generator, height: int, width: int) -> np.ndarray[Any, Any]:
    """An (H, W, 3) uint8 picture with the statistics of a photograph (see the module doc)."""
    lum = _field(rng, height, width, 1.0)
    c1, c2 = _field(rng, height, width, 1.4), _field(rng, height, width, 1.4)
    image = rng.uniform(60, 190, 3) + 40 * lum[..., None]
    image += np.stack([18 * c1, -9 * c1 - 9 * c2, 18 * c2], axis=-1)
    yy, xx = np.mgrid[0:height, 0:width]
    for _ in range(int(rng.integers(2, 6))):
        cy, cx = rng.uniform(0, height), rng.uniform(0, width)
        ry, rx = rng.uniform(0.08, 0.35) * height, rng.uniform(0.08, 0.35) * width
        inside = ((yy - cy) / ry) ** 2 + ((xx - cx) / rx) ** 2 < 1
        texture = _field(rng, height, width, 0.8)[inside][:, None]
        image[inside] = rng.uniform(20, 235, 3) + 30 * texture
    image += rng.normal(0.0, 3.0, image.shape)
    picture: np.ndarray[Any, Any] = np.clip(image, 0, 255).astype(np.uint8)
    return picture


def _encode_jpeg(image: np.ndarray[Any, Any]) -> bytes:
    import cv2

    ok, encoded = cv2.imencode(
        ".jpg", np.ascontiguousarray(image[..., ::-1]), [cv2.IMWRITE_JPEG_QUALITY, _QUALITY]
    )
    if not ok:  # pragma: no cover - OpenCV encodes any uint8 picture
        raise RuntimeError("OpenCV could not encode a JPEG")
    return bytes(encoded)


def _imagenet_shape(rng: np.random.Generator) -> tuple[int, int]:
    width = int(rng.integers(*_IMAGENET_WIDTHS))
    height = int(width * rng.uniform(*_ASPECTS))
    return (width, height) if rng.random() < 0.2 else (height, width)  # some portraits


def jpeg_files(
    count: int,
    kind: str = "imagenet",
    directory: str | Path | None = None,
    progress: Any = None,
    steps: Any = None,
    small: bool = False,
) -> list[Path]:
    """Paths of ``count`` deterministic JPEGs of ``kind``, generating the missing ones.

    Where ``directory`` holds JPEGs of the user's own (:func:`user_jpegs`), ``"imagenet"``
    pictures are those instead, repeated in turn if there are fewer than ``count``.

    Args:
        count: How many files.
        kind: ``"imagenet"`` (varied sizes around 500x375) or ``"large"`` (1280x960 photos).
        directory: The cache root (see :func:`cache_dir`), or a folder of the user's JPEGs.
        progress: Called with a message before generating, when anything is missing.
        steps: Called with (what, done, total) as pictures are generated (a progress bar).
        small: Half the width and height (a quarter of the time to make and to decode), in a
            folder of their own: for smoke runs (see ``BenchOptions.smoke``).

    """
    if kind not in ("imagenet", "large"):
        raise ValueError(f"kind must be 'imagenet' or 'large', got {kind!r}")
    own = _readable(user_jpegs(directory)[:count], progress) if kind == "imagenet" else []
    if own:
        return [own[i % len(own)] for i in range(count)]
    folder = cache_dir(directory) / f"jpeg-{kind}{'_small' if small else ''}-v1"
    folder.mkdir(parents=True, exist_ok=True)
    paths = [folder / f"{i:07d}.jpg" for i in range(count)]
    missing = [i for i, p in enumerate(paths) if not p.exists()]
    if missing and progress is not None:
        progress(f"generating {len(missing)} {kind} JPEGs in {folder} (cached for later runs)")
    what = f"generating {kind} JPEGs"
    for done, i in enumerate(missing):
        if steps is not None:
            steps(what, done, len(missing))
        rng = np.random.default_rng([i, 0 if kind == "imagenet" else 1])
        height, width = _imagenet_shape(rng) if kind == "imagenet" else (960, 1280)
        if small:
            height, width = height // 2, width // 2
        data = _encode_jpeg(natural_image(rng, height, width))
        tmp = paths[i].with_suffix(".tmp")
        tmp.write_bytes(data)
        tmp.replace(paths[i])  # never leave a half-written file for the next run
    if missing and steps is not None:
        steps(what, len(missing), len(missing))
    return paths


def read_all(paths: list[Path]) -> list[bytes]:
    """The contents of ``paths``, in order."""
    return [p.read_bytes() for p in paths]


def random_files(root: Path, count: int, size: int) -> list[Path]:
    """``count`` files of ``size`` random bytes each, cached under ``root``."""
    folder = root / f"random-{size}-v1"
    folder.mkdir(parents=True, exist_ok=True)
    paths = []
    for i in range(count):
        path = folder / f"{i:04d}.bin"
        if not path.exists():
            data = np.random.default_rng(i).integers(0, 256, size, dtype=np.uint8).tobytes()
            tmp = path.with_suffix(".tmp")
            tmp.write_bytes(data)
            tmp.replace(path)
        paths.append(path)
    return paths
