from __future__ import annotations

import pickle
import sys

import numpy as np
import pytest

from feedline import PathList


def test_round_trip_with_unicode_empty_and_odd_bytes() -> None:
    paths = ["a/b.jpg", "", "ünïcødé/日本.png", "x" * 300, "bad-\udcff-name"]
    compact = PathList(paths)
    assert len(compact) == 5
    assert list(compact) == paths
    assert compact[-1] == paths[-1]
    assert compact[1:4] == PathList(paths[1:4]) or list(compact[1:4]) == paths[1:4]
    with pytest.raises(IndexError, match="out of range for 5 paths"):
        compact[5]
    with pytest.raises(IndexError):
        compact[-6]


def test_empty() -> None:
    empty = PathList()
    assert len(empty) == 0
    assert list(empty) == []
    assert list(pickle.loads(pickle.dumps(empty))) == []


def test_compact_and_pickles_as_two_buffers() -> None:
    paths = [f"train/n{i % 1000:08d}/img_{i:07d}.JPEG" for i in range(100_000)]
    compact = PathList(paths)
    as_list = sys.getsizeof(paths) + sum(sys.getsizeof(p) for p in paths)
    assert compact.nbytes < as_list / 2
    blob = pickle.dumps(compact, protocol=5)
    assert len(blob) < compact.nbytes + 1000
    restored = pickle.loads(blob)
    assert restored[12345] == paths[12345]
    assert "100000 paths" in repr(restored)


def test_from_buffers_checks_them() -> None:
    compact = PathList(["ab", "cde"])
    again = PathList.from_buffers(compact._data, compact._ends)
    assert list(again) == ["ab", "cde"]
    with pytest.raises(ValueError, match="non-decreasing"):
        PathList.from_buffers(np.frombuffer(b"abcde", np.uint8), np.array([3, 2]))
    with pytest.raises(ValueError, match="uint8"):
        PathList.from_buffers(np.zeros(3, np.int32), np.array([3]))
