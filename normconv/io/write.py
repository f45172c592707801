"""Writing atomically: an output path checked before the work and again just before the rename (never over
anything the run read, as the run's ledger says: ``loaded.ledger.check_write(path, in_place)``; only ever over a
regular file; a folder that exists and is writable), the format its suffix asks for, a temp file beside it renamed
into place only when the whole write succeeded, the temp files of a killed run removed, and a failed write said in
one line (a full disk as "no space left on device"). SIGINT / SIGTERM wait while a temp file is created or
removed (``signals_held``), so an interrupt never leaves one behind.

One of the io room's lowest modules (onnx.export uses ``check_writable`` and the temp names): it imports
io.pickles (``describe``), io.ledger, io.durable (fsync, write-back) and io.outputs (one writer per format) only.
"""

from __future__ import annotations

import contextlib
import os
import tempfile
from pathlib import Path
from typing import Any, Callable, Iterator, Protocol

import torch.nn as nn

from normconv.errors import Code, NormconvError, describe
from normconv.io import durable
from normconv.io.ledger import Ledger
from normconv.io.outputs import WRITERS, config_mismatch, follow_umask
from normconv.io.pickled import unpicklable
from normconv.verify import Inputs


class Source(Protocol):
    """What writing needs of the load it writes for (io.load.Loaded is one): the model as loaded, its example
    inputs, its format and the ledger of everything the run read."""

    model: nn.Module
    inputs: Inputs | None
    fmt: str
    path: Path | None
    ledger: Ledger

    def require_inputs(self) -> Inputs: ...


def output_format(loaded: Source, out: Path) -> str:
    """Same format as the input unless the suffix asks: .pt2 -> ExportedProgram, .safetensors -> weights."""
    if out.suffix == ".pt2":
        return "pt2"
    if out.suffix == ".safetensors":
        return "safetensors"
    if out.suffix == ".onnx":
        raise NormconvError(f"{out} is an ONNX path: use normconv export to write ONNX")
    if out.suffix in (".pt", ".pth", ".bin", ".pkl"):
        return "pickle"
    if loaded.fmt == "hf":  # a Hugging Face folder in, no telling suffix: a folder out (save_pretrained)
        return "hf"
    return "pt2" if loaded.fmt == "pt2" else "pickle"  # no telling suffix: the input's own format


def check_output_path(loaded: Source, out: str | os.PathLike, in_place: bool = False, overwrite: bool = False,
                      model: bool = True) -> Path:
    """Refuse to write over anything the run read (the model, its --weights, the factory's code, its config,
    shards, calibration data, anything inside its Hugging Face folder; through symlinks and hard links), over
    anything but a regular file (an existing folder only with ``overwrite``, and never one holding what was read),
    or where no file can be created. ``in_place`` allows the model itself. ``model``: ``out`` will hold the rewritten
    torch model (a pickle is then checked to pickle, before the work); False for the ONNX writer's files."""
    refuse_empty(out)
    path = Path(out)
    loaded.ledger.check_write(path, in_place, overwrite=overwrite)
    path = check_writable(path, overwrite)
    if model and output_format(loaded, path) == "pickle":
        why = unpicklable(loaded.model)
        if why is not None:  # torch.save would fail at the end: said before the work
            raise NormconvError(f"cannot write {out}: {type(loaded.model).__name__} does not pickle ({why}); write "
                                f"{_other_formats(path)} instead")
    return path


def _other_formats(path: Path) -> str:
    return f"-o {path.with_suffix('.pt2').name} (torch.export.load) or -o {path.with_suffix('.safetensors').name} " \
           f"(the weights)"


def refuse_empty(out: str | os.PathLike) -> None:
    """An empty output path (``-o "$OUT"`` with ``$OUT`` unset) is refused: ``Path("")`` is the current folder, which
    ``overwrite`` would exchange with the output."""
    if isinstance(out, (str, bytes)) and not out:
        raise NormconvError("the output path is empty (an unset variable?): name the file or folder to write")


def check_writable(path: str | os.PathLike, overwrite: bool = False) -> Path:
    """A file can be created at ``path``: its folder exists, is a folder and is writable, and a temp file is made
    there (and removed); it is not a folder (unless ``overwrite``: the folder is then replaced whole, atomically)."""
    refuse_empty(path)
    path = Path(path)
    parent = path.parent
    if not parent.exists():
        raise NormconvError(f"cannot write {path}: folder {parent} does not exist")
    if not parent.is_dir():
        raise NormconvError(f"cannot write {path}: {parent} is a file, not a folder")
    if path.is_dir() and not overwrite:
        raise NormconvError(f"cannot write {path}: it is a folder (--overwrite replaces it)")
    if not os.access(parent, os.W_OK | os.X_OK):
        raise NormconvError(f"cannot write {path}: folder {parent} is not writable")
    tmp = None
    try:  # access() can say yes where no file can be made (/proc, a root-squashed NFS, an ACL): one made, removed
        with signals_held():
            tmp = temp_file(path)
    except OSError as exc:
        raise write_error(path, exc) from None
    finally:
        remove_temp(tmp)
    return path


TEMP_SUFFIX = ".normconv-tmp"  # every temp file / folder normconv makes next to an output ends with this


@contextlib.contextmanager
def signals_held() -> Iterator[None]:
    """SIGINT and SIGTERM wait until the block is over, then take effect as usual: a temp file or folder is created
    and known to its remover (or removed) whole, so an interrupt never lands in between and leaves it behind. In a
    thread other than the main one (no handlers to set) the block runs as is."""
    import signal
    import threading

    if threading.current_thread() is not threading.main_thread():
        yield
        return
    caught: list[tuple[int, Any]] = []
    old: dict[int, Any] = {}
    for sig in (signal.SIGINT, signal.SIGTERM):
        handler = signal.getsignal(sig)
        if handler is not None and handler is not signal.SIG_IGN:
            old[sig] = signal.signal(sig, lambda signum, frame: caught.append((signum, frame)))
    try:
        yield
    finally:
        for sig, handler in old.items():
            signal.signal(sig, handler)
        for signum, frame in caught[:1]:  # the first one, delivered now as it would have been
            handler = old[signum]
            if callable(handler):
                handler(signum, frame)
            else:  # SIG_DFL: the default action (terminate), after the cleanup the block did
                os.kill(os.getpid(), signum)


def temp_file(path: Path, folder: bool = False) -> str:
    """A new temp file (or folder) next to ``path``; call it inside ``signals_held``, assigning the name in the same
    block, so an interrupt finds it known to the code that removes it."""
    if folder:
        tmp = tempfile.mkdtemp(prefix=temp_name(path), suffix=TEMP_SUFFIX, dir=str(path.parent))
        follow_umask(tmp, 0o777)  # mkdtemp makes 0700: the folder published gets what mkdir would give
        return tmp
    fd, tmp = tempfile.mkstemp(prefix=temp_name(path), suffix=TEMP_SUFFIX, dir=str(path.parent))
    os.close(fd)
    return tmp


def remove_temp(tmp: str | os.PathLike | None) -> None:
    """Remove a temp file or folder whole (interrupts wait until it is gone)."""
    if tmp is None:
        return
    import shutil

    with signals_held():
        shutil.rmtree(tmp, ignore_errors=True) if os.path.isdir(tmp) else _unlink(str(tmp))


def temp_name(path: Path) -> str:
    """Prefix of normconv's temp files for ``path``: hidden, named after the output and this process."""
    return f".{path.name}.{os.getpid()}."


def remove_stale_temps(path: Path) -> list[str]:
    """Temp files / folders an earlier, killed normconv left next to ``path`` (its process is gone): removed."""
    import re
    import shutil

    removed = []
    pattern = re.compile(rf"^\.{re.escape(path.name)}\.(\d+)\..*{re.escape(TEMP_SUFFIX)}$")
    try:
        entries = list(path.parent.iterdir())
    except OSError:
        return removed
    for entry in entries:
        m = pattern.match(entry.name)
        if not m or _alive(int(m.group(1))):
            continue
        try:
            shutil.rmtree(entry) if entry.is_dir() else entry.unlink()
            removed.append(entry.name)
        except OSError:
            pass
    return removed


def _alive(pid: int) -> bool:
    if pid == os.getpid():
        return True
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def write_error(out: Any, exc: BaseException) -> NormconvError:
    """An OSError while writing is the user's situation (full disk, permissions), said in one line."""
    import errno

    why = {errno.ENOSPC: "no space left on device", errno.EACCES: "permission denied",
           errno.EROFS: "read-only file system", errno.EDQUOT: "disk quota exceeded"}.get(
        getattr(exc, "errno", None), describe(exc))
    return NormconvError(f"cannot write {out}: {why}; nothing was written", Code.WRITE_FAILED)


def replace(tmp: str | os.PathLike, path: Path) -> None:
    """Put ``tmp`` (a file or a folder) at ``path``, atomically: a plain rename where nothing or a file is there; over
    an existing folder (``--overwrite``), the two are exchanged in one step (Linux renameat2 RENAME_EXCHANGE; else
    two renames) and the old one, now under the temp name, is deleted: no reader ever sees a half-written output."""
    import shutil

    tmp = str(tmp)
    if not (path.is_dir() or os.path.isdir(tmp) and path.exists()):
        os.replace(tmp, path)
        return
    if not _exchange(tmp, str(path)):
        old = tmp + ".old" + TEMP_SUFFIX
        os.rename(path, old)
        os.rename(tmp, path)
        tmp = old
    # the old one: a folder's tree removed, anything else (a file, a link: never followed) unlinked
    shutil.rmtree(tmp, ignore_errors=True) if os.path.isdir(tmp) and not os.path.islink(tmp) else _unlink(tmp)


def publish(moves: list[tuple[str | os.PathLike, Path]], check: Callable[[], None] | None = None) -> None:
    """Put written temp files (or folders) at their paths, durably: each fsynced first (its bytes on the device before
    a rename shows them), then ``check()`` (the last look before publishing), then every rename (``replace``) with
    interrupts held, then the folders holding them fsynced (the new names on the device too). OSError propagates."""
    for tmp, _ in moves:
        durable.sync(tmp)
    if check is not None:
        check()
    with signals_held():
        for tmp, path in moves:
            replace(tmp, path)
    for path in {path.parent: path for _, path in moves}.values():  # one per folder
        durable.sync_entry(path)


def _exchange(a: str, b: str) -> bool:
    """Swap two paths in one atomic step (renameat2 with RENAME_EXCHANGE); False where the system has no such call."""
    import ctypes

    from normconv.libc import c_function

    renameat2 = c_function("renameat2", (ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p,
                                            ctypes.c_uint), ctypes.c_int)
    if renameat2 is None:
        return False
    at_fdcwd, rename_exchange = -100, 2
    return renameat2(at_fdcwd, os.fsencode(a), at_fdcwd, os.fsencode(b), rename_exchange) == 0


def save(loaded: Source, model: nn.Module, out: str | os.PathLike, in_place: bool = False,
         inputs: Inputs | None = None, *, static: bool = False, overwrite: bool = False,
         info: dict | None = None, before_rename: Callable[[str], None] | None = None) -> Path:
    """Write ``model`` atomically (temp file + rename): any failure or interrupt (Ctrl-C, SIGTERM) leaves no
    file under ``out`` and no temp file beside it. ``static``: a .pt2 keeps the example's shapes (else its dynamic
    dimensions, see ``io.dims``); ``overwrite``: an existing output (a folder too) is replaced; ``info`` receives
    what a writer found (a .pt2's ``dynamic_dims``); ``before_rename(temp path)``: a last check of what was written
    (a Hugging Face folder loaded back), run while the disk writes it (``io.durable``), whose exception, as it is,
    leaves nothing. The bytes are on the device (fsync) before the rename publishes them."""
    path = check_output_path(loaded, out, in_place, overwrite, model=False)  # the rename's check: pickling is tried
    fmt = output_format(loaded, path)
    if fmt == "hf":
        _check_hf_folder_output(loaded, model, path, overwrite)
    remove_stale_temps(path)
    tmp = None
    try:
        try:  # made again for the write: the folder may have changed since the check
            with signals_held():
                tmp = temp_file(path, folder=fmt == "hf")
        except OSError as exc:
            raise write_error(out, exc) from None
        _write(loaded, model, out, path, fmt, tmp, inputs, static, info)
        if before_rename is not None:
            before_rename(tmp)
        try:  # the ledger again just before the rename: nothing read was put there since
            publish([(tmp, path)], check=lambda: loaded.ledger.check_write(path, in_place, overwrite=overwrite))
            tmp = None
        except OSError as exc:
            raise write_error(out, exc) from None
    finally:  # every exit path, KeyboardInterrupt and SystemExit (SIGTERM) included
        remove_temp(tmp)
    return path


def _write(loaded: Source, model: nn.Module, out: Any, path: Path, fmt: str, tmp: str, inputs: Inputs | None,
           static: bool, info: dict | None) -> None:
    """The format's writer into ``tmp``; what fails said in one line (a full disk, a model that does not pickle)."""
    try:
        given = inputs or (loaded.require_inputs() if fmt == "pt2" else loaded.inputs)
        if fmt == "pt2":
            WRITERS[fmt](model, tmp, given, static=static, info=info)
        else:
            WRITERS[fmt](model, tmp, given)
        if fmt == "hf":  # save_pretrained's files: the disk starts on them now (the other writers close through
            durable.start_writeback_under(tmp)  # a LatchedFile, which does it)
    except NormconvError:
        raise
    except OSError as exc:
        raise write_error(out, exc) from None
    except Exception as exc:
        # a .pt2 is a torch.export program: a model torch.export cannot take whole has none
        hint = f"; write -o {path.with_suffix('.pt').name} (torch.load) instead" if fmt == "pt2" else ""
        why = unpicklable(model) if fmt == "pickle" else None
        if why is not None:  # which attribute does not pickle, and what to write instead
            raise NormconvError(f"cannot write {out}: the rewritten {type(model).__name__} does not pickle ({why}); "
                                f"write {_other_formats(path)} instead", Code.WRITE_FAILED) from None
        raise NormconvError(f"cannot write {out}: {describe(exc)}{hint}", Code.WRITE_FAILED) from None


def _check_hf_folder_output(loaded: Source, model: nn.Module, path: Path, overwrite: bool = False) -> None:
    """A folder is written only where its config.json still describes the rewritten model, and only as a new
    folder or with ``overwrite`` (a folder is renamed into place whole)."""
    if path.exists() and not overwrite:
        raise NormconvError(f"cannot write the Hugging Face folder {path}: it exists; pass --overwrite to replace it, "
                            f"or choose a new folder")
    why = config_mismatch(loaded.model, model) if hasattr(model, "save_pretrained") else "it is no longer a " \
        "Hugging Face model class"
    if why:
        raise NormconvError(f"cannot write {path} as a Hugging Face folder: the rewrite changed the architecture its "
                            f"config.json describes ({why}); write -o {path.name}.pt2 (torch.export.load, torch "
                            f"alone) or -o {path.name}.pt (torch.load, needs transformers) instead")


def _unlink(path: str) -> None:
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass
