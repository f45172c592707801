"""Bytes on the device before an output is renamed into place, paid for while other work runs.

    start_writeback(fd)   the kernel starts writing the file's dirty pages now, without waiting (Linux
                          sync_file_range(SYNC_FILE_RANGE_WRITE); elsewhere nothing: the sync below does it all)
    start_writeback_under(folder)   the same for every file under a folder
    drop_cached(fd)       the kernel drops the file's clean pages from the page cache (Linux posix_fadvise DONTNEED;
                          elsewhere nothing): a streamed checkpoint's pages once read, or written and read back
    sync(path)            fsync of a file, or of every file and folder under a folder (a Hugging Face folder
                          written by save_pretrained), before the rename
    sync_entry(path)      fsync of the folder holding it, after the rename: the new name is on the device too
    pieces(data)          the bytes in 1 MiB views, one write call each (a whole tensor in one call is slow)

A writer kicks the write-back as it goes (the pickle writer every 64 MiB: GPT-2 355M's write 1.26 -> 0.9 s; the
streaming writer after each tensor) and for the whole file when it closes it; what follows (a Hugging Face folder
loaded back by from_pretrained, the next blocks computed) runs while the disk writes; the fsync then waits only for
what is left. Measured (BENCHMARKS.md): streamed GPT-2 355M 0.94x of the time with
one fsync at the end. Verifying an in-memory rewrite after writing it, to overlap the same way, gained nothing on
this 2-core machine (GPT-2 124M / 355M swap 1.02x): the write-back competes with the forwards, so the door keeps
verify -> write.

One of the io room's lowest modules: of normconv's it imports libc only.
"""

from __future__ import annotations

import ctypes
import os
from typing import Any, Iterator

from normconv.libc import c_function

_SYNC_FILE_RANGE_WRITE = 2  # start write-out of dirty pages in the range; do not wait
# bytes per write call: the kernel takes one write() of a whole tensor (64 MiB) at a fraction of the speed of the same
# bytes in 1 MiB calls (1.4 GB: 2.05-2.35 s against 0.26-0.54 s here; GPT-2 355M's pickle 2.4-3.1 s against 0.5-0.6 s)
CHUNK = 1 << 20


def _sync_file_range():
    """libc's sync_file_range, or None where the system has none (macOS, a libc without it)."""
    return c_function("sync_file_range", (ctypes.c_int, ctypes.c_int64, ctypes.c_int64, ctypes.c_uint),
                         ctypes.c_int)


def pieces(data: Any) -> Iterator[memoryview]:
    """``data`` (a bytes-like object) as consecutive views of at most ``CHUNK`` bytes, for one write call each."""
    view = memoryview(data).cast("B")
    for start in range(0, view.nbytes, CHUNK):
        yield view[start:start + CHUNK]


def start_writeback(fd: int, offset: int = 0, nbytes: int = 0) -> bool:
    """Ask the kernel to start writing ``fd``'s dirty pages in ``[offset, offset + nbytes)`` (``nbytes`` 0: to the
    end of the file) and return at once; False where it cannot be asked (the later ``sync`` then writes
    everything)."""
    fn = _sync_file_range()
    return fn is not None and fn(fd, offset, nbytes, _SYNC_FILE_RANGE_WRITE) == 0


def drop_cached(fd: int, offset: int = 0, nbytes: int = 0) -> bool:
    """Ask the kernel to drop ``fd``'s clean pages in ``[offset, offset + nbytes)`` (``nbytes`` 0: to the end of the
    file) from the page cache: bytes read or written once that nothing reads again (a checkpoint larger than the
    memory) would otherwise be reclaimed later inside the command's own work. False where it cannot be asked."""
    if not hasattr(os, "posix_fadvise"):
        return False
    os.posix_fadvise(fd, offset, nbytes, os.POSIX_FADV_DONTNEED)
    return True


def start_writeback_under(folder: str | os.PathLike) -> None:
    """``start_writeback`` on every file under ``folder`` (what save_pretrained wrote)."""
    for root, _, files in os.walk(folder):
        for name in files:
            _on_fd(os.path.join(root, name), os.O_RDONLY, start_writeback)


def sync(path: str | os.PathLike) -> None:
    """fsync ``path`` (a file; for a folder, every file and folder under it): its bytes are on the device before
    it is renamed into place. OSError propagates (the caller says it)."""
    path = os.fspath(path)
    if os.path.isdir(path):
        for root, _, files in os.walk(path):
            for name in files:
                _on_fd(os.path.join(root, name), os.O_RDONLY, os.fsync)
            _on_fd(root, _DIRECTORY, os.fsync)
    else:
        _on_fd(path, os.O_RDONLY, os.fsync)


def sync_entry(path: str | os.PathLike) -> None:
    """fsync the folder holding ``path``, after the rename that put it there: the new name is on the device too.
    Best effort: the output is in place, and a file system that refuses a folder's fsync has not failed the write."""
    try:
        _on_fd(os.path.dirname(os.path.abspath(os.fspath(path))), _DIRECTORY, os.fsync)
    except OSError:
        pass


_DIRECTORY = os.O_RDONLY | getattr(os, "O_DIRECTORY", 0)


def _on_fd(path: str, flags: int, fn) -> None:
    fd = os.open(path, flags)
    try:
        fn(fd)
    finally:
        os.close(fd)


__all__ = ["drop_cached", "start_writeback", "start_writeback_under", "sync", "sync_entry"]
