"""ONNX export with one fused op per norm, validated in onnxruntime.

  layernorm     -> LayerNormalization (opset >= 17)
  rmsnorm       -> RMSNormalization (opset >= 23) | SimplifiedLayerNormalization (--target ort)
                   | normconv.RMSNorm with an ONNX function body (--target onnx below opset 23)
  groupnorm     -> GroupNormalization (opset >= 21) | normconv.GroupNorm with a function body (below 21)
  instancenorm  -> InstanceNormalization
  batchnorm     -> folded into its conv / linear, else BatchNormalization
  residual add feeding a norm (--target ort) -> SkipLayerNormalization / SkipSimplifiedLayerNormalization
  hand-written norms are canonicalized into native modules first (else they stay primitive ops)

Flow (normconv.commands.export runs the first step through the engine, as every command does; this module the rest):
canonicalize + fold (exact, verified against torch) -> torch.onnx.export (dynamo) with normconv's
translations (onnx.ops) -> the ONNX half an .onnx file goes through too (passes/: repair the down-conversion, the
LayerNorm / RMSNorm rules for norms written inline, lower placeholders for the target) -> skip fusion
(rules/skipnorm, --target ort)
-> write into a temp folder -> onnx.checker where the ops allow -> onnxruntime validation (onnx_validate)
-> rename into place. Any failure leaves no file under the requested name.
"""

from __future__ import annotations

import collections
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any, Sequence

import torch
import torch.nn as nn

from normconv import kinds
from normconv.graph.detect import NormSite
from normconv.errors import NormconvError, VerificationError
from normconv.quiet import phase, quiet
from normconv.io.time_limit import DYNAMIC_EXPORT_S, Overtime, interrupt_kept, time_limit
from normconv.io import durable
from normconv.io.outputs import latched
from normconv.io.write import check_writable
from normconv.report import Report, Site, Why
from normconv.onnx.defaults import DEFAULT_OPSET, DEFAULT_TARGET, OPSETS, TARGETS

NAME = "export"
IN_EVAL = "an export in eval mode (running statistics, no dropout)"  # what a training-mode .pt2 refusal names
# the provider deployed to picks the Skip*LayerNormalization fusion: measured on an H100 (fp16, (8, 2048, 4096)) the
# fused op runs 1.64x faster than Add + norm, and the 16-layer Llama 4% faster; on onnxruntime CPU it is slower
DEVICES = ("cpu", "cuda")
EXTERNAL_DATA_BYTES = 2 * 1024 ** 3  # protobuf's limit: larger models keep weights in a .data sidecar
# ops a decomposed norm leaves behind; after normconv's export none of them should come from a norm
DECOMPOSED_NORM_OPS = ("ReduceMean", "Pow", "Sqrt", "Reciprocal")


# ---------------------------------------------------------------------------------------------------------
# plan: what export does at each norm site (inspect shows it; export_onnx reports the same decisions)


class ExportWhy(Why):
    """What export does at each norm site, by rule."""

    DEAD = "dead-code"  # the norm's result reaches no output: the exporter drops it
    FOLDED = "folded"  # a BatchNorm folded into its neighbour: no norm op left
    ONE_OP = "one-op"  # one fused op
    CANONICALIZED = "one-op-after-canonicalize"  # a hand-written norm made native first, then one op
    MATCHED_IN_ONNX = "one-op-matched-in-onnx"  # a hand-written norm matched in the exported graph
    PRIMITIVE = "stays-primitive"  # a hand-written norm that stays several primitive ops
    SKIP_FUSED = "one-op-skip-fused"  # ... and its residual add fuses into Skip*LayerNormalization
    ADD_UNFUSED = "one-op-add-unfused"  # ... and its residual add is left as an Add (measured faster on CPU)
    TRAINING_PROGRAM = "program-in-training-mode"  # a .pt2 exported in training mode: export refuses it whole


def plan(norms: Sequence[NormSite], target: str = DEFAULT_TARGET, opset: int = DEFAULT_OPSET,
         canon: dict[str, tuple[bool, str]] | None = None, folds: dict[str, tuple[bool, str]] | None = None,
         skip_fusion: bool = False, live: frozenset[str] | None = None,
         float32: frozenset[str] = frozenset()) -> list[Site]:
    """Per norm site: the one op it becomes at this target and opset, or why it stays several ops.

    ``canon`` / ``folds``: target -> (applied, reason) from the canonicalize / fold plans (None: switched off);
    ``live``: the captured graph's nodes that reach an output (None: all); ``float32``: the sites exported in
    float32 throughout (input and output), whose casts to float32 are no-ops the exporter drops."""
    fuse_inline = canon is not None  # --no-canonicalize leaves hand-written norms as written, in ONNX too
    canon, folds = canon or {}, folds or {}
    out = []
    for s in norms:
        op = kinds.by_name(s.kind).onnx_op(target, opset)  # the kind says which op (an unknown kind: KeyError)
        applied, code = True, ExportWhy.ONE_OP
        if live is not None and s.node not in live:
            # the norm's result reaches no output  =>  the exporter drops it with the dead code around it
            out.append(Site(NAME, s.target, False, f"not exported: its result ({s.node}) reaches no model output "
                                                   f"(dead code the exporter drops), so there is no op to fuse",
                            ExportWhy.DEAD))
            continue
        if s.kind == "batchnorm" and folds.get(s.target, (False, ""))[0]:
            # conv -> bn  =>  folded into the conv / linear, no norm op left
            # (fold-through: through the ops between them; a shift no layer takes stays a per-channel add)
            reason, code = f"folded by fold: {folds[s.target][1]}", ExportWhy.FOLDED
        elif s.kind == "batchnorm":
            # bn without a foldable neighbour  =>  one BatchNormalization (the exporter may still fuse Conv+BN)
            reason = f"one {op}" + (f" ({folds[s.target][1]})" if s.target in folds else "")
        elif s.source == "handwritten":
            ok, why = canon.get(s.target, (False, "canonicalize is switched off"))
            # hand-written norm  =>  canonicalized to a native module, then one op; else it stays primitive ops
            # (an upcast of a float32 input is no cast at all in the ONNX graph)
            applied = ok or (fuse_inline and s.kind in ("rmsnorm", "layernorm") and s.self_contained
                             and (not s.upcast or s.target in float32)
                             and s.dims is not None and len(s.dims) == 1 and s.dims[0] == -1)
            if ok:
                reason, code = f"one {op} after canonicalize", ExportWhy.CANONICALIZED
            elif applied:  # an inline RMS / LayerNorm, no cast inside, nothing reads its parts  =>  matched in ONNX
                reason = (f"one {op}, its decomposed form matched in the exported ONNX graph; not replaced in "
                          f"torch: {why}")
                code = ExportWhy.MATCHED_IN_ONNX
            else:
                reason, code = f"stays {len(s.nodes)} primitive ops: {why}", ExportWhy.PRIMITIVE
        else:
            reason = f"one {op}"
        if target == "ort" and s.kind in ("layernorm", "rmsnorm") and s.producer == "add" and applied:
            skip_op = "Skip" + ("Simplified" if s.kind == "rmsnorm" else "") + "LayerNormalization"
            if skip_fusion:  # residual add -> norm  =>  one Skip(Simplified)LayerNormalization when shapes allow
                reason += f"; its residual add fuses into {skip_op} when both operands have the same shape"
                code = ExportWhy.SKIP_FUSED
            else:  # measured slower on CPU: left as Add + norm unless asked
                reason += (f"; residual add left unfused ({skip_op} is slower on onnxruntime CPU; --device cuda "
                           f"or --skip-fusion fuses it)")
                code = ExportWhy.ADD_UNFUSED
        out.append(Site(NAME, s.target, applied, reason, code))
    return out


# ---------------------------------------------------------------------------------------------------------
# export


def _quiet():
    """torch.onnx prints progress to stdout and warnings to stderr / logging: keep our output ours."""
    return quiet(("torch", "torch.onnx", "onnxscript", "onnx_ir"), stdout=True, stderr=True)


def _one_line(exc: BaseException) -> str:
    """The exception's first line, and its innermost cause's: the exporter's own message ("Failed to convert the
    exported program ... step 3/3") names no op, the cause it chains does."""
    import re

    def first(e: BaseException, width: int) -> str:
        text = re.sub(r"\x1b\[[0-9;]*m", "", str(e))  # the exporter colours its messages
        lines = [l.strip() for l in text.strip().splitlines() if l.strip()]
        line = re.sub(r"\s*Next steps:$", "", lines[0]) if lines else ""  # the exporter's list follows it
        return f"{type(e).__name__}: {line[:width]}" if line else type(e).__name__

    root, seen = exc, {id(exc)}
    while root.__cause__ is not None and id(root.__cause__) not in seen:
        root = root.__cause__
        seen.add(id(root))
    return first(exc, 240) + (f" (cause: {first(root, 240)})" if root is not exc else "")


def torch_export(model: nn.Module, inputs, opset: int, normconv_ops: bool, dynamic: bool, exported: Any = None,
                 pinned: frozenset = frozenset(), notes: list[str] | None = None, refused: dict | None = None):
    """torch.onnx.export (dynamo) without a file; NormconvError with one line if the model does not export.

    ``dynamic``: every input dimension the model lets vary stays symbolic (``io.dims``: Dim.AUTO on each, an example
    batch of 1 exported at 2), except the ``pinned`` (input, axis) places. ``exported``: a static torch.export
    ExportedProgram of ``model`` on ``inputs`` already made (normconv's capture): a static export starts from it
    instead of running torch.export once more; if it fails on it, the module is exported as usual. A dynamic
    export torch.export refuses (a **kwargs forward given a non-tensor keyword: "Must provide a tree_name"; a guard
    on the height it cannot solve: timm's DLA) is tried again with the batch alone dynamic, then made static, said in
    ``notes``; ``refused`` receives each (input, axis) place it made static so, with its code and why (place ->
    (DimWhy.REFUSED or DimWhy.OVERTIME, why))."""
    from normconv.io import dims as io_dims

    if exported is not None and not dynamic:
        try:
            return torch_export(exported, inputs, opset, normconv_ops, dynamic)
        except NormconvError:
            pass
    from normconv.onnx.ops import missing_translations, model_translations, translation_table

    # the graph optimizer runs after the export, outside its time limit (MViT's: 137 s of legitimate work)
    kwargs: dict[str, Any] = dict(dynamo=True, opset_version=opset, external_data=False, verbose=False, optimize=False)
    kwargs["custom_translation_table"] = {**(translation_table() if normconv_ops else missing_translations()),
                                          **model_translations(model)}
    tries, refused = [inputs], {} if refused is None else refused
    if dynamic:
        kwargs["dynamic_shapes"] = io_dims.export_shapes(model, inputs, pinned)
        wide = io_dims.widened(model, inputs, pinned)  # batch 1 is specialized by torch.export: trace at batch 2
        tries = [wide, inputs] if wide is not None and kwargs["dynamic_shapes"] is not None else tries
    limit, optimized = DYNAMIC_EXPORT_S if kwargs.get("dynamic_shapes") is not None else None, False
    for i, example in enumerate(tries):
        try:  # torch.export's reasoning about dynamic dimensions can run for ever (DaViT: sympy): time-limited
            # a Ctrl-C is never one of the export's failures (tried again, then the model's fault)
            with interrupt_kept(), _quiet(), torch.no_grad(), time_limit(limit):
                fresh = io_dims.unmarked(example)  # a failed dynamic export leaves its marks on the tensors given
                args = tuple(fresh.args)
                if args and isinstance(args[-1], dict) and not fresh.kwargs:
                    args += ({},)  # torch.onnx takes a last dict as keyword inputs; its documented escape: an empty one
                program = torch.onnx.export(model, args, kwargs=dict(fresh.kwargs) or None, **kwargs)
            ep = getattr(program, "exported_program", None)
            if i + 1 < len(tries) and ep is not None and not io_dims.kept_free(ep, model, inputs, pinned):
                continue  # the trace at batch 2 specialized the batch (a branch on it): the example's own batch
            break
        except Exception as exc:
            if i + 1 < len(tries) and not isinstance(exc, Overtime):
                continue  # the model takes no batch 2: export at the example as given
            # the places a dynamic export gave up (a static one has none: ``model`` may be the capture's program)
            rest = [p for p in io_dims.free_places(model, inputs, pinned) if p[1] != 0] \
                if kwargs.get("dynamic_shapes") is not None else []
            if kwargs.get("dynamic_shapes") is not None and notes is not None and rest and \
                    not isinstance(exc, Overtime):  # past the limit: not a second time
                notes.append(f"torch.export refuses dynamic dimensions for this model ({_one_line(exc)[:200]}): "
                             f"exported again with the batch alone dynamic")
                program = torch_export(model, inputs, opset, normconv_ops, True, exported, pinned | set(rest), notes,
                                       refused)  # the batch refused too: static, said
                refused.update({p: (io_dims.DimWhy.REFUSED, _one_line(exc)[:200]) for p in rest})
                optimized = True
                break
            if kwargs.get("dynamic_shapes") is not None and notes is not None:
                try:  # torch.export takes the model, not its dynamic shapes: the example's shapes, said
                    program, optimized = torch_export(model, inputs, opset, normconv_ops, False, exported), True
                except NormconvError as static:
                    if isinstance(exc, Overtime):  # no export at any shapes: that reason, not the time the first took
                        raise NormconvError(f"{static.message} (the dynamic export first {exc})") from None
                else:
                    code = io_dims.DimWhy.OVERTIME if isinstance(exc, Overtime) else io_dims.DimWhy.REFUSED
                    refused.update({p: (code, str(exc) if isinstance(exc, Overtime) else _one_line(exc)[:200])
                                    for p in io_dims.free_places(model, inputs, pinned)})
                    notes.append(f"torch.export's reasoning about dynamic dimensions {exc} (--static skips it): "
                                 f"exported with the example's shapes" if isinstance(exc, Overtime) else
                                 f"torch.export refuses dynamic dimensions for this model ({_one_line(exc)[:200]}): "
                                 f"exported with the example's shapes")
                    break
            raise NormconvError(f"cannot export {type(model).__name__} to ONNX at opset {opset}: "
                                f"{_one_line(exc)}") from None
    if program is None or program.model is None:
        raise NormconvError(f"cannot export {type(model).__name__} to ONNX: the exporter returned no model")
    if not optimized:
        with _quiet():
            program.optimize()
    return program


def op_counts(model) -> dict[str, int]:
    """Op types of the main graph ('domain.Op' outside the default domain), most frequent first."""
    c = collections.Counter((f"{n.domain}.{n.op_type}" if n.domain not in ("", "ai.onnx") else n.op_type)
                            for n in model.graph)
    return dict(c.most_common())


def fused_norms(model) -> dict[str, int]:
    from normconv.onnx.ops import FUSED_NORM_OPS

    out: dict[str, int] = {}
    for n in model.graph:
        kind = FUSED_NORM_OPS.get(("" if n.domain == "ai.onnx" else n.domain, n.op_type))
        if kind is not None:
            out[kind] = out.get(kind, 0) + 1
    return out


def _dynamic_axes(model) -> dict[str, dict[int, str]]:
    """input -> {axis: name} of its dynamic axes (torch.onnx's ``dynamic_axes`` form); a static axis is not one."""
    return {v.name: {a: str(d) for a, d in enumerate(v.shape) if not isinstance(d, int)} for v in model.graph.inputs
            if v.shape is not None and any(not isinstance(d, int) for d in v.shape)}


def _nbytes(model) -> int:
    return sum(int(v.const_value.nbytes) for v in model.graph.initializers.values() if v.const_value is not None)


def _check(path: Path, model) -> str:
    """onnx.checker with full_check (shape inference too) where the ops allow it: SimplifiedLayerNormalization
    (--target ort) sits in the default domain unregistered, which the checker rejects."""
    import onnx

    if any(n.op_type == "SimplifiedLayerNormalization" and n.domain in ("", "ai.onnx") for n in model.graph):
        return ("skipped: --target ort writes SimplifiedLayerNormalization, an onnxruntime op in the default domain "
                "that onnx.checker rejects (the default --target onnx passes it)")
    try:
        onnx.checker.check_model(str(path), full_check=True)
    except Exception as exc:
        return f"failed: {_one_line(exc)}"
    return "passed (full_check)"


def runtimes(model, opset: int) -> list[str]:
    """Which runtimes can load the written file, read off its ops: onnxruntime (its version, which validated it),
    TensorRT (RMSNormalization from 10.15; onnxruntime-only ops never), OpenVINO (standard ops and model-local
    functions)."""
    import onnxruntime

    domains = {n.domain for n in model.graph if n.domain not in ("", "ai.onnx")}
    ort_only = {n.op_type for n in model.graph if n.op_type in ORT_ONLY_OPS}
    out = [f"onnxruntime {onnxruntime.__version__} (validated here)"]
    if ort_only:
        out.append(f"not TensorRT / OpenVINO / other runtimes: {', '.join(sorted(ort_only))} are onnxruntime's own "
                   f"ops (--target onnx writes standard ones)")
        return out
    rms = any(n.op_type == "RMSNormalization" for n in model.graph)
    out.append("TensorRT " + ("10.15 or later (RMSNormalization, opset 23)" if rms else
                              f"(standard opset {opset} ops" + (", model-local functions inlined by its parser)"
                                                               if domains else ")")))
    out.append("OpenVINO (standard ops" + (", model-local functions" if domains else "") +
               "; the test suite loads the default file in OpenVINO's CPU runtime)")
    return out


# onnxruntime's own ops normconv may write (--target ort): no other runtime has them
ORT_ONLY_OPS = ("SimplifiedLayerNormalization", "SkipLayerNormalization", "SkipSimplifiedLayerNormalization")


def check_args(path: str | os.PathLike, target: str, opset: int, device: str = "cpu", overwrite: bool = False) -> Path:
    if device not in DEVICES:
        raise NormconvError(f"unknown --device {device!r}; choose {' or '.join(DEVICES)}")
    if target not in TARGETS:
        raise NormconvError(f"unknown --target {target!r}; choose onnx or ort")
    if opset not in OPSETS:
        raise NormconvError(f"unsupported --opset {opset}: normconv exports opsets 17 to 23")
    out = Path(path)
    if out.suffix != ".onnx":
        raise NormconvError(f"output {path} must end with .onnx")
    return check_writable(out, overwrite)


def write_onnx(prepared: nn.Module, original: nn.Module, inputs, reference: Any, out: Path, report: Report,
               norms: Sequence[NormSite], *, target: str = DEFAULT_TARGET, opset: int = DEFAULT_OPSET, dynamic: bool = True,
               validate: Sequence[str] = ("cpu",), atol: float | None = None, rtol: float | None = None,
               baseline: bool = True, repeats: int = 10, skip_fusion: bool = False, exported: Any = None,
               dim_names: dict[str, str] | None = None, fuse_inline: bool = True, truth: nn.Module | None = None,
               pinned: frozenset = frozenset()) -> Report:
    """Export ``prepared`` (the passes already applied and verified, in eval mode) to ``out`` with one fused op
    per norm, validate it in onnxruntime against ``reference`` (the original's outputs), and rename it into
    place. ``original`` is exported plainly for the baseline op counts and latency (None: no baseline).
    ``exported``: normconv's capture of ``prepared`` (an ExportedProgram), reused by a static export.

    ``dynamic`` (the default): every input dimension the model lets vary stays dynamic (``io.dims``), each checked in
    onnxruntime at a second size against ``truth`` (the original model; default ``prepared``); a dimension that fails
    its check is pinned and the file exported again without it (``pinned``: the (input, axis) places already static).

    Raises NormconvError (unexportable model) or VerificationError (outputs beyond tolerance, checker failure);
    in both cases nothing is left under ``out``.

    ``fuse_inline``: RMSNorms and LayerNorms written inside bigger modules are matched in the ONNX graph by the
    same rules an ONNX file goes through (rules/layernorm.py, rules/rmsnorm.py).

    ``skip_fusion`` (with target "ort") fuses residual add + norm into com.microsoft Skip*LayerNormalization.
    It is off by default because onnxruntime 1.31's CPU kernels for those ops measured 4.5-8x (LayerNorm) and
    1.3-2.6x (RMSNorm) slower than Add + the plain norm op (BENCHMARKS.md); the GPU kernels are the use case.
    """
    import onnx_ir as ir

    from normconv.onnx.passes.dangling import RegisterDangling
    from normconv.onnx.passes.lower import LowerNorms
    from normconv.onnx.passes.repair import RepairDownconverted
    from normconv.onnx.passes.rewrite import RulesPass
    from normconv.onnx.rules import inline_rules, skipnorm
    from normconv.onnx.rules.base import SiteLog
    from normconv.onnx.validate import RuntimeRefusal, no_kernel, refuse_random, validate as ort_validate

    from normconv.io import dims as io_dims
    from normconv.onnx.dim_check import check_dims

    extra = report.extra
    entry = (list(report.sites), list(report.notes), list(report.validation), dict(extra))  # for a re-export
    extra.update({"target": target, "opset": opset, "static": not dynamic})
    sites_by_kind = dict(collections.Counter(s.kind for s in norms))
    extra["norm_sites"] = sites_by_kind

    fell_back: list[str] = []
    refused: dict = {}  # (input, axis) -> (code, why): the places torch.export refused dynamic (or ran out of time on)
    phase("export", detail=f"ONNX opset {opset}")
    program = torch_export(prepared, inputs, opset, normconv_ops=True, dynamic=dynamic, exported=exported,
                           pinned=pinned, notes=fell_back, refused=refused)
    report.notes.extend(fell_back)
    onnx_model = program.model
    dims, held = [], {}
    if dynamic and getattr(program, "exported_program", None) is not None:
        held = io_dims.held(program.exported_program)  # written as the number it is held to
        dims = io_dims.found(program.exported_program, io_dims.input_names(prepared, inputs))
        dims = io_dims.name_dims(dims, io_dims.input_shapes(prepared, inputs), dim_names)
    # the ONNX half, one pass set with ONNX files in: repair the down-conversion, match the norms written inside
    # bigger modules (not replaced in torch) in the ONNX graph, lower normconv's placeholders for the target
    log, lower, dangling = SiteLog(), LowerNorms(target), RegisterDangling()
    inline = [RulesPass(inline_rules(log), log, "inline")] if fuse_inline else []
    ir.passes.PassManager([dangling, RepairDownconverted(), *inline, lower])(onnx_model)
    if dangling.made:
        report.notes.append(f"torch.onnx.export's optimizer left {len(dangling.made)} constant(s) its rewrites made "
                            f"unregistered (onnxscript's rewriter reuses a taken initializer name), so nodes read "
                            f"tensors nothing defines; registered as {', '.join(dangling.made[:4])}"
                            f"{', ...' if len(dangling.made) > 4 else ''}")
    extra["inline_fused"] = sum(1 for _, s in log.sites() if s.applied)
    extra["lowered"] = lower.made
    if target == "ort" and skip_fusion:  # residual add -> norm  =>  one Skip*LayerNormalization (rules/skipnorm)
        skip_log, exposed = SiteLog(), []
        ir.passes.PassManager([RulesPass(skipnorm.rules(skip_log, exposed, NAME + ":skip-fusion"), skip_log,
                                         "skip-fusion")])(onnx_model)
        skipnorm.expose_sums(onnx_model, exposed)
        report.sites.extend(site for _, site in skip_log.sites())
    elif target == "ort" and any(s.code == ExportWhy.ADD_UNFUSED for s in report.sites):
        report.notes.append("residual add + norm left unfused: onnxruntime CPU Skip*LayerNormalization measured "
                            "slower than Add + norm (--device cuda, where it is faster, or --skip-fusion fuses them); onnxruntime's "
                            "own session fusion does the same to post-LN adds unless the session disables "
                            "'SkipLayerNormFusion'")
    after = op_counts(onnx_model)
    report.after = after
    fused = fused_norms(onnx_model)
    extra["fused_norm_ops"] = fused
    extra["skip_fused"] = sum(v for k, v in after.items() if k.startswith("com.microsoft.Skip"))
    extra["leftover_decomposed_ops"] = {k: after[k] for k in DECOMPOSED_NORM_OPS if k in after}
    non_bn_sites = sum(v for k, v in sites_by_kind.items() if k != "batchnorm")
    non_bn_fused = sum(v for k, v in fused.items() if k != "batchnorm")
    extra["fused_matches_sites"] = (non_bn_fused == non_bn_sites
                                    and fused.get("batchnorm", 0) <= sites_by_kind.get("batchnorm", 0))
    extra["folded_batchnorm"] = sites_by_kind.get("batchnorm", 0) - fused.get("batchnorm", 0)
    if norms and not extra["fused_matches_sites"]:
        report.notes.append(f"fused norm ops ({non_bn_fused} + {fused.get('batchnorm', 0)} BatchNormalization) "
                            f"differ from norm sites ({non_bn_sites} + {sites_by_kind.get('batchnorm', 0)} batchnorm)")
    from normconv.onnx.names import name_graph

    # logits / batch / sequence, not linear / s72
    extra["renamed"] = name_graph(onnx_model, reference, dim_names,
                                  {**held, **{sym: d.name for d in dims for sym in d.symbols}} or None)
    extra["dynamic_axes"] = _dynamic_axes(onnx_model)
    if dynamic and not extra["dynamic_axes"] and not pinned and not fell_back:
        report.notes.append("the model specializes every input dimension (torch.export found none free): the "
                            "graph is static")

    from normconv.io.write import TEMP_SUFFIX, remove_stale_temps, temp_name, write_error

    def _export_again(pins: frozenset) -> Report:  # the report as it came in, the file exported with more pinned
        nonlocal tmpdir
        report.sites[:], report.notes[:], report.validation[:] = entry[0], entry[1], entry[2]
        report.extra.clear()
        report.extra.update(entry[3])
        shutil.rmtree(tmpdir, ignore_errors=True)
        tmpdir = None
        again = write_onnx(prepared, original, inputs, reference, out, report, norms, target=target, opset=opset,
                           dynamic=dynamic, validate=validate, atol=atol, rtol=rtol, baseline=baseline,
                           repeats=repeats, skip_fusion=skip_fusion, exported=exported, dim_names=dim_names,
                           fuse_inline=fuse_inline, truth=truth, pinned=pinned | pins)
        again.extra["dynamic_dims"] = [d.to_json() for d in dims if d.pinned] + again.extra.get("dynamic_dims", [])
        again.notes.extend(d.note() for d in dims if d.pinned)  # the notes as they came in were restored
        return again

    remove_stale_temps(out)
    tmpdir = None
    try:
        tmpdir = Path(tempfile.mkdtemp(prefix=temp_name(out), suffix=TEMP_SUFFIX, dir=str(out.parent)))
        tmp = tmpdir / out.name
        external = _nbytes(onnx_model) > EXTERNAL_DATA_BYTES
        phase("write", detail=out.name)
        if external:  # onnx_ir writes the .data sidecar
            with _quiet():
                ir.save(onnx_model, str(tmp), external_data=out.name + ".data")
        else:  # what ir.save does, written 1 MiB a call (one write of the whole file: 4x slower, io.durable)
            with latched(str(tmp)) as f:
                f.write(ir.serde.serialize_model(onnx_model).SerializeToString())
        durable.start_writeback_under(tmpdir)  # the disk writes while onnxruntime validates
        extra["external_data"] = (out.name + ".data") if external else None
        extra["checker"] = _check(tmp, onnx_model)
        extra["runtimes"] = runtimes(onnx_model, opset)
        extra["bytes"] = sum(f.stat().st_size for f in tmpdir.iterdir())
        if extra["checker"].startswith("failed"):
            raise VerificationError(f"export: onnx.checker rejects the exported model ({extra['checker']}); "
                                    f"nothing written", report)

        if validate:  # a forward that draws random values: nothing to compare
            refuse_random(after, prepared, NAME)
        if baseline:
            _baseline(original, inputs, opset, dynamic, tmpdir, validate, repeats, report)
        phase("validate", detail="onnxruntime " + ", ".join(validate))
        try:
            result = ort_validate(str(tmp), prepared, inputs, reference, list(validate), atol, rtol, repeats)
        except RuntimeRefusal as exc:  # onnxruntime refusing the dynamic file: pinned below, else raised (a bug of
            if not dims or no_kernel(exc.__cause__):  # normconv's own validation is no refusal: it is raised as is)
                raise
            result, failed = None, f"onnxruntime fails on it ({_refusal(exc)[:160]})"
        if dims and (result is None or not result.passed):  # at the example's own shapes: every dimension pinned
            # (torch's exporter fuses differently on symbolic shapes: its RotaryEmbedding-23 ran at batch 1 only until
            # rules/repair.py broadcast its caches); the static file is exported and validated as usual, and says why
            bad = failed if result is None else "it differs from torch beyond tolerance"
            for d in dims:
                d.pinned = d.pinned or f"the dynamic file fails at the example's shapes: {bad}"
            return _export_again(frozenset(p for d in dims for p in d.places))
        for provider, why in result.unavailable.items():
            report.notes.append(f"{provider}: not validated: {why}")
        report.notes.extend(result.notes)
        report.validation.extend(r.validation for r in result.runs)
        extra["ort"] = [{"provider": r.provider, "optimizations": r.level, "passed": r.validation.passed,
                         "max_abs_error": r.validation.max_abs_error, "max_rel_error": r.validation.max_rel_error,
                         "min_atol": r.min_atol, "min_rtol": r.min_rtol, "latency_ms": r.latency_ms}
                        for r in result.runs]
        extra["latency_ms"] = {r.provider: r.latency_ms for r in result.runs if r.latency_ms is not None}
        if not result.passed:
            bad = next(r for r in result.runs if not r.validation.passed)
            raise VerificationError(
                f"export: {bad.validation.label} differs from torch beyond tolerance ({bad.validation.worst}; "
                f"{bad.validation.criterion}; smallest passing atol {bad.min_atol:.3g}){_traced_differs(exported, inputs, reference)}; "
                f"nothing written", report)
        if validate and not result.runs:
            report.notes.append("no onnxruntime validation ran")
        pins = check_dims(str(tmp), dims, prepared, truth or prepared, inputs, reference, atol, rtol, report,
                           validate, sess=result.cpu_session)
        result.cpu_session = None
        if pins:  # a dimension the file does not really take at another size: pinned, exported again
            return _export_again(pins)
        ep = getattr(program, "exported_program", None) if dynamic else None  # each static dim with its code
        held_dims = io_dims.fixed(ep, prepared, inputs, dims, truth or prepared, pinned, dim_names, refused) \
            if ep else []
        report.notes.extend(io_dims.fixed_notes(held_dims))
        extra["dynamic_dims"] = [d.to_json() for d in dims + held_dims]
        from normconv.io.write import publish

        written = [f for f in tmpdir.iterdir() if f.is_file() and f.name != "baseline.onnx"]
        publish([(f, out.parent / f.name) for f in written])  # over a folder of that name only with --overwrite
        report.output = str(out)
    except (VerificationError, NormconvError):
        raise
    except RuntimeRefusal as exc:  # onnxruntime's refusal or the file's misfit: the user's case, one line (exit 2);
        hint = ""  # any other exception here is normconv's own bug and goes up as an internal error (exit 3)
        if no_kernel(exc.__cause__):  # e.g. bfloat16 MatMul on the CPU provider
            hint = (" (onnxruntime has no kernel for that op at this dtype on this provider; validate on another "
                    "provider, or pass --validate none to write it unvalidated)")
        raise NormconvError(f"export of {report.model} failed while validating: {_refusal(exc)}{hint}") from None
    except OSError as exc:
        raise write_error(out, exc) from None
    finally:  # every exit path, interrupts included
        if tmpdir is not None:
            shutil.rmtree(tmpdir, ignore_errors=True)
    return report


def _refusal(exc: BaseException) -> str:
    """A RuntimeRefusal in one line: onnxruntime's own exception where it wraps one, else its own message."""
    return _one_line(exc.__cause__) if exc.__cause__ is not None else str(exc).splitlines()[0]


def _traced_differs(exported: Any, inputs, reference: Any) -> str:
    """Why onnxruntime may differ when the cause is not ONNX: the torch.export program the exporter converts already
    computes something else than the eager forward (Python that branches on tensor values, e.g. transformers drops
    an all-ones attention mask in eager but keeps the causal mask it builds from it when traced). '' otherwise."""
    from normconv.verify import compare

    if exported is None:
        return ""
    try:
        with torch.no_grad():
            traced = exported.module()(*inputs.args, **inputs.kwargs)
        check = compare(reference, traced, label="torch.export program")
    except Exception:  # noqa: BLE001 - a diagnosis only
        return ""
    if check.passed:
        return ""
    return (f"; torch.export's program of the model already differs from its eager forward (max abs error "
            f"{check.max_abs_error:.3g}): the forward computes something else when traced (Python branching on "
            f"tensor values), so any ONNX export of it differs")


def _baseline(model, inputs, opset, dynamic, tmpdir: Path, validate, repeats, report: Report) -> None:
    """Plain torch.onnx.export of the original model: op counts, and its latency at ORT's default level."""
    import onnx_ir as ir

    from normconv.onnx.validate import PROVIDERS, REPORT_BUDGET_S, available, feeds, latency_ms, refusing, session

    try:
        plain = torch_export(model, inputs, opset, normconv_ops=False, dynamic=dynamic)
    except NormconvError as exc:
        report.notes.append(f"plain torch.onnx.export failed, no baseline: {exc}")
        return
    from normconv.onnx.passes.repair import RepairDownconverted

    RepairDownconverted()(plain.model)  # the same down-conversion fix, or plain opset-17 exports do not load
    report.before = op_counts(plain.model)
    report.extra["baseline_fused_norm_ops"] = fused_norms(plain.model)
    path = tmpdir / "baseline.onnx"
    with _quiet():
        ir.save(plain.model, str(path))
    lat = {}
    for name in validate:
        if available(name) is None and repeats > 0:
            with refusing():
                sess = session(str(path), PROVIDERS[name], "default")
            feed = feeds(sess, model, inputs)
            with refusing():
                lat[name] = latency_ms(sess, feed, repeats, budget_s=REPORT_BUDGET_S)
    report.extra["baseline_latency_ms"] = lat


__all__ = ["write_onnx", "check_args", "plan", "op_counts", "fused_norms", "DEFAULT_OPSET", "OPSETS", "TARGETS", "DEFAULT_TARGET"]
