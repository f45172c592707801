"""``normconv fold``: fold BatchNorm into the neighbouring conv / linear, verified, for deployment."""

from __future__ import annotations

from typing import Annotated

import typer

from .cli_common import (AtolOpt, DtypeOpt, InPlaceOpt, InputShapeOpt, JsonOpt, ModelArg, OutputOpt, RtolOpt,
                         TrustOpt, WeightsOpt, emit, load_from_flags, user_errors)

EvalOpt = Annotated[bool, typer.Option(
    "--eval", help="put a model saved in training mode into eval mode first (BN then uses its running statistics)")]


def register(app: typer.Typer) -> None:
    @app.command()
    @user_errors
    def fold(
        model: ModelArg,
        output: OutputOpt = None,
        eval_mode: EvalOpt = False,
        atol: AtolOpt = None,
        rtol: RtolOpt = None,
        weights: WeightsOpt = None,
        input_shape: InputShapeOpt = None,
        trust_pickle: TrustOpt = False,
        dtype: DtypeOpt = None,
        in_place: InPlaceOpt = False,
        as_json: JsonOpt = False,
    ) -> None:
        """Fold BatchNorm into the conv / linear next to it; exits 1 (writing nothing) if outputs drift."""
        from normconv.passes.fold_batchnorm import fold_loaded

        loaded = load_from_flags(model, weights, input_shape, trust_pickle, dtype)
        report, _ = fold_loaded(loaded, eval_mode=eval_mode, atol=atol, rtol=rtol, output=output, in_place=in_place)
        emit(report, as_json)
