"""``normconv rotate``: fold the norm scales and rotate the residual stream (QuaRot / SliceGPT), exactly."""

from __future__ import annotations

from typing import Annotated

import typer

from normconv.cli.common import (AcceptSpecializedOpt, OverwriteOpt, StaticOpt, TrustCodeOpt, AtolOpt, BenchOpt, DtypeOpt, InPlaceOpt, InputShapeOpt, JsonOpt, ModelArg, OutputOpt,
                                 RtolOpt, TrustOpt, WeightsOpt, emit, load_from_flags, options_from_flags, user_errors)


def register(app: typer.Typer) -> None:
    @app.command()
    @user_errors
    def rotate(
        model: ModelArg,
        output: OutputOpt = None,
        rotation: Annotated[str, typer.Option(
            "--rotation", help="hadamard (randomized Hadamard where the width allows, else random), random "
                               "(QR of a seeded Gaussian) or none (swap and fold the scales only)")] = "hadamard",
        seed: Annotated[int, typer.Option("--seed", help="seed of the random signs / Gaussian")] = 0,
        weights: WeightsOpt = None,
        input_shape: InputShapeOpt = None,
        trust_pickle: TrustOpt = False,
        trust_remote_code: TrustCodeOpt = False,
        dtype: DtypeOpt = None,
        atol: AtolOpt = None,
        rtol: RtolOpt = None,
        in_place: InPlaceOpt = False,
        overwrite: OverwriteOpt = False,
        static: StaticOpt = False,
        bench: BenchOpt = False,
        accept_specialized: AcceptSpecializedOpt = False,
        as_json: JsonOpt = False,
    ) -> None:
        """Canonicalize, swap LayerNorm -> RMSNorm exactly (pre-LN), fold the norm scales into the linears and
        rotate the residual stream by an orthogonal matrix: outputs unchanged, activation outliers spread out."""
        from normconv.commands.swap import rotate as run
        from normconv.errors import NormconvError
        from normconv.passes.rotate import ROTATIONS

        if rotation not in ROTATIONS:
            raise NormconvError(f"unknown --rotation {rotation!r}: choose {', '.join(ROTATIONS)}")
        loaded = load_from_flags(model, weights, input_shape, trust_pickle, dtype, trust_remote_code)
        report, _ = run(loaded, options_from_flags(output, atol, rtol, in_place, bench,
                                                   accept_specialized=accept_specialized, static=static,
                                                   overwrite=overwrite), rotation, seed)
        emit(report, as_json)
