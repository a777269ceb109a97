"""Zero-copy loading of ``.npy`` bytes and a ZIP reader for ``.npz`` that never unpickles.

``numpy.load`` on in-memory bytes goes through ``BytesIO``, ``zipfile`` and a pickle-capable
header reader, all while holding the GIL, and copies every array. Here:

* :func:`load_npy` parses the NPY header (cached by its bytes: a dataset has few distinct
  headers) and returns ``numpy.frombuffer`` over the input: no copy at all.
* :func:`load_npz` reads the ZIP central directory itself. A stored member becomes a view of
  the input; a deflated member is inflated by ISA-L (``isal``, when installed: about 1.4x faster
  than zlib, with a hardware CRC-32) or zlib, both of which release the GIL, into memory
  bounded by the size its directory entry declares (and by ``max_member_bytes``).

Object arrays are refused: loading them needs unpickling, which can run arbitrary code. Every
malformed input raises :class:`ValueError` that says what is wrong; nothing is allocated from a
size read from the input before that size has been checked against the input's length or the
caller's bound.
"""

from __future__ import annotations

import ast
import itertools
import mmap
import re
import struct
import sys
import zlib
from collections.abc import Iterator, Mapping
from typing import Any, Union

import numpy as np

_zlib: Any  # the inflate backend, fixed at import (tests swap it to cover both)
try:  # Intel ISA-L (pip install 'feedline[npz]'): inflates ~1.4x faster, CRC-32 in hardware
    from isal import isal_zlib

    _zlib = isal_zlib
except ImportError:  # pragma: no cover - exercised by the tests through monkeypatching
    _zlib = zlib

__all__ = ["NpzArrays", "load_npy", "load_npz"]

Buffer = Union[bytes, bytearray, memoryview, mmap.mmap, "np.ndarray[Any, Any]"]

_MAGIC = b"\x93NUMPY"
# Parsed headers by (utf-8 text?, header bytes). The offset of the data is not cached: it
# depends on the format version, which the header bytes do not determine.
_HEADER_CACHE: dict[tuple[bool, bytes], tuple[np.dtype[Any], bool, tuple[int, ...]]] = {}
_HEADER_CACHE_MAX = 4096
_CACHE_HEADERS_UP_TO = 1024  # bytes; numpy's own headers are about 120
MAX_HEADER_SIZE = 10_000  # numpy.load's default bound: larger headers are refused
_MAX_DIMS = 64
# The header numpy writes for plain dtypes; anything else goes through ast.literal_eval.
_SIMPLE = re.compile(
    rb"\{'descr': '([<>|=][a-zA-Z][0-9]*)', 'fortran_order': (True|False), "
    rb"'shape': \(((?:\d+, )*\d*|\d+,)\), \} *\n?\Z"
)
# An odd run of backslashes followed by a character that starts no valid escape.
_BAD_ESCAPE = re.compile(r"(?<!\\)(?:\\\\)*\\[^\\'\"abfnrtvx0-7NuU\n]")
DEFAULT_MAX_MEMBER_BYTES = 1 << 34  # 16 GiB: more than any sample, less than a zip bomb


def _as_bytes_view(data: Buffer) -> memoryview:
    try:
        view = memoryview(data)  # type: ignore[arg-type]
    except TypeError:
        raise TypeError(
            f"expected bytes, bytearray, memoryview, mmap or a uint8 array, got "
            f"{type(data).__name__}"
        ) from None
    if not view.c_contiguous:
        raise ValueError("the buffer must be C-contiguous to be read without a copy")
    if view.format != "B" or view.ndim != 1:
        view = view.cast("B")  # unsigned bytes: b"\x93"[0] must read 147, not -109
    return view


def _parse_header(header: bytes, version: int) -> tuple[np.dtype[Any], bool, tuple[int, ...]]:
    match = _SIMPLE.match(header)
    if match is not None:
        descr: Any = match.group(1).decode("ascii")
        fortran = match.group(2) == b"True"
        try:
            shape = tuple(int(s) for s in match.group(3).split(b",") if s.strip())
        except ValueError:  # more digits than int() reads (4,300)
            raise ValueError(f"NPY header: a dimension of {header[:80]!r} is too long") from None
    else:
        try:
            text = header.decode("utf8" if version >= 3 else "latin1")
        except UnicodeDecodeError as error:
            raise ValueError(f"NPY header is not valid UTF-8: {error}") from None
        if _BAD_ESCAPE.search(text):  # repr() never writes one; Python would warn on it
            raise ValueError(f"NPY header has an invalid escape sequence: {text[:80]!r}")
        try:
            meta = ast.literal_eval(text)  # literals only: never runs code
        except Exception as error:  # SyntaxError, TypeError (unhashable keys), MemoryError...
            raise ValueError(f"NPY header is not a valid Python literal: {text[:80]!r}") from error
        if not isinstance(meta, dict) or set(meta) != {"descr", "fortran_order", "shape"}:
            raise ValueError(
                f"NPY header must be a dict with keys descr, fortran_order and shape, "
                f"got {text[:80]!r}"
            )
        descr, fortran, shape = meta["descr"], meta["fortran_order"], meta["shape"]
        if not isinstance(fortran, bool):
            raise ValueError(f"NPY header: fortran_order must be a bool, got {fortran!r}")
        if not isinstance(shape, tuple) or not all(
            isinstance(d, int) and not isinstance(d, bool) for d in shape
        ):
            raise ValueError(f"NPY header: shape must be a tuple of ints, got {shape!r}")
    if len(shape) > _MAX_DIMS:
        raise ValueError(f"NPY header: {len(shape)} dimensions, more than {_MAX_DIMS}")
    if any(d < 0 for d in shape):
        raise ValueError(f"NPY header: negative dimension in shape {shape}")
    if any(d > sys.maxsize for d in shape):  # (an empty array may declare one)
        raise ValueError(f"NPY header: a dimension of {str(shape)[:80]} cannot be indexed")
    try:
        dtype = np.lib.format.descr_to_dtype(descr)
    except Exception as error:  # numpy raises TypeError, ValueError, IndexError, SyntaxError
        raise ValueError(f"NPY header: unknown dtype {str(descr)[:80]!r}: {error}") from error
    if dtype.hasobject:
        raise ValueError(
            f"the array has dtype {dtype} (Python objects), which can only be loaded by "
            "unpickling; load_npy never unpickles. Save it without object fields, or use "
            "numpy.load(..., allow_pickle=True) on data you trust"
        )
    return dtype, fortran, shape


def _npy_header(view: memoryview) -> tuple[np.dtype[Any], bool, tuple[int, ...], int]:
    n = len(view)
    if n < 10 or view[:6].tobytes() != _MAGIC:
        raise ValueError(
            f"not an NPY file: it should start with {_MAGIC!r}, got {bytes(view[:6])!r}"
        )
    major, minor = view[6], view[7]
    if major == 1:
        start = 10
        length = view[8] | (view[9] << 8)
    elif major in (2, 3):
        if n < 12:
            raise ValueError(f"truncated NPY file: {n} bytes, the header length needs 12")
        start = 12
        length = int.from_bytes(view[8:12], "little")
    else:
        raise ValueError(f"unsupported NPY format version {major}.{minor} (known: 1, 2, 3)")
    if length > MAX_HEADER_SIZE:
        raise ValueError(
            f"NPY header of {length} bytes is larger than {MAX_HEADER_SIZE}, the most "
            "numpy.load reads by default; refusing it"
        )
    end = start + length
    if end > n:
        raise ValueError(f"truncated NPY file: the header needs {end} bytes, got {n}")
    header = bytes(view[start:end])
    key = (major >= 3, header)
    cached = _HEADER_CACHE.get(key)
    if cached is None:
        cached = _parse_header(header, major)
        if length <= _CACHE_HEADERS_UP_TO:
            if len(_HEADER_CACHE) >= _HEADER_CACHE_MAX:
                _HEADER_CACHE.clear()
            _HEADER_CACHE[key] = cached
    return (*cached, end)


def load_npy(data: Buffer) -> np.ndarray[Any, Any]:
    """Interpret the bytes of a ``.npy`` file as an array, without copying.

    Args:
        data: The whole file: ``bytes``, ``bytearray``, ``memoryview``, ``mmap`` or a uint8
            array. The result is a view of it, so it stays alive as long as the array does;
            the array is read-only when ``data`` is (``bytes``), writable when it is not.

    Returns:
        The array, with the dtype, shape and memory order the file declares.

    Raises:
        ValueError: If ``data`` is not a well-formed NPY file (bad magic, unknown version,
            malformed header, object dtype, fewer data bytes than the header declares).
        TypeError: If ``data`` does not expose a buffer.

    """
    view = _as_bytes_view(data)
    dtype, fortran, shape, offset = _npy_header(view)
    available = len(view) - offset
    count = 1
    for d in shape:
        count *= d
        if count > sys.maxsize:
            raise ValueError(f"NPY header: shape {shape} has more elements than can be indexed")
    if dtype.itemsize == 0 and count:
        raise ValueError(f"NPY header: {count} elements of the zero-size dtype {dtype}")
    nbytes = count * dtype.itemsize
    if available < nbytes:
        raise ValueError(
            f"truncated NPY data: shape {shape} of {dtype} needs {nbytes} bytes after the "
            f"header, got {available}"
        )
    if count == 0:
        return np.empty(shape, dtype=dtype, order="F" if fortran else "C")
    flat: np.ndarray[Any, Any] = np.frombuffer(view, dtype=dtype, count=count, offset=offset)
    if fortran:
        transposed: np.ndarray[Any, Any] = flat.reshape(shape[::-1]).T
        return transposed
    return flat.reshape(shape)


# -- NPZ: a ZIP archive of .npy members -----------------------------------------------------------

_EOCD = struct.Struct("<4s4H2LH")  # end of central directory
_EOCD64_LOCATOR = struct.Struct("<4sLQL")
_EOCD64 = struct.Struct("<4sQ2H2L4Q")
_CENTRAL = struct.Struct("<4s6H3L5H2L")  # central directory file header
_LOCAL = struct.Struct("<4s5H3L2H")  # local file header
_STORED, _DEFLATED = 0, 8


class _Member:
    __slots__ = ("crc", "csize", "method", "name", "offset", "usize")

    def __init__(
        self, name: str, method: int, crc: int, csize: int, usize: int, offset: int
    ) -> None:
        self.name = name
        self.method = method
        self.crc = crc
        self.csize = csize
        self.usize = usize
        self.offset = offset  # of the member's data (past the local header)


def _zip64_extra(extra: bytes, usize: int, csize: int, offset: int) -> tuple[int, int, int]:
    pos = 0
    while pos + 4 <= len(extra):
        tag, size = struct.unpack_from("<2H", extra, pos)
        body = extra[pos + 4 : pos + 4 + size]
        if tag == 1:
            values = list(struct.unpack_from(f"<{len(body) // 8}Q", body))
            if usize == 0xFFFFFFFF and values:
                usize = values.pop(0)
            if csize == 0xFFFFFFFF and values:
                csize = values.pop(0)
            if offset == 0xFFFFFFFF and values:
                offset = values.pop(0)
            return usize, csize, offset
        pos += 4 + size
    return usize, csize, offset


def _read_directory(view: memoryview) -> dict[str, _Member]:
    n = len(view)
    if n < _EOCD.size:
        raise ValueError(f"not an NPZ (ZIP) file: {n} bytes is too short")
    eocd_at = n - _EOCD.size
    if view[eocd_at : eocd_at + 4].tobytes() != b"PK\x05\x06":
        tail_start = max(0, n - _EOCD.size - 0xFFFF)
        eocd_at = bytes(view[tail_start:]).rfind(b"PK\x05\x06")
        if eocd_at < 0:
            raise ValueError("not an NPZ (ZIP) file: no end-of-central-directory record")
        eocd_at += tail_start
        if eocd_at + _EOCD.size > n:
            raise ValueError("truncated NPZ file: the end-of-central-directory record is cut")
    _, _, _, _, entries, cd_size, cd_offset, _ = _EOCD.unpack_from(view, eocd_at)
    if entries == 0xFFFF or cd_size == 0xFFFFFFFF or cd_offset == 0xFFFFFFFF:
        loc_at = eocd_at - _EOCD64_LOCATOR.size
        if loc_at < 0 or view[loc_at : loc_at + 4].tobytes() != b"PK\x06\x07":
            raise ValueError("malformed NPZ file: ZIP64 sizes without a ZIP64 locator")
        _, _, eocd64_at, _ = _EOCD64_LOCATOR.unpack_from(view, loc_at)
        if (
            eocd64_at + _EOCD64.size > n
            or view[eocd64_at : eocd64_at + 4].tobytes() != b"PK\x06\x06"
        ):
            raise ValueError("malformed NPZ file: bad ZIP64 end-of-central-directory record")
        fields = _EOCD64.unpack_from(view, eocd64_at)
        entries, cd_size, cd_offset = fields[7], fields[8], fields[9]
    if cd_offset + cd_size > eocd_at:
        raise ValueError(
            f"truncated or malformed NPZ file: the central directory ({cd_size} bytes at "
            f"{cd_offset}) does not fit before its end record at {eocd_at}"
        )
    members: dict[str, _Member] = {}
    spans: list[tuple[int, int, str]] = []  # (local header, end of data, name) per member
    pos = cd_offset
    for _ in range(entries):
        if pos + _CENTRAL.size > eocd_at or view[pos : pos + 4].tobytes() != b"PK\x01\x02":
            raise ValueError(f"malformed NPZ file: bad central directory entry at {pos}")
        (
            _,
            _,
            _,
            flags,
            method,
            _,
            _,
            crc,
            csize,
            usize,
            name_len,
            extra_len,
            comment_len,
            _,
            _,
            _,
            offset,
        ) = _CENTRAL.unpack_from(view, pos)
        name_at = pos + _CENTRAL.size
        pos = name_at + name_len + extra_len + comment_len
        if pos > eocd_at:
            raise ValueError("malformed NPZ file: a central directory entry runs past its end")
        raw_name = bytes(view[name_at : name_at + name_len])
        try:
            name = raw_name.decode("utf8" if flags & 0x800 else "cp437")
        except UnicodeDecodeError:
            raise ValueError(
                f"malformed NPZ file: a member name is not valid UTF-8: {raw_name[:40]!r}"
            ) from None
        extra = bytes(view[name_at + name_len : name_at + name_len + extra_len])
        usize, csize, offset = _zip64_extra(extra, usize, csize, offset)
        if flags & 0x1:
            raise ValueError(f"NPZ member {name!r} is encrypted; encrypted members are not read")
        if method not in (_STORED, _DEFLATED):
            raise ValueError(
                f"NPZ member {name!r} uses ZIP compression method {method}; only stored (0) "
                "and deflated (8) members are read (what numpy.savez writes)"
            )
        if offset + _LOCAL.size > n or view[offset : offset + 4].tobytes() != b"PK\x03\x04":
            raise ValueError(f"malformed NPZ file: no local header for member {name!r}")
        local = _LOCAL.unpack_from(view, offset)
        local_name_at = offset + _LOCAL.size
        if view[local_name_at : local_name_at + local[9]] != raw_name:
            raise ValueError(
                f"malformed NPZ file: member {name!r} has another name in its local header "
                f"({bytes(view[local_name_at : local_name_at + local[9]])!r})"
            )
        data_at = local_name_at + local[9] + local[10]
        if data_at + csize > n:
            raise ValueError(
                f"truncated NPZ file: member {name!r} needs {data_at + csize} bytes, got {n}"
            )
        key = name[:-4] if name.endswith(".npy") else name
        if key in members:
            raise ValueError(
                f"malformed NPZ file: two members are named {key!r} (or {key!r} and "
                f"{key + '.npy'!r}); readers would disagree on which one it is"
            )
        members[key] = _Member(name, method, crc, csize, usize, data_at)
        spans.append((offset, data_at + csize, name))
    # Members may not overlap each other or the directory: overlapping entries would let a
    # small file inflate the same compressed bytes many times over (a zip bomb).
    spans.sort()
    for (_, end, name), (start, _, other) in itertools.pairwise(spans):
        if start < end:
            raise ValueError(f"malformed NPZ file: members {name!r} and {other!r} overlap")
    if spans and spans[-1][1] > cd_offset:
        raise ValueError(
            f"malformed NPZ file: member {spans[-1][2]!r} runs into the central directory"
        )
    return members


class NpzArrays(Mapping[str, "np.ndarray[Any, Any]"]):
    """The arrays of an NPZ file, loaded lazily by name (``"x"`` for member ``x.npy``).

    Stored members are views of the input bytes; deflated members are inflated on first
    access and kept. Made by :func:`load_npz`.
    """

    def __init__(
        self, view: memoryview, members: dict[str, _Member], max_member_bytes: int, verify: bool
    ) -> None:
        self._view = view
        self._members = members
        self._max = max_member_bytes
        self._verify = verify
        self._loaded: dict[str, np.ndarray[Any, Any]] = {}

    def __getitem__(self, key: str) -> np.ndarray[Any, Any]:
        array = self._loaded.get(key)
        if array is not None:
            return array
        member = self._members.get(key)
        if member is None and isinstance(key, str) and key.endswith(".npy"):
            member = self._members.get(key[:-4])  # numpy.load's NpzFile takes both names
        if member is None:
            raise KeyError(f"{key!r} is not in this NPZ file; it holds {sorted(self._members)}")
        raw = self._view[member.offset : member.offset + member.csize]
        if member.usize > self._max:
            raise ValueError(
                f"NPZ member {member.name!r} declares {member.usize} bytes, more than "
                f"max_member_bytes={self._max}; raise the bound if the file is trusted"
            )
        if member.method == _STORED:
            if member.csize != member.usize:
                raise ValueError(
                    f"malformed NPZ member {member.name!r}: stored with {member.csize} bytes "
                    f"but declares {member.usize}"
                )
            data: Buffer = raw
            if self._verify and _zlib.crc32(raw) != member.crc:
                raise ValueError(f"NPZ member {member.name!r} fails its CRC-32 check")
        else:
            data = _inflate(member, raw)
        try:
            array = load_npy(data)
        except ValueError as error:
            raise ValueError(f"NPZ member {member.name!r}: {error}") from error
        if member.method != _STORED:
            self._loaded[key] = array
        return array

    def __contains__(self, key: object) -> bool:
        if isinstance(key, str) and key.endswith(".npy"):
            key = key[:-4]  # as numpy.load's NpzFile
        return key in self._members  # without loading (Mapping's default would)

    def __iter__(self) -> Iterator[str]:
        return iter(self._members)

    def __len__(self) -> int:
        return len(self._members)

    def __repr__(self) -> str:
        return f"NpzArrays({sorted(self._members)})"


def _inflate(member: _Member, raw: memoryview) -> bytes:
    inflater = _zlib.decompressobj(-15)
    try:
        # zlib and ISA-L release the GIL while they inflate; max_length bounds the output.
        # max_length 0 would mean "no limit": one byte past the declared size exposes a lie.
        out: bytes = inflater.decompress(raw, min(member.usize + 1, sys.maxsize))
    except _zlib.error as error:
        raise ValueError(f"NPZ member {member.name!r}: corrupt deflate stream: {error}") from error
    if len(out) != member.usize or not inflater.eof or inflater.unconsumed_tail:
        raise ValueError(
            f"NPZ member {member.name!r}: inflates to {len(out)} bytes"
            f"{'' if inflater.eof else ' (stream incomplete)'}, its directory entry says "
            f"{member.usize}"
        )
    if _zlib.crc32(out) != member.crc:
        raise ValueError(f"NPZ member {member.name!r} fails its CRC-32 check")
    return out


def load_npz(
    data: Buffer, *, max_member_bytes: int = DEFAULT_MAX_MEMBER_BYTES, verify: bool = False
) -> NpzArrays:
    """Read the directory of an ``.npz`` file held in memory; arrays load lazily by name.

    Args:
        data: The whole file (``bytes``, ``bytearray``, ``memoryview``, ``mmap``).
        max_member_bytes: Refuse a member that declares more bytes than this (a guard against
            decompression bombs).
        verify: Also check the CRC-32 of stored members (reads every byte: costs time). Deflated
            members are always checked, as inflating reads them anyway.

    Returns:
        A read-only mapping from array name to array.

    Raises:
        ValueError: If the ZIP structure is malformed or truncated (here, or on access for a
            member's contents), a member is encrypted or compressed other than by deflate, or
            a member is not a valid NPY file.

    """
    view = _as_bytes_view(data)
    return NpzArrays(view, _read_directory(view), min(max_member_bytes, sys.maxsize - 1), verify)
