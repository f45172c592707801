"""Zip archives (``torch.save``'s format, a ``.pt2``) checked from their directory before any member is inflated.

torch writes every member stored (uncompressed, its size equal to its data's). A member that inflates to more than
its header declares is cut off by every reader at the declared size (torch's miniz and Python's zipfile both stop
there), so the declared size is the cap; ``check_archive`` refuses what would make that cap large without the bytes
to back it, reading only the central directory and the local headers:

  - a compressed member declaring more than ``MAX_RATIO`` times its compressed size (a 2 MB entry declaring 2 GiB),
    beyond ``SMALL`` bytes: a zip bomb, refused without inflating it;
  - a stored member whose declared size is not its stored size, or whose data lies outside the file;
  - members whose data overlap (one compressed stream counted many times: the overlapping-entry bomb);
  - a local header that disagrees with the directory (another name, method or offset);
  - declared sizes that add up to more than this machine's memory.

The lowest module of the io room with io.ledger: it imports normconv.errors only.
"""

from __future__ import annotations

import os
import struct
import zipfile
from pathlib import Path

from normconv.errors import NormconvError

MAX_RATIO = 64  # deflate reaches ~1000:1 on constant data; real weights compress less than 2:1, torch stores them
SMALL = 1 << 20  # a member this small is never a bomb, whatever its ratio
_LOCAL = struct.Struct("<4sHHHHHIIIHH")  # a zip local file header (30 bytes)
_LOCAL_MAGIC = b"PK\x03\x04"


def memory_bytes() -> int | None:
    """This machine's physical memory in bytes (None where it cannot be read)."""
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return None


def check_archive(path: Path, shown: str) -> None:
    """Refuse a zip archive whose members could inflate beyond what their bytes back (see the module docstring);
    nothing is inflated. A file that is not a zip archive passes (the caller reads it otherwise)."""
    try:
        if not zipfile.is_zipfile(path):
            return
        with zipfile.ZipFile(path) as z:
            infos = z.infolist()
    except (zipfile.BadZipFile, OSError, ValueError, EOFError) as exc:
        raise NormconvError(f"{shown} is truncated or corrupt ({type(exc).__name__}: {exc})") from None
    size = path.stat().st_size
    spans = []
    total = 0
    with open(path, "rb") as f:
        for info in infos:
            name = info.filename
            if info.compress_type == zipfile.ZIP_STORED and info.file_size != info.compress_size:
                raise NormconvError(f"{shown}: archive member {name} is stored but declares {info.file_size} bytes "
                                    f"for {info.compress_size}; refused (a damaged or crafted archive)")
            if info.compress_type != zipfile.ZIP_STORED and info.file_size > max(SMALL, MAX_RATIO * info.compress_size):
                raise NormconvError(f"{shown}: archive member {name} declares {info.file_size} bytes inflated from "
                                    f"{info.compress_size} (more than {MAX_RATIO}:1): refused without inflating it "
                                    f"(a zip bomb; torch writes its archives uncompressed)")
            f.seek(info.header_offset)
            raw = f.read(_LOCAL.size)
            if len(raw) != _LOCAL.size:
                raise NormconvError(f"{shown}: archive member {name} lies outside the file (truncated or crafted)")
            magic, _, _, method, _, _, _, _, _, name_len, extra_len = _LOCAL.unpack(raw)
            local_name = f.read(name_len)
            if magic != _LOCAL_MAGIC or method != info.compress_type or \
                    local_name.decode("utf-8" if info.flag_bits & 0x800 else "cp437", "replace") != name:
                raise NormconvError(f"{shown}: archive member {name}'s local header disagrees with the archive's "
                                    f"directory (a damaged or crafted archive)")
            start = info.header_offset + _LOCAL.size + name_len + extra_len
            end = start + info.compress_size
            if end > size:
                raise NormconvError(f"{shown}: archive member {name} lies outside the file (truncated or crafted)")
            spans.append((start, end, name))
            total += info.file_size
    spans.sort()
    for (s0, e0, n0), (s1, _, n1) in zip(spans, spans[1:]):
        if s1 < e0:
            raise NormconvError(f"{shown}: archive members {n0} and {n1} share their data (an overlapping zip bomb); "
                                f"refused")
    memory = memory_bytes()
    if memory and total > memory:
        raise NormconvError(f"{shown}: its archive members declare {total / 2**30:.1f} GiB, more than this machine's "
                            f"{memory / 2**30:.1f} GiB of memory; refused before reading them")


__all__ = ["check_archive", "memory_bytes", "MAX_RATIO", "SMALL"]
