from __future__ import annotations

import io
import struct
import threading
import zipfile
import zlib
from typing import Any

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from feedline.io import load_npy, load_npz

DTYPES = st.one_of(
    hnp.boolean_dtypes(),
    hnp.integer_dtypes(endianness="="),
    hnp.integer_dtypes(endianness=">"),
    hnp.unsigned_integer_dtypes(endianness="<"),
    hnp.floating_dtypes(endianness="="),
    hnp.floating_dtypes(endianness=">", sizes=(32, 64)),
    hnp.complex_number_dtypes(endianness="="),
    hnp.datetime64_dtypes(endianness="="),
    hnp.timedelta64_dtypes(endianness="="),
    hnp.byte_string_dtypes(max_len=5),
    hnp.unicode_string_dtypes(max_len=5),
    st.just(np.dtype([("a", "<i4"), ("b", ">f8"), ("c", "S3")])),
)


@st.composite
def arrays(draw: Any) -> np.ndarray:
    dtype = draw(DTYPES)
    shape = draw(hnp.array_shapes(min_dims=0, max_dims=4, min_side=0, max_side=5))
    array = draw(hnp.arrays(dtype, shape))
    order = draw(st.sampled_from(["C", "F", "strided"]))
    if order == "F":
        array = np.asfortranarray(array)
    elif order == "strided" and array.ndim:
        array = array[..., ::2]  # numpy.save writes a non-contiguous array in C order
    return array


def npy_bytes(array: np.ndarray) -> bytes:
    buf = io.BytesIO()
    np.save(buf, array)
    return buf.getvalue()


def assert_same(loaded: np.ndarray, expected: np.ndarray) -> None:
    assert loaded.dtype == expected.dtype
    assert loaded.shape == expected.shape
    assert loaded.tobytes() == expected.tobytes()  # exact, NaN payloads included


@settings(max_examples=300, deadline=None)
@given(arrays())
def test_load_npy_round_trips(array: np.ndarray) -> None:
    data = npy_bytes(array)
    loaded = load_npy(data)
    assert_same(loaded, array)
    if array.flags.f_contiguous and not array.flags.c_contiguous:
        assert loaded.flags.f_contiguous


@settings(max_examples=100, deadline=None)
@given(arrays())
def test_load_npy_accepts_every_buffer_kind(array: np.ndarray) -> None:
    data = npy_bytes(array)
    for buffer in (bytearray(data), memoryview(data), np.frombuffer(data, np.uint8)):
        assert_same(load_npy(buffer), array)


def test_load_npy_does_not_copy() -> None:
    array = np.arange(1000, dtype=np.int64)
    data = bytearray(npy_bytes(array))
    loaded = load_npy(data)
    assert loaded.flags.writeable  # a bytearray is writable, so is the view
    loaded[0] = 42
    assert load_npy(data)[0] == 42  # the same memory
    assert not load_npy(bytes(data)).flags.writeable


def test_load_npy_reads_versions_2_and_3() -> None:
    array = np.arange(6, dtype=np.float32).reshape(2, 3)
    for version in ((2, 0), (3, 0)):
        buf = io.BytesIO()
        np.lib.format.write_array(buf, array, version=version)
        assert_same(load_npy(buf.getvalue()), array)


def test_load_npy_refuses_object_arrays() -> None:
    buf = io.BytesIO()
    np.save(buf, np.array([{"a": 1}], dtype=object), allow_pickle=True)
    with pytest.raises(ValueError, match="never unpickles"):
        load_npy(buf.getvalue())


@settings(max_examples=40, deadline=None)
@given(arrays())
def test_load_npy_every_truncation_raises(array: np.ndarray) -> None:
    data = npy_bytes(array)
    for cut in range(len(data)):
        with pytest.raises(ValueError):  # noqa: PT011 - each truncation has its own message
            load_npy(data[:cut])


# A flipped byte can turn a dtype into NumPy's deprecated 'a' alias, which NumPy warns about
# as it parses the header: valid input, not a failure of ours.
@pytest.mark.filterwarnings("ignore:Data type alias:DeprecationWarning")
@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(arrays(), st.data())
def test_load_npy_corruption_raises_or_loads_never_crashes(array: np.ndarray, data: Any) -> None:
    raw = bytearray(npy_bytes(array))
    for _ in range(20):
        corrupt = bytearray(raw)
        pos = data.draw(st.integers(0, len(raw) - 1))
        corrupt[pos] = data.draw(st.integers(0, 255))
        try:
            loaded = load_npy(bytes(corrupt))
        except ValueError:
            continue
        # no checksum in NPY: a flip in the data or padding gives some valid array, within bounds
        assert loaded.nbytes <= len(corrupt)


def test_load_npy_bad_inputs_have_clear_messages() -> None:
    with pytest.raises(ValueError, match="not an NPY file"):
        load_npy(b"PK\x03\x04 this is a zip")
    with pytest.raises(ValueError, match="unsupported NPY format version 9"):
        load_npy(b"\x93NUMPY\x09\x00" + b"\x00" * 20)
    with pytest.raises(ValueError, match="needs 48 bytes after the header"):
        load_npy(npy_bytes(np.zeros(6))[:-1])
    with pytest.raises(TypeError, match="expected bytes"):
        load_npy(12345)  # type: ignore[arg-type]
    huge = b"\x93NUMPY\x01\x00" + (46).to_bytes(2, "little")
    huge += b"{'descr': '<f8', 'fortran_order': False, 'shape': (99999999999999,), }"[:46]
    with pytest.raises(ValueError):  # noqa: PT011
        load_npy(huge)


# -- NPZ -------------------------------------------------------------------------------------------


def npz_bytes(arrays: dict[str, np.ndarray], compressed: bool) -> bytes:
    buf = io.BytesIO()
    (np.savez_compressed if compressed else np.savez)(buf, **arrays)
    return buf.getvalue()


@settings(max_examples=150, deadline=None)
@given(
    st.dictionaries(
        st.from_regex(r"[a-z][a-z0-9_]{0,8}", fullmatch=True), arrays(), min_size=0, max_size=4
    ),
    st.booleans(),
)
def test_load_npz_round_trips(members: dict[str, np.ndarray], compressed: bool) -> None:
    loaded = load_npz(npz_bytes(members, compressed), verify=True)
    assert sorted(loaded) == sorted(members)
    for name, array in members.items():
        assert_same(loaded[name], array)


def test_load_npz_stored_members_are_views() -> None:
    data = bytearray(npz_bytes({"x": np.arange(100)}, compressed=False))
    x = load_npz(data)["x"]
    x[0] = 7
    assert load_npz(data)["x"][0] == 7


def sample_npz(compressed: bool) -> bytes:
    return npz_bytes(
        {"image": np.arange(48, dtype=np.uint8).reshape(3, 4, 4), "label": np.array(3)}, compressed
    )


@pytest.mark.parametrize("compressed", [False, True])
def test_load_npz_every_truncation_raises(compressed: bool) -> None:
    data = sample_npz(compressed)
    for cut in range(len(data)):
        with pytest.raises(ValueError):  # noqa: PT011
            arrays = load_npz(data[:cut])
            for name in arrays:
                arrays[name]


@pytest.mark.parametrize("compressed", [False, True])
def test_load_npz_every_byte_flip_raises_or_changes_nothing(compressed: bool) -> None:
    data = sample_npz(compressed)
    expected = {k: np.load(io.BytesIO(data))[k] for k in ("image", "label")}
    raised = 0
    for pos in range(len(data)):
        corrupt = bytearray(data)
        corrupt[pos] ^= 0x5A
        try:
            arrays = load_npz(bytes(corrupt), verify=True)
            got = {k: arrays[k] for k in arrays}
        except ValueError:
            raised += 1
            continue
        # Only fields that carry no content (timestamps, versions, attributes) may change.
        assert got.keys() == expected.keys()
        for k in expected:
            assert_same(got[k], expected[k])
    assert raised > len(data) // 2


def test_load_npz_bounds_what_a_member_may_inflate_to() -> None:
    data = npz_bytes({"zeros": np.zeros(1 << 20, np.uint8)}, compressed=True)
    assert len(data) < 5000  # 1 MiB of zeros deflates to almost nothing
    arrays = load_npz(data, max_member_bytes=1 << 16)
    with pytest.raises(ValueError, match="max_member_bytes"):
        arrays["zeros"]


def test_load_npz_lies_about_sizes_are_caught() -> None:
    data = bytearray(npz_bytes({"x": np.arange(1000)}, compressed=True))
    zf = zipfile.ZipFile(io.BytesIO(bytes(data)))
    info = zf.infolist()[0]
    cd = bytes(data).rfind(b"PK\x01\x02")
    # uncompressed size field of the central directory entry: offset 24
    data[cd + 24 : cd + 28] = (info.file_size - 8).to_bytes(4, "little")
    with pytest.raises(ValueError, match="inflates to"):
        load_npz(bytes(data))["x"]


def test_load_npz_refuses_other_methods_and_missing_keys() -> None:
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w", compression=zipfile.ZIP_BZIP2) as zf:
        zf.writestr("x.npy", npy_bytes(np.arange(3)))
    with pytest.raises(ValueError, match="compression method 12"):
        load_npz(buf.getvalue())
    arrays = load_npz(sample_npz(False))
    with pytest.raises(KeyError, match="holds"):
        arrays["missing"]
    with pytest.raises(ValueError, match="not an NPZ"):
        load_npz(b"just some bytes that are long enough to look")


def test_load_npz_zip64() -> None:
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w") as zf, zf.open("x.npy", "w", force_zip64=True) as f:
        f.write(npy_bytes(np.arange(10)))
    assert_same(load_npz(buf.getvalue())["x"], np.arange(10))


def test_loaders_are_thread_safe() -> None:
    data = npz_bytes({"a": np.arange(10_000), "b": np.ones((50, 50))}, compressed=True)
    errors: list[BaseException] = []

    def work() -> None:
        try:
            for _ in range(50):
                arrays = load_npz(data)
                assert int(arrays["a"].sum()) == sum(range(10_000))
                assert load_npy(npy_bytes(arrays["b"])).sum() == 2500
        except BaseException as error:  # pragma: no cover - reported below
            errors.append(error)

    threads = [threading.Thread(target=work) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []


@pytest.mark.parametrize("backend", ["default", "zlib"])
def test_both_inflate_backends_round_trip_and_catch_corruption(
    backend: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    import zlib

    from feedline.io import arrays as arrays_module

    if backend == "zlib":
        monkeypatch.setattr(arrays_module, "_zlib", zlib)
    sample = {"a": np.arange(5000, dtype=np.int32), "b": np.full((30, 30), 7.5)}
    data = npz_bytes(sample, compressed=True)
    loaded = load_npz(data)
    for name, array in sample.items():
        assert_same(loaded[name], array)
    corrupt = bytearray(data)
    corrupt[60] ^= 0xFF  # inside the first member's deflate stream
    with pytest.raises(ValueError, match=r"member 'a\.npy'"):
        load_npz(bytes(corrupt))["a"]


def test_headers_with_escapes() -> None:
    # A field name with a real backslash is valid; an invalid escape (never written by numpy)
    # is refused rather than passed to the parser, which would warn.
    array = np.zeros(2, dtype=[("a\\m", "<i4")])
    assert_same(load_npy(npy_bytes(array)), array)
    bad = npy_bytes(array).replace(b"a\\\\m", b"a\\m ")
    with pytest.raises(ValueError, match="invalid escape"):
        load_npy(bad)


# -- regressions from a fuzzing review (each input once broke the contract) --------------------


def raw_npy(header: str, data: bytes = b"", version: int = 1) -> bytes:
    h = header.encode("latin1" if version < 3 else "utf8")
    size = struct.pack("<H", len(h)) if version == 1 else struct.pack("<I", len(h))
    return b"\x93NUMPY" + bytes([version, 0]) + size + h + data


def hdr(descr: Any, shape: Any, fortran: bool = False) -> str:
    return f"{{'descr': {descr!r}, 'fortran_order': {fortran!r}, 'shape': {shape!r}, }}\n"


def one_member_zip(name: bytes, raw: bytes, method: int, usize: int, flags: int = 0) -> bytes:
    lh = (
        struct.pack(
            "<4s5H3L2H", b"PK\x03\x04", 20, flags, method, 0, 0, 0, len(raw), usize, len(name), 0
        )
        + name
    )
    cd = (
        struct.pack(
            "<4s6H3L5H2L",
            b"PK\x01\x02",
            20,
            20,
            flags,
            method,
            0,
            0,
            0,
            len(raw),
            usize,
            len(name),
            0,
            0,
            0,
            0,
            0,
            0,
        )
        + name
    )
    eocd = struct.pack("<4s4H2LH", b"PK\x05\x06", 0, 0, 1, 1, len(cd), len(lh) + len(raw), 0)
    return lh + raw + cd + eocd


def test_a_member_declaring_zero_bytes_cannot_inflate_without_bound() -> None:
    c = zlib.compressobj(9, 8, -15)
    raw = c.compress(b"\0" * (64 << 20)) + c.flush()  # 64 MiB of zeros in ~64 KB
    data = one_member_zip(b"x.npy", raw, 8, usize=0)
    with pytest.raises(ValueError, match="inflates to 1 bytes"):
        load_npz(data, max_member_bytes=1000)["x"]


def test_header_cache_does_not_mix_format_versions() -> None:
    header = "{'descr': '<i4', 'fortran_order': False, 'shape': (2,), }\n"
    payload = struct.pack("<2i", 1, 2)
    v1, v2 = raw_npy(header, payload, 1), raw_npy(header, payload, 2)
    for first, second in ((v1, v2), (v2, v1)):
        assert load_npy(first).tolist() == [1, 2]
        assert load_npy(second).tolist() == [1, 2]


def _local(name: bytes, size: int) -> bytes:
    return (
        struct.pack("<4s5H3L2H", b"PK\x03\x04", 20, 0, 0, 0, 0, 0, size, size, len(name), 0) + name
    )


def _central(name: bytes, size: int, offset: int) -> bytes:
    return (
        struct.pack(
            "<4s6H3L5H2L",
            b"PK\x01\x02",
            20,
            20,
            0,
            0,
            0,
            0,
            0,
            size,
            size,
            len(name),
            0,
            0,
            0,
            0,
            0,
            offset,
        )
        + name
    )


def test_overlapping_members_are_refused() -> None:
    # Member b's (valid) local header and data sit inside member a's data: a reader that
    # allowed this could inflate the same bytes once per member.
    inner = npy_bytes(np.arange(3))
    b_part = _local(b"b.npy", len(inner)) + inner
    a_local = _local(b"a.npy", len(b_part))
    body = a_local + b_part
    directory = _central(b"a.npy", len(b_part), 0) + _central(b"b.npy", len(inner), len(a_local))
    eocd = struct.pack("<4s4H2LH", b"PK\x05\x06", 0, 0, 2, 2, len(directory), len(body), 0)
    with pytest.raises(ValueError, match=r"'a\.npy' and 'b\.npy' overlap"):
        load_npz(body + directory + eocd)


@pytest.mark.parametrize("descr", [("<i4",), (), ",i4", "<02", "(r,3)<f8", "i4,(2,3"])
def test_odd_dtype_descriptions_raise_value_error(descr: Any) -> None:
    with pytest.raises(ValueError):  # noqa: PT011
        load_npy(raw_npy(hdr(descr, (1,)), b"\0" * 16))


@pytest.mark.parametrize("header", ["{[]: 1}", "{{1: 2}}", "[" + "0," * 1000 + "]"])
def test_literals_that_are_not_headers_raise_value_error(header: str) -> None:
    with pytest.raises(ValueError):  # noqa: PT011
        load_npy(raw_npy(header, b"", 2))


@pytest.mark.parametrize(
    ("descr", "shape"), [("|V0", (2**70,)), ("<U0", (2**64,)), ("|S0", (2**40, 2**40))]
)
def test_zero_size_dtypes_and_huge_counts_raise_value_error(descr: str, shape: Any) -> None:
    with pytest.raises(ValueError):  # noqa: PT011
        load_npy(raw_npy(hdr(descr, shape)))


def test_dimensions_past_what_can_be_indexed_name_the_header() -> None:
    with pytest.raises(ValueError, match=r"NPY header: a dimension .* cannot be indexed"):
        load_npy(raw_npy(hdr("<i1", (0, 10**30))))  # no element, yet no array can have it
    digits = "{'descr': '<i1', 'fortran_order': False, 'shape': (" + "9" * 5000 + ",), }\n"
    with pytest.raises(ValueError, match=r"NPY header: a dimension .* is too long"):
        load_npy(raw_npy(digits, b"", 2))


def test_huge_headers_are_refused_quickly() -> None:
    shape = "(" + "9," * 100_000 + ")"
    header = "{'descr': '<i4', 'fortran_order': False, 'shape': " + shape + ", }\n"
    with pytest.raises(ValueError, match="larger than 10000"):
        load_npy(raw_npy(header, b"", 2))
    with pytest.raises(ValueError, match="more than 64"):
        load_npy(raw_npy(hdr("<i4", (1,) * 65), b"\0" * 4))


def test_unusual_buffer_views() -> None:
    good = npy_bytes(np.arange(3, dtype=np.int16))
    assert_same(load_npy(np.frombuffer(good, np.int8)), np.arange(3, dtype=np.int16))
    assert_same(load_npy(memoryview(good).cast("c")), np.arange(3, dtype=np.int16))
    strided = np.frombuffer(bytes(x for c in good for x in (c, 0)), np.uint8)[::2]
    with pytest.raises(ValueError, match="C-contiguous"):
        load_npy(strided)


def test_membership_does_not_load() -> None:
    data = bytearray(npz_bytes({"x": np.arange(1000)}, compressed=True))
    data[60] ^= 0xFF  # corrupt the member's stream
    arrays = load_npz(bytes(data))
    assert "x" in arrays
    assert "x.npy" in arrays  # numpy.load's NpzFile takes the member's file name too
    assert "y" not in arrays
    with pytest.raises(ValueError):  # noqa: PT011
        arrays["x"]


def test_members_are_found_by_their_file_names_too() -> None:
    members = {"x": np.arange(3), "y": np.ones(2)}
    for compressed in (False, True):
        data = npz_bytes(members, compressed=compressed)
        ours, numpys = load_npz(data), np.load(io.BytesIO(data))
        for key in ("x", "x.npy", "y.npy"):
            assert_same(ours[key], numpys[key])
        with pytest.raises(KeyError):
            ours["z.npy"]


def test_duplicate_member_names_are_refused() -> None:
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w") as zf:
        zf.writestr("x.npy", npy_bytes(np.arange(3)))
        zf.writestr("x", npy_bytes(np.arange(4)))
    with pytest.raises(ValueError, match="two members are named 'x'"):
        load_npz(buf.getvalue())


def test_undecodable_names_and_headers_raise_value_error() -> None:
    data = one_member_zip(
        b"\xff.npy", npy_bytes(np.arange(2)), 0, usize=len(npy_bytes(np.arange(2))), flags=0x800
    )
    with pytest.raises(ValueError, match="not valid UTF-8"):
        load_npz(data)
    with pytest.raises(ValueError, match="not valid UTF-8"):
        load_npy(b"\x93NUMPY\x03\x00" + struct.pack("<I", 4) + b"\xff\xfe\xfd\n")
