"""``normconv recalibrate``: BatchNorm running statistics re-estimated from calibration data, verified, written."""

from __future__ import annotations

from typing import Annotated

import typer

from normconv.cli.common import (AtolOpt, BenchOpt, DtypeOpt, InPlaceOpt, InputShapeOpt, JsonOpt, KeepNormconvOpt,
                                 ModelArg, OutputOpt, RtolOpt, TrustCodeOpt, TrustOpt, WeightsOpt, emit,
                                 load_from_flags, options_from_flags, user_errors)


def register(app: typer.Typer) -> None:
    @app.command()
    @user_errors
    def recalibrate(
        model: ModelArg,
        calibration: Annotated[str, typer.Option(
            "--calibration", help="a .pt or .safetensors of input tensors (a tensor, a list, or a dict by argument "
                                  "name) whose first dim is the samples; cut into batches of --batch-size",
            show_default=False)],
        batch_size: Annotated[int, typer.Option("--batch-size", min=1, help="samples per calibration batch")] = 32,
        output: OutputOpt = None,
        weights: WeightsOpt = None,
        input_shape: InputShapeOpt = None,
        trust_pickle: TrustOpt = False,
        trust_remote_code: TrustCodeOpt = False,
        dtype: DtypeOpt = None,
        atol: AtolOpt = None,
        rtol: RtolOpt = None,
        in_place: InPlaceOpt = False,
        bench: BenchOpt = False,
        normconv_modules: KeepNormconvOpt = False,
        as_json: JsonOpt = False,
    ) -> None:
        """Re-estimate every BatchNorm's running statistics from calibration batches (a cumulative average), report
        each site's change and the output drift; nothing else changes (checked)."""
        from normconv.commands.recalibrate import recalibrate as run, split_batches
        from normconv.io.inputs import load_calibration, parse_dtype

        loaded = load_from_flags(model, weights, input_shape, trust_pickle, dtype, trust_remote_code)
        data = load_calibration(calibration, loaded.model, loaded.ledger)
        if dtype is not None:  # the model was cast: its calibration floats too
            data = data.to(parse_dtype(dtype, floating=True))
        report, _ = run(loaded, options_from_flags(output, atol, rtol, in_place, bench, normconv_modules),
                        split_batches(data, batch_size))
        emit(report, as_json)
