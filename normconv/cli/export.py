"""``normconv export``: ONNX with one fused op per norm, validated in onnxruntime."""

from __future__ import annotations

from typing import TYPE_CHECKING, Annotated, Optional

import typer

from normconv.cli.common import (ConstantInitializersOpt, AcceptSpecializedOpt, OverwriteOpt, TrustCodeOpt, AtolOpt, DtypeOpt, InputShapeOpt, JsonOpt, ModelArg, RtolOpt, TrustOpt, WeightsOpt,
                                 emit, is_onnx, load_half_target, onnx_only, refuse_flags, options_from_flags, user_errors)
from normconv.errors import NormconvError
from normconv.onnx.defaults import DEFAULT_OPSET, DEFAULT_TARGET

if TYPE_CHECKING:
    from normconv.report import Report

DIM_KINDS = ("batch", "sequence", "decoder_sequence", "height", "width", "depth", "length")  # --dim-name KIND=NAME


def register(app: typer.Typer) -> None:
    @app.command()
    @user_errors
    def export(
        model: ModelArg,
        output: Annotated[str, typer.Option("--output", "-o", help="the .onnx file to write")],
        target: Annotated[str, typer.Option(help="onnx (default): standard ops only, passes onnx.checker and loads "
                                                 "in every runtime (RMSNormalization at opset 23, a function op "
                                                 "onnxruntime fuses below); ort: onnxruntime's own ops "
                                                 "(SimplifiedLayerNormalization, Skip*LayerNormalization)")] = DEFAULT_TARGET,
        opset: Annotated[Optional[int], typer.Option(
            help=f"ONNX opset, 17 to 23 (default {DEFAULT_OPSET}; an .onnx input keeps its own, raised to 17 "
                 f"where a LayerNormalization needs it)")] = None,
        static: Annotated[bool, typer.Option("--static", help="pin every input dimension to the example's size "
                                                              "(default: each dimension the model lets vary stays "
                                                              "dynamic, checked at a second size)")] = False,
        dynamic: Annotated[bool, typer.Option("--dynamic", hidden=True,
                                              help="the default now (kept so that older command lines run)")] = False,
        no_fold: Annotated[bool, typer.Option("--no-fold", help="do not fold BatchNorm before export")] = False,
        no_canonicalize: Annotated[bool, typer.Option("--no-canonicalize",
                                                      help="do not canonicalize hand-written norms")] = False,
        validate: Annotated[str, typer.Option(help="onnxruntime providers to validate on: cpu, cuda, "
                                                   "comma separated, or none")] = "cpu",
        baseline: Annotated[bool, typer.Option(help="also export with plain torch.onnx.export and compare op "
                                                    "counts and latency (a second export: opt-in)")] = False,
        repeats: Annotated[int, typer.Option(min=0, help="timed onnxruntime runs per provider (0: no timing)")] = 10,
        device: Annotated[str, typer.Option(
            help="the onnxruntime provider you deploy to, cpu or cuda: picks the fusions measured faster there "
                 "(cuda: residual add + norm as one Skip*LayerNormalization)")] = "cpu",
        skip_fusion: Annotated[Optional[bool], typer.Option(
            "--skip-fusion/--no-skip-fusion", help="with --target ort: fuse residual add + norm into "
                                                   "Skip*LayerNormalization, or not (default: what --device says; "
                                                   "measured faster on CUDA, slower on onnxruntime CPU)")] = None,
        dim_name: Annotated[Optional[list[str]], typer.Option(
            "--dim-name", help="your name for a dynamic dimension, e.g. batch=N or sequence=T (repeatable; "
                               "defaults batch, sequence, decoder_sequence, height, width, depth, length)")] = None,
        overwrite: OverwriteOpt = False,
        keep_fp32: Annotated[str, typer.Option(
            "--keep-fp32", help="with --dtype float16/bfloat16: which norm sites run in float32 between Casts: auto "
                                "(those whose measured headroom needs it, e.g. a running var beyond float16's "
                                "range), none, all")] = "auto",
        atol: AtolOpt = None,
        rtol: RtolOpt = None,
        weights: WeightsOpt = None,
        input_shape: InputShapeOpt = None,
        trust_pickle: TrustOpt = False,
        trust_remote_code: TrustCodeOpt = False,
        dtype: DtypeOpt = None,
        accept_specialized: AcceptSpecializedOpt = False,
        constant_initializers: ConstantInitializersOpt = False,
        as_json: JsonOpt = False,
    ) -> None:
        """Export to ONNX with every norm as one fused op; validate in onnxruntime (exit 1, no file, if it fails)."""
        from normconv.commands.export import export as run
        from normconv.onnx.export import check_args
        from normconv.onnx.validate import parse_providers

        if is_onnx(model):  # an ONNX file: fold + fuse, validated against the file given
            from normconv.onnx import onnx_in

            refuse_flags("an .onnx input is rewritten as an ONNX file (validated on onnxruntime's CPU provider)", [
                ("--static", static), ("--no-fold", no_fold), ("--no-canonicalize", no_canonicalize),
                ("--validate", validate.replace(" ", "").lower() != "cpu"), ("--baseline", baseline),
                ("--repeats", repeats != 10), ("--device", device != "cpu"), ("--skip-fusion", skip_fusion is not None),
                ("--dim-name", bool(dim_name)), ("--weights", weights is not None), ("--trust-pickle", trust_pickle),
                ("--trust-remote-code", trust_remote_code), ("--accept-specialized", accept_specialized)])
            emit(onnx_in.run(model, "export", output, target, opset, input_shape=input_shape, atol=atol, rtol=rtol,
                             dtype=dtype, keep_fp32=keep_fp32, overwrite=overwrite,
                             constant_initializers=constant_initializers), as_json)
            return
        onnx_only([("--constant-initializers", constant_initializers)])
        opset = DEFAULT_OPSET if opset is None else opset

        providers = parse_providers(validate)
        if static and dynamic:
            raise NormconvError("--static and --dynamic contradict each other (dynamic is the default: drop --dynamic)")
        dim_names = {}
        for item in dim_name or []:
            key, sep, value = item.partition("=")
            if not sep or key not in DIM_KINDS or not value.isidentifier():
                raise NormconvError(f"bad --dim-name {item!r}: expected KIND=NAME with KIND one of "
                                    f"{', '.join(DIM_KINDS)} and NAME an identifier")
            dim_names[key] = value
        check_args(output, target, opset, device, overwrite)  # bad flags fail before loading the model
        loaded, half = load_half_target(model, weights, input_shape, trust_pickle, dtype, trust_remote_code)
        opts = options_from_flags(output, atol, rtol, dtype=half, accept_specialized=accept_specialized, static=static,
                                  overwrite=overwrite)
        report = run(loaded, opts, target, opset, fold=not no_fold, canonicalize=not no_canonicalize, validate=providers,
                     baseline=baseline,
                     repeats=repeats, skip_fusion=skip_fusion, device=device, dim_names=dim_names, keep_fp32=keep_fp32)
        emit(report, as_json, print_export)


def print_export(report: Report) -> None:
    """Op counts side by side, the per-site plan, validations, latency."""
    from normconv.report import console, render_sites, render_validation, render_headroom, table

    c = console()
    ex = report.extra
    keys = list(dict.fromkeys([*report.after, *report.before]))
    if report.before:  # the plain export ran (--baseline): side by side
        c.print(table(f"op types: normconv ({ex.get('target')}, opset {ex.get('opset')}) vs plain torch.onnx.export",
                      ["op", "normconv", "plain"], [[k, report.after.get(k, 0), report.before.get(k, 0)] for k in keys]))
    else:
        c.print(table(f"op types: normconv ({ex.get('target')}, opset {ex.get('opset')}; --baseline adds plain "
                      f"torch.onnx.export's)", ["op", "normconv"], [[k, report.after.get(k, 0)] for k in keys]))
    if report.sites:
        c.print(render_sites(report.sites, "export plan and passes"))
    fused = sum(ex.get("fused_norm_ops", {}).values())
    sites = sum(ex.get("norm_sites", {}).values())
    c.print(f"fused norm ops: {fused} ({ex.get('fused_norm_ops')}), norm sites: {sites} ({ex.get('norm_sites')}), "
            f"folded batchnorm: {ex.get('folded_batchnorm')}, skip-fused: {ex.get('skip_fused')}, "
            f"ReduceMean/Pow/Sqrt/Reciprocal left (pooling and GELU use them too): "
            f"{ex.get('leftover_decomposed_ops') or 'none'}")
    for v in report.validation:
        c.print(render_validation(v))
    plain = "baseline_latency_ms" in ex
    rows = [[r["provider"], r["optimizations"], r["max_abs_error"], r["min_atol"], r["min_rtol"], r["latency_ms"]]
            + ([ex["baseline_latency_ms"].get(r["provider"]) if r["latency_ms"] else None] if plain else [])
            for r in ex.get("ort", [])]
    if rows:
        c.print(table("onnxruntime", ["provider", "optimizations", "max abs err", "smallest atol", "smallest rtol",
                                      "latency ms"] + (["plain export ms"] if plain else []), rows))
    if ex.get("headroom"):
        c.print(render_headroom(ex["headroom"]))
    dims = ex.get("dynamic_dims") or []
    if dims:
        c.print(table("dynamic dimensions (--static pins them)", ["dimension", "inputs", "example", "range", "checked at",
                                                                  "pinned"],
                      [[d["name"], ", ".join(d["inputs"]), d["example"],
                        f"{d['min'] if d['min'] is not None else '?'}..{d['max'] if d['max'] is not None else 'inf'}",
                        ", ".join(map(str, d["checked"])), d.get("pinned", "")] for d in dims]))
    c.print(f"checker: {ex.get('checker')}; input shapes: "
            f"{ex.get('dynamic_axes') or 'all static' + (' (--static)' if ex.get('static') else '')}")
    if ex.get("runtimes"):
        c.print("loads in: " + "; ".join(ex["runtimes"]))
    for n in report.notes:
        c.print(f"note: {n}")
    if report.output:
        c.print(f"wrote {report.output}")
