"""Video and audio parsing under damaged input: truncations, bit flips, absurd declared sizes,
sample rates and channel counts give frames or a ValueError, quickly and in bounded memory."""

from __future__ import annotations

import resource
import struct
import time
from typing import Any

import numpy as np
import pytest

av = pytest.importorskip("av")

from feedline.io.media import MAX_AUDIO_SAMPLES, decode_audio, decode_video_frames  # noqa: E402

from . import test_media as tm  # noqa: E402


def _inputs() -> dict[str, tuple[str, bytes]]:
    found = {
        "mp4": ("video", tm.encode_video("mpeg4", "mp4")),
        "wav": ("audio", tm.encode_audio(tm.sine_pair(), "pcm_s16le", "wav")),
        "flac": ("audio", tm.encode_audio(tm.sine_pair(), "flac", "flac")),
    }
    if tm.encoder_available("libx264"):
        found["mkv"] = ("video", tm.encode_video("libx264", "matroska"))
    return found


INPUTS = _inputs()


def _mutants(data: bytes, seed: int) -> list[bytes]:
    rng = np.random.default_rng(seed)
    n = len(data)
    cuts = sorted({*range(0, min(n, 600), 37), *np.linspace(0, n - 1, 25, dtype=int).tolist()})
    out = [data[:cut] for cut in cuts]
    for k in range(60):
        damaged = bytearray(data)
        for at in rng.integers(0, n, 1 + k % 8):
            damaged[at] ^= 1 << int(rng.integers(0, 8))
        out.append(bytes(damaged))
    return out


def _decode(kind: str, data: bytes) -> Any:
    if kind == "video":
        frames = decode_video_frames(data, num_frames=4)
        assert frames.shape[0] == 4
        assert frames.dtype == np.uint8
        return frames
    audio = decode_audio(data, sample_rate=16_000)
    assert audio.samples.dtype == np.float32
    assert audio.samples.ndim == 2
    return audio


@pytest.mark.parametrize("name", sorted(INPUTS))
def test_truncated_and_bit_flipped_media_decode_or_raise_value_error(name: str) -> None:
    kind, data = INPUTS[name]
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    started = time.monotonic()
    outcomes = {"decoded": 0, "refused": 0}
    for damaged in _mutants(data, seed=len(name)):
        try:
            _decode(kind, damaged)
        except ValueError:
            outcomes["refused"] += 1
        else:
            outcomes["decoded"] += 1
    assert outcomes["refused"] > 0  # the damage was real
    assert time.monotonic() - started < 60
    grown_mib = (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before) / 1024
    assert grown_mib < 300


def _wav(rate: int | None = None, channels: int | None = None, size: int | None = None) -> bytes:
    data = bytearray(INPUTS["wav"][1])
    fmt = data.index(b"fmt ") + 8
    kind, ch, sr, _, _, bits = struct.unpack("<HHIIHH", data[fmt : fmt + 16])
    ch, sr = channels or ch, rate or sr
    block = ch * bits // 8
    data[fmt : fmt + 16] = struct.pack(
        "<HHIIHH", kind, ch, sr, sr * block & 0xFFFFFFFF, block & 0xFFFF, bits
    )
    if size is not None:
        at = data.index(b"data") + 4
        data[at : at + 4] = struct.pack("<I", size)
    return bytes(data)


def test_an_absurd_sample_rate_is_refused_before_it_is_resampled() -> None:
    # 64 KB declaring 1 Hz, resampled to 48 kHz: 1.5 billion samples (12 GB, 44 s) before.
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    started = time.monotonic()
    with pytest.raises(ValueError, match=f"limit of {MAX_AUDIO_SAMPLES:,}"):
        decode_audio(_wav(rate=1), sample_rate=48_000)
    assert time.monotonic() - started < 5
    assert (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before) / 1024 < 300
    with pytest.raises(ValueError, match="max_samples"):
        decode_audio(INPUTS["wav"][1], max_samples=1000)
    assert decode_audio(INPUTS["wav"][1], max_samples=None).samples.shape == (2, tm.RATE)
    with pytest.raises(ValueError, match="max_samples must be"):
        decode_audio(INPUTS["wav"][1], max_samples=0)


def test_many_channels_and_absurd_sizes_in_a_header_do_not_crash() -> None:
    many = decode_audio(_wav(channels=64), sample_rate=48_000)  # crashed PyAV when planar
    assert many.samples.shape[0] == 64
    assert decode_audio(_wav(size=0xFFFFFFF0)).samples.shape == (2, tm.RATE)
    for damaged in (_wav(channels=1000), _wav(rate=2**31 - 1)):
        try:
            audio = decode_audio(damaged, sample_rate=16_000)
        except ValueError:
            continue
        assert audio.samples.dtype == np.float32


def test_video_frames_over_the_pixel_limit_are_refused() -> None:
    data = INPUTS["mp4"][1]
    with pytest.raises(ValueError, match="limit of 1,000"):
        decode_video_frames(data, num_frames=2, max_pixels=1000)
    with pytest.raises(ValueError, match="limit of 1,000"):
        decode_video_frames(data, indices=[0], max_pixels=1000)
    assert decode_video_frames(data, indices=[0], max_pixels=None).shape == (1, 48, 64, 3)
