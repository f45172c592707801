"""``normconv zoo``: the built-in reference models."""

from __future__ import annotations

import json

import typer

from normconv.cli.common import JsonOpt, report_stdout, user_errors
from normconv.report import console, table


def register(app: typer.Typer) -> None:
    @app.command()
    @user_errors
    def zoo(as_json: JsonOpt = False) -> None:
        """List the built-in reference models (use them as zoo:NAME)."""
        from normconv.models import ZOO

        with report_stdout():
            if as_json:
                typer.echo(json.dumps({name: {"description": z.description, "norms": dict(z.norms)}
                                       for name, z in ZOO.items()}, indent=2))
                return
            rows = [[f"zoo:{name}", ", ".join(f"{v} {k}" for k, v in z.norms.items()), z.description]
                    for name, z in ZOO.items()]
            console().print(table("reference models", ["model", "norms", "what it is"], rows))
