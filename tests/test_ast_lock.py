"""Threads parsing at once must not corrupt the AST constructor (CPython gh-106905)."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest

from feedline import _ast_lock

# Threads parse a large literal (as numpy.load parses NPY headers) while collections run a
# finalizer that hands the GIL to another thread in the middle of the constructor.
_RACE = textwrap.dedent(
    """
    import ast, sys, threading, time
    if sys.argv[1] == "feedline":
        import feedline
    errors = []
    class Yields:
        def __del__(self):
            time.sleep(0)
    text = repr({f"k{i}": (i, i + 1) for i in range(300)})
    def parse():
        for _ in range(150):
            garbage = Yields(); garbage.cycle = garbage; del garbage
            try:
                ast.literal_eval(text)
            except SystemError as e:
                errors.append(e)
                return
    threads = [threading.Thread(target=parse) for _ in range(4)]
    for t in threads: t.start()
    for t in threads: t.join()
    print(len(errors), errors[:1])
    """
)


@pytest.mark.parametrize(
    ("version", "racy"),
    [
        ((3, 10, 14), True),
        ((3, 11, 7), True),
        ((3, 11, 8), False),
        ((3, 12, 1), True),
        ((3, 12, 2), False),
        ((3, 13, 0), False),
    ],
)
def test_the_interpreters_with_the_race(version: tuple[int, int, int], racy: bool) -> None:
    assert _ast_lock.affected(version) is racy


def test_threads_parse_at_once_without_error_once_feedline_is_imported() -> None:
    run = subprocess.run(
        [sys.executable, "-c", _RACE, "feedline"], capture_output=True, text=True, timeout=120
    )
    assert run.returncode == 0, run.stderr
    assert run.stdout.startswith("0 "), run.stdout


# A finalizer that parses, run by a collection in the middle of a large parse in the same
# thread: a lock cannot keep it out (the thread holds it), so no collection runs in a parse.
_NESTED = textwrap.dedent(
    """
    import ast, gc, sys
    if sys.argv[1] == "feedline":
        import feedline
    class Parses:
        def __del__(self):
            ast.parse("x = [1, 2, 3]")
    text = "\\n".join(f"v{i} = [{i}, ({i}, {{'k': {i}}})]" for i in range(2000))
    gc.set_threshold(50)
    errors = []
    for _ in range(20):
        for _ in range(30):
            a = Parses(); a.cycle = [a]; del a
        try:
            ast.parse(text)
        except SystemError as e:
            errors.append(e)
    print(len(errors), errors[:1])
    """
)


def test_a_finalizer_that_parses_inside_a_parse_breaks_nothing_once_feedline_is_imported() -> None:
    run = subprocess.run(
        [sys.executable, "-c", _NESTED, "feedline"], capture_output=True, text=True, timeout=120
    )
    assert run.returncode == 0, run.stderr
    assert run.stdout.startswith("0 "), run.stdout


def test_the_lock_is_in_place_only_where_needed() -> None:
    locked = getattr(__import__("ast").parse, "_feedline_locked", False)
    assert locked is _ast_lock.affected()


def test_parse_still_parses_and_raises_as_before() -> None:
    import ast

    assert ast.literal_eval("{'shape': (2, 3)}") == {"shape": (2, 3)}
    with pytest.raises(SyntaxError):
        ast.parse("def (")


_FORK = textwrap.dedent(
    """
    import ast, os, threading
    import feedline
    from feedline import _ast_lock
    held, release = threading.Event(), threading.Event()
    def hold():
        with _ast_lock._lock:
            held.set()
            release.wait()
    threading.Thread(target=hold, daemon=True).start()
    held.wait()
    pid = os.fork()
    if pid == 0:
        ast.parse("x = 1")
        os._exit(0)
    release.set()
    print(os.waitpid(pid, 0)[1])
    """
)


@pytest.mark.skipif(not _ast_lock.affected(), reason="ast.parse is not wrapped here")
def test_a_child_forked_while_a_thread_parses_can_parse() -> None:
    run = subprocess.run(
        [sys.executable, "-W", "ignore", "-c", _FORK], capture_output=True, text=True, timeout=6
    )
    assert run.returncode == 0, run.stderr
    assert run.stdout.strip() == "0", run.stdout
