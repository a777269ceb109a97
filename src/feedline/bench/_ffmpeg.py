"""Let SPDL's image decoding run where pip installed no FFmpeg: link it to PyAV's copy.

``spdl.io`` decodes through FFmpeg shared libraries that its wheel does not ship: on a machine
without a system FFmpeg, ``spdl.io.load_image`` fails ("Failed to import libspdl") and the
benchmark could not compare with it. PyAV's wheel (the ``video`` extra) bundles FFmpeg, under
names that its own build made unique (``libavcodec-5e6b81c2.so.62.28.102``). SPDL ships a
variant of its extension for each FFmpeg major version and asks for the plain sonames
(``libavcodec.so.62``). So :func:`spdl_env` makes a folder of links from those sonames to
PyAV's files, and the ``feedline bench`` command restarts itself once with that folder (and
PyAV's, where those libraries find their own dependencies) on ``LD_LIBRARY_PATH``: the
dynamic linker reads that variable only when a process starts.

Nothing changes for SPDL when it already loads, or when PyAV is not installed.
"""

from __future__ import annotations

import hashlib
import importlib.util
import os
import re
from pathlib import Path

__all__ = ["MARKER", "spdl_env"]

MARKER = "FEEDLINE_SPDL_FFMPEG"
"""Set in the environment of a restarted ``feedline bench``: it restarts only once."""

# libavcodec-5e6b81c2.so.62.28.102 -> libavcodec.so.62 (FFmpeg's libraries only)
_FFMPEG = "avcodec|avdevice|avfilter|avformat|avutil|postproc|swresample|swscale"
_BUNDLED = re.compile(rf"^(lib(?:{_FFMPEG}))-[0-9a-f]{{8}}\.so\.(\d+)(?:\.\d+)*$")


def _spdl_loads() -> bool:
    """Whether ``spdl.io`` finds an FFmpeg it can decode with in this process."""
    try:
        from spdl.io.lib import _import_libspdl

        _import_libspdl()
    except Exception:
        return False
    return True


def _pyav_libs() -> Path | None:
    """The folder of FFmpeg libraries bundled in PyAV's wheel, if PyAV is installed."""
    spec = importlib.util.find_spec("av")
    if spec is None or spec.origin is None:
        return None
    libs = Path(spec.origin).parent.parent / "av.libs"
    return libs if libs.is_dir() else None


def _link_folder(libs: Path, cache: Path) -> Path | None:
    """A folder of ``soname -> PyAV's file`` links (made once, reused).

    None if PyAV bundles no FFmpeg, or the folder cannot be written (a read-only cache).
    """
    links = {}
    for path in libs.iterdir():
        match = _BUNDLED.match(path.name)
        if match:
            links[f"{match[1]}.so.{match[2]}"] = path.resolve()
    if not links:
        return None
    # One folder per PyAV installation: two environments never overwrite each other's links.
    key = hashlib.sha256(str(libs.resolve()).encode()).hexdigest()[:16]
    folder = cache / "spdl-ffmpeg" / key
    try:
        folder.mkdir(parents=True, exist_ok=True)
        for name, target in links.items():
            link = folder / name
            if link.is_symlink() and Path(os.readlink(link)) == target:
                continue
            tmp = folder / f".{name}.{os.getpid()}"
            tmp.unlink(missing_ok=True)
            tmp.symlink_to(target)
            tmp.replace(link)  # atomic: another run may be making the same folder
    except OSError:
        return None
    return folder


def spdl_env(cache: Path) -> dict[str, str] | None:
    """The environment under which SPDL would find PyAV's FFmpeg, or None if not needed.

    None when SPDL is not installed, already loads, PyAV is not installed, or this process
    was already restarted with such an environment.
    """
    if os.environ.get(MARKER) or importlib.util.find_spec("spdl") is None:
        return None
    libs = _pyav_libs()
    if libs is None or _spdl_loads():
        return None
    folder = _link_folder(libs, cache)
    if folder is None:
        return None
    env = dict(os.environ)
    paths = [str(folder), str(libs), *filter(None, env.get("LD_LIBRARY_PATH", "").split(":"))]
    env["LD_LIBRARY_PATH"] = ":".join(paths)
    env[MARKER] = str(folder)
    return env
