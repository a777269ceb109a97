"""Decode video frames and audio from media files held in memory, through PyAV (FFmpeg).

* :func:`decode_video_frames` decodes a clip sequentially and converts only the frames asked
  for to RGB (optionally resized), stopping at the last one; the frames go into a new
  ``(N, H, W, 3)`` uint8 array or into ``out``, e.g. a slot of a :class:`BufferPool` batch.
* :func:`decode_audio` decodes the first audio stream to float32 ``(channels, samples)``,
  resampled to the rate asked for, and returns it with its rate as :class:`Audio`.

The heavy parts run outside the GIL: demuxing and decoding (libavformat, libavcodec), the
conversion to RGB and resizing (libswscale), resampling (libswresample, in a filter graph)
and NumPy's copy into the output. The container is read from an ``io.BytesIO`` (no temporary
file) and always closed. PyAV is optional: ``pip install 'feedline[video]'``.

Decoder threading is left at PyAV's default (slice threads). Frame threading
(``thread_type="AUTO"``) was slower for H.264 in our measurements, delays each frame by one
per thread (wasted work when decoding stops early) and multiplies threads in a pipeline that
already decodes many clips at once.

Any input FFmpeg cannot read (random bytes, an empty or truncated file, a corrupt stream)
raises :class:`ValueError` naming FFmpeg's reason, as does a file without the stream asked for.
"""

from __future__ import annotations

import io
import operator
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, SupportsIndex

import numpy as np

from ._headers import MAX_IMAGE_PIXELS, check_pixels

if TYPE_CHECKING:
    from av.audio.stream import AudioStream
    from av.container import InputContainer
    from av.video.stream import VideoStream

__all__ = ["MAX_AUDIO_SAMPLES", "Audio", "decode_audio", "decode_video_frames"]

MAX_AUDIO_SAMPLES = 1 << 27
"""The default limit on the samples (all channels together) ``decode_audio`` returns: 512 MiB
of float32, about 70 minutes of 16 kHz stereo. A file of a few kilobytes that declares a
sample rate of 1 Hz, resampled to 48 kHz, would otherwise decode to gigabytes."""

MediaBytes = bytes | bytearray | memoryview

_INSTALL_HINT = "pip install 'feedline[video]'"
_NO_FRAMES = "the video stream has no frames to decode (it is empty, or the file is truncated)"


@dataclass(frozen=True, eq=False)
class Audio:
    """Decoded audio: the samples and their rate.

    Attributes:
        samples: float32 array of shape ``(channels, samples)``: one row per channel (planar,
            the layout FFmpeg calls ``fltp``), values nominally in ``[-1, 1]``.
        sample_rate: Samples per second per channel.

    """

    samples: np.ndarray[Any, np.dtype[np.float32]]
    sample_rate: int

    @property
    def duration(self) -> float:
        """Length in seconds."""
        return float(self.samples.shape[1]) / self.sample_rate


def _check_data(data: MediaBytes) -> MediaBytes:
    if not isinstance(data, (bytes, bytearray, memoryview)):
        raise TypeError(
            f"expected the bytes of a media file (bytes, bytearray or memoryview), got "
            f"{type(data).__name__}; read a file with Path.read_bytes() first"
        )
    if len(data) == 0:  # FFmpeg would say "invalid data"; the cause is simpler
        raise ValueError("cannot decode empty data (0 bytes); the file was probably not read")
    return data


@contextmanager
def _open(data: MediaBytes, kind: str) -> Iterator[InputContainer]:
    """Open ``data`` as a container; FFmpeg's errors inside the block become ValueError."""
    try:
        import av
    except ImportError as error:
        raise ImportError(f"decoding {kind} needs PyAV: {_INSTALL_HINT}") from error
    try:
        # Metadata is never used here: undecodable tags must not fail an otherwise good file.
        # No protocol: a playlist or concat list in the bytes must not make FFmpeg open other
        # files (or block on one, such as dev/stdin); the data itself needs none.
        options = {"protocol_whitelist": "none"}
        with av.open(
            io.BytesIO(data), mode="r", metadata_errors="ignore", options=options
        ) as container:
            yield container
    except av.error.FFmpegError as error:
        reason = error.strerror or str(error)
        raise ValueError(
            f"cannot decode the {kind} of these {len(data)} bytes: FFmpeg says {reason!r} "
            f"({type(error).__name__}); the data is not a media file FFmpeg can read, or it "
            "is truncated or corrupt"
        ) from error


def _first_stream(container: InputContainer, kind: str) -> Any:
    streams = container.streams.video if kind == "video" else container.streams.audio
    if not streams:
        found = ", ".join(sorted({s.type for s in container.streams})) or "no streams at all"
        raise ValueError(
            f"the media ({container.format.name}) has no {kind} stream; it has: {found}"
        )
    return streams[0]


def _check_size(size: tuple[int, int] | None) -> tuple[int, int] | None:
    if size is None:
        return None
    try:
        height, width = (operator.index(d) for d in size)
    except (TypeError, ValueError):
        raise ValueError(f"size must be (height, width), two ints, got {size!r}") from None
    if height < 1 or width < 1:
        raise ValueError(f"size must be (height, width) with both >= 1, got {size!r}")
    return height, width


def _check_out(out: np.ndarray[Any, Any], n: int, size: tuple[int, int] | None) -> None:
    expected = f"({n}, {size[0]}, {size[1]}, 3)" if size else f"({n}, height, width, 3)"
    if not isinstance(out, np.ndarray) or out.dtype != np.uint8 or out.ndim != 4:
        got = f"{out.dtype} array of shape {out.shape}" if isinstance(out, np.ndarray) else out
        raise ValueError(f"out must be a uint8 array of shape {expected}, got {got!r}")
    if out.shape[0] != n or out.shape[3] != 3 or (size and out.shape[1:3] != size):
        raise ValueError(f"out must have shape {expected} ({n} frames requested), got {out.shape}")
    if not out.flags.writeable:
        raise ValueError("out is read-only; pass a writable array")


def _check_stream(stream: Any, max_pixels: int | None) -> None:
    # A damaged header can leave a stream without a codec context (found by fuzzing).
    context = stream.codec_context
    if context is None:
        raise ValueError("the video stream has no decoder settings: the file is corrupt")
    _check_frame(context.width, context.height, max_pixels)


def _check_frame(width: int, height: int, max_pixels: int | None) -> None:
    try:
        check_pixels(height, width, max_pixels)
    except ValueError as error:
        raise ValueError(f"video frames: {error}") from None


def _decode(
    data: MediaBytes,
    indices: list[int],
    size: tuple[int, int] | None,
    out: np.ndarray[Any, Any] | None,
    max_pixels: int | None,
) -> tuple[np.ndarray[Any, Any] | None, int]:
    """Decode up to the last wanted frame; (frames, frames seen), frames None if it ran out."""
    slots: dict[int, list[int]] = {}
    for slot, index in enumerate(indices):
        slots.setdefault(index, []).append(slot)
    last = max(slots)
    target = out
    seen = 0
    with _open(data, "video") as container:
        stream: VideoStream = _first_stream(container, "video")
        _check_stream(stream, max_pixels)
        for frame in container.decode(stream):
            wanted = slots.get(seen)
            if wanted is not None:
                _check_frame(frame.width, frame.height, max_pixels)
                # to_ndarray views the converted frame's memory; the assignment copies it.
                if size is None:
                    rgb = frame.to_ndarray(format="rgb24")
                else:
                    rgb = frame.to_ndarray(width=size[1], height=size[0], format="rgb24")
                if target is None:
                    target = np.empty((len(indices), *rgb.shape), dtype=np.uint8)
                elif rgb.shape != target.shape[1:]:
                    raise ValueError(
                        f"frame {seen} decodes to {rgb.shape[1]}x{rgb.shape[0]} (width x "
                        f"height), but the output holds {target.shape[2]}x{target.shape[1]}; "
                        "pass size=(height, width) to resize every frame to one size"
                    )
                for slot in wanted:
                    target[slot] = rgb
            seen += 1
            if seen > last:
                return target, seen  # stop: nothing after the last wanted frame is decoded
    return None, seen


def _count_frames(data: MediaBytes, max_pixels: int | None) -> int:
    with _open(data, "video") as container:
        stream: VideoStream = _first_stream(container, "video")
        _check_stream(stream, max_pixels)
        if stream.frames > 0:
            return stream.frames
        return sum(1 for _ in container.decode(stream))


def _spread(count: int, num_frames: int) -> list[int]:
    return [int(i) for i in np.linspace(0, count - 1, num_frames).round()]


def decode_video_frames(
    data: MediaBytes,
    *,
    indices: Iterable[SupportsIndex] | None = None,
    num_frames: int | None = None,
    size: tuple[int, int] | None = None,
    out: np.ndarray[Any, Any] | None = None,
    max_pixels: int | None = MAX_IMAGE_PIXELS,
) -> np.ndarray[Any, np.dtype[np.uint8]]:
    """Decode chosen frames of a video file (mp4, webm, mkv, ...) to RGB.

    Frames are numbered from 0 in the order the decoder outputs them (presentation order).
    The clip is decoded from its start up to the last frame wanted, and only the wanted
    frames are converted to RGB. Frames keep their stored size unless ``size`` is given:
    neither the pixel aspect ratio nor a rotation tag is applied.

    With ``num_frames``, the frame count is the container's (``stream.frames``) when it
    declares one (mp4 and avi do); otherwise (webm, mkv) the clip is decoded once more just
    to count. If the clip turns out to be shorter than declared, the frames are picked again
    over the frames it really has.

    Args:
        data: The whole file (``bytes``, ``bytearray`` or ``memoryview``).
        indices: The frames to return, in this order (repeats allowed), e.g. ``[0, 8, 16]``
            or a NumPy array of ints.
        num_frames: Return this many frames spread evenly over the clip: those at
            ``round(linspace(0, count - 1, num_frames))``, first and last included (repeated
            when ``num_frames`` exceeds the frame count). Give ``indices`` or this, not both.
        size: ``(height, width)`` to resize every frame to (bilinear, by libswscale).
        out: A uint8 array of shape ``(N, H, W, 3)`` to write the frames into (e.g.
            ``batch[i]`` of a :class:`~feedline.io.BufferPool` batch), where N is the number
            of frames asked for. On an error it may be partly written.
        max_pixels: Refuse a video whose frames have more pixels than this (default:
            :data:`~feedline.io.MAX_IMAGE_PIXELS`, as for pictures), checked from the
            stream's header before decoding and on each frame converted; ``None`` lifts it.

    Returns:
        uint8 RGB frames of shape ``(N, H, W, 3)``: ``out`` itself when given.

    Raises:
        ValueError: If not exactly one of ``indices`` and ``num_frames`` is given, an index is
            negative or past the last frame, ``size`` or ``out`` is malformed, frames differ
            in size while ``size`` is not given, the data has no video stream, or FFmpeg
            cannot read it (not a media file, truncated, corrupt).
        TypeError: If ``data`` is not bytes-like or an index is not an int.
        ImportError: If PyAV is not installed.

    Example::

        clip = decode_video_frames(data, num_frames=16, size=(224, 224))  # (16, 224, 224, 3)
        decode_video_frames(data, indices=[0, 4, 8], out=batch[i])         # into a batch slot

    """
    data = _check_data(data)
    if (indices is None) == (num_frames is None):
        raise ValueError(
            "give exactly one of indices= (which frames) and num_frames= (how many, spread "
            f"evenly), got {'both' if indices is not None else 'neither'}"
        )
    target_size = _check_size(size)
    if target_size is not None and max_pixels is not None:
        height, width = target_size
        if height * width > max_pixels:
            raise ValueError(
                f"size={size!r} asks for frames of {height * width:,} pixels, more than "
                f"max_pixels={max_pixels:,}; ask for a smaller size, or raise max_pixels"
            )
    if indices is not None:
        try:
            wanted = [operator.index(i) for i in indices]
        except TypeError:
            raise TypeError(f"indices must be ints, got {indices!r}") from None
        if not wanted:
            raise ValueError("indices is empty; ask for at least one frame")
        if min(wanted) < 0:
            raise ValueError(
                f"frame indices count from 0 and may not be negative, got {min(wanted)}"
            )
        n = len(wanted)
    else:
        if isinstance(num_frames, bool) or not isinstance(num_frames, int) or num_frames < 1:
            raise ValueError(f"num_frames must be an int >= 1, got {num_frames!r}")
        n = num_frames
    if out is not None:
        _check_out(out, n, target_size)

    if indices is not None:
        frames, seen = _decode(data, wanted, target_size, out, max_pixels)
        if seen == 0:
            raise ValueError(_NO_FRAMES)
        if frames is None:
            raise ValueError(
                f"frame index {max(wanted)} is out of range: the video has {seen} frames, "
                f"so indices must be in [0, {seen - 1}]"
            )
        return frames

    count = _count_frames(data, max_pixels)
    for _ in range(2):  # a second try only if the container overstated its frame count
        if count == 0:
            raise ValueError(_NO_FRAMES)
        frames, seen = _decode(data, _spread(count, n), target_size, out, max_pixels)
        if frames is not None:
            return frames
        count = seen
    raise ValueError("the video stream yields a different number of frames on each decode")


def _planes(frame: Any) -> np.ndarray[Any, Any]:
    """An interleaved float frame as ``(channels, samples)``."""
    channels = max(frame.layout.nb_channels, 1)
    return frame.to_ndarray().reshape(-1, channels).T  # type: ignore[no-any-return]


class _Blocks:
    """Samples gathered as they are decoded, in blocks of :data:`_BLOCK` per channel.

    A frame's few thousand samples each in an array of their own would stay in the heap
    after :meth:`joined` copied them out: the peak would hold the audio twice. Blocks are
    large enough to be mappings of their own, each unmapped once copied.
    """

    def __init__(self) -> None:
        self.blocks: list[np.ndarray[Any, np.dtype[np.float32]]] = []
        self.used = _BLOCK  # samples per channel in the last block

    def add(self, chunk: np.ndarray[Any, Any]) -> None:
        at, n = 0, chunk.shape[1]
        while at < n:
            if self.used == _BLOCK:
                self.blocks.append(np.empty((chunk.shape[0], _BLOCK), dtype=np.float32))
                self.used = 0
            k = min(n - at, _BLOCK - self.used)
            self.blocks[-1][:, self.used : self.used + k] = chunk[:, at : at + k]
            self.used, at = self.used + k, at + k

    def joined(self, channels: int) -> np.ndarray[Any, np.dtype[np.float32]]:
        """All the samples as ``(channels, samples)``; the blocks are let go."""
        blocks = self.blocks
        if not blocks:
            return np.zeros((channels, 0), dtype=np.float32)
        length = (len(blocks) - 1) * _BLOCK + self.used
        samples = np.empty((blocks[0].shape[0], length), dtype=np.float32)
        blocks.reverse()
        at = 0
        while blocks:
            block = blocks.pop()
            k = min(_BLOCK, length - at)
            samples[:, at : at + k] = block[:, :k]
            at += k
            del block
        return samples


_BLOCK = 1 << 23
"""Samples per channel in a block of :class:`_Blocks`: 32 MiB a channel (and the array's
header), past the size above which glibc maps an allocation of its own however it has tuned
that threshold (32 MiB at most); only the pages written are taken."""


def _check_samples(samples: float, max_samples: int | None) -> None:
    if max_samples is not None and samples > max_samples:
        raise ValueError(
            f"the audio would decode to about {samples:,.0f} samples (all channels), more "
            f"than the limit of {max_samples:,} (max_samples=): an absurd declared duration "
            "or sample rate, or a very long file. Pass a larger max_samples, or None, to "
            "decode it anyway"
        )


def decode_audio(
    data: MediaBytes,
    *,
    sample_rate: int | None = None,
    mono: bool = False,
    max_samples: int | None = MAX_AUDIO_SAMPLES,
) -> Audio:
    """Decode the first audio stream of a file (wav, flac, mp3, m4a, ogg, a video...).

    Samples are converted to float32 and resampled by libswresample when ``sample_rate``
    differs from the stream's; the resampler is flushed at the end, so no sample is lost.
    If the stream changes its format, layout or rate midway, later parts are converted to
    what it started with. Lossy codecs may add samples at the start (AAC's encoder delay):
    they are kept, as FFmpeg decodes them.

    Args:
        data: The whole file (``bytes``, ``bytearray`` or ``memoryview``).
        sample_rate: Resample to this rate (Hz); ``None`` keeps the stream's own rate.
        mono: Mix all channels down to one: their mean (as ``librosa.to_mono``), so a signal
            present in every channel keeps its amplitude. Every channel weighs the same
            (a surround file's LFE too); FFmpeg's own downmix would scale stereo by 1/sqrt(2)
            per channel, raising such a signal by 3 dB.
        max_samples: Refuse to return more samples than this, all channels together
            (default :data:`MAX_AUDIO_SAMPLES`, 512 MiB of float32); checked from the
            stream's declared duration before decoding, and before each frame is resampled,
            so a tiny file that declares an absurd duration or sample rate costs nothing.
            ``None`` lifts it.

    Returns:
        :class:`Audio` with ``samples`` of shape ``(channels, samples)`` (one row per channel;
        one row when ``mono``) and its ``sample_rate``.

    Raises:
        ValueError: If ``sample_rate`` is not a positive int, the data has no audio stream,
            FFmpeg cannot read it (not a media file, truncated, corrupt), or it would decode
            to more than ``max_samples`` samples.
        TypeError: If ``data`` is not bytes-like.
        ImportError: If PyAV is not installed.

    Example::

        audio = decode_audio(data, sample_rate=16_000, mono=True)
        audio.samples.shape  # (1, 16_000 * seconds)

    """
    data = _check_data(data)
    if sample_rate is not None and (
        isinstance(sample_rate, bool) or not isinstance(sample_rate, int) or sample_rate < 1
    ):
        raise ValueError(f"sample_rate must be a positive int (Hz) or None, got {sample_rate!r}")
    if max_samples is not None and (
        isinstance(max_samples, bool) or not isinstance(max_samples, int) or max_samples < 1
    ):
        raise ValueError(f"max_samples must be an int >= 1 or None, got {max_samples!r}")
    gathered = _Blocks()
    total = 0.0  # samples (all channels) returned so far, and about to be
    rate = sample_rate or 0
    with _open(data, "audio") as container:
        import av  # _open has checked that it is installed

        stream: AudioStream = _first_stream(container, "audio")
        if stream.codec_context is None:
            raise ValueError("the audio stream has no decoder settings: the file is corrupt")
        channels = max(stream.codec_context.layout.nb_channels, 1)
        if stream.duration and stream.time_base and stream.rate:
            seconds = float(stream.duration * stream.time_base)
            _check_samples(seconds * (sample_rate or stream.rate) * channels, max_samples)
        resampler = av.AudioResampler()  # replaced at the first frame
        layout: Any = None
        source: tuple[str, str, int] | None = None
        for frame in container.decode(stream):
            this = (frame.format.name, frame.layout.name, frame.sample_rate)
            if this != source:  # the first frame, or the stream changed midway
                for f in resampler.resample(None):
                    gathered.add(_planes(f))
                if source is None:
                    rate = rate or frame.sample_rate
                    layout = frame.layout
                source = this
                # Interleaved ("flt"), not planar: PyAV reads at most 8 planes of a frame, and
                # a planar frame of more channels (a corrupt header says 64) crashed it.
                resampler = av.AudioResampler(format="flt", layout=layout, rate=rate)
            # Before resampling: a frame at 1 Hz resampled to 48 kHz grows 48,000-fold.
            total += frame.samples * rate / max(frame.sample_rate, 1) * layout.nb_channels
            _check_samples(total, max_samples)
            for f in resampler.resample(frame):
                gathered.add(_planes(f))
        for f in resampler.resample(None):  # flush
            gathered.add(_planes(f))
        rate = rate or stream.rate or 0
    if rate < 1:
        raise ValueError("the audio stream declares no sample rate; it cannot be decoded")
    samples = gathered.joined(channels)  # no frame at all: the stream's channel count
    if mono and samples.shape[0] > 1:
        samples = samples.mean(axis=0, keepdims=True, dtype=np.float32)
    return Audio(samples, rate)
