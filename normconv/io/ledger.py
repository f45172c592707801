"""The ledger of one run: every file and folder it opened for reading, tracked (not listed) and checked by every write.

    ledger = Ledger()
    with ledger.watching():          # every file opened for reading inside is recorded (Python's "open" audit event)
        model = import_and_build()
    ledger.record(path)              # files read where no audit event fires (torch's C++ readers)
    ledger.record_folder(folder)     # a folder: nothing may be written inside it, and every file in it is recorded
    ledger.check_write(out)          # NormconvError unless ``out`` may be written: see ``check_write``

An entry is the file as it is on disk, resolved through symbolic links (its real path) and hard links (its device and
inode): ``-o`` naming a symlink, a hard link or a Hugging Face cache blob that a snapshot links to is the same file.
An output only ever replaces a regular file: a FIFO, a device node, a folder, a socket or a symlink is refused.

The lowest module of the io room: it imports normconv.errors only.
"""

from __future__ import annotations

import contextlib
import os
import stat
import sys
import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterator

from normconv.errors import NormconvError


@dataclass(frozen=True)
class Entry:
    """One thing read: its real path, (st_dev, st_ino), whether it is a folder, and whether it is the model itself
    (``--in-place`` may write over the model; never over anything else the run read)."""

    real: Path
    ident: tuple[int, int] | None
    folder: bool
    primary: bool


@dataclass
class Ledger:
    """Every file and folder one run read (see the module docstring)."""

    entries: dict[Path, Entry] = field(default_factory=dict)
    # a transformers load records ~7,000 paths (every module file opened, then every module imported): each path
    # once, each folder resolved once (os.path.realpath costs an lstat per component)
    _seen: set[str] = field(default_factory=set, repr=False)
    _dirs: dict[str, str] = field(default_factory=dict, repr=False)

    def record(self, path: str | os.PathLike, primary: bool = False) -> None:
        """Record a file (or folder) that was read: by its real path and its inode."""
        raw = os.fspath(path)
        absolute = raw if os.path.isabs(raw) else os.path.join(os.getcwd(), raw)  # a relative path: from here
        if not primary and absolute in self._seen:
            return
        found = self._resolve(absolute)
        if found is None:
            return  # nothing there: nothing to protect
        self._seen.add(absolute)
        real, st = found
        old = self.entries.get(real)
        self.entries[real] = Entry(real, (st.st_dev, st.st_ino), stat.S_ISDIR(st.st_mode),
                                   primary or (old is not None and old.primary))

    def _resolve(self, raw: str) -> tuple[Path, os.stat_result] | None:
        """(real path, stat) of the absolute path ``raw``, as ``os.path.realpath`` + ``os.stat`` give them: its
        folder's real path (cached) joined with its name, followed further only where the name is itself a symbolic
        link; a path with "." / ".." parts or ending in a separator goes through realpath whole (".." after a
        link)."""
        head, name = os.path.split(raw)
        parts = raw.replace(os.sep, "/").split("/")
        try:
            if not name or "." in parts or ".." in parts:
                real = os.path.realpath(raw)
                return Path(real), os.stat(real)
            folder = self._dirs.get(head)
            if folder is None:
                folder = self._dirs[head] = os.path.realpath(head)
            real = os.path.join(folder, name)
            st = os.lstat(real)
            if stat.S_ISLNK(st.st_mode):
                real = os.path.realpath(real)
                st = os.stat(real)
            return Path(real), st
        except (OSError, ValueError):
            return None

    def record_folder(self, folder: str | os.PathLike, primary: bool = False) -> None:
        """A folder read as a whole (a Hugging Face model folder): the folder, and every file under it resolved
        (a snapshot's symlinks into the hub cache protect the blobs they point to)."""
        self.record(folder, primary)
        for root, dirs, files in os.walk(folder):
            for name in files + [d for d in dirs if os.path.islink(os.path.join(root, d))]:
                self.record(os.path.join(root, name))

    @property
    def paths(self) -> tuple[Path, ...]:
        return tuple(self.entries)

    @contextlib.contextmanager
    def watching(self) -> Iterator["Ledger"]:
        """Record every file opened for reading inside the block (any thread): a factory's own ``torch.load``, the
        modules its import reads, a config file a library opens."""
        _install_hook()
        with _LOCK:
            _WATCHING.append(self)
        try:
            yield self
        finally:
            with _LOCK:
                _WATCHING.remove(self)

    def check_write(self, out: str | os.PathLike, in_place: bool = False, folder: bool = False,
                    overwrite: bool = False) -> Path:
        """Refuse to write ``out`` where it is, or lies inside, anything this run read (the same real path, or the
        same inode through a hard link), or where it is not a regular file (it exists as a FIFO, a device node, a
        folder, a socket or a symlink). ``in_place`` allows writing over the model itself (never over its weights,
        config, code or data). ``folder``: ``out`` is a new folder to be renamed into place (the caller refuses one
        that exists), so only the ledger is checked. ``overwrite``: an existing folder may be replaced whole, unless
        anything this run read lies inside it (replacing it would delete what was read)."""
        path = Path(out)
        try:
            st = os.lstat(path)
        except OSError:  # nothing there (or no folder to hold it: check_writable says which)
            st = None
        real = Path(os.path.realpath(path))
        ident = (st.st_dev, st.st_ino) if st is not None else None
        # paths compared as strings, the output's parents computed once: a run's ledger holds every module file
        # the libraries imported (1,300 for a transformers model), and Path arithmetic per entry cost a second
        real_s, above = os.fspath(real), {os.fspath(p) for p in real.parents}
        inside_out = real_s.rstrip(os.sep) + os.sep
        for e in sorted(self.entries.values(), key=lambda e: not e.folder):  # "inside the input folder" first
            allowed = in_place and e.primary
            e_s = os.fspath(e.real)
            if e.folder and (real_s == e_s or e_s in above) and not allowed:
                what = "the input folder" if real == e.real else f"a file inside the input folder {e.real}"
                raise NormconvError(f"refusing to write {out}: it is {what}, which this run read; choose another -o")
            if not e.folder and (real_s == e_s or (ident is not None and ident == e.ident)) and not allowed:
                via = "" if real == e.real else f" (it is {e.real} under another name)"
                if e.primary:
                    raise NormconvError(f"refusing to overwrite the input {out}{via}: choose another -o or pass "
                                        f"--in-place")
                hint = " (--in-place writes over the model itself only)" if in_place else ""
                raise NormconvError(f"refusing to overwrite {out}: this run read it{via}; choose another -o{hint}")
            if overwrite and e_s.startswith(inside_out):  # replacing the folder would delete what was read
                raise NormconvError(f"refusing to overwrite {out}: the input {e.real} is inside it")
        if st is not None and overwrite and stat.S_ISDIR(st.st_mode):
            return path  # a real folder (not a symlink to one), replaced whole with --overwrite
        if st is not None and not stat.S_ISREG(st.st_mode) and not (folder and stat.S_ISDIR(st.st_mode)):
            how = "choose a new path, or pass --overwrite to replace the folder whole" if stat.S_ISDIR(st.st_mode) \
                else "choose a new path"
            raise NormconvError(f"refusing to write {out}: it is {_kind(st.st_mode)}; an output only ever replaces a "
                                f"regular file ({how})")
        return path


def _kind(mode: int) -> str:
    if stat.S_ISLNK(mode):
        return "a symbolic link"
    if stat.S_ISDIR(mode):
        return "a folder"
    if stat.S_ISFIFO(mode):
        return "a FIFO"
    if stat.S_ISCHR(mode) or stat.S_ISBLK(mode):
        return "a device node"
    if stat.S_ISSOCK(mode):
        return "a socket"
    return "not a regular file"


# -- reads seen as they happen: Python's "open" audit event (builtins.open, io.open, os.open, io.open_code) ----------

_WATCHING: list[Ledger] = []
_LOCK = threading.Lock()
_HOOKED = False


def _install_hook() -> None:
    global _HOOKED
    with _LOCK:
        if not _HOOKED:
            sys.addaudithook(_audit)  # process-wide and permanent: it does nothing unless a ledger is watching
            _watch_safetensors()
            _HOOKED = True


def _watch_safetensors() -> None:
    """safetensors opens files in Rust (no audit event): its ``safe_open`` (which ``load_file`` calls) reports the
    path it opens to the watching ledgers. Modules that imported it before keep the library's own (a Hugging Face
    folder is recorded whole anyway)."""
    try:
        import safetensors
        import safetensors.torch as st_torch
    except ImportError:
        return
    real = safetensors.safe_open

    def safe_open(filename, *args, **kwargs):
        _record_read(filename)
        return real(filename, *args, **kwargs)

    safe_open.__doc__ = real.__doc__
    for module in (safetensors, st_torch):
        if getattr(module, "safe_open", None) is real:
            module.safe_open = safe_open


def _record_read(path: Any) -> None:
    for ledger in list(_WATCHING):
        try:
            ledger.record(os.fsdecode(path))
        except (OSError, ValueError, TypeError):
            pass


def _audit(event: str, args: tuple) -> None:
    if event != "open" or not _WATCHING:
        return
    path, mode, flags = args
    if isinstance(path, int) or path is None:
        return  # an already open descriptor
    reads = ("r" in mode or "+" in mode) if isinstance(mode, str) else (flags & os.O_ACCMODE) != os.O_WRONLY
    if reads:
        _record_read(path)


__all__ = ["Ledger", "Entry"]
