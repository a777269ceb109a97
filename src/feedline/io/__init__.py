"""Functions a pipeline stage calls to turn bytes into arrays, releasing the GIL where it counts.

Each function is stateless and thread-safe, and avoids copies: ``load_npy`` returns a view of
the bytes it is given, ``load_npz`` views stored members in place and inflates compressed ones
with ISA-L or zlib (which release the GIL while they work); ``decode_image`` decodes and
resizes pictures straight into a slot of a batch buffer with libjpeg-turbo and OpenCV.
"""

from __future__ import annotations

from ._headers import MAX_IMAGE_PIXELS
from .arrays import NpzArrays, load_npy, load_npz
from .buffers import BufferPool
from .images import decode_image, image_size
from .media import MAX_AUDIO_SAMPLES, Audio, decode_audio, decode_video_frames
from .transfer import to_jax, to_numpy, to_torch, transfer

__all__ = [
    "Audio",
    "BufferPool",
    "MAX_AUDIO_SAMPLES",
    "MAX_IMAGE_PIXELS",
    "NpzArrays",
    "decode_audio",
    "decode_image",
    "decode_video_frames",
    "image_size",
    "load_npy",
    "load_npz",
    "to_jax",
    "to_numpy",
    "to_torch",
    "transfer",
]
