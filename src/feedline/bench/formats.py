"""The ``formats`` scenario: turning NPY / NPZ bytes into arrays, across threads.

A sample is a 3x224x224 uint8 image, a 224x224 int32 mask and a little metadata, as ``.npy``
(the image alone) or ``.npz`` (all three; stored, or deflated by ``savez_compressed``). Each
contender loads the same in-memory samples with 1, 2 and 4 threads; the baseline is
``numpy.load`` on a ``BytesIO``, what a dataset's ``__getitem__`` usually does. SPDL's loaders
(``spdl.io``) run beside them when installed.

Every thread runs its own loop over its share of the samples, so what scales (or not) is the
loader, not a pool's hand-off.
"""

from __future__ import annotations

import io
from collections.abc import Callable
from typing import Any

import numpy as np

from feedline.io import load_npy, load_npz

from ._common import Contender, Measurement, ScenarioResult, alternate, make_result, threaded_loop
from ._registry import BenchOptions

__all__ = ["make_sample", "run"]


def make_sample(seed: int = 0) -> dict[str, np.ndarray[Any, Any]]:
    """A deterministic sample with image-like content (smooth regions, edges, some noise)."""
    rng = np.random.default_rng(seed)
    y, x = np.mgrid[0:224, 0:224]
    base = (np.sin(x / 17.0 + seed) + np.cos(y / 23.0)) * 60 + 128
    image = np.stack([base + rng.normal(0, 6, base.shape) + 20 * c for c in range(3)])
    mask = ((x // 32 + y // 48 + seed) % 5).astype(np.int32)
    return {
        "image": np.clip(image, 0, 255).astype(np.uint8),
        "mask": mask,
        "meta": np.array([seed, 224, 224, 0.5], dtype=np.float64),
    }


def _npy(array: np.ndarray[Any, Any]) -> bytes:
    buf = io.BytesIO()
    np.save(buf, array)
    return buf.getvalue()


def _npz(sample: dict[str, np.ndarray[Any, Any]], compressed: bool) -> bytes:
    buf = io.BytesIO()
    if compressed:
        np.savez_compressed(buf, **sample)  # type: ignore[arg-type]
    else:
        np.savez(buf, **sample)  # type: ignore[arg-type]
    return buf.getvalue()


def _numpy_npy(data: bytes) -> Any:
    return np.load(io.BytesIO(data))


def _numpy_npz(data: bytes) -> Any:
    with np.load(io.BytesIO(data)) as f:
        return {k: f[k] for k in f.files}


def _ours_npz(data: bytes) -> Any:
    arrays = load_npz(data)
    return {k: arrays[k] for k in arrays}


def _spdl_loaders() -> tuple[Callable[[bytes], Any], Callable[[bytes], Any]] | None:
    try:
        import spdl.io as sio
    except ImportError:
        return None

    def npz(data: bytes) -> Any:
        arrays = sio.load_npz(data)
        return {k: arrays[k] for k in arrays.keys()}  # noqa: SIM118 - NpzFile is not a dict

    return sio.load_npy, npz


def _contender(
    name: str, fn: Callable[[bytes], Any], samples: list[bytes], threads: int
) -> Contender:
    return Contender(name, lambda: threaded_loop(fn, samples, threads))


def run(options: BenchOptions) -> ScenarioResult:
    """Run the formats scenario; ``options.quick`` shrinks it to a smoke test."""
    quick, progress = options.quick, options.progress
    repeats = 1 if quick else 5
    sample = make_sample()
    spdl = _spdl_loaders()
    kinds: list[tuple[str, bytes, Callable[[bytes], Any], Callable[[bytes], Any], int]] = [
        ("npy", _npy(sample["image"]), _numpy_npy, load_npy, 40 if quick else 4000),
        ("npz stored", _npz(sample, False), _numpy_npz, _ours_npz, 20 if quick else 2000),
        ("npz compressed", _npz(sample, True), _numpy_npz, _ours_npz, 8 if quick else 400),
    ]
    measurements: list[Measurement] = []
    for label, data, baseline, ours, n in kinds:
        samples = [data] * n
        for threads in (1, 2, 4):
            contenders = [
                _contender("numpy.load", baseline, samples, threads),
                _contender("feedline", ours, samples, threads),
            ]
            if spdl is not None:
                theirs = spdl[0] if label == "npy" else spdl[1]
                contenders.append(_contender("spdl", theirs, samples, threads))
            case = f"{label} ({len(data) // 1024} KiB), {threads} thread(s)"
            measurements += alternate(case, contenders, repeats, "numpy.load", progress)
    notes = [
        f"{repeats} alternating run(s) per contender, medians; samples/s; every array of a "
        "sample is materialised",
        "sample: 3x224x224 uint8 image (npy: the image alone), 224x224 int32 mask, 4 floats",
    ]
    return make_result(
        "formats",
        "numpy.load",
        measurements,
        notes,
        spdl is not None,
        unit="samples/s",
        headline=["feedline"],
    )
