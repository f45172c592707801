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


def test_validation_failure_writes_nothing(tmp_path):
    """A tolerance nothing meets: exit 1 semantics, no output file."""
    src = G.save(G.layernorm_tf(15), tmp_path / "in.onnx")
    with pytest.raises(VerificationError):
        onnx_in.run(src, "export", str(tmp_path / "out.onnx"), target="onnx", atol=0.0, rtol=0.0)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["in.onnx"]
