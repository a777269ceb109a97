"""tools/code_size.py counts what the engine issue sets limits on."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
import textwrap
from pathlib import Path
from types import ModuleType

import pytest

TOOL = Path(__file__).resolve().parents[1] / "tools" / "code_size.py"


def _tool() -> ModuleType:
    spec = importlib.util.spec_from_file_location("code_size", TOOL)
    assert spec is not None
    assert spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules["code_size"] = module  # dataclasses look their module up
    spec.loader.exec_module(module)
    return module


SAMPLE = textwrap.dedent(
    """\
    import threading
    from threading import Condition

    LIMIT = 64
    RATIO = 0.5
    name = 3
    WORDS = "not a number"


    class Box:
        kind = "box"

        def __init__(self):
            self._lock = threading.Lock()
            self._ready = Condition(self._lock)
            self.a, self.b = 1, 2

        def put(self, x):
            with self._lock:
                self.items = [x]
            with open("f") as f, self._ready:
                self.a += 1


    class Small:
        def go(self):
            pass
    """
)


def test_it_counts_lines_locks_blocks_settings_and_class_sizes(tmp_path: Path) -> None:
    (tmp_path / "sub").mkdir()
    (tmp_path / "sub" / "box.py").write_text(SAMPLE)
    (tmp_path / "empty.py").write_text("")
    size = _tool().measure(tmp_path)
    assert size.modules == 2
    assert size.lines == SAMPLE.count("\n")
    assert size.locks == 2  # Lock() and Condition(); Semaphore would count too
    assert size.lock_blocks == 2  # `with self._lock` and the `self._ready` of the second with
    assert size.settings == {"sub/box.py": ["LIMIT", "RATIO"]}
    box, small = size.classes
    assert (box.name, box.attributes, box.methods) == (
        "Box",
        6,
        2,
    )  # kind, _lock, _ready, a, b, items
    assert (small.name, small.attributes, small.methods) == ("Small", 0, 1)


def test_the_command_reports_the_pipeline_and_refuses_what_is_not_a_directory() -> None:
    root = TOOL.parents[1]
    run = subprocess.run(
        [sys.executable, str(TOOL)], cwd=root, capture_output=True, text=True, timeout=60
    )
    assert run.returncode == 0, run.stderr
    assert run.stdout.startswith("src/feedline/pipeline: ")
    assert "locks created:" in run.stdout
    bad = subprocess.run(
        [sys.executable, str(TOOL), "no/such/dir"], cwd=root, capture_output=True, text=True
    )
    assert bad.returncode == 2
    assert "is not a directory" in bad.stderr


@pytest.mark.parametrize("flag", ["--json"])
def test_json_output_is_one_object_per_directory(flag: str) -> None:
    import json

    root = TOOL.parents[1]
    run = subprocess.run(
        [sys.executable, str(TOOL), flag, "src/feedline/pipeline", "src/feedline/loader"],
        cwd=root,
        capture_output=True,
        text=True,
        timeout=60,
    )
    objects = [json.loads(line) for line in run.stdout.splitlines()]
    assert [o["path"] for o in objects] == ["src/feedline/pipeline", "src/feedline/loader"]
    assert all(o["lines"] > 0 and o["classes"] for o in objects)
