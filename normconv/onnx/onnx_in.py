"""ONNX in, ONNX out: fold and fuse the norms of a model users only have as an .onnx file, validated against it.

  load IN (external data kept apart) -> shapes inferred -> [opset converted if a fused op needs it; the converted
  model validated against IN] -> fold (rules/batchnorm) -> fuse (rules/layernorm, rmsnorm, groupnorm) -> lower
  the placeholders for the target (passes/lower) -> norm-like code listed -> write into a temp folder next to OUT
  -> onnx.checker (full_check, --target onnx) -> onnxruntime: OUT against IN at two sizes of every dynamic
  dimension, optimizations disabled and default (parity.py) -> rename into place.

Promises: IN (and its external data) is never written; nothing is written unless validated; every site is listed
with what was done there or why not; the input's names, dynamic dimensions, metadata, producer and external data
layout are kept. ``inspect`` runs the same plan without writing.
"""

from __future__ import annotations

import collections
import math
import shutil
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

import onnx
import onnx_ir as ir

from normconv.errors import Code, NormconvError, VerificationError
from normconv.onnx import parity
from normconv.onnx.defaults import OPSETS
from normconv.onnx.ops import DOMAIN, FUNCTION_OPSET
from normconv.onnx.passes.convert import ConvertOpset
from normconv.onnx.passes.function_types import TypeFunctionBodies
from normconv.onnx.passes.dangling import RegisterDangling
from normconv.onnx.passes.half import KEEP as HALF_KEEP, HalfPrecision
from normconv.onnx.passes.inline import call_counts, inline_functions, with_callers
from normconv.onnx.passes.ir3 import InitializerInputs, list_initializers, unlisted
from normconv.onnx.passes.lower import LowerNorms
from normconv.onnx.passes.rewrite import RulesPass
from normconv.onnx.sites import inspect_sites, norm_sites
from normconv.onnx.rules import batchnorm, fold_rules, fuse_rules
from normconv.onnx.rules.base import SiteLog
from normconv.onnx.rules.layernorm import OPSET as LN_OPSET, LayerNormWhy
from normconv.onnx.rules.nearmiss import list_near_misses
from normconv.quiet import phase
from normconv.report import Report

EXTERNAL_DATA_BYTES = 2 * 1024 ** 3
TARGETS = ("onnx", "ort")  # onnx first: a standard file by default, as torch models export (onnx.export.DEFAULT_TARGET)
JOBS = {"fold": ("fold",), "export": ("fold", "fuse"), "inspect": ("fold", "fuse")}


@dataclass
class Source:
    path: Path
    proto: onnx.ModelProto
    external: list[str] = field(default_factory=list)  # external data files IN reads (relative to its folder)

    @property
    def opset(self) -> int:
        return next((o.version for o in self.proto.opset_import if o.domain in ("", "ai.onnx")), 1)


def load(spec: str) -> Source:
    """Read an .onnx file (and its external data) or say in one line why not."""
    path = Path(spec)
    if not path.is_file():
        raise NormconvError(f"{spec}: no such file")
    try:
        proto = onnx.load(str(path), load_external_data=False)
    except Exception as exc:  # noqa: BLE001 - protobuf's message is the reason
        raise NormconvError(f"{spec} is not an ONNX file normconv can read ({type(exc).__name__}: "
                            f"{str(exc).splitlines()[0][:160] if str(exc) else 'unparsable protobuf'})") from None
    if not proto.graph.node and not proto.graph.output:
        raise NormconvError(f"{spec} is not an ONNX model (no graph)")
    from onnx.external_data_helper import _get_all_tensors, uses_external_data

    external = sorted({next(e.value for e in t.external_data if e.key == "location")
                       for t in _get_all_tensors(proto) if uses_external_data(t)})
    if external:
        try:
            onnx.external_data_helper.load_external_data_for_model(proto, str(path.parent))
        except Exception as exc:  # noqa: BLE001
            raise NormconvError(f"{spec}: its external data cannot be read ({exc})") from None
    return Source(path, proto, external)


def as_constants(src: Source) -> tuple[Source, list[str]]:
    """``--constant-initializers``: the graph inputs of an IR >= 4 file that name an initializer dropped (``ir3.unlisted``;
    the file is not touched), so the rules read them as the constants the file holds. Returns the new source and the
    names dropped. The file given stays the reference: onnxruntime runs it with those inputs at their defaults."""
    proto, dropped = unlisted(src.proto)
    return (Source(src.path, proto, src.external) if dropped else src), dropped


def to_ir(proto: onnx.ModelProto) -> ir.Model:
    """The model in onnx-ir with inferred shapes (a rule reads ranks and static sizes): onnxruntime's symbolic
    shape inference (it follows Shape -> Concat -> Reshape chains that onnx's own inference loses, as in
    paddle2onnx files), else onnx's."""
    from onnxruntime.tools.symbolic_shape_infer import SymbolicShapeInference

    try:
        with _quiet():
            inferred = SymbolicShapeInference.infer_shapes(proto, auto_merge=True, guess_output_rank=True)
        if inferred is not None:
            return _typed_functions(ir.serde.deserialize_model(inferred))
    except Exception:  # noqa: BLE001 - an op it does not know: onnx's inference below
        pass
    try:
        proto = onnx.shape_inference.infer_shapes(proto, data_prop=True)
    except Exception:  # noqa: BLE001 - past 2 GB or an op onnx does not know: rules see the declared shapes
        pass
    try:
        model = ir.serde.deserialize_model(proto)
    except ir.serde.SerdeError as exc:  # a graph ONNX's rules forbid (a name defined twice): the file's own fault
        cause = exc.__cause__ or exc
        raise NormconvError(f"the file is not a valid ONNX model ({str(cause).splitlines()[0][:200]})") from None
    return _typed_functions(model)


def _typed_functions(model: ir.Model) -> ir.Model:
    import onnxscript.optimizer

    InitializerInputs()(model)  # IR < 4: the initializers listed as inputs are constants (passes/ir3.py)

    for fn in model.functions.values():  # Constant nodes' values, for per-node inference and the rules
        onnxscript.optimizer.basic_constant_propagation(fn)
    TypeFunctionBodies()(model)
    return model


def _quiet():
    from normconv.quiet import quiet

    return quiet(("onnxruntime",), stdout=True, stderr=True)


def _as_written(proto: onnx.ModelProto, src: Source) -> onnx.ModelProto:
    """The rewritten model with the input's interface: inferred value_info dropped, the graph inputs' and outputs'
    types (names, dynamic dimensions) as the input declared them."""
    del proto.graph.value_info[:]
    list_initializers(proto)  # IR < 4: every initializer listed as a graph input again
    declared = {v.name: v for v in list(src.proto.graph.input) + list(src.proto.graph.output)}
    initializers = {t.name for t in proto.graph.initializer}  # typed by their tensors (a half export casts them)
    for v in list(proto.graph.input) + list(proto.graph.output):
        if v.name in declared and v.name not in initializers:
            v.type.CopyFrom(declared[v.name].type)
    proto.producer_name, proto.producer_version = src.proto.producer_name, src.proto.producer_version
    return proto


def op_counts(model: ir.Model) -> dict[str, int]:
    c = collections.Counter((f"{n.domain}.{n.op_type}" if n.domain not in ("", "ai.onnx") else n.op_type)
                            for n in batchnorm.all_nodes(model))
    return dict(c.most_common())


def _rewrite(model: ir.Model, jobs: tuple[str, ...], target: str) -> tuple[ir.Model, SiteLog, dict]:
    """Run the job's passes on ``model`` in place; returns the model, the site log and what was lowered."""
    log = SiteLog()
    steps = []
    if "fold" in jobs:
        steps.append(RulesPass(fold_rules(log), log, "fold"))
    lower = LowerNorms(target)
    if "fuse" in jobs:
        steps += [RulesPass(fuse_rules(log), log, "fuse"), lower]
    ir.passes.PassManager([*steps, RegisterDangling()])(model)  # a new initializer whose name the file held
    batchnorm.standalone(model, log)
    if "fuse" in jobs:
        list_near_misses(list(batchnorm.all_nodes(model)), log)
    return model, log, lower.made


def _inline_hidden(src: Source, jobs: tuple[str, ...], target: str) -> tuple[Source, list[str]]:
    """``src`` with the local functions inlined whose boundary hid a norm from the rules (passes/inline.py), and
    their names; ``src`` itself where no site inside a function was refused, or the inlined plan does no more: the
    plans compared by the sites they apply, a site in a function counted once per run of its body (a fused
    LayerNorm that needs opset 17 counted as applied)."""
    if not src.proto.functions:
        return src, []
    model, log, _ = _rewrite(to_ir(src.proto), jobs, target)
    fn_of = {id(f.graph): (f.domain, f.name) for f in model.functions.values()}
    within = {t: fn_of[id(g)] for t, g in log.graph_of.items() if id(g) in fn_of}
    held = {within[s.target] for _, s in log.sites() if not s.applied and s.target in within}
    if not held:
        return src, []
    ids = with_callers(src.proto, held)
    try:
        proto = inline_functions(src.proto, only=ids)
    except NormconvError:  # the inliner refuses: the functions stay, their sites' refusals say why
        return src, []
    _, inlined, _ = _rewrite(to_ir(proto), jobs, target)
    runs = call_counts(src.proto)
    if _gain(inlined) <= _gain(log, lambda t: runs.get(within[t], 1) if t in within else 1):
        return src, []
    return Source(src.path, proto, src.external), sorted(f"{d}.{n}" if d else n for d, n in ids)


def _gain(log: SiteLog, weight=lambda target: 1) -> int:
    """The sites a plan applies, and the LayerNorms it fuses once the file is at opset 17 (``weight``: how many
    times a site's graph runs)."""
    return sum(weight(s.target) for _, s in log.sites() if s.applied or s.code == LayerNormWhy.OPSET_BELOW)


def _needs_opset(src: Source, jobs: tuple[str, ...], target: str) -> tuple[int, str]:
    """The opset the fused ops need, and which op needs it: 17 where a LayerNorm was refused only for the file's
    opset; ``FUNCTION_OPSET`` where a placeholder stays a function op (normconv.RMSNorm below 23, normconv.GroupNorm
    below 21), whose body reads Constant(value_float) and CastLike."""
    if "fuse" not in jobs or src.opset >= max(LN_OPSET, FUNCTION_OPSET):
        return src.opset, ""
    _, log, lowered = _rewrite(to_ir(src.proto), ("fuse",), target)
    needs = [(src.opset, "")]
    if any(s.code == LayerNormWhy.OPSET_BELOW for rows in log.rows.values() for _, s in rows):
        needs.append((LN_OPSET, "LayerNormalization"))
    kept = sorted(k for k in lowered if k.startswith(f"{DOMAIN}."))
    if kept and src.opset < FUNCTION_OPSET:  # the function body's ops, written at the file's opset, are invalid
        needs.append((FUNCTION_OPSET, f"the function body of {', '.join(kept)}"))
    want = max(n for n, _ in needs)
    return want, " and ".join(why for n, why in needs if why)


def _needed_for(log: SiteLog, lowered: dict, opset: int) -> str:
    """What in a plan made at a converted opset needs more than the file's ``opset``: a fused LayerNormalization, a
    placeholder kept as a function op; "" where nothing does."""
    needs = []
    if opset < LN_OPSET and any(k == "layernorm" and s.applied for k, s in log.sites()):
        needs.append("LayerNormalization")
    kept = sorted(k for k in lowered if k.startswith(f"{DOMAIN}."))
    if kept and opset < FUNCTION_OPSET:
        needs.append(f"the function body of {', '.join(kept)}")
    return " and ".join(needs)


def plan(src: Source, command: str, target: str = "onnx", opset: int | None = None) -> tuple[ir.Model, Report, int]:
    """The rewritten model (in memory), its report without validation, and the opset it converted from (or 0)."""
    if target not in TARGETS:
        raise NormconvError(f"unknown --target {target!r}; choose onnx or ort")
    jobs = JOBS[command]
    if opset is not None and opset < src.opset:
        raise NormconvError(f"--opset {opset} is below the file's opset {src.opset}: normconv converts up, not down")
    if opset is not None and opset != src.opset and opset not in OPSETS:  # the file's own opset: nothing converted
        raise NormconvError(f"unsupported --opset {opset}: normconv exports opsets {OPSETS[0]} to {OPSETS[-1]}")
    given = src
    src, inlined_hidden = _inline_hidden(src, jobs, target)
    needed, needs = _needs_opset(src, jobs, target)
    want = max(opset or 0, needed)
    model = to_ir(src.proto)
    report = Report(command, str(src.path))
    report.before = op_counts(model if src is given else ir.serde.deserialize_model(given.proto))  # the file's
    converted = 0
    inlined: list[str] = []
    if want > src.opset:
        convert = ConvertOpset(want)
        model = to_ir(ir.serde.serialize_model(convert(model).model))
        converted, inlined = src.opset, convert.inlined
    found = norm_sites(model) if command == "inspect" else []  # before the rewrite changes them
    model, log, lowered = _rewrite(model, jobs, target)
    if command == "inspect":
        report.extra["norm_sites"] = inspect_sites(found, log)
        report.extra["counts"] = dict(collections.Counter(r["kind"] for r in report.extra["norm_sites"]))
    if converted:  # what the converted file's plan needs (the file's own opset refused other spellings)
        needs = _needed_for(log, lowered, src.opset) or (f"--opset {opset}" if opset and opset > src.opset else "")
        report.notes.append(
            f"{'export would convert' if command == 'inspect' else 'converted'} the file from opset {src.opset} to "
            f"{want} (onnx.version_converter){' for ' + needs if needs else ''}"
            + (f", its local function(s) {', '.join(inlined)} inlined first (the converter converts the graph, not "
               f"function bodies)" if inlined else "") + "; the converted file is validated against the input before "
            "fusing")
    if inlined_hidden:
        report.notes.append(f"{'would inline' if command == 'inspect' else 'inlined'} the local function(s) "
                            f"{', '.join(inlined_hidden)}: their norms, typed by no one call or fed their parameters "
                            f"by the call, are fused or folded only in the caller's graph")
        report.extra["inlined_functions"] = inlined_hidden
    for kind, site in log.sites():
        report.sites.append(site)
    report.after = op_counts(model)
    applied = collections.Counter(k for k, s in log.sites() if s.applied)
    had, left = report.before.get("BatchNormalization", 0), report.after.get("BatchNormalization", 0)
    if not (inlined_hidden or converted) and left != had - applied.get("batchnorm", 0):
        # a fold said done that the graph does not show (a rewrite its rewriter dropped): never a false claim
        raise RuntimeError(f"{applied.get('batchnorm', 0)} BatchNorm(s) logged folded, {left} left of {had}")
    report.extra.update({"target": target, "opset_in": src.opset, "opset": model.opset_imports.get("", src.opset),
                         "converted_from": converted or None, "folded_batchnorm": applied.get("batchnorm", 0),
                         "fused": {k: v for k, v in applied.items() if k != "batchnorm"}, "lowered": lowered,
                         "norm_like": sum(1 for k, _ in log.sites() if k == "norm-like"),
                         "kinds": dict(collections.Counter(k for k, _ in log.sites()))})
    return model, report, converted


def _save(proto: onnx.ModelProto, path: Path, external: bool) -> None:
    """``proto`` at ``path``; ``external``: its tensors of 1 KiB and more in ``path.name + ".data"`` beside it. The
    tensors are marked here, as onnx.save_model(save_as_external_data=True) marks them, because that call refuses
    a location that exists relative to the current folder, not the model's (a rerun's OUT.onnx.data there)."""
    if external:
        import sys

        from onnx.external_data_helper import _get_initializer_tensors, set_external_data

        for tensor in _get_initializer_tensors(proto):
            if tensor.HasField("raw_data") and sys.getsizeof(tensor.raw_data) >= 1024:
                set_external_data(tensor, path.name + ".data")
    onnx.save_model(proto, str(path))  # writes the tensors marked external into path's folder


def _check(path: Path, target: str, src: Source) -> tuple[bool, str]:
    """onnx.checker (full_check) on OUT with --target onnx: (no new failure, what it said); a failure the input file
    has too is not OUT's."""
    if target != "onnx":
        return True, "skipped: --target ort writes onnxruntime's ops (SimplifiedLayerNormalization, which the " \
                     "checker rejects)"
    try:
        onnx.checker.check_model(str(path), full_check=True)
    except Exception as exc:  # noqa: BLE001
        why = f"{type(exc).__name__}: {str(exc).splitlines()[0][:200]}"
        try:
            onnx.checker.check_model(str(src.path), full_check=True)
        except Exception:  # noqa: BLE001
            return True, f"skipped: the input file itself fails onnx.checker ({why})"
        return False, f"failed: {why}"
    return True, "passed (full_check)"


def _guard_output(src: Source, out: Path, overwrite: bool = False) -> Path:
    """``out`` refused before any work where it, or the external data written beside it, is anything the input
    read (the file, its external data; by real path and by inode: a symlink or a hard link to the input is the
    input), or is no regular file; else the path to write."""
    from normconv.io.ledger import Ledger
    from normconv.io.write import check_writable

    if out.suffix.lower() != ".onnx":
        raise NormconvError(f"output {out} must end with .onnx")
    ledger = Ledger()
    for f in [src.path, *(src.path.parent / e for e in src.external)]:
        ledger.record(f)
    ledger.check_write(out, overwrite=overwrite)
    sidecar = out.parent / (out.name + ".data")  # where a file past 2 GB, or one read with external data, puts it
    try:
        ledger.check_write(sidecar, overwrite=overwrite)
    except NormconvError as exc:
        raise NormconvError(f"refusing to write {out}: its external data would go to {sidecar.name} ({exc.message})",
                            exc.code) from None
    if _writes_sidecar(src) and sidecar.exists() and not overwrite and not _owned_by(out, sidecar):
        raise NormconvError(f"refusing to write {out}: its external data would replace the existing {sidecar}, which "
                            f"is not the external data of {out}; pass --overwrite to replace it, or choose another -o")
    return check_writable(out, overwrite)


def _writes_sidecar(src: Source) -> bool:
    """Whether the output keeps its tensors in OUT.onnx.data: the input did, or they pass protobuf's 2 GB."""
    return bool(src.external) or sum(len(t.raw_data) for t in src.proto.graph.initializer) > EXTERNAL_DATA_BYTES


def _owned_by(out: Path, sidecar: Path) -> bool:
    """``sidecar`` is the external data of the existing ``out`` (a file the run replaces with ``out``, as a
    rerun of the same command does)."""
    from onnx.external_data_helper import _get_all_tensors, uses_external_data

    if not out.is_file() or out.is_symlink():
        return False
    try:
        old = onnx.load(str(out), load_external_data=False)
    except Exception:  # noqa: BLE001 - not an ONNX file: the data beside it is not its own
        return False
    return any(e.key == "location" and e.value == sidecar.name for t in _get_all_tensors(old)
               if uses_external_data(t) for e in t.external_data)


def _public(text: str, tmpdir: Path | None, out: Path | None) -> str:
    """A library's message about a file in normconv's temp folder, naming what the user knows instead: the output
    (OUT), the opset-converted input."""
    if tmpdir is None:
        return text
    for name, said in (("converted.onnx", "the file converted to the new opset"),
                       (out.name if out is not None else "out.onnx", str(out) if out is not None else "the output")):
        text = text.replace(str(tmpdir / name), said)
    return text.replace(str(tmpdir), "a temp folder")


def run(spec: str, command: str, output: str | None, target: str = "onnx", opset: int | None = None,
        input_shape: list[str] | None = None, atol: float | None = None, rtol: float | None = None,
        dtype: str | None = None, keep_fp32: str = "auto", overwrite: bool = False,
        constant_initializers: bool = False) -> Report:
    """``normconv fold|export IN.onnx -o OUT.onnx`` (and ``inspect IN.onnx`` with output None); ``dtype``
    "float16": the output in half precision (passes/half.py), validated against the float32 input; ``overwrite``:
    an existing OUT (a folder too) is replaced, never the input; ``constant_initializers``: initializers the file
    also lists as inputs are read as constants (``as_constants``) and are no inputs of the output."""
    if dtype not in (None, "float32", "float16"):
        raise NormconvError(f"--dtype {dtype} with an .onnx input: normconv writes float16 (or float32) ONNX files")
    if keep_fp32 not in HALF_KEEP:
        raise NormconvError(f"unknown --keep-fp32 {keep_fp32!r}; choose auto, none or all")
    phase("load", detail=spec)
    src = load(spec)
    out = _guard_output(src, Path(output), overwrite) if output is not None else None
    dropped: list[str] = []
    if constant_initializers:
        src, dropped = as_constants(src)
    phase("rewrite", detail=command)
    model, report, converted = plan(src, command, target, opset)
    if constant_initializers:
        report.notes.append(f"--constant-initializers: {len(dropped)} initializer(s) the file also lists as inputs "
                            f"read as the constants it holds" + (" and no longer inputs of the output" if dropped else
                                                                 " (none: nothing changed)"))
        report.extra["constant_initializers"] = dropped
    if dtype == "float16":
        half = HalfPrecision(keep_fp32)
        model = half(model).model
        report.extra.update({"dtype": "float16", "keep_fp32": keep_fp32, "float32_nodes": half.kept})
        report.notes.append(f"float16: {len(half.kept)} node(s) kept in float32 (--keep-fp32 {keep_fp32}); fused "
                            f"norms compute their statistics in float32; inputs and outputs keep their types")
        atol = 1e-2 if atol is None else atol
        rtol = 1e-2 if rtol is None else rtol
        report.after = op_counts(model)
    if command == "inspect":
        report.sites = [s.__class__(s.pass_name, s.target, s.applied, ("would be " if s.applied else "") + s.reason,
                                    s.code) for s in report.sites]
        return report
    from normconv.io import durable
    from normconv.io.write import TEMP_SUFFIX, publish, remove_stale_temps, temp_name, write_error

    where = out if out is not None else src.path
    remove_stale_temps(where)
    tmpdir = None
    try:
        tmpdir = Path(tempfile.mkdtemp(prefix=temp_name(where), suffix=TEMP_SUFFIX, dir=str(where.parent)))
        specs = parity.specs(str(src.path), to_ir(src.proto), input_shape)
        sizes = parity.plan_sizes(str(src.path), specs)
        report.notes.extend(sizes.notes)
        report.extra["validated_sizes"] = [{str(k): v for k, v in s.items()} for s in sizes.sizes]
        if converted:
            conv = tmpdir / "converted.onnx"
            _save(ir.serde.serialize_model(ConvertOpset(report.extra["opset"])(to_ir(src.proto)).model), conv,
                  bool(src.external))
            checks = parity.compare_files(str(src.path), str(conv), sizes, atol, rtol, levels=("disabled",))
            if not all(v.passed for v in checks):
                report.validation.extend(checks)
                raise VerificationError(f"{command}: the file converted to opset {report.extra['opset']} differs "
                                        f"from the input; nothing written", report)
            report.notes.append(f"opset conversion validated: max abs error "
                                f"{max(v.max_abs_error for v in checks):.3g}")
        phase("write", detail=str(where))
        proto = _as_written(ir.serde.serialize_model(model), src)
        # the input's layout kept: external data in, external data out; past protobuf's 2 GB, external data too
        external = bool(src.external) or sum(len(t.raw_data) for t in proto.graph.initializer) > EXTERNAL_DATA_BYTES
        tmp = tmpdir / (out.name if out is not None else "out.onnx")
        _save(proto, tmp, external)
        durable.start_writeback_under(tmpdir)  # the disk writes while onnxruntime compares
        report.extra["external_data"] = (tmp.name + ".data") if external else None
        ok, report.extra["checker"] = _check(tmp, target, src)
        if not ok:
            raise VerificationError(f"{command}: onnx.checker rejects the output ({report.extra['checker']}); "
                                    f"nothing written", report)
        phase("validate", detail="onnxruntime, against the input file")
        report.validation.extend(parity.compare_files(str(src.path), str(tmp), sizes, atol, rtol))
        if not report.passed:
            bad = next(v for v in report.validation if not v.passed)
            if not bad.outputs:  # nothing compared (its label says why): not a difference, and not a pass
                raise VerificationError(f"{command}: {bad.label}; nothing written", report)
            overflow = dtype == "float16" and not math.isfinite(bad.max_abs_error)  # inf / NaN where the input is not
            raise VerificationError(f"{command}: {bad.label} differs from the input beyond tolerance ({bad.worst}; "
                                    f"{bad.criterion})" + (": the float16 file overflows where the float32 input "
                                                           "computes finite values (activations beyond float16's "
                                                           "65504)" if overflow else "") + "; nothing written",
                                    report)
        if out is not None:
            written = [f for f in (tmp, tmpdir / (tmp.name + ".data")) if f.exists()]
            # the external data of the OUT this run replaces, where the new OUT keeps its tensors inline
            stale = out.parent / (out.name + ".data")
            stale = stale if not external and stale.is_file() and _owned_by(out, stale) else None
            publish([(f, out.parent / f.name) for f in written])  # over a folder of that name only with --overwrite
            if stale is not None:
                stale.unlink()
                report.notes.append(f"removed {stale.name}: the external data of the {out.name} replaced (the new "
                                    f"file holds its tensors inline)")
            report.output = str(out)
    except (VerificationError, NormconvError):
        raise
    except OSError as exc:
        raise write_error(where, exc) from None
    except Exception as exc:  # noqa: BLE001 - onnxruntime refusing a file is the input's situation, in one line
        said = _public(str(exc).splitlines()[0] if str(exc) else "", tmpdir, out)
        raise NormconvError(f"{command} of {spec} failed in onnxruntime: {type(exc).__name__}: {said[:240]}",
                            Code.NOT_VERIFIED) from None
    finally:
        if tmpdir is not None:
            shutil.rmtree(tmpdir, ignore_errors=True)
    return report
