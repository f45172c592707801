"""The ``normconv`` command line: one module per command, each parsing flags, calling ``normconv.commands`` and
rendering the report. Exit codes: 0 ok, 1 verification failed (nothing written), 2 bad input, 3 internal error."""

from __future__ import annotations

from typing import Annotated, Optional

import typer

from normconv import __version__
from normconv.cli import canonicalize, deepnorm, export, fold, inspect, recalibrate, rotate, swap, zoo

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
) -> None:
    """Rewrite the normalization layers of PyTorch models and ship them to deployment."""


# the commands, in the order `normconv --help` lists them (an explicit tuple, no import-time registry)
COMMANDS = (inspect, fold, swap, rotate, canonicalize, export, deepnorm, recalibrate, zoo)
for _command in COMMANDS:
    _command.register(app)


def _terminated(signum, frame):
    raise SystemExit(128 + signum)  # unwinds like Ctrl-C: every temp file is removed on the way out


def main() -> None:
    import signal

    signal.signal(signal.SIGTERM, _terminated)
    app()


__all__ = ["app", "main"]
