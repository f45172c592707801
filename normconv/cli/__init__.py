"""The ``normconv`` command line: one module per command, each parsing flags, calling ``normconv.commands`` and
rendering the report. Exit codes: 0 ok, 1 verification failed (nothing written), 2 bad input, 3 internal error,
141 stdout's reader went away (a pipe closed early; what was written is in place)."""

from __future__ import annotations

from typing import Annotated, Optional

import typer

from normconv import __version__
from normconv.cli import canonicalize, deepnorm, export, fold, inspect, recalibrate, rotate, swap, zoo
from normconv.cli.common import Terminated, json_error, show_progress

app = typer.Typer(
    name="normconv",
    help="Rewrite the normalization layers of PyTorch models and ship them to deployment.",
    add_completion=False,
    no_args_is_help=True,
    pretty_exceptions_enable=False,
    rich_markup_mode=None,
)


def _version(value: bool) -> None:
    if value:
        typer.echo(f"normconv {__version__}")
        raise typer.Exit()


@app.callback()
def main_options(
    version: Annotated[Optional[bool], typer.Option("--version", callback=_version, is_eager=True,
                                                    help="print the version and exit")] = None,
    quiet: Annotated[bool, typer.Option("--quiet", help="no progress display on stderr (it shows only when "
                                                            "stderr is a terminal)")] = False,
) -> None:
    """Rewrite the normalization layers of PyTorch models and ship them to deployment."""
    show_progress(not quiet)


# the commands, in the order `normconv --help` lists them (an explicit tuple, no import-time registry)
COMMANDS = (inspect, fold, swap, rotate, canonicalize, export, deepnorm, recalibrate, zoo)
for _command in COMMANDS:
    _command.register(app)


def _terminated(signum, frame):
    raise Terminated(128 + signum)  # unwinds like Ctrl-C: every temp file is removed on the way out


def main() -> None:
    """The command line: a flag or argument click refuses (a usage error) is one line on stderr and exit 2, as every
    other bad input is (click prints the usage and the error over four lines); no arguments still show the help."""
    import signal
    import sys

    errors = _click_errors()
    signal.signal(signal.SIGTERM, _terminated)
    try:
        code = app(standalone_mode=False)
    except getattr(errors, "NoArgsIsHelpError", ()) as exc:  # `normconv` alone: the help, as click shows it
        exc.show()
        raise SystemExit(exc.exit_code) from None
    except errors.UsageError as exc:
        where = exc.ctx.command_path if exc.ctx is not None else "normconv"
        message = f"{exc.format_message()} (see {where} --help)"
        if any(a == "--json" or a.startswith("--json=") for a in sys.argv[1:]):  # asked for JSON (--json=1 too):
            # stdout is one object for a usage error too
            json_error(message, exc.exit_code, "usage")
        sys.stderr.write(f"error: {message}\n")
        raise SystemExit(exc.exit_code) from None
    except typer.Abort:  # end of input or Ctrl-C at a prompt, as click reports it
        sys.stderr.write("Aborted!\n")
        raise SystemExit(1) from None
    # typer.Exit(code) inside a command is returned in this mode: the exit click's own mode makes, 0 included
    raise SystemExit(code if isinstance(code, int) else 0)


def _click_errors():
    """The exceptions module of the click typer runs on (typer >= 0.20 carries its own copy)."""
    try:
        from typer._click import exceptions
    except ImportError:
        from click import exceptions
    return exceptions


def entry() -> None:
    """The ``normconv`` script (and ``python -m normconv.cli``): ``main``, then the process ends at once.

    Everything normconv writes is closed, fsynced and renamed into place before a command returns, so tearing the
    interpreter down (collecting the model, the captured graphs and every module; 0.75 s after a GPT-2 124M swap,
    BENCHMARKS.md) does nothing a user needs: the exit handlers run (libraries' temp files, logging), stdout and
    stderr are flushed, and the process exits with the command's code. A stdout that cannot take the rest (a closed
    pipe) exits 120, as Python's own shutdown does. ``main`` itself returns normally, for callers in-process."""
    import atexit
    import os
    import sys

    try:
        main()
        code = 0
    except SystemExit as exc:
        code = exc.code
    if code is None:
        code = 0
    elif not isinstance(code, int):  # SystemExit("message"): printed, exit 1, as the interpreter does
        sys.stderr.write(f"{code}\n")
        code = 1
    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):
            code = code or 120
    os._exit(code)


__all__ = ["app", "main", "entry"]
