"""``normconv swap``: LayerNorm -> RMSNorm (or back), exact where the residual stream allows it; BatchNorm -> frozen,
batchnorm, affine, groupnorm[:G] or instancenorm (commands/swap_batchnorm.py)."""

from __future__ import annotations

from typing import Annotated

import typer

from normconv.cli.common import (AcceptSpecializedOpt, OverwriteOpt, StaticOpt, TrustCodeOpt, KeepNormconvOpt, AtolOpt, BenchOpt, DtypeOpt, InPlaceOpt, InputShapeOpt, JsonOpt, ModelArg, OutputOpt, RtolOpt,
                         TrustOpt, WeightsOpt, check_stream_flags, emit, load_from_flags, options_from_flags, refuse_flags, user_errors)


def register(app: typer.Typer) -> None:
    @app.command()
    @user_errors
    def swap(
        model: ModelArg,
        to: Annotated[str, typer.Option("--to", help="target norm: rmsnorm (from LayerNorm) or layernorm (from "
                                                     "RMSNorm); from BatchNorm: frozen-batchnorm, batchnorm (from "
                                                     "SyncBatchNorm / frozen), affine (what fold leaves), "
                                                     "groupnorm[:G] or instancenorm (approximate)")] = "rmsnorm",
        output: OutputOpt = None,
        approximate: Annotated[bool, typer.Option(
            "--approximate", help="swap sites that cannot be made exact too, and report the output drift")] = False,
        partial: Annotated[bool, typer.Option(
            "--partial", help="swap only the sites that can be made exact and keep the others as they are (the "
                              "result stays exact; each kept site says why)")] = False,
        no_canonicalize: Annotated[bool, typer.Option(
            "--no-canonicalize", help="do not convert hand-written norms to native modules first")] = False,
        fold_scales: Annotated[bool, typer.Option(
            "--fold-scales", help="then fold each RMSNorm's scale into the linears reading it")] = False,
        as_conv: Annotated[bool, typer.Option(
            "--as-conv", help="with --to affine: a depthwise 1x1 conv instead of a per-channel Mul and Add")] = False,
        eval_mode: Annotated[bool, typer.Option(
            "--eval", help="with a BatchNorm target: convert a model saved in training mode as its eval-mode self "
                           "(needed by --to affine, which replaces batch statistics)")] = False,
        stream: Annotated[bool, typer.Option(
            "--stream", help="Hugging Face folder with safetensors weights: rewrite it tensor by tensor, never "
                             "holding the model (larger than RAM); writes the same architecture with rewritten "
                             "weights, verified block by block")] = False,
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
        normconv_modules: KeepNormconvOpt = False,
        accept_specialized: AcceptSpecializedOpt = False,
        as_json: JsonOpt = False,
    ) -> None:
        """Swap LayerNorm -> RMSNorm exactly (Pre-LN: center the residual writers, fold the bias), or back; or
        convert BatchNorm for training (frozen, batchnorm, groupnorm, instancenorm) or the edge (affine)."""
        from normconv.commands.swap import swap as run
        from normconv.commands.swap_batchnorm import parse_target, swap_batchnorm
        from normconv.errors import NormconvError
        from normconv.passes.swap_norm import SOURCE_KIND

        if parse_target(to) is not None:
            refuse_flags(f"--to {to}", [("--approximate", approximate), ("--partial", partial),
                                        ("--no-canonicalize", no_canonicalize), ("--fold-scales", fold_scales),
                                        ("--stream", stream)])
            loaded = load_from_flags(model, weights, input_shape, trust_pickle, dtype, trust_remote_code)
            report, _ = swap_batchnorm(loaded, options_from_flags(output, atol, rtol, in_place, bench,
                                                                  normconv_modules, eval_mode,
                                                                  accept_specialized=accept_specialized,
                                                                  static=static, overwrite=overwrite),
                                       to, as_conv=as_conv)
            emit(report, as_json)
            return
        if to not in SOURCE_KIND:
            raise NormconvError(f"unknown --to {to!r}: choose rmsnorm, layernorm, frozen-batchnorm, batchnorm, "
                                f"affine, groupnorm[:G] or instancenorm")
        refuse_flags(f"--to {to}", [("--as-conv", as_conv), ("--eval", eval_mode)])
        if stream:
            from normconv.stream import swap as streaming

            check_stream_flags("rewrites an exact LayerNorm -> RMSNorm swap of a Hugging Face folder",
                               [("--to layernorm", to != "rmsnorm"), ("--approximate", approximate),
                                ("--partial", partial),
                                ("--fold-scales", fold_scales), ("--weights", weights is not None),
                                ("--input-shape", bool(input_shape)), ("--dtype", dtype is not None),
                                ("--in-place", in_place), ("--bench", bench), ("--no-canonicalize", no_canonicalize),
                                ("--normconv-modules", normconv_modules), ("--trust-pickle", trust_pickle),
                                ("--trust-remote-code", trust_remote_code), ("--static", static),
                                ("--accept-specialized", accept_specialized)], output)
            emit(streaming.swap(model, output, atol=atol, rtol=rtol, overwrite=overwrite), as_json)
            return
        loaded = load_from_flags(model, weights, input_shape, trust_pickle, dtype, trust_remote_code)
        report, _ = run(loaded, options_from_flags(output, atol, rtol, in_place, bench, normconv_modules,
                                                   accept_specialized=accept_specialized, static=static,
                                                   overwrite=overwrite), to,
                        approximate, canonicalize=not no_canonicalize, fold_scales_=fold_scales, partial=partial)
        emit(report, as_json)
