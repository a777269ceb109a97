"""Shared-memory segments are named after the program that made them, so that a program (and
a test) counts its own: other programs on the machine make segments too, at any time."""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
from collections.abc import Iterator
from multiprocessing.shared_memory import SharedMemory

import numpy as np
import pytest

from feedline import run_pipeline_in_subprocess
from feedline._proc import shm as _shm
from feedline._proc.shm import (
    SHM_AVAILABLE,
    SegmentNames,
    pack,
    release,
    remove_prefixed,
    shared_empty,
)

from .._system import own_segments, starts_processes
from ..pipeline import _helpers

pytestmark = [
    pytest.mark.skipif(not SHM_AVAILABLE, reason="needs /dev/shm"),
    starts_processes,
]

_MINE = f"psm_fl{os.getpid()}_"

# Another feedline program: it packs an array (a segment in its own namespace), says the
# segment's name, and removes it when told to (a line on stdin), or when it ends.
_OTHER_PROGRAM = """
import sys
import numpy as np
from feedline._proc.shm import pack, release

packed = pack(np.zeros(100_000), 1024)
print(packed.name, flush=True)
sys.stdin.readline()
release(packed)
"""


@contextlib.contextmanager
def foreign_segments() -> Iterator[list[str]]:
    """Two segments made by others: one by another feedline program, one in the ``psm_``
    namespace by a plain ``SharedMemory`` (as any program's); both go at the end."""
    other = subprocess.Popen(
        [sys.executable, "-c", _OTHER_PROGRAM],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    plain = SharedMemory(create=True, size=4096)
    names = [plain.name.lstrip("/")]
    try:
        assert other.stdout is not None
        names.append(other.stdout.readline().strip())
        assert all(os.path.exists(f"/dev/shm/{name}") for name in names), names
        yield names
    finally:
        plain.close()
        plain.unlink()
        assert other.stdin is not None
        other.stdin.write("\n")
        other.stdin.close()
        other.wait(60)
    assert not any(os.path.exists(f"/dev/shm/{name}") for name in names)


def test_a_count_of_own_segments_leaves_out_other_programs() -> None:
    # A test that counts what an epoch of arrays through a child leaves, while other
    # programs make segments: it finds nothing of its own left, and its own when it makes
    # one.
    before = own_segments()
    with run_pipeline_in_subprocess(_helpers.array_builder(10)) as epochs:
        it = iter(epochs)
        got = [next(it)]
        with foreign_segments() as foreign:
            got += list(it)
            assert len(got) == 10
            assert own_segments() - before == set()
            array = shared_empty((1000,), np.uint8)
            (made,) = own_segments() - before
            assert made.startswith(_MINE)
            assert made not in foreign
            del array
            assert own_segments() - before == set()


def test_segments_made_without_names_are_in_this_process_s_namespace() -> None:
    before = own_segments()
    array = shared_empty((1000,), np.uint8)
    packed = pack(np.zeros(100_000), 1024)
    made = own_segments() - before
    assert len(made) == 2
    assert all(name.startswith(_MINE) for name in made), made
    release(packed)
    del array
    assert own_segments() - before == set()


def test_a_child_s_prefix_extends_its_parent_s_and_goes_with_it() -> None:
    # A child given names (a pipeline in a subprocess) that starts processes of its own (a
    # process region) names their segments after its prefix, so after the program's root.
    child = SegmentNames.new_prefix()
    assert child.startswith(_MINE)
    saved = _shm._names
    try:
        _shm.set_segment_names(SegmentNames(child))
        grandchild = SegmentNames.new_prefix()
    finally:
        _shm._names = saved
    assert grandchild.startswith(child)
    assert grandchild != child
    before = own_segments()
    mine = pack(np.zeros(100_000), 1024)  # no prefix of the child's: it stays
    theirs = [pack(np.zeros(100_000), 1024, SegmentNames(p)) for p in (child, grandchild)]
    assert len(own_segments() - before) == 3
    assert remove_prefixed(child) == 2  # the child is gone: its segments and its children's
    assert own_segments() - before == {mine.name}
    release(mine)
    del theirs
