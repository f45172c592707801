"""``normconv inspect``: every norm site, and what each pass would do with it or why not."""

from __future__ import annotations

import collections
from typing import TYPE_CHECKING, Annotated, Optional

import typer

from normconv.cli.common import (ConstantInitializersOpt, TrustCodeOpt, DtypeOpt, InputShapeOpt, JsonOpt, ModelArg, TrustOpt, WeightsOpt, emit,
                                 is_onnx, load_half_target, onnx_only, refuse_flags, user_errors)
from normconv.errors import NormconvError

if TYPE_CHECKING:
    from normconv.report import Report

CAPTURES = ("auto", "symbolic_trace", "torch.export")


def register(app: typer.Typer) -> None:
    @app.command()
    @user_errors
    def inspect(
        model: ModelArg,
        weights: WeightsOpt = None,
        input_shape: InputShapeOpt = None,
        trust_pickle: TrustOpt = False,
        trust_remote_code: TrustCodeOpt = False,
        dtype: DtypeOpt = None,
        capture: Annotated[str, typer.Option(help="graph capture: auto, symbolic_trace or torch.export")] = "auto",
        calibration: Annotated[Optional[str], typer.Option(
            "--calibration", help="with --dtype float16/bfloat16: a .pt or .safetensors of input tensors (a tensor, "
                                  "a list, or a dict by argument name) to measure headroom on")] = None,
        constant_initializers: ConstantInitializersOpt = False,
        as_json: JsonOpt = False,
    ) -> None:
        """List every norm site: kind, eps, placement, and what each pass would do with it or why not.
        With --dtype float16 or bfloat16: each site's headroom in that dtype, measured in float32."""
        from normconv.commands.inspect import inspect as run
        from normconv.graph.headroom import HALF_DTYPES
        from normconv.io.inputs import load_calibration

        if is_onnx(model):  # an ONNX file: what fold and export would do at each site
            from normconv.onnx import onnx_in

            refuse_flags("an .onnx input is inspected as an ONNX file", [
                ("--weights", weights is not None), ("--trust-pickle", trust_pickle),
                ("--trust-remote-code", trust_remote_code), ("--dtype", dtype is not None),
                ("--capture", capture != "auto"), ("--calibration", calibration is not None)])
            emit(onnx_in.run(model, "inspect", None, input_shape=input_shape,
                             constant_initializers=constant_initializers), as_json, print_onnx_inspect)
            return
        onnx_only([("--constant-initializers", constant_initializers)])

        if capture not in CAPTURES:
            raise NormconvError(f"unknown --capture {capture!r}; choose auto, symbolic_trace or torch.export")
        if calibration is not None and (dtype or "").lower() not in HALF_DTYPES:
            raise NormconvError("--calibration measures half-precision headroom: give --dtype float16 or bfloat16")
        # a half --dtype is the target of the headroom report: the model is measured in float32, not cast
        loaded, target = load_half_target(model, weights, input_shape, trust_pickle, dtype, trust_remote_code)
        # calibration data is read too (recorded in the run's ledger): no write of this run may replace it
        calib = load_calibration(calibration, loaded.model, loaded.ledger) if calibration else None
        emit(run(loaded, capture, target, calib), as_json, print_inspect)


def print_inspect(report: Report) -> None:
    from normconv.report import console, render_headroom, table

    c = console()
    ex = report.extra
    c.print(f"{report.model}: {len(report.sites)} norm sites "
            f"({', '.join(f'{v} {k}' for k, v in ex['counts'].items()) or 'none'}); "
            f"graph by {ex['capture']}; inputs {ex['inputs']}")
    for method, why in ex["capture_failures"].items():
        c.print(f"note: {method} failed: {why}")
    for where in ex.get("not_inspected", []):
        c.print(f"note: not inspected: {where}")
    # a module called at several places is one site per call: identical rows are shown once, with the count
    rows = _once([[s["target"], s["kind"], s["source"], s["module_type"], s["eps"], _shape(s), s["placement"],
                   _affine(s)] for s in report.sites])
    c.print(table("norm sites", ["target", "kind", "source", "class", "eps", "shape", "placement", "params"], rows))
    plan_rows = _once([[s["target"], p["pass"], "apply" if p["applied"] else "skip", p["reason"]]
                       for s in report.sites for p in s["plan"]])
    c.print(table("plan", ["target", "pass", "would", "why"], plan_rows))
    if ex.get("headroom"):
        c.print(render_headroom(ex["headroom"]))
    ws = ex.get("weight_standardizations", [])
    if ws:
        c.print(table(f"weight standardization: {len(ws)} (a parameter normalized, not an activation norm)",
                      ["target", "param", "written as", "read by"],
                      [[w["target"], w["param"], w["written_as"], w["consumer"] or "-"] for w in ws]))
    misses = ex.get("near_misses", [])
    if misses:
        c.print(table(f"norm-like but not a norm: {len(misses)} left as written", ["target", "computes", "why"],
                      [[m["target"], m["computes"], m["reason"]] for m in misses]))


def print_onnx_inspect(report: Report) -> None:
    """An ONNX file's inspect: its norm sites (ops it holds, norms written out in elementwise ops), what fold and
    export would do at each, and the op counts before / after."""
    from normconv.report import console, print_report, table

    c = console()
    sites = report.extra.get("norm_sites", [])
    c.print(f"{report.model}: {len(sites)} norm sites "
            f"({', '.join(f'{v} {k}' for k, v in report.extra.get('counts', {}).items()) or 'none'}); "
            f"opset {report.extra.get('opset_in')}")
    if sites:
        c.print(table("norm sites", ["target", "kind", "op", "eps", "shape", "fed by", "would"],
                      [[s["target"], s["kind"], s["op"], "-" if s["eps"] is None else f"{s['eps']:g}", s["shape"],
                        s["fed_by"], _would(s)] for s in sites]))
    print_report(report)


def _would(site: dict) -> str:
    """What the plan does at a site, in a word or two: the passes that would apply, else "kept"."""
    applied = [p["pass"] for p in site["plan"] if p["applied"]]
    if applied:
        return ", ".join(dict.fromkeys(applied))
    return "kept (one op)" if site["source"] == "op" else "kept (see plan)"


def _once(rows: list[list]) -> list[list]:
    """Identical rows once, in first-seen order, the target marked with how many calls share it ("x3")."""
    counts = collections.Counter(tuple(map(str, r)) for r in rows)
    seen, out = set(), []
    for r in rows:
        key = tuple(map(str, r))
        if key not in seen:
            seen.add(key)
            out.append([f"{r[0]} (x{counts[key]})" if counts[key] > 1 else r[0], *r[1:]])
    return out


def _shape(s: dict) -> str:
    if s["normalized_shape"]:
        return "x".join(str(d) for d in s["normalized_shape"])
    parts = []
    if s["num_features"]:
        parts.append(f"C={s['num_features']}")
    if s["num_groups"]:
        parts.append(f"G={s['num_groups']}")
    return " ".join(parts) or "-"


def _affine(s: dict) -> str:
    a = s["affine"]
    parts = [("w+1" if a["weight_offset"] else "w") if a["weight"] else "", "b" if a["bias"] else "",
             "running" if s["running_stats"] else ""]
    return ",".join(p for p in parts if p) or "-"
