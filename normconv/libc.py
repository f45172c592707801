"""The C library's calls normconv makes where Python has none: one lookup of libc per process, each function typed
once.

    madvise = c_function("madvise", (c_void_p, c_size_t, c_int), c_int)   # None: not here
    if madvise is not None and madvise(start, length, advice) == 0: ...

``c_function`` returns None where this system has no such call (not Linux, a libc without it): every caller has a
plain path for that case and never fails for want of one. Calls made with ``use_errno`` (``ctypes.get_errno`` after
a failed one). Used by clone (madvise: a file-mapped weight's pages let go), io.durable (sync_file_range: the disk's
write-back started early), io.write (renameat2: two paths exchanged in one step) and stream.blocks (malloc_trim:
freed heap pages given back).
On the ground floor, beside errors and quiet: it imports nothing of normconv's (clone, below io, uses it too).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import sys
from typing import Any


@functools.lru_cache(maxsize=1)
def _libc() -> ctypes.CDLL | None:
    """The process's C library (Linux only), or None where it cannot be opened."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        return ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
    except OSError:
        return None


@functools.lru_cache(maxsize=None)
def c_function(name: str, argtypes: tuple[Any, ...], restype: Any) -> Any:
    """libc's ``name`` with its argument and result types (a tuple of ctypes types), or None where this system has
    none."""
    libc = _libc()
    if libc is None:
        return None
    try:
        return ctypes.CFUNCTYPE(restype, *argtypes, use_errno=True)((name, libc))
    except AttributeError:  # this libc has no such function
        return None


__all__ = ["c_function"]
