"""normconv's output is normconv's: libraries' logging, warnings and prints are silenced around the calls that make
them (torch.export failures dump graphs, torch.onnx prints progress, torch's loaders log tracebacks); and
normconv's own progress of long work, by phase (load, capture, rewrite, verify shape 1/2, write; streaming: block
i/N; export: capture, export, validate).

Every module calls ``phase(...)`` at its phase boundaries; it does nothing unless a display is on. The command
line turns one on (``progress_display``) only where a person watches: stderr a terminal and no ``--quiet``. The
display is rich's progress bar on stderr, never stdout (``--json`` stays one JSON object), imported only then.

    with progress_display(enabled=sys.stderr.isatty()):
        phase("verify", 1, 2, detail="shape")   # "verify: shape 1/2" with a bar
        phase("capture")                         # a phase of unknown length
        end_progress()                           # the display ends before a report is printed
"""

from __future__ import annotations

import contextlib
import gc
import io
import json
import logging
import os
import sys
import time
import warnings
from typing import Any, Iterable, Iterator


@contextlib.contextmanager
def quiet(loggers: Iterable[str] = ("torch",), stdout: bool = False, stderr: bool = False) -> Iterator[None]:
    """Within the block: the named loggers at CRITICAL, warnings ignored, and (if asked) stdout / stderr swallowed;
    everything restored on exit."""
    found = [logging.getLogger(n) for n in loggers]
    levels = [lg.level for lg in found]
    for lg in found:
        lg.setLevel(logging.CRITICAL)
    try:
        with contextlib.ExitStack() as stack:
            stack.enter_context(warnings.catch_warnings())
            warnings.simplefilter("ignore")
            if stdout:
                stack.enter_context(contextlib.redirect_stdout(io.StringIO()))
            if stderr:
                stack.enter_context(contextlib.redirect_stderr(io.StringIO()))
            yield
    finally:
        for lg, level in zip(found, levels):
            lg.setLevel(level)


# ---------------------------------------------------------------------------------------------------------
# progress

_SHOWN: list[Any] = []  # the live display, while one is on (one at a time)


_MET: list[set[str]] = []  # the phases met so far, while ``collector_frozen_at_phases`` is on


_PHASE_LOG = os.environ.get("NORMCONV_PHASE_LOG")  # a new file: each mark appended as a JSON line (profiling)
_LOG: list[Any] = []  # the log, once this process created it


def _log_mark(name: str, step: int | None, total: int | None, detail: str) -> None:
    """One line of ``$NORMCONV_PHASE_LOG``: the wall clock, the phase, and the resident set now and at its peak
    (Linux's /proc; absent elsewhere). benchmarks/phase_profile.py reads it. The log is a file this process creates
    (a regular file, exclusively): a path that exists (a model, a link, anything read) is never written, said once."""
    global _PHASE_LOG
    if not _LOG:
        try:
            _LOG.append(open(_PHASE_LOG, "x", buffering=1))  # type: ignore[arg-type]
        except OSError as exc:
            sys.stderr.write(f"warning: NORMCONV_PHASE_LOG={_PHASE_LOG} not written ({exc.strerror}): the phase "
                             f"log must be a new file\n")
            _PHASE_LOG = None
            return
    mark: dict[str, Any] = {"t": time.time(), "phase": name, "step": step, "total": total, "detail": detail}
    try:
        with open("/proc/self/status") as status:
            for line in status:
                if line.startswith(("VmRSS:", "VmHWM:")):
                    mark[line[:5].lower()] = int(line.split()[1]) * 1024
    except OSError:
        pass
    _LOG[0].write(json.dumps(mark) + "\n")


def phase(name: str, step: int | None = None, total: int | None = None, detail: str = "") -> None:
    """Tell the display (if one is on) that ``name`` has begun; ``step`` of ``total`` where the work counts
    (a block of N, a shape of 2). ``detail``: a few words more (which pass, which shard). With
    ``$NORMCONV_PHASE_LOG`` set, the mark is also appended to that file (``_log_mark``)."""
    if _PHASE_LOG:
        _log_mark(name, step, total, detail)
    if _MET and name not in _MET[-1]:  # a phase's first mark, not each block of a streamed pass
        _MET[-1].add(name)
        gc.freeze()
    if _SHOWN:
        _SHOWN[-1].show(name, step, total, detail)


def end_progress() -> None:
    """End the live display now (before a report or an error is printed)."""
    if _SHOWN:
        _SHOWN.pop().close()


def progress_active() -> bool:
    return bool(_SHOWN)


class _Bar:
    """rich's Progress on stderr with one task whose description is the phase; transient (gone when it ends)."""

    def __init__(self, console: Any = None) -> None:
        # the stream stderr is now: a library silenced later (its stderr swapped for a buffer) leaves the bar shown
        from rich.console import Console
        from rich.progress import BarColumn, MofNCompleteColumn, Progress, SpinnerColumn, TextColumn, \
            TimeElapsedColumn

        self.progress = Progress(SpinnerColumn(), TextColumn("{task.description}"), BarColumn(),
                                 MofNCompleteColumn(), TimeElapsedColumn(),
                                 console=console or Console(file=sys.stderr), transient=True,
                                 redirect_stdout=False, redirect_stderr=False)
        self.task = self.progress.add_task("start", total=None)
        self.last = ""
        self.progress.start()

    def show(self, name: str, step: int | None, total: int | None, detail: str) -> None:
        text = name if not detail else f"{name}: {detail}"
        if step is not None and total:
            text = f"{text} {step}/{total}"
        # a counted phase fills its bar (step - 1 of total done as step begins); an uncounted one pulses
        self.progress.update(self.task, description=text, total=total or None,
                             completed=(step - 1) if step is not None and total else 0)
        if text != self.last:  # a new phase or step is drawn at once (a bar's own progress at rich's pace)
            self.last = text
            self.progress.refresh()

    def close(self) -> None:
        self.progress.stop()


@contextlib.contextmanager
def progress_display(enabled: bool, console: Any = None) -> Iterator[None]:
    """Within the block, ``phase`` calls show on a live progress bar (``enabled``: the caller decided a person is
    watching); the display ends with the block, whatever ends it."""
    if not enabled:
        yield
        return
    bar = _Bar(console)
    _SHOWN.append(bar)
    try:
        yield
    finally:
        if bar in _SHOWN:
            _SHOWN.remove(bar)
            bar.close()


@contextlib.contextmanager
def collector_frozen_at_phases() -> Iterator[None]:
    """Within the block, each phase's first mark freezes the objects alive (module docstring); on exit they are
    unfrozen (``gc.unfreeze``: back in the oldest generation, as before). Nothing is done where the block is nested
    in another or the caller froze objects of its own (``gc.get_freeze_count``): their freeze is theirs to end."""
    if _MET or gc.get_freeze_count():
        yield
        return
    _MET.append(set())
    try:
        yield
    finally:
        _MET.clear()
        gc.unfreeze()


__all__ = ["quiet", "phase", "end_progress", "progress_active", "progress_display", "collector_frozen_at_phases"]
