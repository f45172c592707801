"""``normconv canonicalize``: replace hand-written norms by torch's native modules, verified."""

from __future__ import annotations

import typer

from normconv.cli.common import (AcceptSpecializedOpt, OverwriteOpt, StaticOpt, TrustCodeOpt, KeepNormconvOpt, AtolOpt, BenchOpt, DtypeOpt, InPlaceOpt, InputShapeOpt, JsonOpt, ModelArg, OutputOpt, RtolOpt,
                         TrustOpt, WeightsOpt, emit, load_half_target, options_from_flags, user_errors)


def register(app: typer.Typer) -> None:
    @app.command()
    @user_errors
    def canonicalize(
        model: ModelArg,
        output: OutputOpt = None,
        atol: AtolOpt = None,
        rtol: RtolOpt = None,
        weights: WeightsOpt = None,
        input_shape: InputShapeOpt = None,
        trust_pickle: TrustOpt = False,
        trust_remote_code: TrustCodeOpt = False,
        dtype: DtypeOpt = None,
        in_place: InPlaceOpt = False,
        overwrite: OverwriteOpt = False,
        static: StaticOpt = False,
        bench: BenchOpt = False,
        normconv_modules: KeepNormconvOpt = False,
        accept_specialized: AcceptSpecializedOpt = False,
        as_json: JsonOpt = False,
    ) -> None:
        """Replace hand-written norms (modules and inline code) by native ones; exits 1 (writing nothing) on drift."""
        from normconv.commands.canonicalize import canonicalize as run

        # a half --dtype: canonicalized in it, verified against the half model and the float32 model as loaded
        loaded, half = load_half_target(model, weights, input_shape, trust_pickle, dtype, trust_remote_code)
        report, _ = run(loaded, options_from_flags(output, atol, rtol, in_place, bench, normconv_modules, dtype=half,
                                                   accept_specialized=accept_specialized, static=static,
                                                   overwrite=overwrite))
        emit(report, as_json)
