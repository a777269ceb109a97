"""Reading tar archives in memory without copying, and grouping their files into samples.

Training sets packed as tar shards (the WebDataset layout) put the files of one sample next to
each other under one key: ``train/000123.jpg``, ``train/000123.cls``. :func:`tar_members`
walks an archive's headers in a bytes-like object (a whole object read from storage, a memory
map) and yields each regular file as a ``memoryview`` of that object: nothing is copied, and
per member it does only what the format needs (a header's checksum, its size, its name),
where ``tarfile`` builds an object per member through a file interface. :func:`tar_samples`
groups consecutive files by key, as WebDataset does.

It reads ustar, GNU (long names, base-256 sizes) and pax (``path`` and ``size`` records)
archives, as ``tarfile`` writes them. Links, directories and devices are skipped. Whatever
does not add up raises :class:`ValueError` naming the shard and the byte offset: a header
whose checksum fails, a size field that is not a number (or is negative), a member that runs
past the end, an archive that ends without its end-of-archive block (a truncated download
looks like that). Each header moves the walk forward, so any input ends it. The archive ends
at a zero block followed by zeros only: bytes after one (archives joined end to end, or a
header that damage zeroed) are walked on, never dropped unsaid. A member's bytes carry no
checksum in the format, so damage inside them cannot be seen here.
"""

from __future__ import annotations

import zlib
from collections.abc import Iterator
from typing import Any, NamedTuple

__all__ = ["TarMember", "tar_members", "tar_samples"]

_BLOCK = 512
_COMPRESSED = (
    (b"\x1f\x8b", "gzip"),
    (b"\x28\xb5\x2f\xfd", "zstd"),
    (b"BZh", "bzip2"),
    (b"\xfd7zXZ\x00", "xz"),
)
_REGULAR = (b"0", b"\0", b"7")  # a file ("7": contiguous, read as a file, as tarfile does)
_SKIPPED = (b"1", b"2", b"3", b"4", b"5", b"6")  # links, devices, directories, FIFOs
_EMPTY = bytes(_BLOCK)


class TarMember(NamedTuple):
    """A regular file of an archive.

    Attributes:
        name: Its path in the archive.
        data: Its bytes: a view of the archive's buffer (keep the buffer's object alive, or
            copy with ``bytes(data)``).
        offset: Where its header starts in the archive.

    """

    name: str
    data: memoryview
    offset: int


def tar_members(data: Any, *, shard: str = "<bytes>") -> Iterator[TarMember]:
    """The regular files of the tar archive in ``data`` (bytes, bytearray, memoryview, mmap).

    Args:
        data: The whole archive.
        shard: What to call the archive in error messages (its key or path).

    Raises:
        ValueError: A malformed or truncated archive, naming ``shard`` and the offset.

    """
    view = memoryview(data).cast("B")
    raw = data if isinstance(data, bytes) else view  # bytes slice into bytes at once
    size = len(view)
    offset = 0
    long_name: str | None = None  # from a GNU "L" member or a pax "path" record
    pax_size: int | None = None
    for magic, method in _COMPRESSED:
        if bytes(view[: len(magic)]) == magic:
            raise ValueError(
                f"{shard}: a {method}-compressed archive; shards are read as plain tar (their "
                f"members are JPEGs and the like already): decompress it, or write it without "
                "compression"
            )
    while True:
        if offset + _BLOCK > size:
            where = "ends" if offset == size else "ends inside a header"
            raise ValueError(
                f"{shard}: the archive {where} at offset {offset}, without the end-of-archive "
                "block: it is truncated (or not a tar archive)"
            )
        block = raw[offset : offset + _BLOCK]
        if not isinstance(block, bytes):
            block = block.tobytes()
        if block == _EMPTY:
            # The end of the archive if only zero blocks follow (one is enough, as for
            # tarfile). A block that is not: archives joined end to end (GNU tar's
            # --ignore-zeros reads on), or a header zeroed by damage, whose member's bytes
            # then fail the checksum. Either way no member after it is dropped unsaid.
            offset += _BLOCK
            while offset + _BLOCK <= size and raw[offset : offset + _BLOCK] == _EMPTY:
                offset += _BLOCK
            if offset + _BLOCK > size:
                return  # (a tail shorter than a block holds no header)
            continue
        _check_sum(block, shard, offset)
        kind = block[156:157]
        length = pax_size if pax_size is not None else _number(block[124:136], shard, offset)
        start = offset + _BLOCK
        end = start + length
        if end > size:
            raise ValueError(
                f"{shard}: the member at offset {offset} declares {length} bytes but the "
                f"archive ends {size - start} bytes after its header: it is truncated"
            )
        body = view[start:end]
        offset = start + -(-length // _BLOCK) * _BLOCK
        if kind == b"L":  # GNU: the next member's long name
            long_name = _text(body.tobytes())
            continue
        if kind == b"K":  # GNU: the next member's long link name (links are skipped)
            continue
        if kind in (b"x", b"g"):  # pax: records for the next member (or all: "g")
            records = _pax(body.tobytes(), shard, offset)
            if any(key.startswith("GNU.sparse.") for key in records):
                raise _sparse(shard, start - _BLOCK)
            if kind == b"x":
                long_name = records.get("path", long_name)
                if "size" in records:
                    pax_size = _pax_size(records["size"], shard, offset)
            continue
        name, long_name, pax_size = long_name or _name(block), None, None
        if kind == b"S":
            raise _sparse(shard, start - _BLOCK)
        if kind in _REGULAR:
            yield TarMember(name, body, start - _BLOCK)
        elif kind not in _SKIPPED:
            continue  # another extension's header (Solaris ACLs, volume labels): skipped


def tar_samples(data: Any, *, shard: str = "<bytes>") -> Iterator[dict[str, Any]]:
    """The archive's files grouped into samples by key, as WebDataset groups them.

    A file's key is its path up to the first dot of its base name, and the rest, in lower
    case, is its field: ``train/000123.Seg.PNG`` is key ``train/000123``, field
    ``seg.png``. Consecutive files with one key make a sample: ``{"__key__": key,
    "__url__": shard, "jpg": memoryview, "cls": memoryview}``. Files without an extension
    are left out. A key that comes back after another one starts another sample, and a
    field twice in one sample raises :class:`ValueError` (as in WebDataset).
    """
    sample: dict[str, Any] | None = None
    for member in tar_members(data, shard=shard):
        slash = member.name.rfind("/") + 1
        dot = member.name.find(".", slash)
        if dot <= slash:  # no extension (or a hidden file: ".name")
            continue
        key, field = member.name[:dot], member.name[dot + 1 :].lower()
        if sample is None or sample["__key__"] != key:
            if sample is not None:
                yield sample
            sample = {"__key__": key, "__url__": shard}
        elif field in sample:
            raise ValueError(
                f"{shard}: the sample {key!r} has {field!r} twice (offset {member.offset}): "
                "two files of one sample with the same extension"
            )
        sample[field] = member.data
    if sample is not None:
        yield sample


def _sparse(shard: str, offset: int) -> ValueError:
    return ValueError(
        f"{shard}: the member at offset {offset} is a sparse file, which this reader does "
        "not expand: write shards without --sparse (or read this one with tarfile)"
    )


def _check_sum(block: bytes, shard: str, offset: int) -> None:
    try:
        stored = int(block[148:156].rstrip(b"\0 ").lstrip(b" ") or b"x", 8)
    except ValueError:
        raise ValueError(
            f"{shard}: the header at offset {offset} has no checksum: not a tar header "
            "(the archive is damaged, or this is not one)"
        ) from None
    unsigned = _byte_sum(block) - sum(block[148:156]) + 8 * 0x20
    if stored != unsigned:
        # Old tars summed the bytes as signed chars: each byte over 127 counts 256 less (the
        # checksum field itself counts as spaces, which are below).
        high = _high_count(block) - _high_count(block[148:156])
        signed = unsigned - 256 * high
        if stored != signed:
            raise ValueError(
                f"{shard}: the header at offset {offset} fails its checksum (stored {stored}, "
                f"computed {unsigned}): the archive is damaged"
            )


_HIGH = bytes(range(128, 256))


def _high_count(raw: bytes) -> int:
    # How many of the bytes are over 127.
    return len(raw) - len(raw.translate(None, _HIGH))


def _byte_sum(block: bytes) -> int:
    # The sum of a header's bytes, from zlib's Adler-32 (its low half is 1 + the sum, modulo
    # 65521) where that settles it: the sum is at most 255 per nonzero byte, and a header
    # has a few hundred zeros. Python's sum() over 512 bytes took most of a member's time.
    low = (zlib.adler32(block) & 0xFFFF) - 1
    low %= _ADLER
    if low + _ADLER <= 255 * (len(block) - block.count(0)):
        return sum(block)  # either low or low + 65521: count
    return low


_ADLER = 65521


def _number(field: bytes, shard: str, offset: int) -> int:
    # An octal number, or GNU's base-256 for sizes of 8 GiB and more.
    if field[:1] in (b"\x80", b"\xff"):
        value = int.from_bytes(field[1:], "big")
        if field[0] == 0xFF:
            raise ValueError(f"{shard}: the header at offset {offset} has a negative size")
        return value
    digits = field.rstrip(b"\0 ").lstrip(b" ")
    try:
        value = int(digits or b"0", 8)
    except ValueError:
        raise ValueError(
            f"{shard}: the header at offset {offset} has a size that is not a number "
            f"({field!r}): the archive is damaged"
        ) from None
    if value < 0:  # int() takes a sign: the walk would go back to an earlier header, for ever
        raise ValueError(
            f"{shard}: the header at offset {offset} has a negative size ({field!r}): the "
            "archive is damaged"
        )
    return value


def _name(block: bytes) -> str:
    name = _text(block[0:100])
    if block[257:263] == b"ustar\0":  # POSIX ustar: a prefix holds the path's start
        prefix = _text(block[345:500])
        if prefix:
            return f"{prefix}/{name}"
    return name


def _text(raw: bytes) -> str:
    end = raw.find(b"\0")
    return (raw if end < 0 else raw[:end]).decode("utf-8", "surrogateescape")


def _pax(raw: bytes, shard: str, offset: int) -> dict[str, str]:
    # Records "LENGTH KEY=VALUE\n", LENGTH counting the whole record.
    records: dict[str, str] = {}
    position = 0
    while position < len(raw) and raw[position] != 0:
        space = raw.find(b" ", position)
        try:
            length = int(raw[position:space])
        except ValueError:
            length = 0
        record = raw[space + 1 : position + length - 1]
        if space < 0 or length <= 0 or position + length > len(raw) or b"=" not in record:
            raise ValueError(
                f"{shard}: a pax header before offset {offset} has a malformed record at "
                f"byte {position}: the archive is damaged"
            )
        key, _, value = record.partition(b"=")
        records[key.decode("utf-8", "surrogateescape")] = value.decode("utf-8", "surrogateescape")
        position += length
    return records


def _pax_size(value: str, shard: str, offset: int) -> int:
    try:
        size = int(value)
    except ValueError:
        size = -1
    if size < 0:
        raise ValueError(f"{shard}: a pax header before offset {offset} has a bad size {value!r}")
    return size
