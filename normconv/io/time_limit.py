"""A time limit on a library call normconv cannot stop otherwise: torch.export's reasoning about dynamic dimensions
(timm's DaViT-T: past 20 minutes simplifying sympy expressions, where the same model's static export takes under 2).

    with time_limit(DYNAMIC_EXPORT_S):   # Overtime if the block runs past that many seconds
        ep = torch.export.export(model, args, dynamic_shapes=shapes)

The limit is a real-time interval timer (SIGALRM) whose handler raises ``_Expired``, a BaseException, so that the
library's own ``except Exception`` does not take it for one of its failures (torch.onnx tries its next capture
strategy on any Exception); it leaves the block as ``Overtime``, an Exception with the limit. The library unwinds
through its own ``finally`` blocks and context managers, as it does for Ctrl-C.

Only in the main thread of a process that has interval timers (elsewhere the block runs without a limit, as before).
A timer already set (a sweep's limit on a whole command, ``signal.alarm``) is kept: one that ends before this limit is
left alone, a later one is set again on the way out with what is left of it, its handler restored. A block that ends
within microseconds of its limit may be taken as overtime; the caller's fallback then runs, which is never a wrong
result, only a slower one. Once the timer has raised, any exception that leaves the block is ``Overtime``: a raise
that lands in C code comes out as that code's own error (the suite saw Python's AST constructor turn it into
"SystemError: AST constructor recursion depth mismatch", which torch.onnx then reported as its own failure).

A Ctrl-C is the same kind of raise into the library (``interrupt_kept``): torch.export wraps a KeyboardInterrupt
that lands in its lazy import of torch._dynamo into its own error ("module 'torch._dynamo' has no attribute 'exc'"),
which a caller's ``except Exception`` took for the model's failure (and tried again). Within ``interrupt_kept`` an
interrupt always leaves the block as KeyboardInterrupt, whatever it became on the way.
One of the io room's lowest modules: it imports nothing of normconv's.
"""

from __future__ import annotations

import contextlib
import signal
import threading
import time
from typing import Iterator

# torch.export with dynamic dimensions (and, for ONNX, its translation): a capture that is not stuck takes seconds
# (GPT-2 124M's whole plain dynamic ONNX export: 12 s on 2 cores); past this the caller exports with the example's
# shapes and says so
DYNAMIC_EXPORT_S = 180.0
# past the limit the timer fires again this often until the block is left: a raise that lands in a finalizer or a
# garbage-collector callback, where Python prints and drops exceptions, is not the last
_AGAIN_S = 0.5


class Overtime(Exception):
    """The block ran past its limit (``seconds``)."""

    def __init__(self, seconds: float):
        super().__init__(f"ran past {seconds:g} s")
        self.seconds = seconds


class _Expired(BaseException):
    """Raised by the timer inside the block: a BaseException, past the library's ``except Exception``."""


def available() -> bool:
    """A limit can be set here: the main thread of a process with interval timers."""
    return threading.current_thread() is threading.main_thread() and hasattr(signal, "setitimer")


def _importing(frame) -> bool:
    """The interrupted code runs inside an import: raising there would leave a module half-run in sys.modules (the
    suite saw torchlib's ``aten_native_batch_norm`` undefined after an export interrupted while importing it)."""
    while frame is not None:
        if frame.f_code.co_filename.startswith("<frozen importlib"):
            return True
        frame = frame.f_back
    return False


@contextlib.contextmanager
def time_limit(seconds: float | None) -> Iterator[None]:
    """Within the block, ``Overtime`` once ``seconds`` have passed (None, or no limit possible here: no limit)."""
    outer, every = signal.getitimer(signal.ITIMER_REAL) if available() else (0.0, 0.0)
    if seconds is None or not available() or 0 < outer <= seconds:  # a caller's timer that ends first stays alone
        yield
        return
    armed, fired, start = [True], [False], time.monotonic()

    def expire(signum, frame):
        if armed[0] and not _importing(frame):  # inside an import: the next firing (a half-run module stays broken)
            fired[0] = True
            raise _Expired()

    previous = signal.signal(signal.SIGALRM, expire)
    try:
        try:
            signal.setitimer(signal.ITIMER_REAL, seconds, _AGAIN_S)
            yield
        finally:
            armed[0] = False
            signal.setitimer(signal.ITIMER_REAL, 0)
            signal.signal(signal.SIGALRM, previous)
            if outer:  # the caller's timer (a sweep's limit on the whole command), with what is left of it
                signal.setitimer(signal.ITIMER_REAL, max(outer - (time.monotonic() - start), 1e-3), every)
    except _Expired:
        raise Overtime(seconds) from None
    except Exception as exc:
        if fired[0]:  # the timer's raise turned into another exception on its way out (C code: a SystemError)
            raise Overtime(seconds) from exc
        raise


@contextlib.contextmanager
def interrupt_kept() -> Iterator[None]:
    """Within the block, a SIGINT leaves it as KeyboardInterrupt: turned into another exception by the library on
    its way out, or swallowed by it (the block then ends with it). Only where ``available`` and SIGINT raises."""
    previous = signal.getsignal(signal.SIGINT) if available() else None
    if not callable(previous):  # not the main thread, or SIGINT ignored / left to the system: nothing to keep
        yield
        return
    seen = [False]

    def interrupt(signum, frame):
        seen[0] = True
        previous(signum, frame)

    signal.signal(signal.SIGINT, interrupt)
    try:
        yield
    except KeyboardInterrupt:
        raise
    except BaseException as exc:
        if seen[0]:
            raise KeyboardInterrupt from exc
        raise
    finally:
        signal.signal(signal.SIGINT, previous)
    if seen[0]:
        raise KeyboardInterrupt


__all__ = ["DYNAMIC_EXPORT_S", "Overtime", "available", "interrupt_kept", "time_limit"]
