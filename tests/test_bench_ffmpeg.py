"""Linking SPDL to PyAV's FFmpeg, so that ``feedline bench`` can compare with SPDL's decoding."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from feedline.bench import _ffmpeg
from feedline.bench._registry import SMOKE_ENV

from ._system import starts_processes

needs_spdl_and_av = pytest.mark.skipif(
    importlib.util.find_spec("spdl") is None or importlib.util.find_spec("av") is None,
    reason="needs spdl and PyAV (pip install 'feedline[test]')",
)


def test_link_folder_maps_sonames_to_bundled_ffmpeg(tmp_path: Path) -> None:
    libs = tmp_path / "av.libs"
    libs.mkdir()
    for name in (
        "libavcodec-5e6b81c2.so.62.28.102",
        "libavutil-5809ad29.so.60.26.102",
        "libswscale-88e9f973.so.9.5.102",
        "libpostproc-0a1b2c3d.so.59.1.100",
        "libdrm-b0291a67.so.2.4.0",  # not FFmpeg's: no link
        "libavif-1a2b3c4d.so.16.0.1",  # not FFmpeg's either, whatever its prefix
        "libavformat.so.62",  # not a bundled name: no link
    ):
        (libs / name).write_bytes(b"")
    folder = _ffmpeg._link_folder(libs, tmp_path / "cache")
    assert folder is not None
    links = {p.name: p for p in folder.iterdir()}
    assert sorted(links) == [
        "libavcodec.so.62",
        "libavutil.so.60",
        "libpostproc.so.59",
        "libswscale.so.9",
    ]
    assert links["libavcodec.so.62"].resolve() == (libs / "libavcodec-5e6b81c2.so.62.28.102")
    # Made again (a second run, or one racing it): the same links, nothing else left behind.
    again = _ffmpeg._link_folder(libs, tmp_path / "cache")
    assert again == folder
    assert sorted(p.name for p in folder.iterdir()) == sorted(links)


def test_link_folder_without_ffmpeg_is_none(tmp_path: Path) -> None:
    libs = tmp_path / "av.libs"
    libs.mkdir()
    (libs / "libz-1a2b3c4d.so.1.2.3").write_bytes(b"")
    assert _ffmpeg._link_folder(libs, tmp_path / "cache") is None
    assert not (tmp_path / "cache").exists()


def test_an_unwritable_cache_leaves_spdl_out(tmp_path: Path) -> None:
    libs = tmp_path / "av.libs"
    libs.mkdir()
    (libs / "libavutil-5809ad29.so.60.26.102").write_bytes(b"")
    not_a_folder = tmp_path / "cache"
    not_a_folder.write_bytes(b"")  # mkdir under it fails, as in a read-only cache
    assert _ffmpeg._link_folder(libs, not_a_folder) is None


def test_restarted_process_is_not_restarted_again(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(_ffmpeg.MARKER, str(tmp_path))
    assert _ffmpeg.spdl_env(tmp_path) is None


@needs_spdl_and_av
def test_spdl_decodes_with_pyav_ffmpeg(tmp_path: Path) -> None:
    env = _ffmpeg.spdl_env(tmp_path)
    if env is None:  # pragma: no cover - a machine whose FFmpeg SPDL already finds
        pytest.skip("SPDL already loads FFmpeg here: nothing to link")
    code = (
        "from feedline.bench.decode import spdl_decoder\n"
        "from feedline.bench._data import natural_image\n"
        "import cv2\n"
        "decode, why = spdl_decoder()\n"
        "assert decode is not None, why\n"
        "import numpy as np\n"
        "picture = natural_image(np.random.default_rng(1), 300, 400)\n"
        "ok, jpeg = cv2.imencode('.jpg', picture)\n"
        "print(decode(jpeg.tobytes()).shape)\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "(224, 224, 3)"


@needs_spdl_and_av
@pytest.mark.slow
@starts_processes  # a subprocess that imports torch and runs a scenario
def test_bench_command_restarts_once_and_compares_with_spdl(tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items() if k != _ffmpeg.MARKER}
    env["XDG_CACHE_HOME"] = str(tmp_path / "xdg")
    env[SMOKE_ENV] = "1"  # the least the scenario does, SPDL's contender included
    out = tmp_path / "out"
    (tmp_path / "data").mkdir()
    args = ["decode", "--quick", "--data", str(tmp_path / "data"), "--out", str(out)]
    done = subprocess.run(
        [sys.executable, "-m", "feedline", "bench", *args],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr
    if _ffmpeg._spdl_loads():  # pragma: no cover - SPDL found an FFmpeg without help
        return
    assert done.stderr.count("restarting with PyAV's FFmpeg") == 1
    contenders = {
        m["contender"] for m in json.loads((out / "decode.json").read_text())["measurements"]
    }
    assert "SPDL" in contenders


class _Stop(Exception):
    pass


def test_only_the_command_restarts_and_with_the_same_interpreter_arguments(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    import feedline.bench
    from feedline import cli

    restarts: list[tuple[str, list[str], dict[str, str]]] = []

    def execve(exe: str, args: list[str], env: dict[str, str]) -> None:
        restarts.append((exe, args, env))
        raise _Stop("restarted")

    def ran(*args: object, **kwargs: object) -> None:
        raise _Stop("ran in this process")

    env = {_ffmpeg.MARKER: "/links", "LD_LIBRARY_PATH": "/links"}
    monkeypatch.setattr(_ffmpeg, "spdl_env", lambda cache: env)
    monkeypatch.setattr(cli.os, "execve", execve)
    monkeypatch.setattr(feedline.bench, "run_scenarios", ran)
    command = ["bench", "decode", "--quick"]
    monkeypatch.setattr(sys, "argv", ["feedline", *command])
    monkeypatch.setattr(sys, "orig_argv", ["python", "-X", "dev", "/venv/bin/feedline", *command])

    with pytest.raises(_Stop, match="ran in this process"):  # called from Python: no restart
        cli.main(command)
    assert restarts == []
    with pytest.raises(_Stop, match="restarted"):  # the command: restarts, flags and all
        cli.console()
    assert restarts == [
        (sys.executable, [sys.executable, "-X", "dev", "/venv/bin/feedline", *command], env)
    ]
    with pytest.raises(_Stop, match="ran in this process"):  # scenarios without SPDL: no restart
        cli.main(["bench", "engine"], may_restart=True)
    assert len(restarts) == 1
