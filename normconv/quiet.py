"""normconv's output is normconv's: libraries' logging, warnings and prints are silenced around the calls that make
them (torch.export failures dump graphs, torch.onnx prints progress, torch's loaders log tracebacks)."""

from __future__ import annotations

import contextlib
import io
import logging
import warnings
from typing import Iterable, Iterator


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


__all__ = ["quiet"]
