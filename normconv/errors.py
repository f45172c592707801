"""Errors a user can cause, and the exit codes the CLI gives them.

Exit codes (the same for every command):
  0  success
  1  the job ran but its result failed verification (tolerance missed); nothing was written
  2  bad input: missing/unreadable file, not a model, refused pickle, wrong shape, uncapturable model, bad flag
"""

EXIT_OK = 0
EXIT_VERIFY_FAILED = 1
EXIT_BAD_INPUT = 2


class NormconvError(Exception):
    """A user-facing error: printed as one line, never as a traceback."""

    exit_code = EXIT_BAD_INPUT


class VerificationError(NormconvError):
    """A rewrite (or export) missed its tolerance; its output was not written."""

    exit_code = EXIT_VERIFY_FAILED

    def __init__(self, message: str, report=None):
        super().__init__(message)
        self.report = report
