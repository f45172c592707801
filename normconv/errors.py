"""Errors a user can cause, the exit codes the CLI gives them, and the codes code branches on.

Exit codes (the same for every command):
  0  success
  1  the job ran but its result failed verification (tolerance missed); nothing was written
  2  bad input: missing/unreadable file, not a model, refused pickle, wrong shape, uncapturable model, bad flag

Every error carries a ``Code``: callers branch on ``exc.code`` (and ``exc.pass_name``), never on the text. The
text is for people: ``str(exc)`` is ``exc.message`` followed by ``exc.hint`` (what to try instead), and a caller
that words the failure its own way reads ``exc.message`` alone.
"""

from __future__ import annotations

from enum import Enum

EXIT_OK = 0
EXIT_VERIFY_FAILED = 1
EXIT_BAD_INPUT = 2


class Code(str, Enum):
    """What kind of failure an error is (its JSON and branching name)."""

    BAD_INPUT = "bad-input"  # a user mistake: a file, a flag, a shape, a format
    CANNOT_CAPTURE = "cannot-capture"  # no capture method takes the model (whole)
    REFUSED = "refused"  # a pass refuses the model as a whole; ``pass_name`` says which
    NOT_VERIFIED = "not-verified"  # a rewrite missed its tolerance, or compared nothing
    WRITE_FAILED = "write-failed"  # the output could not be written (disk, permissions, format)


class NormconvError(Exception):
    """A user-facing error: printed as one line, never as a traceback."""

    exit_code = EXIT_BAD_INPUT

    def __init__(self, message: str, code: Code = Code.BAD_INPUT, *, hint: str = "", pass_name: str | None = None):
        self.message, self.code, self.hint, self.pass_name = message, code, hint, pass_name
        super().__init__(f"{message}. {hint}" if hint else message)


class CaptureError(NormconvError):
    """No capture method took the model whole (Code.CANNOT_CAPTURE); ``attempts``: each method's own failure, for a
    caller that needs one method in particular (a .pt2 is a torch.export program)."""

    def __init__(self, message: str, attempts: dict[str, str]):
        super().__init__(message, Code.CANNOT_CAPTURE)
        self.attempts = dict(attempts)


class VerificationError(NormconvError):
    """A rewrite (or export) missed its tolerance; its output was not written."""

    exit_code = EXIT_VERIFY_FAILED

    def __init__(self, message: str, report=None):
        super().__init__(message, Code.NOT_VERIFIED)
        self.report = report


def describe(exc: BaseException) -> str:
    """``exc`` in one line: its type and the first line of its text."""
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0][:200]}" if text else type(exc).__name__
