"""The tar reader against Python's tarfile, and every truncation or damaged header."""

from __future__ import annotations

import io
import tarfile

import pytest

from feedline.io.tar import tar_members, tar_samples


def _archive(fmt: int, count: int = 6, long_names: bool = False) -> bytes:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=fmt) as tar:
        for i in range(count):
            stem = ("d" * 120 + "/") if long_names and i % 2 else ""
            for ext, body in (("jpg", bytes([i]) * (300 + 97 * i)), ("cls", str(i).encode())):
                info = tarfile.TarInfo(f"train/{stem}{i:06d}.{ext}")
                info.size = len(body)
                tar.addfile(info, io.BytesIO(body))
        folder = tarfile.TarInfo("train/folder")
        folder.type = tarfile.DIRTYPE
        tar.addfile(folder)
        link = tarfile.TarInfo("train/link.jpg")
        link.type = tarfile.SYMTYPE
        link.linkname = "x" * (150 if fmt != tarfile.USTAR_FORMAT else 50)
        tar.addfile(link)
        empty = tarfile.TarInfo("train/empty.txt")
        tar.addfile(empty, io.BytesIO(b""))
    return buf.getvalue()


def _tarfile_members(data: bytes) -> list[tuple[str, bytes]]:
    with tarfile.open(fileobj=io.BytesIO(data)) as tar:
        return [(m.name, tar.extractfile(m).read()) for m in tar if m.isfile()]  # type: ignore[union-attr]


@pytest.mark.parametrize("fmt", [tarfile.USTAR_FORMAT, tarfile.GNU_FORMAT, tarfile.PAX_FORMAT])
@pytest.mark.parametrize("long_names", [False, True])
def test_members_are_tarfiles_without_a_copy(fmt: int, long_names: bool) -> None:
    if fmt == tarfile.USTAR_FORMAT and long_names:
        long_names = False  # ustar cannot hold them; its prefix field is covered below
    data = _archive(fmt, long_names=long_names)
    ours = list(tar_members(data, shard="a.tar"))
    assert [(m.name, bytes(m.data)) for m in ours] == _tarfile_members(data)
    assert all(m.data.obj is data for m in ours)  # views of the archive, not copies
    assert ours[0].offset == 0 if fmt == tarfile.USTAR_FORMAT else ours[0].offset >= 0


def test_a_ustar_prefix_and_pax_paths() -> None:
    for fmt, name in (
        (tarfile.USTAR_FORMAT, "p" * 90 + "/" + "q" * 90 + ".bin"),  # split into the prefix
        (tarfile.PAX_FORMAT, "ü/" + "r" * 200 + ".txt"),  # non-ASCII and long: a pax path
    ):
        buf = io.BytesIO()
        with tarfile.open(fileobj=buf, mode="w", format=fmt) as tar:
            info = tarfile.TarInfo(name)
            info.size = 5
            tar.addfile(info, io.BytesIO(b"hello"))
        data = buf.getvalue()
        found = [(m.name, bytes(m.data)) for m in tar_members(data)]
        assert found == _tarfile_members(data) == [(name, b"hello")]


def test_a_base_256_size_is_read() -> None:
    data = bytearray(_archive(tarfile.GNU_FORMAT, count=1))
    header = data[:512]
    size = int(header[124:136].rstrip(b"\0 "), 8)
    header[124:136] = b"\x80" + size.to_bytes(11, "big")  # GNU's base-256 form
    header[148:156] = b" " * 8
    header[148:156] = f"{sum(header):06o}\0 ".encode()
    data[:512] = header
    assert bytes(next(tar_members(bytes(data))).data) == b"\0" * size


def test_samples_are_grouped_by_key_as_webdataset_does() -> None:
    data = _archive(tarfile.GNU_FORMAT, count=3)
    samples = list(tar_samples(data, shard="s3://b/shard-0.tar"))
    keys = ["train/000000", "train/000001", "train/000002", "train/empty"]
    assert [s["__key__"] for s in samples] == keys
    assert all(s["__url__"] == "s3://b/shard-0.tar" for s in samples)
    assert bytes(samples[1]["cls"]) == b"1"
    assert bytes(samples[2]["jpg"]) == bytes([2]) * (300 + 97 * 2)
    assert set(samples[0]) == {"__key__", "__url__", "jpg", "cls"}
    assert bytes(samples[3]["txt"]) == b""
    assert list(tar_samples(b"\0" * 1024)) == []


def test_every_truncation_raises_value_error_naming_the_shard_and_offset() -> None:
    data = _archive(tarfile.PAX_FORMAT, count=3, long_names=True)
    end = len(data) - 1024  # tarfile pads: the end-of-archive block is somewhere before
    while data[end - 512 : end] == bytes(512):
        end -= 512
    end += 512  # just after the first end-of-archive block
    for cut in range(end):
        with pytest.raises(ValueError, match=r"cut\.tar: .*offset \d+"):
            list(tar_members(data[:cut], shard="cut.tar"))


def test_every_damaged_header_byte_raises_value_error() -> None:
    data = _archive(tarfile.GNU_FORMAT, count=2)
    headers = [m.offset for m in tar_members(data)]
    for start in headers:
        for k in range(512):
            damaged = bytearray(data)
            damaged[start + k] ^= 0x41
            with pytest.raises(ValueError, match=r"damaged|not a tar header|truncated"):
                list(tar_members(bytes(damaged), shard="bad.tar"))


def test_a_zeroed_header_raises_instead_of_ending_the_archive() -> None:
    # A zero block is the end only when zeros follow it to the end: a header wiped by damage
    # (or a zero-filled block in the middle) would otherwise drop every member after it.
    data = _archive(tarfile.GNU_FORMAT, count=10)
    # (A member whose bytes are all zeros, or none, leaves nothing to tell a wiped header by:
    # an empty last member wiped is an archive that ends one member sooner.)
    for member in [m for m in tar_members(data) if any(bytes(m.data))]:
        damaged = bytearray(data)
        damaged[member.offset : member.offset + 512] = bytes(512)
        with pytest.raises(ValueError, match=r"bad\.tar.*not a tar header"):
            list(tar_members(bytes(damaged), shard="bad.tar"))


def test_archives_joined_end_to_end_are_read_whole() -> None:
    # What `cat a.tar b.tar` makes (GNU tar reads it with --ignore-zeros): no member dropped.
    first, second = _archive(tarfile.GNU_FORMAT, count=3), _archive(tarfile.PAX_FORMAT, count=2)
    names = [m.name for m in tar_members(first + second)]
    parts = [[m.name for m in tar_members(part)] for part in (first, second)]
    assert names == parts[0] + parts[1]
    assert len(parts[1]) == 5  # two samples of two files, and the empty file


@pytest.mark.parametrize("mode", ["w:gz", "w:bz2", "w:xz"])
def test_a_compressed_archive_says_so(mode: str) -> None:
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode=mode) as tar:  # type: ignore[call-overload]
        tar.addfile(tarfile.TarInfo("a.jpg"), io.BytesIO(b""))
    with pytest.raises(ValueError, match=r"x.tar.*compressed archive.*decompress it"):
        list(tar_members(buffer.getvalue(), shard="x.tar"))


def test_not_a_tar_archive_says_so() -> None:
    with pytest.raises(ValueError, match="not a tar header"):
        list(tar_members(b"PK\x03\x04" + bytes(1020), shard="x.zip"))
    with pytest.raises(ValueError, match="truncated"):
        list(tar_members(b"", shard="empty"))


def test_a_sparse_member_raises_instead_of_being_left_out() -> None:
    data = bytearray(_archive(tarfile.GNU_FORMAT, count=1))
    header = data[:512]
    header[156:157] = b"S"  # GNU sparse: this reader does not expand it
    header[148:156] = b" " * 8
    header[148:156] = f"{sum(header):06o}\0 ".encode()
    data[:512] = header
    with pytest.raises(ValueError, match="sparse file"):
        list(tar_members(bytes(data), shard="s.tar"))


def test_fields_are_lower_case_and_a_field_twice_raises_as_in_webdataset() -> None:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w") as tar:
        for name in ("a/001.JPG", "a/001.Cls", "a/002.jpg", "a/002.jpg"):
            info = tarfile.TarInfo(name)
            info.size = 1
            tar.addfile(info, io.BytesIO(b"x"))
    samples = tar_samples(buf.getvalue(), shard="w.tar")
    assert set(next(samples)) == {"__key__", "__url__", "jpg", "cls"}
    with pytest.raises(ValueError, match=r"w\.tar: the sample 'a/002' has 'jpg' twice"):
        next(samples)


def _reheader(data: bytes, edit: dict[int, bytes], signed: bool = False) -> bytes:
    # The first header with ``edit`` applied and its checksum made again (as signed chars
    # with ``signed``, as old tars wrote it).
    header = bytearray(data[:512])
    for where, raw in edit.items():
        header[where : where + len(raw)] = raw
    header[148:156] = b" " * 8
    total = sum(b - 256 if signed and b > 127 else b for b in header)
    header[148:156] = f"{total:06o}\0 ".encode()
    return bytes(header) + data[512:]


@pytest.mark.parametrize("size", [b"-0000001000", b"-1000", b"-0"])
def test_a_negative_size_raises_instead_of_walking_back(size: bytes) -> None:
    data = _archive(tarfile.USTAR_FORMAT, count=2)
    damaged = _reheader(data, {124: size})
    with pytest.raises(ValueError, match=r"neg\.tar: .*offset 0 .*negative size"):
        list(tar_members(damaged, shard="neg.tar"))
    with pytest.raises(ValueError, match="negative size"):
        list(tar_samples(damaged, shard="neg.tar"))


def test_a_size_with_a_plus_sign_is_read_as_tarfile_reads_it() -> None:
    data = _archive(tarfile.USTAR_FORMAT, count=2)
    size = int(data[124:136].rstrip(b"\0 "), 8)
    signed = _reheader(data, {124: f"+{size:010o}".encode()})
    assert [(m.name, bytes(m.data)) for m in tar_members(signed)] == _tarfile_members(signed)


def test_an_old_signed_checksum_with_a_utf8_name_is_read() -> None:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=tarfile.USTAR_FORMAT) as tar:
        info = tarfile.TarInfo("train/ünïcødé.txt")
        info.size = 5
        tar.addfile(info, io.BytesIO(b"hello"))
    data = _reheader(buf.getvalue(), {}, signed=True)
    unsigned = sum(data[:148]) + sum(data[156:512]) + 8 * 0x20
    assert int(data[148:154], 8) != unsigned  # the header really is summed signed
    assert _tarfile_members(data) == [("train/ünïcødé.txt", b"hello")]
    assert [(m.name, bytes(m.data)) for m in tar_members(data)] == _tarfile_members(data)


def test_any_bytes_end_the_walk() -> None:
    # Whatever the headers say, each step moves forward: the walk ends (or raises) within as
    # many steps as the archive has blocks.
    import random

    rng = random.Random(5)
    data = _archive(tarfile.PAX_FORMAT, count=3, long_names=True)
    for _ in range(300):
        damaged = bytearray(data)
        for _ in range(rng.randrange(1, 6)):
            damaged[rng.randrange(len(damaged))] = rng.randrange(256)
        for where in range(0, len(damaged), 512):  # every header's checksum made good
            block = damaged[where : where + 512]
            if any(block):
                damaged[where : where + 512] = _reheader(bytes(block), {})[:512]
        steps = 0
        try:
            for _ in tar_members(bytes(damaged)):
                steps += 1
                assert steps <= len(damaged) // 512
        except ValueError:
            pass
