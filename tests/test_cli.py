from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import numpy as np
import pytest

from feedline.cli import main

# Each scenario imports torch, starts servers or processes and runs every contender: 10 to
# 20 s on an idle 2-core machine, 40 to 50 s on a loaded one, too close to the default 60.
pytestmark = pytest.mark.timeout(300)


def test_bench_engine_quick_writes_json(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["bench", "engine", "--quick", "--out", str(tmp_path)]) == 0
    data = json.loads((tmp_path / "engine.json").read_text())
    assert data["scenario"] == "engine"
    cases = {m["case"] for m in data["measurements"]}
    assert "3 sync no-op stages, concurrency 1" in cases
    assert "sha256(1 MiB), concurrency 4" in cases
    feedline_rates = [
        m["items_per_s"] for m in data["measurements"] if m["contender"] == "feedline"
    ]
    assert feedline_rates
    assert all(r > 0 for r in feedline_rates)
    out = capsys.readouterr().out
    assert "== engine ==" in out
    assert "feedline" in out
    assert_png(tmp_path / "engine.png")
    summary = (tmp_path / "summary.md").read_text()
    assert summary.startswith("| scenario | case |")
    # The headline row names the fastest feedline contender of the case, whichever it was.
    assert "| engine | 3 sync no-op stages, concurrency 1 | feedline" in summary


def assert_png(path: Path) -> None:
    if importlib.util.find_spec("matplotlib") is None:
        return
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    assert len(data) > 5000  # a drawn chart, not an empty canvas


def test_unknown_scenario_is_a_clear_error(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["bench", "nope", "--out", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert "unknown scenario" in err
    assert "engine" in err


def test_bad_flag_exits_with_usage(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as info:
        main(["bench", "--fast"])
    assert info.value.code == 2
    assert "unrecognized arguments" in capsys.readouterr().err


def test_bench_formats_quick(tmp_path: Path) -> None:
    assert main(["bench", "formats", "--quick", "--out", str(tmp_path)]) == 0
    data = json.loads((tmp_path / "formats.json").read_text())
    cases = {m["case"].split(" (")[0] for m in data["measurements"]}
    assert cases == {"npy", "npz stored", "npz compressed"}
    ours = [m for m in data["measurements"] if m["contender"] == "feedline"]
    assert len(ours) == 9
    assert all(m["ratio"] > 0 for m in ours)
    assert all(m["extra"]["cpu_s_per_1000"] >= 0 for m in data["measurements"])


def test_bench_decode_quick(tmp_path: Path) -> None:
    pytest.importorskip("simplejpeg")
    pytest.importorskip("PIL")
    out = tmp_path / "out"
    code = main(["bench", "decode", "--quick", "--data", str(tmp_path / "data"), "--out", str(out)])
    assert code == 0
    data = json.loads((out / "decode.json").read_text())
    assert_png(out / "decode.png")
    cases = {m["case"] for m in data["measurements"]}
    assert cases == {f"{k}, {t} thread(s)" for k in ("imagenet", "large") for t in (1, 2)}
    contenders = {m["contender"] for m in data["measurements"]}
    assert {"PIL", "OpenCV", "feedline fast", "feedline exact"} <= contenders
    two = [m for m in data["measurements"] if m["case"].endswith("2 thread(s)")]
    assert all(m["extra"]["scaling"] > 0 for m in two)
    processes = [m for m in two if m["contender"] == "feedline fast, 2 processes"]
    assert len(processes) == 2
    assert all(m["items_per_s"] > 0 for m in processes)
    # CPU per picture, per contender: decoding is CPU work, so never nothing (the processes'
    # CPU is their own, not this process's: not reported).
    threaded = [m for m in data["measurements"] if m not in processes]
    assert all(m["extra"]["cpu_s_per_1000"] > 0 for m in threaded)
    assert all("cpu_s_per_1000" not in m["extra"] for m in processes)
    assert any("PSNR fast vs exact" in n for n in data["notes"])
    # The generated pictures are cached: a second call finds them.
    cached = sorted((tmp_path / "data").rglob("*.jpg"))
    assert len(cached) == 10


def test_bench_uses_a_folder_of_your_own_jpegs_and_writes_nothing_there(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    cv2 = pytest.importorskip("cv2")
    pytest.importorskip("PIL")
    mine = tmp_path / "mine"
    (mine / "b").mkdir(parents=True)
    rng = np.random.default_rng(0)
    for name in ("a.jpg", "b/c.JPEG"):
        picture = rng.integers(0, 255, (300, 400, 3), dtype=np.uint8)
        assert cv2.imwrite(str(mine / name), picture)
    (mine / "b" / "broken.jpg").write_bytes(b"\xff\xd8\xff not a picture")
    (mine / "notes.txt").write_text("not a picture")
    before = sorted(mine.rglob("*"))
    monkeypatch.setenv("FEEDLINE_BENCH_DATA", str(tmp_path / "cache"))
    out = tmp_path / "out"
    assert main(["bench", "decode", "--quick", "--data", str(mine), "--out", str(out)]) == 0
    data = json.loads((out / "decode.json").read_text())
    assert any(f"your JPEGs from {mine}" in n for n in data["notes"])
    # Its two readable pictures, in turn: the mean size is theirs, not a generated one's.
    sizes = [(mine / n).stat().st_size for n in ("a.jpg", "b/c.JPEG")]
    mean = f"imagenet: 8 JPEGs, mean {np.mean(sizes) / 1024:.0f} KiB"
    assert mean in data["notes"]
    assert sorted(mine.rglob("*")) == before  # generated data went to the cache instead
    assert list((tmp_path / "cache").rglob("*.jpg"))


@pytest.mark.parametrize("scenario", ["latency", "startup", "images", "memory"])
def test_loader_scenarios_quick(scenario: str, tmp_path: Path) -> None:
    pytest.importorskip("torch")
    pytest.importorskip("PIL")
    out = tmp_path / "out"
    code = main(["bench", scenario, "--quick", "--data", str(tmp_path / "d"), "--out", str(out)])
    assert code == 0
    data = json.loads((out / f"{scenario}.json").read_text())
    assert data["scenario"] == scenario
    assert_png(out / f"{scenario}.png")
    by_name = {m["contender"]: m for m in data["measurements"]}
    ours = [m for name, m in by_name.items() if name.startswith("feedline")]
    assert ours
    assert all(m["items_per_s"] > 0 and m["ratio"] > 0 for m in ours)
    assert any(name.startswith("PyTorch") for name in by_name)
    # Every contender reports what it cost: memory (children included) and CPU time.
    references = ("upper bound", "machine bound", "decode alone")  # measured, not loaders
    contenders = [m for m in data["measurements"] if not m["contender"].startswith(references)]
    assert all(m["extra"]["peak_pss_mib"] > 10 for m in contenders)
    assert all(m["extra"]["peak_rss_mib"] >= m["extra"]["peak_pss_mib"] for m in contenders)
    if scenario != "memory":
        assert all(m["extra"]["cpu_s_per_1000"] > 0 for m in contenders)
        assert all(m["extra"]["first_batch_ms"] > 0 for m in contenders)
    if scenario == "startup":
        summary = (out / "summary.md").read_text()
        assert "x the wait |" in summary
    if scenario == "images":
        assert 0 < by_name["feedline pipeline"]["extra"]["of_bound"] < 2
        assert "upper bound" in by_name
        assert any(name.startswith("decode alone") for name in by_name)
        assert by_name["ThreadPoolExecutor.map"]["items_per_s"] > 0  # the hand-written way
        assert all(0 < m["extra"]["of_decode_alone"] < 3 for m in contenders)
