"""The ``normconv`` command line. Each command is a thin layer over the Python API."""

from __future__ import annotations

import os
import sys
from typing import Annotated, Optional

import typer

from . import __version__
from .cli_common import (DtypeOpt, InputShapeOpt, JsonOpt, ModelArg, TrustOpt, WeightsOpt, emit, load_from_flags,
                         user_errors)

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


@app.command()
@user_errors
def inspect(
    model: ModelArg,
    weights: WeightsOpt = None,
    input_shape: InputShapeOpt = None,
    trust_pickle: TrustOpt = False,
    dtype: DtypeOpt = None,
    capture: Annotated[str, typer.Option(help="graph capture: auto, symbolic_trace or torch.export")] = "auto",
    as_json: JsonOpt = False,
) -> None:
    """List every norm site: kind, eps, placement, and what each pass would do with it or why not."""
    from .inspect_model import inspect as run_inspect, print_inspect

    if capture not in ("auto", "symbolic_trace", "torch.export"):
        from .errors import NormconvError

        raise NormconvError(f"unknown --capture {capture!r}; choose auto, symbolic_trace or torch.export")
    loaded = load_from_flags(model, weights, input_shape, trust_pickle, dtype)
    emit(run_inspect(loaded, capture), as_json, print_inspect)


@app.command()
@user_errors
def zoo(as_json: JsonOpt = False) -> None:
    """List the built-in reference models (use them as zoo:NAME)."""
    import json

    from normconv.models import ZOO

    from .report import console, table

    if as_json:
        typer.echo(json.dumps({name: {"description": z.description, "norms": dict(z.norms)} for name, z in ZOO.items()},
                              indent=2))
        return
    rows = [[f"zoo:{name}", ", ".join(f"{v} {k}" for k, v in z.norms.items()), z.description] for name, z in ZOO.items()]
    console().print(table("reference models", ["model", "norms", "what it is"], rows))


# commands of the other capabilities register here, one line each (no import-time registry)
COMMAND_MODULES: tuple[str, ...] = ("cli_fold", "cli_swap", "cli_canonicalize", "cli_export", "cli_deepnorm")

for _module in COMMAND_MODULES:
    __import__(f"normconv.{_module}", fromlist=["register"]).register(app)


def main() -> None:
    # like `python -m`: a `package.module:factory` spec (and a pickle's own classes) import from the current folder
    if "" not in sys.path and os.getcwd() not in sys.path:
        sys.path.insert(0, os.getcwd())
    app()


if __name__ == "__main__":
    main()
