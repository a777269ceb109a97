from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import numpy as np
import pytest

from feedline.bench._registry import SMOKE_ENV
from feedline.cli import main

from ._system import starts_processes

# Each scenario imports torch, starts servers or processes and runs every contender: 10 to
# 20 s on an idle 2-core machine, 40 to 50 s on a loaded one, too close to the default 60.
pytestmark = starts_processes


@pytest.fixture(autouse=True)
def smoke_sizes(monkeypatch: pytest.MonkeyPatch) -> None:
    """``--quick`` at its smallest: these tests check that a scenario runs and reports in
    full, not its figures (the processes a scenario starts inherit it)."""
    monkeypatch.setenv(SMOKE_ENV, "1")


@pytest.fixture(scope="module")
def pictures(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A data folder the scenarios share: each generates only the pictures the ones before
    it have not (they are deterministic; 0.3 s of CPU each)."""
    return tmp_path_factory.mktemp("bench-data")


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
    assert "## engine: " in out
    assert "feedline" in out
    assert_png(tmp_path / "engine.png")
    summary = (tmp_path / "summary.md").read_text()
    assert summary.startswith("# feedline bench")
    assert "`feedline bench engine --quick --out" in summary  # how to reproduce it
    assert "cores" in summary
    assert "numpy " in summary  # library versions
    # The headline quotes feedline with its default settings only (its default sink), not
    # the variants measured beside it.
    headline = summary.split("## Headline")[1].split("\n## ")[0]
    assert "| engine | 3 sync no-op stages, concurrency 1 | feedline | " in headline
    assert "add_sink(3)" not in headline


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


def test_a_missing_data_folder_is_an_error_and_nothing_is_created(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    missing = tmp_path / "nonexistent" / "dir"
    assert main(["bench", "engine", "--data", str(missing), "--out", str(tmp_path / "o")]) == 2
    err = capsys.readouterr().err
    assert f"--data {missing}: no such folder" in err
    assert not (tmp_path / "nonexistent").exists()
    assert not (tmp_path / "o").exists()


def test_a_scenario_without_its_modules_is_skipped_and_says_what_to_install(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    from feedline.bench import _registry

    # numpy: a module that is there (torch is not, on free-threaded Python).
    monkeypatch.setitem(_registry.REQUIRES, "formats", ("numpy", "feedline_absent_module"))
    out = tmp_path / "out"
    assert main(["bench", "formats", "verify", "--quick", "--out", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "skipped formats: needs feedline_absent_module: pip install 'feedline[bench]'" in (
        printed
    )
    assert json.loads((out / "verify.json").read_text())["measurements"]  # the other ran
    skipped = json.loads((out / "formats.json").read_text())
    assert skipped["measurements"] == []
    assert "feedline_absent_module" in skipped["skipped"]
    summary = (out / "summary.md").read_text()
    assert "## Not run" in summary
    assert "- formats: needs feedline_absent_module" in summary
    assert not (out / "formats.png").exists()
    # The header names the machine and versions though the first scenario did not run.
    assert "- **feedline**: 0." in summary
    assert "?" not in summary.split("## Headline")[0]
    assert "numpy " in summary
    assert "**Quick run**" in summary  # a smoke test says so


def test_out_that_is_a_file_is_an_error_before_anything_runs(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    target = tmp_path / "results"
    target.write_text("not a folder")
    assert main(["bench", "engine", "--quick", "--out", str(target)]) == 2
    assert f"--out {target} is a file" in capsys.readouterr().err
    assert target.read_text() == "not a folder"


def test_a_data_folder_without_jpegs_is_not_filled_with_generated_pictures(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    pictures = tmp_path / "pngs"
    pictures.mkdir()
    (pictures / "a.png").write_bytes(b"\x89PNG")
    assert main(["bench", "decode", "--quick", "--data", str(pictures)]) == 2
    assert "holds files but no JPEG" in capsys.readouterr().err
    assert [p.name for p in pictures.iterdir()] == ["a.png"]


def test_feedline_alone_prints_its_help(capsys: pytest.CaptureFixture[str]) -> None:
    assert main([]) == 2
    out = capsys.readouterr().out
    assert "bench" in out
    assert "report" in out


def test_report_writes_the_summary_again_from_the_json(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "out"
    assert main(["bench", "verify", "--quick", "--out", str(out)]) == 0
    first = (out / "summary.md").read_text()
    (out / "summary.md").unlink()
    capsys.readouterr()
    assert main(["report", str(out)]) == 0
    assert (out / "summary.md").read_text() == first
    assert "## verify" in capsys.readouterr().out
    (tmp_path / "empty").mkdir()
    assert main(["report", str(tmp_path / "empty")]) == 2
    assert "no results of feedline bench" in capsys.readouterr().err


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


@pytest.mark.timeout(600)
def test_bench_distributed_quick_reads_the_store_once_with_the_locality_aware_loader(
    tmp_path: Path, pictures: Path
) -> None:
    pytest.importorskip("torch")
    pytest.importorskip("simplejpeg")
    out = tmp_path / "out"
    code = main(["bench", "distributed", "--quick", "--data", str(pictures), "--out", str(out)])
    assert code == 0
    data = json.loads((out / "distributed.json").read_text())
    cases = {m["case"] for m in data["measurements"]}
    assert cases == {"2 ranks, epoch 0", "2 ranks, later epochs"}
    gets = {n.split(":")[0]: n for n in data["notes"] if " GETs " in n}
    # The regular loader reads every sample each epoch; the locality-aware one, once.
    assert "(3.00 per sample)" in gets["2 ranks, regular"]
    assert "(1.00 per sample)" in gets["2 ranks, locality-aware"]
    later = [m for m in data["measurements"] if m["case"] == "2 ranks, later epochs"]
    ours = next(m for m in later if m["contender"] == "feedline.distributed")
    assert 0 < ours["extra"]["beta_percent"] < 50
    assert ours["extra"]["exchanged_mb"] > 0
    assert ours["extra"]["store_gets"] == 0  # the later epochs read nothing from the store
    # The cost model predicts every epoch, from terms measured in the same run.
    assert all(m["extra"]["model_s"] > 0 for m in data["measurements"])
    assert any(n.startswith("2 ranks, the cost model's terms") for n in data["notes"])


def test_bench_decode_quick(tmp_path: Path) -> None:
    pytest.importorskip("simplejpeg")
    pytest.importorskip("PIL")
    out = tmp_path / "out"
    (tmp_path / "data").mkdir()
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
def test_loader_scenarios_quick(scenario: str, tmp_path: Path, pictures: Path) -> None:
    pytest.importorskip("torch")
    pytest.importorskip("PIL")
    out = tmp_path / "out"
    code = main(["bench", scenario, "--quick", "--data", str(pictures), "--out", str(out)])
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


def test_report_pastes_the_summary_between_a_readme_s_markers(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "out"
    assert main(["bench", "verify", "--quick", "--out", str(out)]) == 0
    readme = tmp_path / "README.md"
    readme.write_text(
        "# Project\n\n## Benchmarks\n\n<!-- feedline report: start -->\nold figures\n"
        "<!-- feedline report: end -->\n\n## After\n"
    )
    assert main(["report", str(out), "--into", str(readme)]) == 0
    text = readme.read_text()
    assert "old figures" not in text
    assert text.startswith("# Project\n\n## Benchmarks\n\n<!-- feedline report: start -->\n")
    assert text.endswith("<!-- feedline report: end -->\n\n## After\n")
    assert "### verify: " in text  # the summary's sections sit under the README's heading
    assert "\n# feedline bench" not in text
    assert "- **Machine**: " in text
    assert "commit" not in text
    assert ", run 20" not in text
    assert ", run 20" in (out / "summary.md").read_text()  # the run's own summary does
    # Where the results were written is this machine's: the README's command leaves it out.
    assert "- **Command**: `feedline bench verify --quick`" in text
    assert str(out) not in text
    assert f"--out {out}" in (out / "summary.md").read_text()
    twice = readme.read_text()
    assert main(["report", str(out), "--into", str(readme)]) == 0
    assert readme.read_text() == twice  # pasting again changes nothing
    assert main(["report", str(out), "--into", str(readme), "--headline"]) == 0
    headline = readme.read_text()
    assert "### Headline" in headline
    assert "- **Machine**: " in headline
    assert "### verify: " not in headline  # the scenario's own section stays in the report
    assert headline.endswith("<!-- feedline report: end -->\n\n## After\n")
    readme.write_text("no markers\n")
    capsys.readouterr()
    assert main(["report", str(out), "--into", str(readme)]) == 2
    assert "<!-- feedline report: start -->" in capsys.readouterr().err
    assert readme.read_text() == "no markers\n"


def test_bench_train_quick_reports_headspace(tmp_path: Path, pictures: Path) -> None:
    pytest.importorskip("torch")
    pytest.importorskip("cv2")
    out = tmp_path / "out"
    assert main(["bench", "train", "--quick", "--data", str(pictures), "--out", str(out)]) == 0
    data = json.loads((out / "train.json").read_text())
    assert data["unit"] == "steps/s"
    cases = {m["case"] for m in data["measurements"]}
    assert len(cases) == 6  # JPEG, NPZ with numpy.load, NPZ with load_npz; x model, launches
    for m in data["measurements"]:
        assert m["items_per_s"] > 0
        assert m["extra"]["step_p50_ms"] > 0
        assert m["extra"]["step_p99_ms"] >= m["extra"]["step_p50_ms"]
        if m["contender"] == "cached batches (upper bound)":
            assert m["ratio"] == 1.0
        else:
            assert m["ratio"] > 0
            assert m["extra"]["vs_pytorch"] > 0
    assert {"feedline DataLoader", "feedline DataLoader, workers=2", "feedline pipeline"} <= {
        m["contender"] for m in data["measurements"]
    }
    headline = (out / "summary.md").read_text().split("## Headline")[1].split("\n## ")[0]
    assert "| train | JPEG files (decode releases the GIL), model step | feedline DataLoader" in (
        headline
    )
    assert_png(out / "train.png")


def test_report_names_each_run_and_leaves_out_what_is_not_a_result(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "out"
    assert main(["bench", "verify", "--quick", "--out", str(out)]) == 0
    assert main(["bench", "formats", "--quick", "--out", str(tmp_path / "other")]) == 0
    (tmp_path / "other" / "formats.json").rename(out / "formats.json")
    (out / "notes.json").write_text("[1, 2]")
    (out / "empty.json").write_text("{}")
    capsys.readouterr()
    assert main(["report", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "notes.json is not a feedline bench result" in printed
    assert "empty.json is not a feedline bench result" in printed
    summary = (out / "summary.md").read_text()
    assert "- **Commands** (results of several runs): `formats`: `feedline bench formats" in summary
    assert "`verify`: `feedline bench verify --quick" in summary
    assert main(["report", str(tmp_path / "missing")]) == 2
    assert "no such folder" in capsys.readouterr().err


def test_bench_autotune_quick_compares_the_tuned_pipeline_with_the_grid_s_best(
    tmp_path: Path, pictures: Path
) -> None:
    pytest.importorskip("obstore")
    pytest.importorskip("cv2")
    out = tmp_path / "out"
    args = ["bench", "autotune", "--quick", "--data", str(pictures), "--out", str(out)]
    assert main(args) == 0
    data = json.loads((out / "autotune.json").read_text())
    rows = {(m["case"], m["contender"]): m for m in data["measurements"]}
    for case in ("read + decode (5-100 ms GETs)", "1 MB objects, 200 MB/s server", "CPU decode"):
        tuned = rows[case, "feedline, autotuned"]
        assert tuned["items_per_s"] > 0
        assert tuned["ratio"] > 0
        assert tuned["extra"]["tuner_cpu_percent"] > 0
        assert rows[case, "best fixed configuration (grid search)"]["ratio"] == 1.0
        # The chart over time has a point every tick (0.25 s; a smoke run's 0.1 s) with each
        # stage's concurrency.
        points = data["timelines"][case]
        assert len(points) >= 4
        assert all(c >= 1 for _, _, conc in points for c in conc.values())
    changed = rows["read + decode, server 10 -> 100 ms", "feedline, autotuned"]
    assert changed["items_per_s"] > 0
    budgeted = [m for (case, _), m in rows.items() if "memory_budget" in case]
    assert budgeted[0]["extra"]["rss_growth_mib"] < 200
    if importlib.util.find_spec("tensorflow") is None:
        assert any("tf.data left out" in n for n in data["notes"])
    assert_png(out / "autotune.png")
    assert_png(out / "autotune-over-time.png")


def test_bench_storage_quick_reads_through_a_throttling_store(tmp_path: Path) -> None:
    pytest.importorskip("obstore")
    out = tmp_path / "out"
    assert main(["bench", "storage", "--quick", "--out", str(out)]) == 0
    data = json.loads((out / "storage.json").read_text())
    rows = {m["contender"]: m for m in data["measurements"]}
    feedline = rows["feedline RemoteStore.read pipeline"]["extra"]
    pool = rows["obstore thread pool (64)"]["extra"]
    assert feedline["lost"] == 0  # refusals are sent again, never charged to the budget
    assert feedline["refused_percent"] < pool["refused_percent"]
    assert all(key in feedline for key in ("share_of_cap", "recovery_s", "unthrottled_per_s"))
    # The chart over time: a point a second, with refusals, and feedline's in-flight limit.
    points = data["timelines"]["feedline RemoteStore.read pipeline, round 1"]
    assert len(points) >= 4
    assert all(set(p[2]) == {"refused/s", "in-flight limit"} for p in points)
    assert_png(out / "storage-over-time.png")


def test_bench_freethreaded_leaves_out_an_interpreter_with_the_gil(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:

    fake = tmp_path / "python3.13t"
    # This interpreter with the GIL, whether or not it is a free-threaded build (PYTHON_GIL=1
    # turns it on there and is ignored elsewhere).
    fake.write_text(f'#!/bin/sh\nPYTHON_GIL=1 exec {sys.executable} "$@"\n')
    fake.chmod(0o755)
    monkeypatch.setenv("FEEDLINE_FREE_THREADED_PYTHON", str(fake))
    out = tmp_path / "out"
    assert main(["bench", "freethreaded", "--quick", "--out", str(out)]) == 0
    result = json.loads((out / "freethreaded.json").read_text())
    assert any("runs with the GIL: not a free-threaded build" in n for n in result["notes"])
    cases = {m["case"] for m in result["measurements"]}
    assert len(cases) == 2  # two kinds of work, on this interpreter only
    # Its label: "3.11 (GIL)", or "3.13t" where the tests themselves run without the GIL.
    gil = getattr(sys, "_is_gil_enabled", lambda: True)()
    assert all(c.endswith(" (GIL)" if gil else "t") for c in cases)
    contenders = {m["contender"] for m in result["measurements"]}
    assert contenders == {
        "ThreadPoolExecutor.map, 1 thread",
        "ThreadPoolExecutor.map, 2 threads",
        "feedline pipeline, 1 thread",
        "feedline pipeline, 2 threads",
    }
    assert all(m["items_per_s"] > 0 for m in result["measurements"])
    monkeypatch.setenv("FEEDLINE_FREE_THREADED_PYTHON", str(tmp_path / "absent"))
    assert main(["bench", "freethreaded", "--quick", "--out", str(out)]) == 0
    result = json.loads((out / "freethreaded.json").read_text())
    assert any("is not an executable" in n for n in result["notes"])
