"""The ``decode`` scenario: JPEG bytes to a 224x224 RGB array, per library, on 1 and 2 threads.

Two kinds of pictures: ImageNet-like (about 500x375, about 110 KB) and large photos
(1280x960). Contenders, each turning the same in-memory bytes into a 224x224x3 uint8 array:

* ``feedline fast`` / ``feedline exact``: :func:`feedline.io.decode_image` writing into a slot
  of a preallocated batch, with and without reduced-scale DCT decoding;
* ``feedline fast, no antialias``: the same resize as the OpenCV contender;
* ``PIL``: ``Image.open`` + ``convert("RGB")`` + ``resize(BILINEAR)``, as torchvision users run it
  (the baseline);
* ``OpenCV``: ``cv2.imdecode`` + ``cv2.resize`` (bilinear, not antialiased);
* ``SPDL``: ``spdl.io.load_image`` with a scale filter, when spdl and its FFmpeg libraries load.

Each thread loops over its share of the pictures (no pool in between), so the 2-thread rate
over the 1-thread rate is the library's own scaling. ``feedline fast, 2 processes`` runs the
same loop in two processes instead (no GIL shared): the cores' own scaling, the most any
threaded or multi-process loader can reach on this machine. The notes give the PSNR of the
fast path against the exact path.
"""

from __future__ import annotations

import functools
import io
import multiprocessing
import time
from collections.abc import Callable
from concurrent.futures import ProcessPoolExecutor
from typing import Any

import numpy as np

from feedline.io import decode_image
from feedline.io.images import ImageMode

from ._common import Contender, Measurement, ScenarioResult, alternate, make_result, threaded_loop
from ._data import jpeg_files, jpeg_source, read_all
from ._registry import BenchOptions

__all__ = ["pil_decode", "psnr", "run", "spdl_decoder", "spdl_scale_filter"]

SIZE = (224, 224)


def psnr(a: np.ndarray[Any, Any], b: np.ndarray[Any, Any]) -> float:
    """Peak signal-to-noise ratio of two uint8 arrays, in dB (inf when equal)."""
    mse = float(np.mean((a.astype(np.float64) - b.astype(np.float64)) ** 2))
    return float("inf") if mse == 0 else float(10 * np.log10(255.0**2 / mse))


def _feedline(mode: ImageMode, antialias: bool = True) -> Callable[[bytes], Any]:
    # One batch per thread, slots reused round-robin: what a batching stage does.
    import threading

    local = threading.local()

    def fn(data: bytes) -> Any:
        batch = getattr(local, "batch", None)
        if batch is None:
            batch = local.batch = np.empty((32, *SIZE, 3), np.uint8)
            local.i = 0
        local.i = (local.i + 1) % 32
        return decode_image(data, size=SIZE, mode=mode, antialias=antialias, out=batch[local.i])

    return fn


_CHILD_SAMPLES: list[bytes] = []


def _keep_samples(samples: list[bytes]) -> None:
    _CHILD_SAMPLES[:] = samples  # the worker process's copy, set once


def _decode_share(first: int, step: int) -> tuple[float, float]:
    # In a worker process: decode every step-th sample from first; (start, end) on the
    # system-wide monotonic clock, which the parent compares across processes.
    fn = _feedline("fast")
    start = time.perf_counter()
    for data in _CHILD_SAMPLES[first::step]:
        fn(data)
    return start, time.perf_counter()


class ProcessLoop:
    """``feedline fast`` looping over shares of the samples in ``processes`` worker processes.

    The processes start (and receive the samples) once; each call times one pass, from the
    first worker's start to the last one's end.
    """

    def __init__(self, samples: list[bytes], processes: int) -> None:
        self.samples, self.processes = samples, processes
        context = multiprocessing.get_context("spawn")  # no fork of a threaded process
        self._pool = ProcessPoolExecutor(
            processes, mp_context=context, initializer=_keep_samples, initargs=(samples,)
        )
        self()  # start the workers and warm them up

    def __call__(self) -> tuple[int, float]:
        """Decode every sample once; return (items, seconds)."""
        spans = [self._pool.submit(_decode_share, i, self.processes) for i in range(self.processes)]
        times = [future.result() for future in spans]
        return len(self.samples), max(t[1] for t in times) - min(t[0] for t in times)

    def close(self) -> None:
        """Stop the worker processes."""
        self._pool.shutdown()


def pil_decode(data: bytes) -> Any:
    """Pillow's decode and antialiased bilinear resize, as torchvision users run it."""
    from PIL import Image

    with Image.open(io.BytesIO(data)) as im:
        return np.asarray(im.convert("RGB").resize(SIZE[::-1], Image.Resampling.BILINEAR))


def _opencv(data: bytes) -> Any:
    import cv2

    image = cv2.imdecode(np.frombuffer(data, np.uint8), cv2.IMREAD_COLOR_RGB)
    if image is None:
        raise ValueError("OpenCV could not decode the picture")
    return cv2.resize(image, SIZE[::-1], interpolation=cv2.INTER_LINEAR)


def spdl_scale_filter() -> str:
    """FFmpeg's filter for SPDL to resize as the other contenders do: bilinear, stretched."""
    import spdl.io as sio

    desc = sio.get_video_filter_desc(
        scale_width=SIZE[1],
        scale_height=SIZE[0],
        scale_algo="bilinear",
        scale_mode=None,  # SPDL's default pads to keep the aspect ratio
        pix_fmt="rgb24",
    )
    assert desc is not None  # a scale was asked for
    return desc


def spdl_decoder() -> tuple[Callable[[bytes], Any] | None, str | None]:
    """SPDL's decode + resize to 224x224 RGB, or ``None`` and why it cannot run here."""
    try:
        import spdl.io as sio

        desc = spdl_scale_filter()

        def fn(data: bytes) -> Any:
            return sio.to_numpy(sio.load_image(data, filter_desc=desc))

        fn(jpeg_probe())
    except ImportError:
        return None, "spdl is not installed (pip install 'feedline[bench]'): no SPDL column"
    except Exception as exc:  # spdl installed, but its FFmpeg libraries are missing
        reason = str(exc).split(". ")[0][:160]
        return None, f"SPDL left out: spdl.io cannot decode here ({reason})"
    return fn, None


def jpeg_probe() -> bytes:
    """A tiny valid JPEG, to check a decoder works before timing it."""
    import cv2

    ok, data = cv2.imencode(".jpg", np.full((16, 16, 3), 128, np.uint8))
    assert ok
    return bytes(data)


def _available(name: str, fn: Callable[[bytes], Any], probe: bytes) -> str | None:
    try:
        fn(probe)
    except ImportError as exc:
        return f"{name} left out: {exc} (pip install 'feedline[bench]')"
    return None


def run(options: BenchOptions) -> ScenarioResult:
    """Run the decode scenario; ``options.quick`` shrinks it to a smoke test."""
    quick, progress, data_dir = options.quick, options.progress, options.data_dir
    repeats = 1 if quick else 9
    notes = [
        jpeg_source(options.data_dir),
        f"{repeats} alternating run(s) per contender, medians; pictures/s to a 224x224x3 array",
        "each thread loops over its share of in-memory bytes: no pool, no file reads",
        "feedline fast, 2 processes: the same loop in 2 worker processes (spawned once per "
        "case): how far the cores themselves scale; scaling is against feedline fast on "
        "1 thread",
    ]
    contenders_fn: dict[str, Callable[[bytes], Any]] = {
        "PIL": pil_decode,
        "OpenCV": _opencv,
        "feedline fast": _feedline("fast"),
        "feedline exact": _feedline("exact"),
        "feedline fast, no antialias": _feedline("fast", antialias=False),
    }
    probe = jpeg_probe()
    for name in ("PIL", "OpenCV"):
        missing = _available(name, contenders_fn[name], probe)
        if missing is not None:
            notes.append(missing)
            del contenders_fn[name]
    spdl, why = spdl_decoder()
    if spdl is not None:
        contenders_fn["SPDL"] = spdl
    elif why is not None:
        notes.append(why)
    kinds = [("imagenet", 8 if quick else 64), ("large", 2 if quick else 16)]
    measurements: list[Measurement] = []
    for kind, count in kinds:
        files = jpeg_files(count, kind, data_dir, progress, options.steps, options.smoke_run)
        pictures = read_all(files)
        sizes = [len(p) for p in pictures]
        notes.append(f"{kind}: {count} JPEGs, mean {np.mean(sizes) / 1024:.0f} KiB")
        fast = [decode_image(p, size=SIZE) for p in pictures]
        exact = [decode_image(p, size=SIZE, mode="exact") for p in pictures]
        quality = np.median([psnr(a, b) for a, b in zip(fast, exact, strict=True)])
        notes.append(f"{kind}: PSNR fast vs exact {quality:.1f} dB (median)")
        rounds = 1 if quick else max(1, 128 // count)
        samples = pictures * rounds
        per_thread: dict[int, list[Measurement]] = {}
        for threads in (1, 2):
            contenders = [
                Contender(name, functools.partial(threaded_loop, fn, samples, threads))
                for name, fn in contenders_fn.items()
            ]
            processes = ProcessLoop(samples, threads) if threads > 1 else None
            if processes is not None:
                contenders.append(Contender(f"feedline fast, {threads} processes", processes))
            baseline = "PIL" if "PIL" in contenders_fn else None
            try:
                found = alternate(
                    f"{kind}, {threads} thread(s)", contenders, repeats, baseline, progress
                )
            finally:
                if processes is not None:
                    processes.close()
            per_thread[threads] = found
            measurements += found
        single = {m.contender: m.items_per_s for m in per_thread[1]}
        for two in per_thread[2]:
            one = single.get(two.contender.replace(", 2 processes", ""), 0.0)
            if one > 0:
                two.extra["scaling"] = two.items_per_s / one
            if two.contender.endswith("processes"):  # its CPU time is the workers'
                two.extra.pop("cpu_s_per_1000", None)
    return make_result(
        "decode", "PIL", measurements, notes, True, unit="pictures/s", headline=["feedline fast"]
    )
