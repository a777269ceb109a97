"""decode_image against Pillow, the reference decoder, for every format and mode."""

from __future__ import annotations

import io
from typing import Any

import numpy as np
import pytest

pytest.importorskip("simplejpeg")
pytest.importorskip("cv2")
Image = pytest.importorskip("PIL.Image")

from feedline.errors import ConfigurationError  # noqa: E402
from feedline.io import decode_image, image_size  # noqa: E402
from feedline.io.images import _SCRATCH, _prefilter, _reduction, _ScratchPool  # noqa: E402

# Tolerances, stated once. Both libraries decode JPEG with libjpeg-turbo, but may pick
# different IDCT / upsampling settings: a pixel may differ by a few levels, the mean by < 1.
JPEG_MAX_DIFF = 12
JPEG_MEAN_DIFF = 1.0
# Our antialiased bilinear resize against Pillow's (a different filter, the same intent).
RESIZE_PSNR_DB = 30.0
# Shrinking 10x-16x a picture with a 16-px checkerboard puts it near the Nyquist limit, where
# a box filter and Pillow's triangle filter disagree most.
EXTREME_SHRINK_PSNR_DB = 26.0
# The fast (reduced DCT scale) path against the exact (full decode) path.
FAST_PSNR_DB = 30.0


def psnr(a: np.ndarray[Any, Any], b: np.ndarray[Any, Any]) -> float:
    mse = float(np.mean((a.astype(np.float64) - b.astype(np.float64)) ** 2))
    return float("inf") if mse == 0 else 10 * float(np.log10(255.0**2 / mse))


def picture(height: int, width: int, seed: int = 0) -> np.ndarray[Any, Any]:
    """Smooth gradients, edges and a little noise: compresses like a photo, at any size."""
    rng = np.random.default_rng(seed)
    y, x = np.mgrid[0:height, 0:width].astype(np.float64)
    base = np.stack(
        [
            128 + 90 * np.sin(x / (7 + width / 20)),
            128 + 90 * np.cos(y / (5 + height / 25)),
            (x * 3 + y * 2) % 256,
        ],
        axis=-1,
    )
    base[(x // 16 + y // 16) % 2 == 0] *= 0.6
    return np.clip(base + rng.normal(0, 4, base.shape), 0, 255).astype(np.uint8)


def encode(array: np.ndarray[Any, Any], fmt: str, mode: str = "RGB", **kwargs: Any) -> bytes:
    buf = io.BytesIO()
    Image.fromarray(array).convert(mode).save(buf, fmt, **kwargs)
    return buf.getvalue()


def pil_decode(data: bytes, size: tuple[int, int] | None = None, mode: str = "RGB") -> Any:
    with Image.open(io.BytesIO(data)) as im:
        im = im.convert(mode)
        if size is not None:
            im = im.resize(size[::-1], Image.Resampling.BILINEAR)
        return np.asarray(im)


def assert_close_jpeg(ours: np.ndarray[Any, Any], ref: np.ndarray[Any, Any]) -> None:
    diff = np.abs(ours.astype(np.int16) - ref.astype(np.int16))
    assert diff.max() <= JPEG_MAX_DIFF, diff.max()
    assert diff.mean() <= JPEG_MEAN_DIFF, diff.mean()


@pytest.mark.parametrize(("height", "width"), [(1, 1), (37, 53), (375, 500), (121, 97)])
def test_jpeg_full_size_matches_pillow(height: int, width: int) -> None:
    data = encode(picture(height, width), "JPEG", quality=90)
    for mode in ("fast", "exact"):
        ours = decode_image(data, mode=mode)  # type: ignore[arg-type]
        assert ours.shape == (height, width, 3)
        assert ours.dtype == np.uint8
        assert_close_jpeg(ours, pil_decode(data))


@pytest.mark.parametrize("fmt", ["PNG", "BMP", "WEBP"])
def test_lossless_formats_equal_pillow(fmt: str) -> None:
    array = picture(45, 67, seed=3)
    kwargs = {"lossless": True} if fmt == "WEBP" else {}
    data = encode(array, fmt, **kwargs)
    ours = decode_image(data)
    np.testing.assert_array_equal(ours, pil_decode(data))
    np.testing.assert_array_equal(ours, array)


def test_lossy_webp_matches_pillow() -> None:
    data = encode(picture(64, 80, seed=4), "WEBP", quality=80)
    ours = decode_image(data)
    assert ours.shape == (64, 80, 3)
    assert psnr(ours, pil_decode(data)) > 40


def test_png_with_alpha_and_palette_decode_to_rgb() -> None:
    array = picture(30, 40, seed=5)
    rgba = np.concatenate([array, np.full((30, 40, 1), 200, np.uint8)], axis=-1)
    buf = io.BytesIO()
    Image.fromarray(rgba, "RGBA").save(buf, "PNG")
    np.testing.assert_array_equal(decode_image(buf.getvalue()), array)
    palette = encode(array, "PNG", mode="P")
    np.testing.assert_array_equal(decode_image(palette), pil_decode(palette))


@pytest.mark.parametrize("fmt", ["JPEG", "PNG", "BMP", "WEBP"])
@pytest.mark.parametrize("size", [(224, 224), (50, 31), (400, 500)])
def test_resized_close_to_pillow(fmt: str, size: tuple[int, int]) -> None:
    data = encode(picture(375, 500, seed=1), fmt, quality=95)
    ref = pil_decode(data, size)
    bar = EXTREME_SHRINK_PSNR_DB if size == (50, 31) else RESIZE_PSNR_DB
    for mode in ("fast", "exact"):
        ours = decode_image(data, size=size, mode=mode)  # type: ignore[arg-type]
        assert ours.shape == (*size, 3)
        assert psnr(ours, ref) >= bar, (mode, psnr(ours, ref))


def test_fast_mode_decodes_large_jpeg_at_reduced_scale_within_psnr() -> None:
    data = encode(picture(960, 1280, seed=2), "JPEG", quality=90)
    fast = decode_image(data, size=(224, 224))
    exact = decode_image(data, size=(224, 224), mode="exact")
    assert not np.array_equal(fast, exact)  # a different (reduced) decode happened
    assert psnr(fast, exact) >= FAST_PSNR_DB
    assert psnr(fast, pil_decode(data, (224, 224))) >= RESIZE_PSNR_DB


@pytest.mark.parametrize(
    ("height", "width", "size", "expected"),
    [
        (960, 1280, (224, 224), 4),  # 240x320 still covers 224x224
        (375, 500, (224, 224), 1),  # half would be 188 high: too small
        (2000, 3000, (224, 224), 8),  # never past libjpeg-turbo's 1/8
        (448, 448, (224, 224), 2),  # exactly twice
        (447, 448, (224, 224), 1),  # just under twice: ceil(447/2)=224 is still enough
    ],
)
def test_reduction_keeps_both_sides_at_least_the_target(
    height: int, width: int, size: tuple[int, int], expected: int
) -> None:
    if (height, width) == (447, 448):
        expected = 2  # ceil(447 / 2) == 224
    k = _reduction(height, width, size)
    assert k == expected
    assert -(-height // k) >= size[0]
    assert -(-width // k) >= size[1]


def test_grayscale_matches_pillow_luma() -> None:
    data = encode(picture(61, 83, seed=6), "JPEG", quality=92)
    ours = decode_image(data, grayscale=True)
    assert ours.shape == (61, 83, 1)
    assert_close_jpeg(ours[..., 0], pil_decode(data, mode="L"))
    resized = decode_image(data, size=(20, 30), grayscale=True)
    assert resized.shape == (20, 30, 1)
    png = encode(picture(61, 83, seed=6), "PNG", mode="L")
    ours = decode_image(png, grayscale=True)[..., 0]
    np.testing.assert_array_equal(ours, pil_decode(png, mode="L"))


def test_grayscale_jpeg_decodes_to_rgb_by_default() -> None:
    data = encode(picture(40, 40), "JPEG", mode="L")
    ours = decode_image(data)
    assert ours.shape == (40, 40, 3)
    assert_close_jpeg(ours, pil_decode(data))


def test_cmyk_jpeg_matches_pillow() -> None:
    data = encode(picture(47, 59, seed=7), "JPEG", mode="CMYK", quality=95)
    assert_close_jpeg(decode_image(data), pil_decode(data))
    resized = decode_image(data, size=(20, 20))
    assert psnr(resized, pil_decode(data, (20, 20))) >= RESIZE_PSNR_DB


def test_out_writes_into_the_given_slot_only() -> None:
    batch = np.full((4, 32, 48, 3), 7, np.uint8)
    data = encode(picture(100, 150), "JPEG")
    result = decode_image(data, size=(32, 48), out=batch[2])
    assert result is batch[2] or np.shares_memory(result, batch[2])
    np.testing.assert_array_equal(batch[2], decode_image(data, size=(32, 48)))
    for other in (0, 1, 3):
        assert (batch[other] == 7).all()


@pytest.mark.parametrize("fmt", ["JPEG", "PNG"])
def test_out_without_resize_is_written_in_place(fmt: str) -> None:
    array = picture(16, 24)
    data = encode(array, fmt)
    batch = np.zeros((2, 16, 24, 3), np.uint8)
    result = decode_image(data, out=batch[1])
    assert np.shares_memory(result, batch[1])
    np.testing.assert_array_equal(batch[1], decode_image(data))
    assert not batch[0].any()


def test_fast_mode_reduced_decode_goes_straight_into_out() -> None:
    # 448x448 at scale 1/2 is exactly 224x224: decoded into the slot, no resize at all.
    data = encode(picture(448, 448), "JPEG")
    batch = np.zeros((2, 224, 224, 3), np.uint8)
    decode_image(data, size=(224, 224), out=batch[0])
    assert batch[0].any()
    assert not batch[1].any()
    # The 1/2-scale IDCT averages 2x2 pixels, not Pillow's 4-tap triangle: on this picture's
    # hard checkerboard edges that is the largest gap between the two modes (29 dB), so the
    # slot is held to the reference decoder's bar rather than the exact mode's.
    assert psnr(batch[0], pil_decode(data, (224, 224))) >= RESIZE_PSNR_DB


def test_out_of_the_wrong_shape_or_layout_is_refused() -> None:
    data = encode(picture(20, 30), "JPEG")
    with pytest.raises(ValueError, match=r"out has shape \(10, 10, 3\).*decodes to \(20, 30, 3\)"):
        decode_image(data, out=np.empty((10, 10, 3), np.uint8))
    with pytest.raises(ValueError, match="dtype float32"):
        decode_image(data, out=np.empty((20, 30, 3), np.float32))
    with pytest.raises(ValueError, match="C-contiguous"):
        decode_image(data, out=np.empty((20, 60, 3), np.uint8)[:, ::2])
    with pytest.raises(TypeError, match="numpy array"):
        decode_image(data, out=[[0]])  # type: ignore[arg-type]


@pytest.mark.parametrize(
    "data",
    [
        b"",
        b"not an image at all",
        b"\xff\xd8\xff" + b"\x00" * 50,
        b"\x89PNG\r\n\x1a\n" + b"\x00" * 50,
        bytes(np.random.default_rng(0).integers(0, 256, 4096, dtype=np.uint8)),
    ],
    ids=["empty", "text", "jpeg-magic", "png-magic", "random"],
)
def test_bad_bytes_raise_value_error(data: bytes) -> None:
    with pytest.raises(ValueError, match=r"JPEG|image|decode"):
        decode_image(data, size=(8, 8))


@pytest.mark.parametrize("fmt", ["JPEG", "PNG", "WEBP", "BMP"])
def test_every_truncation_raises_value_error(fmt: str) -> None:
    data = encode(picture(24, 32, seed=9), fmt)
    for cut in sorted({1, 2, 3, 8, 20, *range(30, len(data) - 1, max(1, len(data) // 25))}):
        with pytest.raises(ValueError):  # noqa: PT011 - the message depends on the cut
            decode_image(data[:cut])


def test_corrupted_jpeg_body_is_reported_not_crashed() -> None:
    data = bytearray(encode(picture(64, 64, seed=10), "JPEG"))
    rng = np.random.default_rng(1)
    failures = 0
    for _ in range(40):
        bad = bytearray(data)
        for i in rng.integers(200, len(bad) - 2, 8):
            bad[i] ^= 0xFF
        try:
            result = decode_image(bytes(bad))
        except ValueError:
            failures += 1
        else:
            assert result.shape == (64, 64, 3)  # corruption libjpeg could not notice
    assert failures > 0


def test_accepts_every_buffer_type() -> None:
    data = encode(picture(10, 12), "JPEG")
    ref = decode_image(data)
    for view in (bytearray(data), memoryview(data), np.frombuffer(data, np.uint8)):
        np.testing.assert_array_equal(decode_image(view), ref)
    # Strided views: the bytes in order, whatever the layout (the decoders read memory
    # forward from the first byte; before, a view with a step read past what it viewed).
    spread = np.repeat(np.frombuffer(data, np.uint8), 2)
    reversed_copy = np.frombuffer(data[::-1], np.uint8)
    for view in (spread[::2], reversed_copy[::-1], memoryview(spread)[::2]):
        np.testing.assert_array_equal(decode_image(view), ref)
        assert image_size(view) == (10, 12)
    with pytest.raises(TypeError, match="encoded bytes"):
        decode_image("a string")  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="1-D uint8"):
        decode_image(np.zeros((2, 2), np.uint8))


@pytest.mark.parametrize("size", [(0, 10), (10,), (1.5, 2), "224", (True, 3)])
def test_invalid_size_is_a_configuration_error(size: Any) -> None:
    with pytest.raises(ConfigurationError, match=r"\(height, width\)"):
        decode_image(b"\xff\xd8\xff", size=size)


def test_invalid_mode_is_a_configuration_error() -> None:
    with pytest.raises(ConfigurationError, match="'fast' or 'exact'"):
        decode_image(b"\xff\xd8\xff", mode="quick")  # type: ignore[arg-type]


def test_no_antialias_is_plain_bilinear_and_differs_when_shrinking() -> None:
    import cv2

    array = picture(375, 500, seed=11)
    data = encode(array, "PNG")
    plain = decode_image(data, size=(100, 100), antialias=False)
    np.testing.assert_array_equal(
        plain, cv2.resize(array, (100, 100), interpolation=cv2.INTER_LINEAR)
    )
    smooth = decode_image(data, size=(100, 100))
    assert psnr(smooth, pil_decode(data, (100, 100))) > psnr(plain, pil_decode(data, (100, 100)))


def test_image_size_reads_the_header() -> None:
    assert image_size(encode(picture(33, 44), "JPEG")) == (33, 44)
    assert image_size(encode(picture(33, 44), "PNG")) == (33, 44)
    with pytest.raises(ValueError, match="JPEG"):
        image_size(b"\xff\xd8\xff\x00")


def test_concurrent_decodes_share_no_scratch_memory() -> None:
    from concurrent.futures import ThreadPoolExecutor

    pictures = [encode(picture(200 + 7 * i, 300 - 5 * i, seed=i), "JPEG") for i in range(12)]
    expected = [decode_image(p, size=(64, 48)) for p in pictures]
    with ThreadPoolExecutor(4) as pool:
        for _ in range(3):
            got = list(pool.map(lambda p: decode_image(p, size=(64, 48)), pictures))
            for a, b in zip(got, expected, strict=True):
                np.testing.assert_array_equal(a, b)
    # A result never aliases a thread's scratch buffer: the next decode does not change it.
    first = decode_image(pictures[0], size=(64, 48))
    decode_image(pictures[1], size=(64, 48))
    np.testing.assert_array_equal(first, expected[0])


def test_scratch_buffers_are_lent_per_decode_and_reused_across_threads() -> None:
    import threading

    data = encode(picture(375, 500, seed=3), "JPEG")
    decode_image(data, size=(224, 224))  # a set exists and is idle now
    before = {id(s) for s in _SCRATCH._idle}
    assert before
    seen: list[set[int]] = []

    def decode_on_a_new_thread() -> None:
        decode_image(data, size=(224, 224))
        seen.append({id(s) for s in _SCRATCH._idle})

    thread = threading.Thread(target=decode_on_a_new_thread)
    thread.start()
    thread.join()
    # A thread that never decoded before borrowed an idle set instead of allocating its own.
    assert seen == [before]


def test_scratch_pool_lends_distinct_sets_at_once_and_keeps_a_bounded_number() -> None:
    pool = _ScratchPool(keep=2, max_bytes=4 << 20)
    with pool.borrow() as a, pool.borrow() as b, pool.borrow() as c:
        assert len({id(a), id(b), id(c)}) == 3  # concurrent decodes never share buffers
        x = a.array("decoded", (10, 10, 3))
        y = b.array("decoded", (10, 10, 3))
        assert not np.shares_memory(x, y)
    assert len(pool._idle) == 2  # the third set is dropped, not kept
    with pool.borrow() as again:
        assert again in (a, b, c)  # and idle sets are lent again
        big = again.array("decoded", (2000, 1000, 3))  # grows past its first 1 MiB
        assert big.shape == (2000, 1000, 3)
    # A set that grew past max_bytes (6 MB > 4 MiB) is dropped rather than kept resident.
    assert again not in pool._idle
    assert len(pool._idle) == 1


RATIOS = [1.0, 1.19, 1.2, 1.4, 1.58, 1.59, 1.674, 2.0, 2.232, 2.236, 2.24, 2.9, 3.0, 5.7, 8.0]


def _variance(kernel: np.ndarray[Any, Any]) -> float:
    taps = np.arange(kernel.size) - kernel.size // 2
    return float(np.sum(kernel.astype(np.float64) * taps**2))


def _operator_variance(columns: list[np.ndarray[Any, Any]]) -> float:
    """Mean spread (variance, in source pixels) of the rows of a linear 1-D resize operator.

    ``columns[i]`` is the resize of an impulse at source pixel ``i``; outputs near the edges
    (where borders are handled differently) are left out.
    """
    weights = np.stack(columns, axis=1).astype(np.float64)[6:-6]
    position = np.arange(weights.shape[1])
    total = weights.sum(axis=1)
    mean = weights @ position / total
    return float(np.mean((weights * (position - mean[:, None]) ** 2).sum(axis=1) / total))


def _spreads(ratio: float, exact: bool) -> tuple[float, float]:
    """(Pillow's, ours): the mean variance of an antialiased bilinear shrink by ``ratio``."""
    cv2 = pytest.importorskip("cv2")
    n_dst = 250
    n_src = round(ratio * n_dst)
    assert abs(n_src / n_dst - ratio) < 0.003  # measured at the ratio asked for
    kernel = _prefilter(n_src / n_dst, exact)
    pillow, ours = [], []
    for i in range(n_src):
        impulse = np.zeros((1, n_src), np.float32)
        impulse[0, i] = 1.0
        image = Image.fromarray(impulse, "F").resize((n_dst, 1), Image.Resampling.BILINEAR)
        pillow.append(np.asarray(image)[0])
        if kernel is not None:
            impulse = np.convolve(impulse[0], kernel, mode="same")[None].astype(np.float32)
        ours.append(cv2.resize(impulse, (n_dst, 1), interpolation=cv2.INTER_LINEAR)[0])
    return _operator_variance(pillow), _operator_variance(ours)


@pytest.mark.parametrize("exact", [True, False])
@pytest.mark.parametrize("ratio", RATIOS)
def test_prefilter_spreads_like_pillows_triangle(ratio: float, exact: bool) -> None:
    kernel = _prefilter(ratio, exact)
    if ratio < 1.2:
        assert kernel is None
        return
    assert kernel is not None
    assert kernel.size % 2 == 1  # centred: no half-pixel shift
    np.testing.assert_allclose(kernel, kernel[::-1])
    assert kernel.sum() == pytest.approx(1.0, abs=1e-6)
    # Measured on the operators themselves: Pillow's resize against prefilter + cv2.resize.
    pillow, ours = _spreads(ratio, exact)
    if exact or (kernel.size == 3 and kernel[0] != kernel[1]):
        # Exact at integer ratios; a few percent over at small non-integer ones, where
        # Pillow's weights, sampled at whole pixels, spread less than a continuous triangle.
        assert ours == pytest.approx(pillow, rel=0.04, abs=0.01)
    else:
        # The fast box: the odd width nearest that of a box of the missing variance, which
        # spreads a pixel between about half and twice as far as Pillow (0.59x to 2.02x
        # measured over ratios 1.2 to 8).
        wanted = (ratio * ratio - 1) / 6
        assert abs(kernel.size - np.sqrt(12 * wanted + 1)) <= 1.0
        assert 0.5 <= ours / pillow <= 2.1


def test_exact_prefilter_varies_smoothly_with_the_ratio() -> None:
    # No jumps where the kernel changes shape (3-tap to box, box to wider box).
    ratios = np.linspace(1.2, 6.0, 481)  # integer ratios included
    variances = [_variance(k) for r in ratios if (k := _prefilter(float(r), True)) is not None]
    steps = np.diff(variances)
    assert np.all(steps >= 0)
    assert steps.max() < 0.05


@pytest.mark.parametrize("grayscale", [False, True])
@pytest.mark.parametrize("mode", ["fast", "exact"])
def test_small_shrink_uses_the_3_tap_filter_and_tracks_pillow(grayscale: bool, mode: str) -> None:
    # 375x500 -> 300x400 is a 1.25x shrink on both axes: the 3-tap kernel, not a box.
    kernel = _prefilter(1.25, mode == "exact")
    assert kernel is not None
    assert kernel.size == 3
    assert kernel[0] != kernel[1]
    data = encode(picture(375, 500, seed=4), "PNG")
    ours = decode_image(data, size=(300, 400), grayscale=grayscale, mode=mode)  # type: ignore[arg-type]
    ref = pil_decode(data, (300, 400), mode="L" if grayscale else "RGB")
    ref = ref[:, :, None] if grayscale else ref
    plain = decode_image(data, size=(300, 400), grayscale=grayscale, antialias=False)
    assert ours.shape == ref.shape == plain.shape
    assert psnr(ours, ref) >= RESIZE_PSNR_DB
    assert psnr(ours, ref) > psnr(plain, ref)
