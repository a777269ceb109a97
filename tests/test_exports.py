from __future__ import annotations

import subprocess
import sys
import types

import feedline
import feedline.distributed
import feedline.io
import feedline.loader
import feedline.pipeline
import feedline.source

from ._system import starts_processes


def test_all_is_sorted_and_complete() -> None:
    modules = (feedline, feedline.pipeline, feedline.io, feedline.loader, feedline.source)
    for module in (*modules, feedline.distributed):
        names = list(module.__all__)
        assert names == sorted(names), f"{module.__name__}.__all__ is not sorted"
        for name in names:
            assert hasattr(module, name), f"{module.__name__} lacks {name}"
        public = {
            n
            for n, v in vars(module).items()
            if not n.startswith("_") and not isinstance(v, types.ModuleType)
        }
        public -= {"annotations"}
        assert public <= set(names), f"public but not exported: {public - set(names)}"


def test_public_objects_have_docstrings() -> None:
    for name in feedline.__all__:
        obj = getattr(feedline, name)
        if callable(obj):
            assert obj.__doc__, f"feedline.{name} has no docstring"


@starts_processes
def test_import_needs_only_numpy() -> None:
    code = (
        "import sys, feedline; "
        "heavy = ('torch', 'jax', 'PIL', 'cv2', 'av', 'aiohttp', 'obstore'); "
        "heavy = [m for m in heavy if m in sys.modules]; "
        "print(heavy)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"
