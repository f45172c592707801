"""Checksums of what normconv writes: zlib's CRC-32 by ISA-L, and the CRC-32 of each member of a zip archive
filled in after the archive was written without them.

    crc32(data, value=0)      # == zlib.crc32(data, value), 30 GB/s against zlib's 6.6 GB/s on this machine
    with unchecked_torch_save():
        torch.save(model, f)  # the zip's members written with a CRC-32 of 0 ...
    fill_zip_crcs(path)       # ... and each one's real CRC-32 put in its data descriptor and central directory

Why: torch.save computes each member's CRC-32 with miniz's byte-at-a-time loop while it writes, 0.6 s of a 1.6 GB
GPT-2 355M pickle's 1.0 s (``torch.utils.serialization.config.save.compute_crc32`` off: 0.4 s). The same values
read back from the page cache and computed by ISA-L cost a fraction of that, and the file is the same standard zip:
``zipfile``'s own check (``testzip``) passes on it, member by member (test).

The zip rules followed (PKWARE APPNOTE 4.3.7, 4.3.9, 4.3.12): a member whose general-purpose flag has bit 3 set keeps
its CRC-32 in the data descriptor after its data (optionally signed 0x08074b50), the central directory record keeps
it at byte 16; a member without bit 3 keeps it in its local header at byte 14. Sizes and offsets are read by
``zipfile`` (zip64 extra fields included); only the 4 CRC bytes of each place are written.
"""

from __future__ import annotations

import contextlib
import struct
import threading
import zipfile
from typing import Iterator

from isal.isal_zlib import crc32 as _isal_crc32

_CRC_PIECE = 1 << 30  # bytes per checksum call (no length near 32 bits reaches the library)
_READ = 8 << 20  # bytes read back at a time
_LOCAL = b"PK\x03\x04"
_CENTRAL = b"PK\x01\x02"
_DESCRIPTOR = b"PK\x07\x08"


def crc32(data, value: int = 0) -> int:
    """zlib's CRC-32 of ``data`` (a bytes-like object) continued from ``value``, computed by ISA-L (the same values
    as ``zlib.crc32``, test), a GiB at a time."""
    view = memoryview(data).cast("B")
    for start in range(0, view.nbytes, _CRC_PIECE):
        value = _isal_crc32(view[start:start + _CRC_PIECE], value)
    return value


@contextlib.contextmanager
def unchecked_torch_save() -> Iterator[bool]:
    """torch.save without its own CRC-32s inside the block (torch's documented setting,
    ``torch.serialization.set_crc32_options``); yields whether it was turned off. It is left on, and its CRC-32s
    written as before, on a torch without the setting, and wherever another thread that is not a daemon runs: the
    setting is the process's, and a caller's own torch.save in another thread must keep its checksums (the progress
    display's refresh thread is a daemon)."""
    main = threading.main_thread()
    if any(t is not main and not t.daemon for t in threading.enumerate()):
        yield False
        return
    try:
        from torch.utils.serialization import config
        save = config.save
        before = save.compute_crc32
    except (ImportError, AttributeError):
        yield False
        return
    save.compute_crc32 = False
    try:
        yield True
    finally:
        save.compute_crc32 = before


def fill_zip_crcs(path: str) -> int:
    """Each member of the zip at ``path`` gets the CRC-32 of its stored bytes where it records one (module
    docstring); returns how many places were written. Members stored compressed are refused (torch.save stores)."""
    with zipfile.ZipFile(path) as archive:
        members = archive.infolist()
        start_dir = archive.start_dir
    written = 0
    buf = bytearray(_READ)
    with open(path, "r+b") as f:
        central = start_dir
        for info in members:
            if info.compress_type != zipfile.ZIP_STORED:
                raise ValueError(f"{info.filename}: compressed member (method {info.compress_type})")
            f.seek(info.header_offset)
            local = f.read(30)
            if local[:4] != _LOCAL:
                raise ValueError(f"{info.filename}: no local header at {info.header_offset}")
            name_len, extra_len = struct.unpack("<HH", local[26:30])
            data = info.header_offset + 30 + name_len + extra_len
            value, left = 0, info.compress_size
            f.seek(data)
            view = memoryview(buf)
            while left:
                got = f.readinto(view[:min(left, _READ)])
                if not got:
                    raise ValueError(f"{info.filename}: the file ends inside its data")
                value, left = crc32(view[:got], value), left - got
            field = struct.pack("<I", value)
            if info.flag_bits & 0x08:  # a data descriptor after the data, its signature optional
                f.seek(data + info.compress_size)
                at = data + info.compress_size + (4 if f.read(4) == _DESCRIPTOR else 0)
            else:
                at = info.header_offset + 14
            f.seek(at)
            f.write(field)
            f.seek(central)  # the central directory's record of the same member, in the same order
            record = f.read(46)
            if record[:4] != _CENTRAL:
                raise ValueError(f"{info.filename}: no central directory record at {central}")
            f.seek(central + 16)
            f.write(field)
            n, m, k = struct.unpack("<HHH", record[28:34])
            central += 46 + n + m + k
            written += 2
    return written


__all__ = ["crc32", "unchecked_torch_save", "fill_zip_crcs"]
