"""``normconv fold``: fold BatchNorm into the neighbouring conv / linear, verified, for deployment."""

from __future__ import annotations

from typing import Annotated

import typer

from normconv.cli.common import (ConstantInitializersOpt, AcceptSpecializedOpt, OverwriteOpt, StaticOpt, TrustCodeOpt, KeepNormconvOpt, AtolOpt, BenchOpt, DtypeOpt, InPlaceOpt, InputShapeOpt, JsonOpt, ModelArg, OutputOpt, RtolOpt,
                         TrustOpt, WeightsOpt, check_stream_flags, emit, is_onnx, onnx_only, refuse_flags, load_half_target, options_from_flags, user_errors)

EvalOpt = Annotated[bool, typer.Option(
    "--eval", help="rewrite a model saved in training mode as its eval-mode self (BN then uses its running statistics)")]


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
        trust_remote_code: TrustCodeOpt = False,
        dtype: DtypeOpt = None,
        in_place: InPlaceOpt = False,
        overwrite: OverwriteOpt = False,
        static: StaticOpt = False,
        bench: BenchOpt = False,
        normconv_modules: KeepNormconvOpt = False,
        stream: Annotated[bool, typer.Option(
            "--stream", help="Hugging Face folder with safetensors weights: fold tensor by tensor, never holding "
                             "the model; writes the same architecture with each folded BatchNorm made the "
                             "identity, verified block by block")] = False,
        accept_specialized: AcceptSpecializedOpt = False,
        constant_initializers: ConstantInitializersOpt = False,
        as_json: JsonOpt = False,
    ) -> None:
        """Fold BatchNorm into the conv / linear next to it; exits 1 (writing nothing) if outputs drift."""
        from normconv.commands.fold import fold as run

        if is_onnx(model):  # an ONNX file in, an ONNX file out, validated in onnxruntime
            from normconv.onnx import onnx_in

            refuse_flags("an .onnx input is rewritten as an ONNX file", [
                ("--eval", eval_mode), ("--weights", weights is not None), ("--trust-pickle", trust_pickle),
                ("--trust-remote-code", trust_remote_code), ("--in-place", in_place), ("--static", static),
                ("--bench", bench), ("--normconv-modules", normconv_modules), ("--stream", stream),
                ("--accept-specialized", accept_specialized)])
            emit(onnx_in.run(model, "fold", output, input_shape=input_shape, atol=atol, rtol=rtol, dtype=dtype,
                             overwrite=overwrite, constant_initializers=constant_initializers), as_json)
            return
        onnx_only([("--constant-initializers", constant_initializers)])
        if stream:
            from normconv.stream import fold as streaming

            check_stream_flags("folds the BatchNorms of a Hugging Face folder",
                               [("--eval", eval_mode), ("--weights", weights is not None),
                                ("--input-shape", bool(input_shape)), ("--dtype", dtype is not None),
                                ("--in-place", in_place), ("--bench", bench), ("--normconv-modules", normconv_modules),
                                ("--trust-pickle", trust_pickle), ("--trust-remote-code", trust_remote_code),
                                ("--accept-specialized", accept_specialized), ("--static", static)], output)
            emit(streaming.fold(model, output, atol=atol, rtol=rtol, overwrite=overwrite), as_json)
            return

        # a half --dtype: headroom is measured on the model as loaded (float32), then it is cast and folded
        loaded, half = load_half_target(model, weights, input_shape, trust_pickle, dtype, trust_remote_code)
        report, _ = run(loaded, options_from_flags(output, atol, rtol, in_place, bench, normconv_modules, eval_mode,
                                                   half, accept_specialized, static=static,
                                                   overwrite=overwrite))
        emit(report, as_json)
