"""io.checksum: ISA-L's CRC-32 is zlib's, and a zip written without its members' CRC-32s (torch.save with
``compute_crc32`` off, or any stored zip) gets each one filled in exactly where the zip rules keep it: zipfile's
own check passes, the values are the ones torch computes itself, and normconv's pickles are such zips."""

from __future__ import annotations

import io
import struct
import zipfile
import zlib

import pytest
import torch
import torch.nn as nn

from normconv.io import checksum
from normconv.io.checksum import crc32, fill_zip_crcs, unchecked_torch_save


@pytest.mark.parametrize("piece", [1 << 30, 7])
def test_the_checksum_is_zlib_s_crc32(monkeypatch, piece):
    """ISA-L's CRC-32 gives zlib's values on zlib's own edge cases (empty, one byte, unaligned views, a running value
    carried over), over a tensor's bytes, and across the pieces it is computed in."""
    from normconv.stream.checkpoint import tensor_bytes

    monkeypatch.setattr(checksum, "_CRC_PIECE", piece)
    data = bytes(range(256)) * 41 + b"\xff"
    view = memoryview(bytearray(data))
    cases = [b"", b"\x00", data, view[1:], view[3:4000], bytearray(data[::-1])]
    cases.append(tensor_bytes(torch.randn(33, 17, generator=torch.Generator().manual_seed(1)).to(torch.bfloat16)))
    for case in cases:
        for start in (0, 1, 0xFFFFFFFF, zlib.crc32(b"abc")):
            assert crc32(case, start) == zlib.crc32(case, start)
    assert crc32(view[1000:], crc32(view[:1000])) == zlib.crc32(data)


def _crcs(path) -> dict[str, int]:
    with zipfile.ZipFile(path) as z:
        return {i.filename: i.CRC for i in z.infolist()}


def test_torch_s_own_crcs_are_filled_in(tmp_path, monkeypatch):
    monkeypatch.setattr(checksum, "_READ", 1000)  # members read back across many reads
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(300, 200), nn.Linear(200, 5), nn.BatchNorm1d(5))
    (tmp_path / "a").mkdir(), (tmp_path / "b").mkdir()
    torch.save(model, tmp_path / "a" / "m.pt")  # torch's own CRC-32s
    with unchecked_torch_save() as unchecked:
        torch.save(model, tmp_path / "b" / "m.pt")
    assert unchecked
    without = _crcs(tmp_path / "b" / "m.pt")
    assert set(without.values()) == {0}
    with zipfile.ZipFile(tmp_path / "b" / "m.pt") as z:
        assert z.testzip() is not None  # zipfile's check refuses it as torch wrote it
    assert fill_zip_crcs(str(tmp_path / "b" / "m.pt")) == 2 * len(without)
    ours, torchs = _crcs(tmp_path / "b" / "m.pt"), _crcs(tmp_path / "a" / "m.pt")
    assert {k: v for k, v in ours.items() if not k.endswith("serialization_id")} == \
        {k: v for k, v in torchs.items() if not k.endswith("serialization_id")}  # a random id per save
    with zipfile.ZipFile(tmp_path / "b" / "m.pt") as z:
        assert z.testzip() is None  # every member, local header or descriptor and central directory
    back = torch.load(tmp_path / "b" / "m.pt", weights_only=False)
    x = torch.randn(4, 300)
    torch.testing.assert_close(back.eval()(x), model.eval()(x), rtol=0, atol=0)
    from torch.utils.serialization import config
    assert config.save.compute_crc32  # put back after the block


def _zeroed(data: bytes) -> bytes:
    """The zip with every CRC-32 field set to 0 (local headers, data descriptors, central directory)."""
    buf = bytearray(data)
    with zipfile.ZipFile(io.BytesIO(data)) as z:
        infos, central = z.infolist(), z.start_dir
    for info in infos:
        n, m = struct.unpack("<HH", buf[info.header_offset + 26:info.header_offset + 30])
        buf[info.header_offset + 14:info.header_offset + 18] = b"\0\0\0\0"
        if info.flag_bits & 0x08:
            end = info.header_offset + 30 + n + m + info.compress_size
            at = end + 4 if buf[end:end + 4] == b"PK\x07\x08" else end
            buf[at:at + 4] = b"\0\0\0\0"
        buf[central + 16:central + 20] = b"\0\0\0\0"
        cn, cm, ck = struct.unpack("<HHH", buf[central + 28:central + 34])
        central += 46 + cn + cm + ck
    return bytes(buf)


class _Unseekable(io.RawIOBase):
    """A stream zipfile cannot seek back in: it writes a data descriptor after each member."""

    def __init__(self):
        self.out = bytearray()

    def writable(self):
        return True

    def write(self, b):
        self.out += b
        return len(b)


@pytest.mark.parametrize("zip64", [False, True], ids=["zip32", "zip64"])
@pytest.mark.parametrize("descriptors", [False, True], ids=["headers", "descriptors"])
def test_zipfile_s_own_stored_zips_with_and_without_descriptors(tmp_path, descriptors, zip64):
    """Both places the zip rules keep a CRC-32 (local header, or a data descriptor after the data), with 32-bit
    sizes and with zip64's extra fields and 8-byte descriptor sizes (what torch.save writes past 4 GiB)."""
    members = {"empty": b"", "one": b"\x01", "big": bytes(range(256)) * 5000, "dir/nested.bin": b"x" * 70000}
    sink = _Unseekable() if descriptors else io.BytesIO()
    with zipfile.ZipFile(sink, "w", zipfile.ZIP_STORED) as z:
        for name, body in members.items():
            with z.open(name, "w", force_zip64=zip64) as f:
                f.write(body)
    data = bytes(sink.out) if descriptors else sink.getvalue()
    with zipfile.ZipFile(io.BytesIO(data)) as z:
        assert all(bool(i.flag_bits & 0x08) == descriptors for i in z.infolist())
    path = tmp_path / "z.zip"
    path.write_bytes(_zeroed(data))
    fill_zip_crcs(str(path))
    assert path.read_bytes() == data  # byte for byte what zipfile wrote
    with zipfile.ZipFile(path) as z:
        assert z.testzip() is None and {n: z.read(n) for n in members} == members


def test_a_compressed_member_is_refused(tmp_path):
    path = tmp_path / "c.zip"
    with zipfile.ZipFile(path, "w", zipfile.ZIP_DEFLATED) as z:
        z.writestr("a", b"a" * 1000)
    with pytest.raises(ValueError, match="compressed member"):
        fill_zip_crcs(str(path))


def test_a_written_pickle_is_a_zip_whose_every_crc_checks(tmp_path):
    from typer.testing import CliRunner

    from normconv.cli import app

    out = tmp_path / "f.pt"
    result = CliRunner().invoke(app, ["fold", "zoo:resnet", "-o", str(out)])
    assert result.exit_code == 0, result.output
    with zipfile.ZipFile(out) as z:
        assert len(z.infolist()) > 5 and z.testzip() is None
        assert all(i.CRC != 0 for i in z.infolist() if i.file_size)
    assert isinstance(torch.load(out, weights_only=False), nn.Module)


def test_the_setting_is_left_alone_while_another_thread_runs(tmp_path):
    """torch's CRC setting is the process's: with another (non-daemon) thread alive, where a caller's own torch.save
    might run, torch.save keeps computing its CRC-32s, and filling them in finds them right; a daemon thread (the
    progress display's refresh) does not stop it."""
    import threading

    from torch.utils.serialization import config

    stop = threading.Event()
    other = threading.Thread(target=stop.wait)
    other.start()
    try:
        with unchecked_torch_save() as unchecked:
            assert not unchecked and config.save.compute_crc32
            torch.save(nn.Linear(3, 2), tmp_path / "m.pt")
    finally:
        stop.set()
        other.join()
    assert all(crc != 0 for crc in _crcs(tmp_path / "m.pt").values())
    fill_zip_crcs(str(tmp_path / "m.pt"))
    with zipfile.ZipFile(tmp_path / "m.pt") as z:
        assert z.testzip() is None
    stop = threading.Event()
    daemon = threading.Thread(target=stop.wait, daemon=True)
    daemon.start()
    try:
        with unchecked_torch_save() as unchecked:
            assert unchecked and not config.save.compute_crc32
    finally:
        stop.set()
        daemon.join()
    with zipfile.ZipFile(tmp_path / "m.pt") as z:
        assert z.testzip() is None
