"""``normconv export``: ONNX with one fused op per norm, validated in onnxruntime."""

from __future__ import annotations

from typing import Annotated

import typer

from .cli_common import (AtolOpt, DtypeOpt, InputShapeOpt, JsonOpt, ModelArg, RtolOpt, TrustOpt, WeightsOpt, emit,
                         load_from_flags, user_errors)
from .export import DEFAULT_OPSET


def register(app: typer.Typer) -> None:
    @app.command()
    @user_errors
    def export(
        model: ModelArg,
        output: Annotated[str, typer.Option("--output", "-o", help="the .onnx file to write")],
        target: Annotated[str, typer.Option(help="onnx: standard ops only; ort: onnxruntime's fused ops "
                                                 "(SimplifiedLayerNormalization, Skip*LayerNormalization)")] = "onnx",
        opset: Annotated[int, typer.Option(help="ONNX opset, 17 to 23")] = DEFAULT_OPSET,
        dynamic: Annotated[bool, typer.Option("--dynamic", help="dynamic batch and sequence axes where the "
                                                                "model allows them")] = False,
        no_fold: Annotated[bool, typer.Option("--no-fold", help="do not fold BatchNorm before export")] = False,
        no_canonicalize: Annotated[bool, typer.Option("--no-canonicalize",
                                                      help="do not canonicalize hand-written norms")] = False,
        validate: Annotated[str, typer.Option(help="onnxruntime providers to validate on: cpu, cuda, "
                                                   "comma separated, or none")] = "cpu",
        baseline: Annotated[bool, typer.Option(help="also export with plain torch.onnx.export and compare op "
                                                    "counts and latency")] = True,
        repeats: Annotated[int, typer.Option(help="timed onnxruntime runs per provider (0: no timing)")] = 10,
        skip_fusion: Annotated[bool, typer.Option(
            "--skip-fusion", help="with --target ort: fuse residual add + norm into Skip*LayerNormalization "
                                  "(onnxruntime's GPU kernels; measured slower on onnxruntime CPU)")] = False,
        atol: AtolOpt = None,
        rtol: RtolOpt = None,
        weights: WeightsOpt = None,
        input_shape: InputShapeOpt = None,
        trust_pickle: TrustOpt = False,
        dtype: DtypeOpt = None,
        as_json: JsonOpt = False,
    ) -> None:
        """Export to ONNX with every norm as one fused op; validate in onnxruntime (exit 1, no file, if it fails)."""
        from .export import _check_args, export_onnx, print_export
        from .onnx_validate import parse_providers

        providers = parse_providers(validate)
        _check_args(output, target, opset)  # bad flags fail before loading the model
        loaded = load_from_flags(model, weights, input_shape, trust_pickle, dtype)
        report = export_onnx(loaded.model, loaded.require_inputs(), output, target, opset, dynamic=dynamic,
                             fold=not no_fold, canonicalize=not no_canonicalize, validate=providers, atol=atol,
                             rtol=rtol, baseline=baseline, repeats=repeats, spec=loaded.spec,
                             skip_fusion=skip_fusion)
        emit(report, as_json, print_export)
