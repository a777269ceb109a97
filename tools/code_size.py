"""How big a package is, in the measures the engine issue sets limits on.

    python tools/code_size.py [PACKAGE_DIR ...]     (default: src/feedline/pipeline)

For each directory: lines of Python (every line, as ``wc -l`` counts), the classes with the most
attributes (names assigned as ``self.name`` anywhere in the class, plus class-level
assignments) and methods, the locks created (calls to ``Lock``, ``RLock``, ``Condition``,
``Semaphore`` and ``BoundedSemaphore``), the ``with`` blocks over a lock (a ``with`` whose
context expression is a name a lock is assigned to anywhere in the directory, or has
"lock" in it), and the module-level
numeric settings (``NAME = <number>``) with the modules they live in. The output is plain
text; ``--json`` prints the same as one JSON object for scripts.
"""

from __future__ import annotations

import argparse
import ast
import json
import sys
from dataclasses import asdict, dataclass, field
from pathlib import Path

LOCK_FACTORIES = {"Lock", "RLock", "Condition", "Semaphore", "BoundedSemaphore"}


@dataclass
class ClassSize:
    """One class: where it is, how many attributes and methods it has."""

    name: str
    module: str
    attributes: int
    methods: int


@dataclass
class Size:
    """The measures of one package directory."""

    path: str
    lines: int = 0
    modules: int = 0
    locks: int = 0
    lock_blocks: int = 0
    classes: list[ClassSize] = field(default_factory=list)
    settings: dict[str, list[str]] = field(default_factory=dict)  # module -> names


def _called_name(node: ast.expr) -> str | None:
    """``Lock`` for ``Lock()``, ``threading.Lock()`` and the like; None for anything else."""
    if isinstance(node, ast.Call):
        func = node.func
        if isinstance(func, ast.Name):
            return func.id
        if isinstance(func, ast.Attribute):
            return func.attr
    return None


def _last_name(node: ast.expr) -> str | None:
    """``_ready`` for ``self._ready`` or ``_ready``."""
    if isinstance(node, ast.Attribute):
        return node.attr
    if isinstance(node, ast.Name):
        return node.id
    return None


def _lock_names(tree: ast.AST) -> set[str]:
    """Names (variables and attributes) that a lock is assigned to."""
    names: set[str] = set()
    for node in ast.walk(tree):
        if (
            isinstance(node, (ast.Assign, ast.AnnAssign))
            and node.value is not None
            and _called_name(node.value) in LOCK_FACTORIES
        ):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            names.update(n for t in targets if (n := _last_name(t)) is not None)
    return names


def _names_a_lock(node: ast.expr, locks: set[str]) -> bool:
    if _called_name(node) is not None:
        return False  # a call (``open(...)``, ``contextlib.suppress(...)``) is no lock
    return _last_name(node) in locks or "lock" in ast.unparse(node).lower()


def _class_size(node: ast.ClassDef, module: str) -> ClassSize:
    attributes: set[str] = set()
    methods = 0
    for item in node.body:
        if isinstance(item, (ast.FunctionDef, ast.AsyncFunctionDef)):
            methods += 1
        elif isinstance(item, ast.AnnAssign) and isinstance(item.target, ast.Name):
            attributes.add(item.target.id)
        elif isinstance(item, ast.Assign):
            attributes.update(t.id for t in item.targets if isinstance(t, ast.Name))
    for sub in ast.walk(node):
        targets: list[ast.expr] = []
        if isinstance(sub, ast.Assign):
            targets = sub.targets
        elif isinstance(sub, (ast.AnnAssign, ast.AugAssign)):
            targets = [sub.target]
        for target in targets:
            for t in ast.walk(target):
                if (
                    isinstance(t, ast.Attribute)
                    and isinstance(t.value, ast.Name)
                    and t.value.id == "self"
                ):
                    attributes.add(t.attr)
    return ClassSize(node.name, module, len(attributes), methods)


def measure(directory: Path) -> Size:
    """Measure every ``*.py`` file below ``directory``."""
    size = Size(str(directory))
    trees: dict[str, ast.Module] = {}
    for path in sorted(directory.rglob("*.py")):
        text = path.read_text(encoding="utf-8")
        size.modules += 1
        size.lines += text.count("\n") + (0 if text.endswith("\n") or not text else 1)
        trees[str(path.relative_to(directory))] = ast.parse(text, str(path))
    locks = set().union(*(_lock_names(tree) for tree in trees.values()))
    for module, tree in trees.items():
        for node in ast.walk(tree):
            if isinstance(node, ast.ClassDef):
                size.classes.append(_class_size(node, module))
            elif isinstance(node, ast.Call) and _called_name(node) in LOCK_FACTORIES:
                size.locks += 1
            elif isinstance(node, (ast.With, ast.AsyncWith)):
                size.lock_blocks += sum(_names_a_lock(i.context_expr, locks) for i in node.items)
        for node in tree.body:
            if (
                isinstance(node, ast.Assign)
                and isinstance(node.value, ast.Constant)
                and type(node.value.value) in (int, float)
            ):
                names = [t.id for t in node.targets if isinstance(t, ast.Name) and t.id.isupper()]
                size.settings.setdefault(module, []).extend(names)
    size.settings = {m: names for m, names in size.settings.items() if names}
    size.classes.sort(key=lambda c: (-c.attributes, -c.methods, c.module, c.name))
    return size


def report(size: Size, top: int = 8) -> str:
    """The measures as a few lines of text."""
    settings = sum(len(v) for v in size.settings.values())
    lines = [
        f"{size.path}: {size.lines} lines in {size.modules} modules",
        f"  locks created: {size.locks}; with-blocks over a lock: {size.lock_blocks}",
        f"  numeric settings: {settings} in {len(size.settings)} modules",
        f"  largest classes (attributes / methods), of {len(size.classes)}:",
    ]
    lines += [
        f"    {c.attributes:3d} / {c.methods:3d}  {c.module}:{c.name}" for c in size.classes[:top]
    ]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    """Print the measures of each directory named (default: the pipeline package)."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("paths", nargs="*", default=["src/feedline/pipeline"])
    parser.add_argument("--json", action="store_true", help="one JSON object per directory")
    parser.add_argument("--top", type=int, default=8, help="how many classes to list")
    args = parser.parse_args(argv)
    for name in args.paths:
        directory = Path(name)
        if not directory.is_dir():
            parser.error(
                f"{name} is not a directory; name a package directory such as src/feedline"
            )
        size = measure(directory)
        print(json.dumps(asdict(size)) if args.json else report(size, args.top))
    return 0


if __name__ == "__main__":
    sys.exit(main())
