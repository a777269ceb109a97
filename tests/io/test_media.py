from __future__ import annotations

import io
import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import numpy as np
import pytest

av = pytest.importorskip("av")

from feedline.io import BufferPool, media  # noqa: E402
from feedline.io.media import Audio, decode_audio, decode_video_frames  # noqa: E402

from .._system import starts_processes  # noqa: E402

N_FRAMES, HEIGHT, WIDTH = 40, 48, 64
RATE = 16_000


# -- synthetic media, encoded here with PyAV ------------------------------------------------------


def synthetic_frame(i: int, h: int = HEIGHT, w: int = WIDTH) -> np.ndarray:
    """A gradient moving right by 4 px a frame; blue carries the frame index (6 * i)."""
    yy, xx = np.mgrid[0:h, 0:w]
    img = np.empty((h, w, 3), np.uint8)
    img[..., 0] = (xx * 4 + i * 16) % 256
    img[..., 1] = (yy * 5) % 256
    img[..., 2] = i * 6
    return img


def encode_video(codec: str, fmt: str, n: int = N_FRAMES, audio: bool = False) -> bytes:
    buf = io.BytesIO()
    with av.open(buf, "w", format=fmt) as container:
        stream = container.add_stream(codec, rate=25)
        stream.width, stream.height, stream.pix_fmt = WIDTH, HEIGHT, "yuv420p"
        stream.bit_rate = 2_000_000  # high quality: blue must still tell the frame index
        sound = container.add_stream("aac", rate=RATE, layout="mono") if audio else None
        for i in range(n):
            frame = av.VideoFrame.from_ndarray(synthetic_frame(i), format="rgb24")
            container.mux(stream.encode(frame))
        container.mux(stream.encode())
        if sound is not None:
            samples = np.sin(np.arange(RATE, dtype=np.float32) * 0.1)[None]
            chunk = av.AudioFrame.from_ndarray(samples, format="fltp", layout="mono")
            chunk.sample_rate, chunk.pts = RATE, 0
            container.mux(sound.encode(chunk))
            container.mux(sound.encode())
    return buf.getvalue()


def encoder_available(name: str) -> bool:
    try:
        av.Codec(name, "w")
    except Exception:
        return False
    return True


VIDEO_KINDS = [
    pytest.param(("mpeg4", "mp4"), id="mpeg4-mp4"),  # the container declares its frame count
    pytest.param(  # no frame count in the header (counted by decoding); B-frames reorder
        ("libx264", "matroska"),
        id="h264-mkv",
        marks=pytest.mark.skipif(not encoder_available("libx264"), reason="no libx264"),
    ),
]


@pytest.fixture(scope="module", params=VIDEO_KINDS)
def clip(request: pytest.FixtureRequest) -> bytes:
    return encode_video(*request.param)


@pytest.fixture(scope="module")
def mp4() -> bytes:
    return encode_video("mpeg4", "mp4")


def frame_numbers(frames: np.ndarray) -> np.ndarray:
    """Which synthetic frame each one is, read from its blue channel."""
    return np.round(frames[..., 2].mean(axis=(1, 2)) / 6).astype(int)


def reference(data: bytes, **kwargs: Any) -> np.ndarray:
    """Every frame, decoded and converted by plain PyAV."""
    with av.open(io.BytesIO(data)) as container:
        frames = [f.to_ndarray(format="rgb24", **kwargs) for f in container.decode(video=0)]
    return np.stack(frames)


def sine_pair(n: int = RATE) -> np.ndarray:
    t = np.arange(n) / RATE
    return np.stack([0.5 * np.sin(2 * np.pi * 440 * t), 0.25 * np.sin(2 * np.pi * 1000 * t)])


def encode_audio(signal: np.ndarray, codec: str, fmt: str) -> bytes:
    """Encode (channels, samples) floats as 16-bit PCM through ``codec``."""
    layout = "stereo" if signal.shape[0] == 2 else "mono"
    pcm = np.round(signal * 32767).astype(np.int16)
    buf = io.BytesIO()
    with av.open(buf, "w", format=fmt) as container:
        stream = container.add_stream(codec, rate=RATE, layout=layout)
        stream.format = "s16"
        for start in range(0, pcm.shape[1], 1000):
            interleaved = np.ascontiguousarray(pcm[:, start : start + 1000].T).reshape(1, -1)
            frame = av.AudioFrame.from_ndarray(interleaved, format="s16", layout=layout)
            frame.sample_rate, frame.pts = RATE, start
            container.mux(stream.encode(frame))
        container.mux(stream.encode())
    return buf.getvalue()


@pytest.fixture(scope="module", params=[("pcm_s16le", "wav"), ("flac", "flac")], ids=str)
def stereo(request: pytest.FixtureRequest) -> bytes:
    return encode_audio(sine_pair(), *request.param)


def peak_hz(samples: np.ndarray, rate: int) -> float:
    spectrum = np.abs(np.fft.rfft(samples))
    return float(np.fft.rfftfreq(len(samples), 1 / rate)[spectrum.argmax()])


# -- video ----------------------------------------------------------------------------------------


def test_synthetic_frames_differ_and_carry_their_index(clip: bytes) -> None:
    ref = reference(clip)
    assert ref.shape == (N_FRAMES, HEIGHT, WIDTH, 3)
    np.testing.assert_array_equal(frame_numbers(ref), np.arange(N_FRAMES))


def test_indices_match_pyav_exactly(clip: bytes) -> None:
    indices = [0, 5, 39, 5, 12, 1]
    frames = decode_video_frames(clip, indices=indices)
    assert frames.dtype == np.uint8
    assert frames.shape == (len(indices), HEIGHT, WIDTH, 3)
    np.testing.assert_array_equal(frames, reference(clip)[indices])


def test_numpy_indices(mp4: bytes) -> None:
    frames = decode_video_frames(mp4, indices=np.array([3, 2], dtype=np.int64))
    np.testing.assert_array_equal(frames, reference(mp4)[[3, 2]])


def test_resized_frames_match_pyav(clip: bytes) -> None:
    frames = decode_video_frames(clip, indices=[2, 30], size=(24, 40))
    assert frames.shape == (2, 24, 40, 3)
    np.testing.assert_array_equal(frames, reference(clip, width=40, height=24)[[2, 30]])


def test_num_frames_spreads_evenly(clip: bytes) -> None:
    frames = decode_video_frames(clip, num_frames=5)
    expected = [0, 10, 20, 29, 39]  # round(linspace(0, 39, 5)) = round(0, 9.75, 19.5, 29.25, 39)
    np.testing.assert_array_equal(frames, reference(clip)[expected])
    np.testing.assert_array_equal(frame_numbers(frames), expected)


def test_num_frames_one_and_more_than_the_clip(mp4: bytes) -> None:
    ref = reference(mp4)
    np.testing.assert_array_equal(decode_video_frames(mp4, num_frames=1), ref[[0]])
    many = decode_video_frames(mp4, num_frames=2 * N_FRAMES)
    np.testing.assert_array_equal(many, ref[np.linspace(0, 39, 80).round().astype(int)])


def test_num_frames_when_the_container_overstates_its_count(
    mp4: bytes, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(media, "_count_frames", lambda data, max_pixels: 100)
    frames = decode_video_frames(mp4, num_frames=3)
    np.testing.assert_array_equal(frames, reference(mp4)[[0, 20, 39]])


def test_decoding_stops_at_the_last_wanted_frame(
    mp4: bytes, monkeypatch: pytest.MonkeyPatch
) -> None:
    pulled = []
    real_open = media._open

    class Counting:
        def __init__(self, container: Any) -> None:
            self._container = container

        def __getattr__(self, name: str) -> Any:
            return getattr(self._container, name)

        def decode(self, *args: Any) -> Iterator[Any]:
            for frame in self._container.decode(*args):
                pulled.append(frame)
                yield frame

    @contextmanager
    def counting_open(data: bytes, kind: str) -> Iterator[Any]:
        with real_open(data, kind) as container:
            yield Counting(container)

    monkeypatch.setattr(media, "_open", counting_open)
    decode_video_frames(mp4, indices=[7, 3])
    assert len(pulled) == 8


def test_out_writes_only_its_slot(clip: bytes) -> None:
    batch = np.full((3, 4, HEIGHT, WIDTH, 3), 7, dtype=np.uint8)
    slot = batch[1]
    result = decode_video_frames(clip, indices=[1, 2, 3, 4], out=slot)
    assert result is slot
    np.testing.assert_array_equal(batch[1], reference(clip)[[1, 2, 3, 4]])
    assert (batch[0] == 7).all()
    assert (batch[2] == 7).all()


def test_out_from_a_buffer_pool_with_resize(mp4: bytes) -> None:
    pool = BufferPool((2, 3, 24, 32, 3), count=1)
    batch = pool.acquire()
    batch[...] = 7
    decode_video_frames(mp4, num_frames=3, size=(24, 32), out=batch[1])
    np.testing.assert_array_equal(batch[1], reference(mp4, width=32, height=24)[[0, 20, 39]])
    assert (batch[0] == 7).all()


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({}, "exactly one of indices= .* got neither"),
        ({"indices": [0], "num_frames": 1}, "exactly one .* got both"),
        ({"indices": []}, "indices is empty"),
        ({"indices": [0, -1]}, "may not be negative, got -1"),
        ({"num_frames": 0}, "num_frames must be an int >= 1, got 0"),
        ({"num_frames": 2.0}, "num_frames must be an int >= 1, got 2.0"),
        ({"indices": [0], "size": (24,)}, r"size must be \(height, width\)"),
        ({"indices": [0], "size": (0, 8)}, "both >= 1"),
        ({"indices": [0], "size": (50_000, 50_000)}, "2,500,000,000 pixels, more than max_"),
        ({"indices": [0], "size": (10, 10), "max_pixels": 99}, "100 pixels"),
        ({"indices": [0, 1], "out": np.zeros((3, HEIGHT, WIDTH, 3), np.uint8)}, "2 frames"),
        ({"indices": [0], "out": np.zeros((1, HEIGHT, WIDTH, 3), np.float32)}, "uint8 array"),
        ({"indices": [0], "out": np.zeros((1, HEIGHT, WIDTH), np.uint8)}, "uint8 array"),
        (
            {"indices": [0], "size": (8, 8), "out": np.zeros((1, 8, 9, 3), np.uint8)},
            r"\(1, 8, 8, 3\)",
        ),
        ({"indices": [0], "out": np.zeros((1, 8, 8, 3), np.uint8)}, "pass size="),
    ],
)
def test_invalid_arguments(mp4: bytes, kwargs: dict[str, Any], match: str) -> None:
    with pytest.raises(ValueError, match=match):
        decode_video_frames(mp4, **kwargs)


def test_out_of_range_index_names_the_range(clip: bytes) -> None:
    with pytest.raises(ValueError, match=r"index 40 is out of range: .* 40 frames.*\[0, 39\]"):
        decode_video_frames(clip, indices=[3, 40])


def test_read_only_out(mp4: bytes) -> None:
    out = np.zeros((1, HEIGHT, WIDTH, 3), np.uint8)
    out.flags.writeable = False
    with pytest.raises(ValueError, match="read-only"):
        decode_video_frames(mp4, indices=[0], out=out)


def test_wrong_types(mp4: bytes) -> None:
    with pytest.raises(TypeError, match="got str"):
        decode_video_frames("clip.mp4", indices=[0])  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="indices must be ints"):
        decode_video_frames(mp4, indices=[0.5])  # type: ignore[list-item]


def test_bytearray_and_memoryview(mp4: bytes) -> None:
    ref = reference(mp4)[[4]]
    np.testing.assert_array_equal(decode_video_frames(bytearray(mp4), indices=[4]), ref)
    np.testing.assert_array_equal(decode_video_frames(memoryview(mp4), indices=[4]), ref)


@pytest.mark.parametrize(
    "make_bad",
    [
        pytest.param(lambda good: np.random.default_rng(0).bytes(5000), id="random"),
        pytest.param(lambda good: good[: len(good) // 2], id="first-half"),
        pytest.param(lambda good: good[:-300], id="tail-cut"),
        pytest.param(lambda good: b"\0" * 64, id="zeros"),
    ],
)
def test_malformed_media_raises_value_error(mp4: bytes, make_bad: Any) -> None:
    bad = make_bad(mp4)
    with pytest.raises(ValueError, match="cannot decode the video of these"):
        decode_video_frames(bad, indices=[0])
    with pytest.raises(ValueError, match="cannot decode the audio of these"):
        decode_audio(bad)


def test_empty_data() -> None:
    with pytest.raises(ValueError, match="empty data"):
        decode_video_frames(b"", num_frames=1)
    with pytest.raises(ValueError, match="empty data"):
        decode_audio(b"")


def test_corrupted_bytes_give_frames_or_value_error(clip: bytes) -> None:
    rng = np.random.default_rng(1)
    for _ in range(20):
        bad = bytearray(clip)
        at = rng.integers(0, len(bad), 8)
        bad_values = rng.integers(0, 256, 8)
        for i, v in zip(at, bad_values, strict=True):
            bad[i] = v
        try:
            frames = decode_video_frames(bad, num_frames=4)
        except ValueError:
            continue
        assert frames.shape[0] == 4
        assert frames.dtype == np.uint8


def test_missing_streams(mp4: bytes) -> None:
    with pytest.raises(ValueError, match="no audio stream; it has: video"):
        decode_audio(mp4)
    with pytest.raises(ValueError, match="no video stream; it has: audio"):
        decode_video_frames(encode_audio(sine_pair(1000), "pcm_s16le", "wav"), indices=[0])


def test_video_and_audio_in_one_file() -> None:
    data = encode_video("mpeg4", "mp4", n=10, audio=True)
    np.testing.assert_array_equal(decode_video_frames(data, indices=[9]), reference(data)[[9]])
    audio = decode_audio(data)
    assert audio.sample_rate == RATE
    assert audio.samples.shape[0] == 1
    assert audio.samples.shape[1] >= RATE  # AAC adds its encoder delay


# -- audio ----------------------------------------------------------------------------------------


def test_audio_equals_the_lossless_original(stereo: bytes) -> None:
    audio = decode_audio(stereo)
    assert isinstance(audio, Audio)
    assert audio.sample_rate == RATE
    assert audio.samples.dtype == np.float32
    assert audio.samples.shape == (2, RATE)
    assert audio.duration == pytest.approx(1.0)
    pcm = np.round(sine_pair() * 32767)
    np.testing.assert_array_equal(audio.samples, (pcm / 32768).astype(np.float32))
    np.testing.assert_allclose(audio.samples, sine_pair(), atol=1 / 32767)


def test_audio_equals_pyav_decode(stereo: bytes) -> None:
    with av.open(io.BytesIO(stereo)) as container:
        interleaved = np.concatenate([f.to_ndarray() for f in container.decode(audio=0)], axis=1)
    assert interleaved.dtype == np.int16
    expected = interleaved.reshape(-1, 2).T / 32768
    np.testing.assert_array_equal(decode_audio(stereo).samples, expected.astype(np.float32))


@pytest.mark.parametrize("rate", [8_000, 22_050, 44_100])
def test_resampling_keeps_length_and_pitch(stereo: bytes, rate: int) -> None:
    audio = decode_audio(stereo, sample_rate=rate)
    assert audio.sample_rate == rate
    assert audio.samples.shape[0] == 2
    assert abs(audio.samples.shape[1] - rate) <= 2  # one second of sound
    assert peak_hz(audio.samples[0], rate) == pytest.approx(440, abs=1.5)
    assert peak_hz(audio.samples[1], rate) == pytest.approx(1000, abs=1.5)
    middle = audio.samples[0, rate // 4 : 3 * rate // 4]
    assert np.abs(middle).max() == pytest.approx(0.5, abs=0.01)


def test_mono_is_the_mean_of_the_channels(stereo: bytes) -> None:
    both = decode_audio(stereo).samples
    mono = decode_audio(stereo, mono=True)
    assert mono.samples.shape == (1, RATE)
    np.testing.assert_allclose(mono.samples[0], both.mean(axis=0), atol=1e-7)
    resampled = decode_audio(stereo, mono=True, sample_rate=8_000)
    assert resampled.samples.shape[0] == 1
    assert abs(resampled.samples.shape[1] - 8_000) <= 2


def test_mono_source_stays_mono() -> None:
    data = encode_audio(sine_pair()[:1], "flac", "flac")
    audio = decode_audio(data, mono=True)
    assert audio.samples.shape == (1, RATE)
    np.testing.assert_allclose(audio.samples[0], sine_pair()[0], atol=1 / 32767)


@pytest.mark.parametrize("rate", [0, -8000, 8000.0, True])
def test_invalid_sample_rate(stereo: bytes, rate: Any) -> None:
    with pytest.raises(ValueError, match="sample_rate must be a positive int"):
        decode_audio(stereo, sample_rate=rate)


# -- packaging ------------------------------------------------------------------------------------


@starts_processes
def test_importing_the_module_does_not_import_av() -> None:
    code = "import sys, feedline.io.media; print('av' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


def test_missing_pyav_says_how_to_install(mp4: bytes, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "av", None)  # makes `import av` raise ImportError
    with pytest.raises(ImportError, match=r"pip install 'feedline\[video\]'"):
        decode_video_frames(mp4, indices=[0])
    with pytest.raises(ImportError, match=r"pip install 'feedline\[video\]'"):
        decode_audio(mp4)


def test_bytes_that_name_other_files_open_none_of_them(
    tmp_path: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    # An FFmpeg concat list (a playlist, too) names files for FFmpeg to open: a sample's
    # bytes must never read the job's own files (relative paths pass FFmpeg's safe mode), nor
    # wait on one such as dev/stdin.
    (tmp_path / "secret.mp4").write_bytes(encode_video("mpeg4", "mp4"))
    (tmp_path / "secret.wav").write_bytes(encode_audio(sine_pair(), "pcm_s16le", "wav"))
    monkeypatch.chdir(tmp_path)
    video = (tmp_path / "secret.mp4").read_bytes()
    assert decode_video_frames(video, num_frames=2).shape[0] == 2  # the file itself decodes
    listing = b"ffconcat version 1.0\nfile 'secret.mp4'\n"
    with pytest.raises(ValueError, match="cannot decode"):
        decode_video_frames(listing, num_frames=2)
    with pytest.raises(ValueError, match="cannot decode"):
        decode_audio(b"ffconcat version 1.0\nfile 'secret.wav'\n")


@starts_processes
def test_decoded_audio_peaks_near_one_copy_of_its_samples() -> None:
    # A WAV of 700 samples at 1 Hz, resampled to 48 kHz: 128 MiB of output, made of small
    # frames. The peak resident size grows by about the output, not twice it (the frames'
    # samples gathered apart and then joined held both).
    script = """
import resource, struct
from feedline.io import decode_audio
n = 700
fmt = struct.pack("<HHIIHH", 1, 1, 1, 2, 2, 16)
body = b"WAVE" + b"fmt " + struct.pack("<I", 16) + fmt + b"data" + struct.pack("<I", 2 * n)
body += b"\\x01\\x00" * n
data = b"RIFF" + struct.pack("<I", len(body)) + body
decode_audio(data, sample_rate=480)  # warm up
before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
audio = decode_audio(data, sample_rate=48_000)
grown = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before
print(audio.samples.nbytes // 1024, grown)
"""
    done = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=120, check=False
    )
    assert done.returncode == 0, done.stderr
    output_kib, grown_kib = (int(v) for v in done.stdout.split())
    assert output_kib > 100 * 1024
    assert grown_kib < 1.4 * output_kib, f"peak grew {grown_kib} KiB for {output_kib} KiB"
