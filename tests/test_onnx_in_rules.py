"""ONNX in: every spelling found by what it computes, fused or folded into one op, OUT validated against IN."""

from __future__ import annotations

import collections

import numpy as np
import onnx
import pytest

from normconv.errors import VerificationError
from normconv.onnx import onnx_in
from tests import onnx_in_graphs as G


def _ops(path) -> collections.Counter:
    m = onnx.load(str(path))
    c = collections.Counter()

    def walk(g):
        for n in g.node:
            c[n.op_type] += 1
            for a in n.attribute:
                if a.type == onnx.AttributeProto.GRAPH:
                    walk(a.g)
    walk(m.graph)
    return c


def _run(tmp_path, proto, command="export", target="onnx", **kw):
    src = G.save(proto, tmp_path / "in.onnx")
    before = (tmp_path / "in.onnx").read_bytes()
    report = onnx_in.run(src, command, str(tmp_path / "out.onnx"), target=target, **kw)
    assert (tmp_path / "in.onnx").read_bytes() == before  # the input is never written
    assert report.passed and len(report.validation) >= 2
    return report, _ops(tmp_path / "out.onnx")


def _codes(report):
    return collections.Counter(str(s.code) for s in report.sites)


@pytest.mark.parametrize("opset", [11, 13, 17, 18])
def test_torch_layernorm_fused_at_every_opset(tmp_path, opset):
    report, ops = _run(tmp_path, G.layernorm_torch(opset))
    assert ops["LayerNormalization"] == 1 and not ops["ReduceMean"] and not ops["Sqrt"] and not ops["Pow"]
    assert _codes(report) == {"fused-layernorm": 1}
    assert report.extra["opset"] == max(opset, 17)
    assert (report.extra["converted_from"] == opset) == (opset < 17)
    assert report.extra["checker"].startswith("passed")
    # two sizes of each dynamic dimension, disabled and default optimizations
    assert len(report.validation) == 4 and report.validation[0].outputs[0].max_abs_error < 1e-5


def test_layernorm_without_affine_and_mul_square(tmp_path):
    report, ops = _run(tmp_path, G.layernorm_torch(17, affine=False, pow_square=False))
    assert ops["LayerNormalization"] == 1 and ops["Mul"] == 0


def test_tf2onnx_moments_layernorm_on_an_inner_axis(tmp_path):
    """E[x²] − E[x]² clamped by Max, ReduceSum · 1/n, Reshape + Expand back, scale inside the rsqrt: one
    LayerNormalization between two Transposes (axis 1 of 3)."""
    report, ops = _run(tmp_path, G.layernorm_tf(15), atol=1e-3)
    assert ops["LayerNormalization"] == 1 and ops["Transpose"] == 2
    assert not ops["ReduceSum"] and not ops["Max"] and not ops["Sqrt"]
    assert _codes(report) == {"fused-layernorm": 1} and "E[x²] − E[x]²" in report.sites[0].reason


@pytest.mark.parametrize("target,op", [("ort", "SimplifiedLayerNormalization"), ("onnx", "RMSNorm")])
def test_rmsnorm_per_target(tmp_path, target, op):
    report, ops = _run(tmp_path, G.rmsnorm(18), target=target)
    assert ops[op] == 1 and not ops["Sqrt"] and not ops["ReduceMean"] and not ops["Mul"]
    if target == "onnx":  # below opset 23: normconv.RMSNorm with its function body
        assert [f.name for f in onnx.load(str(tmp_path / "out.onnx")).functions] == ["RMSNorm"]


@pytest.mark.parametrize("build,op", [(lambda o: G.rmsnorm(o), "RMSNorm"), (lambda o: G.groupnorm(o), "GroupNorm")])
@pytest.mark.parametrize("opset", [11, 13])
def test_function_op_in_an_old_opset_file_converts_the_file(tmp_path, build, op, opset):
    """tf2onnx / paddle2onnx default to opsets 11-13: a norm kept as a function op converts the file to the opset its
    body needs (Constant value_float is 12, CastLike 15), as a LayerNorm does; the output passes the checker."""
    report, ops = _run(tmp_path, build(opset))
    assert ops[op] == 1 and report.extra["converted_from"] == opset and report.extra["opset"] == 15
    assert report.extra["checker"].startswith("passed")
    assert any(f"the function body of normconv.{op}" in n for n in report.notes)


def test_float64_rmsnorm_function_computes_in_float64(tmp_path):
    """A float64 file's RMSNorm kept as a function op (opset < 23) computes in float64: a float32 body lost 7e-8 of
    the scale and failed the float64 bound; that bound is labelled float64."""
    report, ops = _run(tmp_path, G.rmsnorm_float64(17))
    assert ops["RMSNorm"] == 1 and _codes(report) == {"fused-rmsnorm": 1}
    body = onnx.load(str(tmp_path / "out.onnx")).functions[0]
    assert {a.i for n in body.node if n.op_type == "Cast" for a in n.attribute} == {onnx.TensorProto.DOUBLE}
    assert all("float64 rounding" in v.criterion for v in report.validation)
    assert max(v.max_scale_error for v in report.validation) < 1e-12


def test_rmsnorm_opset_23_is_the_standard_op(tmp_path):
    report, ops = _run(tmp_path, G.rmsnorm(18), opset=23)
    assert ops["RMSNormalization"] == 1 and report.extra["opset"] == 23


@pytest.mark.parametrize("kw", [dict(casts=True), dict(gemma=True), dict(div=True), dict(casts=True, div=True)])
def test_rmsnorm_spellings(tmp_path, kw):
    report, ops = _run(tmp_path, G.rmsnorm(17, **kw), target="ort", atol=1e-2 if kw.get("casts") else None)
    assert ops["SimplifiedLayerNormalization"] == 1 and not ops["Sqrt"]
    if kw.get("casts"):  # the norm runs on the float32 value between the casts: float32 statistics
        assert ops["Cast"] == 2
    if kw.get("gemma"):  # 1 + w folded into the scale
        assert not ops["Mul"] and not ops["Add"]


def test_groupnorm_reshape_instancenorm(tmp_path):
    report, ops = _run(tmp_path, G.groupnorm(17), target="onnx")
    assert ops["GroupNorm"] == 1 and not ops["InstanceNormalization"] and not ops["Mul"]
    assert _codes(report) == {"fused-groupnorm": 1}


def test_groupnorm_opset_21_is_the_standard_op(tmp_path):
    report, ops = _run(tmp_path, G.groupnorm(17), opset=21)
    assert ops["GroupNormalization"] == 1


@pytest.mark.parametrize("op,groups,dilation", [("Conv", 1, 1), ("Conv", 2, 2), ("ConvTranspose", 1, 1),
                                                ("ConvTranspose", 2, 1)])
def test_bn_after_conv_folded(tmp_path, op, groups, dilation):
    report, ops = _run(tmp_path, G.conv_bn(op, groups, dilation), command="fold")
    assert ops == {op: 1} and _codes(report) == {"folded": 1}


@pytest.mark.parametrize("op", ["Conv", "ConvTranspose"])
def test_bn_after_conv_with_a_separate_bias_add_folded(tmp_path, op):
    report, ops = _run(tmp_path, G.conv_bn(op, bias_add=True), command="fold")
    assert ops == {op: 1} and _codes(report) == {"folded": 1}


@pytest.mark.parametrize("kw", [dict(trans_b=1), dict(trans_b=0), dict(matmul=True)])
def test_bn_after_gemm_and_matmul_folded(tmp_path, kw):
    report, ops = _run(tmp_path, G.gemm_bn(**kw), command="fold")
    assert not ops["BatchNormalization"] and report.extra["folded_batchnorm"] == 1


def test_bn_before_conv_folded_only_without_padding(tmp_path):
    report, ops = _run(tmp_path, G.bn_conv(pads=0), command="fold")
    assert ops == {"Conv": 1} and _codes(report) == {"folded-into-next": 1}
    report, ops = _run(tmp_path, G.bn_conv(pads=1), command="fold")
    assert ops["BatchNormalization"] == 1 and _codes(report) == {"padded-conv": 1}


def test_standalone_bn_listed_and_kept(tmp_path):
    report, ops = _run(tmp_path, G.bn_conv(standalone=True), command="fold")
    assert ops["BatchNormalization"] == 1 and _codes(report) == {"no-foldable-neighbour": 1}


def test_no_false_site(tmp_path):
    """An L2 normalization and an STFT magnitude are left alone and listed as norm-like, with why."""
    report, ops = _run(tmp_path, G.l2_and_magnitude())
    assert ops["Sqrt"] == 2 and ops["ReduceSum"] == 1
    assert _codes(report) == {"l2-norm": 1, "elementwise-magnitude": 1}
    assert not any(s.applied for s in report.sites)


def test_layernorm_inside_an_if_branch(tmp_path):
    report, ops = _run(tmp_path, G.layernorm_in_if(17))
    assert ops["LayerNormalization"] == 1 and not ops["ReduceMean"]


def test_layernorm_inside_an_onnx_function(tmp_path):
    """The function body takes its one call's types, so the rule reads ranks and sizes there too."""
    report, _ = _run(tmp_path, G.layernorm_in_function(17))
    fn = onnx.load(str(tmp_path / "out.onnx")).functions[0]
    ops = collections.Counter(n.op_type for n in fn.node)
    assert ops["LayerNormalization"] == 1 and not ops["ReduceMean"] and not ops["Sqrt"]
    assert _codes(report) == {"fused-layernorm": 1}


def test_layernorm_read_inside_is_refused_with_a_code(tmp_path):
    """The variance is also a model output: fusing would drop it, so the site stays, listed with its code."""
    proto = G.layernorm_torch(17)
    proto.graph.output.append(onnx.helper.make_tensor_value_info("v", onnx.TensorProto.FLOAT, ["batch", "seq", 1]))
    report, ops = _run(tmp_path, proto)
    assert ops["ReduceMean"] == 2 and ops["Sqrt"] == 1 and _codes(report) == {"inner-value-read": 1}


def test_layernorm_whose_mean_is_read_becomes_an_rmsnorm_of_the_centered_input(tmp_path):
    """The mean is also a model output: x − E[x] stays, and d / sqrt(E[d²] + ε) is an RMSNorm of d."""
    proto = G.layernorm_torch(17)
    proto.graph.output.append(onnx.helper.make_tensor_value_info("m", onnx.TensorProto.FLOAT, ["batch", "seq", 1]))
    report, ops = _run(tmp_path, proto, target="ort")
    assert ops["ReduceMean"] == 1 and ops["SimplifiedLayerNormalization"] == 1 and not ops["Sqrt"]
    assert _codes(report) == {"fused-rmsnorm": 1}


def test_onnxruntime_changing_the_inputs_own_result_is_not_the_outputs_fault(tmp_path):
    """fold leaves a LayerNorm whose eps broadcasts up a rank as it is; onnxruntime's LayerNormFusion drops that rank
    at its default level in the input as in the output: the output is judged against the input at that level, the
    label says why, and the fold passes (it exited 1, 'differs from the input')."""
    report, _ = _run(tmp_path, G.norms_eps_rank_up("layernorm"), command="fold")
    default = [v for v in report.validation if "default" in v.label]
    assert default and all("change the input's result" in v.label and v.passed for v in default)
    assert all("same level" not in v.label for v in report.validation if "disabled" in v.label)


@pytest.mark.parametrize("kind,op,code", [("layernorm", "LayerNormalization", "fused-layernorm"),
                                          ("rmsnorm", "RMSNorm", "fused-rmsnorm")])
def test_an_eps_that_broadcasts_up_a_rank_is_refused_and_the_rest_fuses(tmp_path, kind, op, code):
    """eps of shape (1, 1, 1, 1) on a rank-3 input makes the file's result rank 4: that site is refused with a code
    (one fused op would drop the rank), the other norm of the file fuses, and the export passes."""
    report, ops = _run(tmp_path, G.norms_eps_rank_up(kind))
    assert ops[op] == 1 and ops["Sqrt"] == 1
    assert _codes(report) == {code: 1, "constant-broadcasts-up-a-rank": 1}
    refused = next(s for s in report.sites if not s.applied)
    assert "(1, 1, 1, 1)" in refused.reason and "rank 4" in refused.reason
    # onnxruntime's own fusion drops that rank in the kept site at its default level, in the input as in the
    # output: judged against the input at that level, and said (the file's meaning is its unoptimized run)
    assert all("change the input's result" in v.label for v in report.validation if "default" in v.label)


def test_validation_failure_writes_nothing(tmp_path):
    """A tolerance nothing meets: exit 1 semantics, no output file."""
    src = G.save(G.layernorm_tf(15), tmp_path / "in.onnx")
    with pytest.raises(VerificationError):
        onnx_in.run(src, "export", str(tmp_path / "out.onnx"), target="onnx", atol=0.0, rtol=0.0)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["in.onnx"]


@pytest.mark.parametrize("keep", ["none", "all"])
def test_float16_keeps_the_interface_and_float32_statistics(tmp_path, keep):
    report, ops = _run(tmp_path, G.layernorm_torch(17), dtype="float16", keep_fp32=keep)
    m = onnx.load(str(tmp_path / "out.onnx"))
    assert m.graph.input[0].type.tensor_type.elem_type == onnx.TensorProto.FLOAT  # the interface as declared
    assert m.graph.output[0].type.tensor_type.elem_type == onnx.TensorProto.FLOAT
    ln = next(n for n in m.graph.node if n.op_type == "LayerNormalization")
    assert onnx.helper.get_attribute_value(next(a for a in ln.attribute if a.name == "stash_type")) == 1
    cast = next(n for n in m.graph.node if ln.input[0] in n.output)
    # none: the LayerNormalization reads float16 (its statistics in float32); all: float32 between Casts
    assert cast.op_type == "Cast" and onnx.helper.get_attribute_value(cast.attribute[0]) == (
        onnx.TensorProto.FLOAT16 if keep == "none" else onnx.TensorProto.FLOAT)
    assert report.extra["dtype"] == "float16" and len(report.extra["float32_nodes"]) == (keep == "all")


def test_float16_auto_keeps_unfused_statistics_in_float32(tmp_path):
    """What no rule fused (an L2 norm's Σx², a magnitude's squares and roots) overflows float16 past |x| = 256:
    auto keeps those nodes in float32 between Casts, none keeps nothing (asserted on the graph: onnxruntime's CPU
    kernels reduce float16 in float32, so its outputs would not show the overflow)."""
    report, _ = _run(tmp_path, G.l2_and_magnitude(), dtype="float16", keep_fp32="auto")
    kept = report.extra["float32_nodes"]
    assert len(kept) == 6  # Mul(x, x), ReduceSum, Sqrt; Pow, Pow, Sqrt
    report, _ = _run(tmp_path, G.l2_and_magnitude(), dtype="float16", keep_fp32="none")
    assert report.extra["float32_nodes"] == []


def test_float16_auto_keeps_a_weight_beyond_its_range_in_float32():
    """A BN with a tiny running variance folds into conv weights beyond 65504: auto keeps that conv in float32."""
    import onnx_ir as ir

    from normconv.onnx.passes.half import HalfPrecision

    proto = G.conv_bn()
    var = next(i for i in proto.graph.initializer if i.name == "bn_v")
    var.CopyFrom(onnx.numpy_helper.from_array(np.full(8, 1e-14, np.float32), "bn_v"))
    next(i for i in proto.graph.initializer if i.name == "w").CopyFrom(
        onnx.numpy_helper.from_array(np.full((8, 4, 3, 3), 0.5, np.float32), "w"))
    next(a for n in proto.graph.node if n.op_type == "BatchNormalization" for a in n.attribute
         if a.name == "epsilon").f = 1e-14
    model, report, _ = onnx_in.plan(onnx_in.Source(onnx_in.Path("x.onnx"), proto), "fold")
    assert report.extra["folded_batchnorm"] == 1
    half = HalfPrecision("auto")
    out = half(model).model
    assert half.kept == [next(n.name for n in model.graph if n.op_type == "Conv")]
    conv = next(n for n in out.graph if n.op_type == "Conv")
    assert conv.inputs[1].dtype == ir.DataType.FLOAT  # the folded weight stays float32


def test_a_sigmoid_output_is_judged_through_its_logits(tmp_path):
    """A probability map whose largest value is 6e-6 while its logits reach 6e4: the logits' rounding after a
    fold (a few u of their scale) is thousands of u of the map's scale, so the map alone refused an exact fold;
    judged through the Sigmoid's input the fold passes, and a planted error of 1e-3 of the logits' scale is still
    refused."""
    import onnx_ir

    from normconv.onnx import parity

    report, ops = _run(tmp_path, G.conv_bn_sigmoid(), "fold")
    assert ops["BatchNormalization"] == 0
    src = str(tmp_path / "in.onnx")
    outs = [o for v in report.validation for o in v.outputs]
    assert outs and all("judged through its Sigmoid" in o.note for o in outs)
    assert max(o.scale_error for o in outs) > 6.1e-5  # the map's own scale would have refused it
    wrong = G.save(G.conv_bn_sigmoid(planted=1e-3), tmp_path / "wrong.onnx")
    plan = parity.plan_sizes(src, parity.specs(src, onnx_ir.load(src), None))
    found = parity.compare_files(src, str(wrong), plan, None, None)
    assert found and not any(v.passed for v in found)


@pytest.mark.parametrize("before", [False, True])
def test_bn_with_per_element_statistics_is_kept_with_a_code(tmp_path, before):
    """Opset 7's spatial=0 BatchNormalization: statistics per element, (C, H, W). A conv folds one scale per channel,
    so that BN stays, listed with its code; the BN beside it still folds (was: exit 3, numpy broadcast error)."""
    report, ops = _run(tmp_path, G.bn_spatial0(before=before), command="fold")
    assert ops["BatchNormalization"] == 1 and ops["Conv"] == 2
    assert _codes(report) == {"per-element-statistics": 1, "folded": 1}


@pytest.mark.parametrize("before", [False, True])
def test_bn_with_per_element_statistics_equal_per_channel_folds(tmp_path, before):
    """spatial=0 statistics that hold one value per channel (equal along H and W) fold as a spatial BN's."""
    report, ops = _run(tmp_path, G.bn_spatial0(before=before, per_channel=True), command="fold")
    assert ops == {"Conv": 2}
    assert _codes(report) == collections.Counter(["folded-into-next" if before else "folded", "folded"])


@pytest.mark.filterwarnings("error::RuntimeWarning")  # numpy's overflow in a cast, printed on stderr before
@pytest.mark.parametrize("before", [False, True])
def test_a_float16_file_keeps_a_bn_whose_fold_passes_half_range(tmp_path, before):
    """A float16 file: a fold past half of float16's max would write inf; that BN stays (code past-half-range, as
    the torch path), the other folds (was: inf weights, NaN outputs, the whole fold refused). Validated in
    onnxruntime with the BN before its conv: after it, onnxruntime's own default-level Conv + BN fusion overflows
    the kept pair (the input's too), which the plan alone shows."""
    proto = G.conv_bn_float16(before=before)
    if before:
        report, ops = _run(tmp_path, proto, command="fold")
        weights = onnx.load(str(tmp_path / "out.onnx")).graph.initializer
    else:
        model, report, _ = onnx_in.plan(onnx_in.Source(onnx_in.Path("x.onnx"), proto), "fold")
        ops = onnx_in.op_counts(model)
        weights = [onnx.numpy_helper.from_array(v.const_value.numpy()) for v in model.graph.initializers.values()]
    assert ops["BatchNormalization"] == 1 and ops["Conv"] == 2
    assert _codes(report) == {"past-half-range": 1, "folded-into-next" if before else "folded": 1}
    kept = next(s for s in report.sites if not s.applied)
    assert kept.target == "bn0" and "float16's max 65504" in kept.reason
    assert all(np.isfinite(onnx.numpy_helper.to_array(i)).all() for i in weights)


@pytest.mark.parametrize("returned", ["bn_g", "x"])
def test_float16_export_of_a_graph_output_no_node_makes(tmp_path, returned):
    """An initializer the file also returns (a BN's scale), or its input returned as it is: --dtype float16 keeps
    that output, its name and its declared type (was: the boundary Cast took the name, exit 3)."""
    proto = G.conv_bn()
    proto.graph.output.append(onnx.helper.make_tensor_value_info(returned, onnx.TensorProto.FLOAT, None))
    _run(tmp_path, proto, dtype="float16")
    m = onnx.load(str(tmp_path / "out.onnx"))
    assert [o.name for o in m.graph.output] == ["y", returned] and [i.name for i in m.graph.input] == ["x"]
    assert all(o.type.tensor_type.elem_type == onnx.TensorProto.FLOAT for o in m.graph.output)
