"""Half precision that does not overflow (issue 15): the zoo case that fails without it, the headroom report,
the fp16 export with fp32 statistics, validation against the fp32 model."""

from __future__ import annotations

import copy

import pytest
import torch

import normconv
from normconv.models import get
from normconv.verify import default_tolerance


def _fp32_and_inputs(name="fp16_overflow"):
    z = get(name)
    return z.build(), z.example_inputs()


def _half_run(model, inputs, dtype=torch.float16):
    m = copy.deepcopy(model).to(dtype)  # a copy: .to() would convert the user's (shared) parameters in place
    with torch.no_grad():
        return m(*[x.to(dtype) for x in inputs]).float()


def _max_err(a, b):
    return (a.double() - b.double()).abs().max().item()


def test_fp16_eager_overflows_but_canonicalized_fp16_stays_within_tolerance_of_fp32():
    model, inputs = _fp32_and_inputs()
    with torch.no_grad():
        ref = model(*inputs)
    scale = ref.abs().max().item()
    plain = _half_run(model, inputs)
    # x^2 > 65504 in the hand-written norms: rows come out as zeros, the error is the size of the output
    assert _max_err(plain, ref) > 0.5 * scale
    canon, report = normconv.canonicalize(model, inputs)
    assert sum(s.applied for s in report.sites) == 3
    atol, rtol = default_tolerance(torch.float16)
    fixed = _half_run(canon, inputs)
    assert torch.isfinite(fixed).all()
    assert torch.allclose(fixed, ref, atol=atol, rtol=rtol), _max_err(fixed, ref)
    # the user's model is still float32 and unchanged
    assert all(p.dtype == torch.float32 for p in model.parameters())


# -- the headroom report ------------------------------------------------------------------------------------


def _inspect(cli, *args):
    import json

    code, out, err = cli("inspect", *args, "--json")
    assert code == 0, err
    return json.loads(out)


def test_inspect_float16_flags_the_overflowing_sites_with_measured_numbers(cli):
    report = _inspect(cli, "zoo:fp16_overflow", "--dtype", "float16")
    room = report["extra"]["headroom"]
    assert room["dtype"] == "float16"
    assert room["without_headroom"] == ["blocks.0.norm", "blocks.1.norm", "norm"]
    for site in report["sites"]:
        h = site["headroom"]
        assert h["max_abs"] > 256 and h["max_square"] > 65504 and h["margin_log2"] < 0
        assert "overflow" in h["reasons"][0]
        assert h["error"] > 1.0  # the site's own module in fp16 is far off its fp32 output
    # measured in float32: the model was not cast (the inputs described are float32)
    assert "float32" in room["inputs"]


def test_inspect_bfloat16_has_range_but_reports_each_sites_error(cli):
    room = _inspect(cli, "zoo:fp16_overflow", "--dtype", "bfloat16")["extra"]["headroom"]
    assert room["without_headroom"] == []
    assert all(h["margin_log2"] > 100 and 0 < h["error"] < 0.2 for h in room["sites"])


def test_bert_eps_rounds_to_zero_in_float16_not_in_bfloat16(cli):
    fp16 = _inspect(cli, "zoo:bert", "--dtype", "float16")["extra"]["headroom"]
    assert all(h["eps"] == 1e-12 and h["eps_in_dtype"] == 0.0 and not h["ok"] for h in fp16["sites"])
    assert "rounds to 0" in fp16["sites"][0]["reasons"][0]
    bf16 = _inspect(cli, "zoo:bert", "--dtype", "bfloat16")["extra"]["headroom"]
    assert all(h["eps_in_dtype"] > 0 and h["ok"] for h in bf16["sites"])


def test_batchnorm_sites_report_the_folded_scale(cli):
    import torch

    model = get("resnet").build()
    room = _inspect(cli, "zoo:resnet", "--dtype", "float16")["extra"]["headroom"]
    bn1 = next(h for h in room["sites"] if h["target"] == "bn1")
    want = (model.bn1.weight / (model.bn1.running_var + model.bn1.eps).sqrt()).abs().max().item()
    assert bn1["folded_scale"] == pytest.approx(want, rel=1e-6)
    assert room["without_headroom"] == []
    assert all(p.dtype == torch.float32 for p in model.parameters())


def test_calibration_file_is_what_headroom_is_measured_on(cli, tmp_path):
    import torch
    from safetensors.torch import save_file

    x = get("resnet").example_inputs()[0]
    path = tmp_path / "calib.safetensors"
    save_file({"x": (x * 30000).contiguous()}, str(path))
    room = _inspect(cli, "zoo:resnet", "--dtype", "float16", "--calibration", str(path))["extra"]["headroom"]
    assert "calibration" in room["inputs"]
    stem = room["sites"][0]
    assert stem["max_abs"] > 65504 and not stem["ok"] and "beyond" in stem["reasons"][0]
    pt = tmp_path / "calib.pt"
    torch.save([x], pt)
    again = _inspect(cli, "zoo:resnet", "--dtype", "float16", "--calibration", str(pt))["extra"]["headroom"]
    assert again["without_headroom"] == []


def test_bad_calibration_is_one_line_exit_2(cli, tmp_path):
    bad = tmp_path / "calib.pt"
    bad.write_text("not a tensor file")
    code, _, err = cli("inspect", "zoo:resnet", "--dtype", "float16", "--calibration", str(bad))
    assert code == 2 and err.count("\n") == 1
    code, _, err = cli("inspect", "zoo:resnet", "--calibration", str(bad))
    assert code == 2 and "--dtype" in err


# -- fp16 export: statistics in float32, validated against the float32 model ----------------------------------

REDUCTIONS = ("ReduceMean", "ReduceSum", "ReduceSumSquare", "ReduceL2")


def _fp16_reductions(model) -> list[str]:
    """Reductions in the main graph whose input is float16 (what CUDA / TensorRT / Core ML run in fp16)."""
    import onnx

    inferred = onnx.shape_inference.infer_shapes(model)
    types = {v.name: v.type.tensor_type.elem_type for v in
             list(inferred.graph.value_info) + list(inferred.graph.input) + list(inferred.graph.output)}
    return [n.name for n in inferred.graph.node
            if n.op_type in REDUCTIONS and types.get(n.input[0]) == onnx.TensorProto.FLOAT16]


def test_fp16_export_keeps_norm_statistics_in_float32_and_validates_against_fp32(cli, tmp_path):
    import json

    import onnx

    out = tmp_path / "m.onnx"
    code, stdout, err = cli("export", "zoo:fp16_overflow", "--dtype", "float16", "-o", str(out), "--no-baseline",
                            "--repeats", "0", "--json", "--target", "onnx")
    assert code == 0, err
    report = json.loads(stdout)
    half = report["extra"]["half_precision"]
    assert half["error_vs_float32"]["given"] > 0.5 and half["error_vs_float32"]["normconv"] < 1e-2
    model = onnx.load(str(out))
    assert model.graph.input[0].type.tensor_type.elem_type == onnx.TensorProto.FLOAT16
    assert _fp16_reductions(model) == []
    ops = [n for n in model.graph.node]
    ln = [n for n in ops if n.op_type == "LayerNormalization"]
    rms = [n for n in ops if n.op_type == "RMSNorm" and n.domain == "normconv"]
    assert len(ln) == 1 and len(rms) == 2
    for n in ln:  # stash_type: 1 (float32 statistics) is the op's default; nobody set it lower
        assert all(a.i == 1 for a in n.attribute if a.name == "stash_type")
    body = next(f for f in model.functions if f.name == "RMSNorm")
    first = body.node[0]
    assert first.op_type == "Cast" and first.attribute[0].i == onnx.TensorProto.FLOAT
    reduce_in = [n.input[0] for n in body.node if n.op_type in REDUCTIONS]
    casts = {o for n in body.node if n.op_type == "Cast" for o in n.output}
    products = {n.output[0]: n.input for n in body.node if n.op_type in ("Mul", "Pow")}
    assert reduce_in and all(set(products.get(i, [i])) <= casts for i in reduce_in)


def test_plain_torch_onnx_export_of_the_fp16_model_reduces_squares_in_fp16():
    import torch

    model, inputs = _fp32_and_inputs()
    half = copy.deepcopy(model).half()
    with torch.no_grad():
        program = torch.onnx.export(half, tuple(x.half() for x in inputs), dynamo=True, external_data=False,
                                    verbose=False)
    assert len(_fp16_reductions(program.model_proto)) >= 3


def test_fp16_export_default_target_keeps_statistics_in_float32(cli, tmp_path):
    """The default (--target ort): SimplifiedLayerNormalization / LayerNormalization with float32 statistics
    (stash_type 1, the ops' default), no reduction on fp16 data, and the fp32 model's outputs within tolerance."""
    import json

    import onnx

    out = tmp_path / "m.onnx"
    code, stdout, err = cli("export", "zoo:fp16_overflow", "--dtype", "float16", "-o", str(out), "--no-baseline",
                            "--repeats", "0", "--json")
    assert code == 0, err
    assert json.loads(stdout)["extra"]["half_precision"]["error_vs_float32"]["normconv"] < 1e-2
    model = onnx.load(str(out))
    norms = [n for n in model.graph.node if n.op_type in ("SimplifiedLayerNormalization", "LayerNormalization")]
    assert len(norms) == 3 and _fp16_reductions(model) == []
    assert all(a.i == 1 for n in norms for a in n.attribute if a.name == "stash_type")
