"""normconv export: every norm one fused op, validated in onnxruntime against torch; errors leave no file."""

from __future__ import annotations

import json
import os
from collections import Counter

import numpy as np
import onnx
import onnxruntime as ort
import pytest
import torch
import torch.nn as nn

from normconv.errors import NormconvError, VerificationError
from normconv.api import export as export_onnx
from normconv.models import ZOO
from normconv.verify import Inputs

from hf_tiny import TINY, tiny_mamba

HAS_CUDA = "CUDAExecutionProvider" in ort.get_available_providers() and torch.cuda.is_available()
COMBOS = [(t, o) for o in (17, 18, 20, 23) for t in ("onnx", "ort")]  # 20: the default
# non-norm uses of these ops in the zoo: global average pooling (ReduceMean), GELU-tanh (Pow)
POOLING = {"resnet", "mobilenet", "conv1d", "conv3d", "tutorial_bn", "inline_norm"}


def zoo_inputs(name):
    z = ZOO[name]
    return z.build().eval(), Inputs(tuple(z.example_inputs()))


def export(model, inputs, tmp_path, target, opset, **kw):
    kw.setdefault("baseline", False)
    kw.setdefault("repeats", 0)
    return export_onnx(model, inputs, tmp_path / "m.onnx", target, opset, **kw)


def node_types(path):
    m = onnx.load(str(path))
    return Counter((n.domain, n.op_type) for n in m.graph.node), m


TANH_GELU = ("gpt", "gpt2", "gemma")  # below opset 20 their GELU decomposes with a Pow


def check_fused(report, path, name):
    """ORT agrees with torch at both levels; one fused op per norm site; no decomposed-norm ops left."""
    ex = report.extra
    assert report.passed and os.path.exists(path)
    runs = {(r["provider"], r["optimizations"]) for r in ex["ort"]}
    assert runs == {("cpu", "disabled"), ("cpu", "default")}
    assert all(r["max_abs_error"] < 1e-4 for r in ex["ort"])
    assert ex["fused_matches_sites"], (ex["fused_norm_ops"], ex["norm_sites"])
    sites = ZOO[name].norms if name in ZOO else ex["norm_sites"]
    non_bn = sum(v for k, v in sites.items() if k != "batchnorm")
    assert sum(v for k, v in ex["fused_norm_ops"].items() if k != "batchnorm") == non_bn
    left = ex["leftover_decomposed_ops"]
    assert left.get("Sqrt", 0) == 0 and left.get("Reciprocal", 0) == 0
    assert left.get("ReduceMean", 0) <= (1 if name in POOLING else 0)
    if name not in TANH_GELU:
        assert left.get("Pow", 0) == 0


@pytest.mark.parametrize("target,opset", COMBOS)
@pytest.mark.parametrize("name", list(ZOO))
def test_zoo_exports_and_validates(tmp_path, name, target, opset):
    model, inputs = zoo_inputs(name)
    report = export(model, inputs, tmp_path, target, opset)
    check_fused(report, tmp_path / "m.onnx", name)


@pytest.mark.parametrize("target,opset", COMBOS)
def test_llama_rmsnorm_every_target_and_opset(tmp_path, target, opset):
    model, inputs = zoo_inputs("llama")
    report = export(model, inputs, tmp_path, target, opset, skip_fusion=True)
    check_fused(report, tmp_path / "m.onnx", "llama")
    types, m = node_types(tmp_path / "m.onnx")
    rms = {k: v for k, v in types.items() if "Normalization" in k[1] or k[1] == "RMSNorm"}
    if target == "ort":  # 4 residual adds feed a norm; the first norm reads the embedding
        assert rms == {("", "SimplifiedLayerNormalization"): 1, ("com.microsoft", "SkipSimplifiedLayerNormalization"): 4}
    elif opset >= 23:
        assert rms == {("", "RMSNormalization"): 5}
    else:
        assert rms == {("normconv", "RMSNorm"): 5}
        assert [f.name for f in m.functions] == ["RMSNorm"] and m.functions[0].domain == "normconv"


@pytest.mark.parametrize("target,opset", COMBOS)
@pytest.mark.parametrize("name", ["bert", "gpt2", "llama"])
def test_hf_tiny_models(tmp_path, name, target, opset):
    model, inputs = TINY[name]()
    report = export(model, inputs, tmp_path, target, opset, skip_fusion=True)
    check_fused(report, tmp_path / "m.onnx", name)
    if target == "ort":
        assert report.extra["skip_fused"] == 4  # the residual adds of 2 layers; the embedding LN has a broadcast add


class _HandRMSNorm(nn.Module):
    def __init__(self, d):
        super().__init__()
        self.weight = nn.Parameter(torch.linspace(0.5, 1.5, d))

    def forward(self, h):
        h32 = h.to(torch.float32)
        return self.weight * (h32 * torch.rsqrt(h32.pow(2).mean(-1, keepdim=True) + 1e-5)).to(h.dtype)


class _CastsBeforeItsNorm(nn.Module):
    def __init__(self, d=8):
        super().__init__()
        self.norm, self.proj = _HandRMSNorm(d), nn.Linear(d, d)

    def forward(self, x):  # Mamba's block: the cast is the caller's, the norm module is still the whole norm
        return x + self.proj(self.norm(x.to(dtype=self.norm.weight.dtype)))


@pytest.mark.parametrize("opset", [17, 20, 23])
@pytest.mark.parametrize("name", ["module", "mamba"])
def test_norm_module_called_on_a_cast_its_caller_makes_exports_fused(tmp_path, name, opset):
    if name == "mamba":
        model, inputs = tiny_mamba()
        assert sum(1 for m in model.modules() if type(m).__name__ == "MambaRMSNorm") == 3
    else:
        # a block in a model (the cast is the block's, not the root's), captured by torch.export (keyword input)
        model, inputs = nn.Sequential(_CastsBeforeItsNorm()).eval(), Inputs((), {"input": torch.randn(2, 5, 8)})
    report = export(model, inputs, tmp_path, "ort", opset)
    assert report.extra["norm_sites"] == {"rmsnorm": 3 if name == "mamba" else 1}
    check_fused(report, tmp_path / "m.onnx", name)


@pytest.mark.parametrize("target,opset", [("onnx", 17), ("ort", 20)])
@pytest.mark.parametrize("name", ["t5", "gemma"])
def test_hf_t5_and_gemma_handwritten_rmsnorms_export_fused(tmp_path, name, target, opset):
    """T5LayerNorm and GemmaRMSNorm (1 + w) are canonicalized, then exported as one op each."""
    model, inputs = TINY[name]()
    check_fused(export(model, inputs, tmp_path, target, opset), tmp_path / "m.onnx", name)


def test_skip_fusion_post_ln_bert_and_exposed_sum(tmp_path):
    model, inputs = zoo_inputs("bert")
    report = export(model, inputs, tmp_path, "ort", 18, skip_fusion=True)
    types, m = node_types(tmp_path / "m.onnx")
    assert types[("com.microsoft", "SkipLayerNormalization")] == 4
    assert types[("", "LayerNormalization")] == 1  # embeddings: word + position is a broadcast add
    fused = [s for s in report.sites if s.pass_name == "export:skip-fusion"]
    assert sum(s.applied for s in fused) == 4
    assert any(not s.applied and "broadcast" in s.reason for s in fused)
    # pre-norm llama: the residual stream continues, so the sum output (index 3) is wired to its other uses
    model, inputs = zoo_inputs("llama")
    export(model, inputs, tmp_path, "ort", 18, skip_fusion=True)
    _, m = node_types(tmp_path / "m.onnx")
    skip = [n for n in m.graph.node if n.op_type == "SkipSimplifiedLayerNormalization"]
    used = {i for n in m.graph.node for i in n.input} | {o.name for o in m.graph.output}
    assert sum(len(n.output) == 4 and n.output[3] in used for n in skip) == 3  # all but the final norm


def test_function_bodied_op_runs_inlined_in_ort(tmp_path):
    model, inputs = zoo_inputs("tutorial_rms")
    export(model, inputs, tmp_path, "onnx", 18)
    path = tmp_path / "m.onnx"
    types, m = node_types(path)
    assert types[("normconv", "RMSNorm")] == 5
    onnx.checker.check_model(m, full_check=True)  # the function body type-checks
    opts = ort.SessionOptions()
    opts.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    opts.optimized_model_filepath = str(tmp_path / "inlined.onnx")
    sess = ort.InferenceSession(str(path), opts, providers=["CPUExecutionProvider"])
    out = sess.run(None, {sess.get_inputs()[0].name: inputs.args[0].numpy()})[0]
    np.testing.assert_allclose(out, model(*inputs.args).detach().numpy(), atol=1e-5, rtol=1e-4)
    inlined = onnx.load(str(tmp_path / "inlined.onnx"))
    assert not any(n.domain == "normconv" for n in inlined.graph.node)  # ORT inlined the body
    assert sum(n.op_type == "ReduceMean" for n in inlined.graph.node) == 5


def test_groupnorm_function_below_21_and_standard_op_at_21(tmp_path):
    model, inputs = zoo_inputs("unet")
    export(model, inputs, tmp_path, "onnx", 18)
    types, m = node_types(tmp_path / "m.onnx")
    assert types[("normconv", "GroupNorm")] == 5 and [f.name for f in m.functions] == ["GroupNorm"]
    onnx.checker.check_model(m, full_check=True)
    export(model, inputs, tmp_path, "onnx", 21)
    types, m = node_types(tmp_path / "m.onnx")
    assert types[("", "GroupNormalization")] == 5 and not m.functions


def test_dynamic_axes_run_other_shapes(tmp_path):
    model, inputs = zoo_inputs("gpt")
    report = export(model, inputs, tmp_path, "ort", 18, dynamic=True)
    dims = next(iter(report.extra["dynamic_axes"].values()))
    assert sorted(dims) == [0, 1] and not any(d.isdigit() for d in dims.values())
    sess = ort.InferenceSession(str(tmp_path / "m.onnx"), providers=["CPUExecutionProvider"])
    ids = torch.randint(0, 50, (3, 9))
    out = sess.run(None, {sess.get_inputs()[0].name: ids.numpy()})[0]
    with torch.no_grad():
        ref = model(ids)
    np.testing.assert_allclose(out, ref.numpy(), atol=1e-4, rtol=1e-4)


def test_report_has_baseline_counts_and_latency(tmp_path):
    model, inputs = zoo_inputs("llama")
    report = export_onnx(model, inputs, tmp_path / "m.onnx", "ort", 18, repeats=3, baseline=True)
    assert report.before["ReduceMean"] == 5 and "ReduceMean" not in report.after  # plain export decomposes
    assert report.extra["baseline_latency_ms"]["cpu"] > 0 and report.extra["latency_ms"]["cpu"] > 0
    assert report.extra["checker"].startswith("skipped")  # SimplifiedLayerNormalization in the default domain
    payload = report.to_json()
    json.dumps(payload)
    assert payload["output"] == str(tmp_path / "m.onnx")


# ---------------------------------------------------------------------------------------------------------
# errors


class NotExportable(nn.Module):
    def forward(self, x):  # output shape depends on the data: torch.export cannot trace it
        n = int(x.argmax())
        return x[:, :n].sum(-1) if bool(x.sum() > 0) else x.new_zeros(1)


def test_unexportable_model_is_a_clear_error(tmp_path):
    with pytest.raises(NormconvError, match="cannot export NotExportable to ONNX at opset 18: TorchExportError") as e:
        export(NotExportable(), Inputs((torch.randn(2, 3),)), tmp_path, "onnx", 18)
    assert "\n" not in str(e.value) and "\x1b" not in str(e.value)
    assert list(tmp_path.iterdir()) == []


class NoOnnxFunction(nn.Module):
    def __init__(self):
        super().__init__()
        self.ln = nn.LayerNorm(8)

    def forward(self, x):  # torch.export traces it; the ONNX exporter has no function for aten.linalg_qr
        return torch.linalg.qr(self.ln(x))[0]


def test_conversion_error_names_the_op_the_exporter_lacks(tmp_path):
    # the exporter's own message ("Failed to convert ... step 3/3") names nothing; the cause it chains does
    with pytest.raises(NormconvError, match=r"ConversionError: .*\(cause: DispatchError: No ONNX function found for "
                                            r"<OpOverload\(op='aten.linalg_qr'") as e:
        export(NoOnnxFunction().eval(), Inputs((torch.randn(2, 3, 8),)), tmp_path, "ort", 20)
    assert "\n" not in str(e.value) and "Next steps" not in str(e.value)
    assert list(tmp_path.iterdir()) == []


class TracedDiffers(nn.Module):
    def __init__(self):
        super().__init__()
        self.ln = nn.LayerNorm(8)

    def forward(self, x, mask):
        # transformers' way (Aimv2's text model): an all-ones mask is dropped in eager, so the causal mask built
        # from it applies only when traced
        scores = self.ln(x) @ self.ln(x).transpose(-1, -2)
        if torch.compiler.is_exporting() or not bool(mask.all()):
            scores = scores + torch.triu(torch.full_like(scores, -1e4), 1)
        return scores.softmax(-1) @ x


def test_ort_mismatch_says_when_the_traced_program_already_differs(tmp_path):
    x = torch.randn(2, 5, 8)
    with pytest.raises(VerificationError, match=r"differs from torch beyond tolerance .*torch.export's program of the "
                                                r"model already differs from its eager forward \(max abs error "):
        export(TracedDiffers().eval(), Inputs((), {"x": x, "mask": torch.ones(2, 5)}), tmp_path, "ort", 20)
    assert list(tmp_path.iterdir()) == []


def test_failing_validation_exits_1_and_writes_nothing(cli, tmp_path):
    out = tmp_path / "m.onnx"
    code, stdout, stderr = cli("export", "zoo:gpt", "-o", out, "--atol", "0", "--rtol", "0", "--no-baseline")
    assert code == 1
    assert "differs from torch beyond tolerance" in stderr and "nothing written" in stderr
    assert list(tmp_path.iterdir()) == []  # no file, no temp folder left behind


@pytest.mark.parametrize("args,message", [
    (("--opset", "16"), "unsupported --opset 16: normconv exports opsets 17 to 23"),
    (("--opset", "24"), "unsupported --opset 24"),
    (("--target", "tensorrt"), "unknown --target 'tensorrt'"),
    (("--validate", "tpu"), "unknown --validate provider 'tpu'"),
])
def test_bad_flags_exit_2(cli, tmp_path, args, message):
    code, _, stderr = cli("export", "zoo:mlp", "-o", tmp_path / "m.onnx", *args)
    assert code == 2 and message in stderr and "Traceback" not in stderr
    assert not (tmp_path / "m.onnx").exists()


def test_bad_output_paths_exit_2(cli, tmp_path):
    code, _, stderr = cli("export", "zoo:mlp", "-o", tmp_path / "m.pt")
    assert code == 2 and "must end with .onnx" in stderr
    code, _, stderr = cli("export", "zoo:mlp", "-o", tmp_path / "missing" / "m.onnx")
    assert code == 2 and "does not exist" in stderr


def test_cli_json_and_cuda_unavailable_note(cli, tmp_path):
    out = tmp_path / "m.onnx"
    code, stdout, stderr = cli("export", "zoo:tutorial_ln", "-o", out, "--target", "ort", "--validate", "cpu,cuda",
                               "--json", "--repeats", "2")
    assert code == 0, stderr
    d = json.loads(stdout)
    assert d["command"] == "export" and d["output"] == str(out) and out.exists()
    assert d["extra"]["fused_norm_ops"] == {"layernorm": 3} and d["extra"]["norm_sites"] == {"layernorm": 3}
    assert d["before"].get("LayerNormalization", 0) == 0  # plain export leaves the hand-written norms decomposed
    if not HAS_CUDA:
        assert any(n.startswith("cuda: not validated: CUDAExecutionProvider") for n in d["notes"])


@pytest.mark.cuda
@pytest.mark.skipif(not HAS_CUDA, reason="CUDAExecutionProvider and a CUDA device are not available")
def test_cuda_validation(tmp_path):
    model, inputs = zoo_inputs("llama")
    report = export(model, inputs, tmp_path, "ort", 18, validate=("cpu", "cuda"))
    assert {r["provider"] for r in report.extra["ort"]} == {"cpu", "cuda"} and report.passed


def test_cuda_validation_is_float32_exact_and_reports_tf32(tmp_path):
    """onnxruntime's CUDA provider runs float32 MatMul in TF32 by default (1e-3 off on an H100, which no float32
    tolerance passes): validation turns it off and reports the TF32 error beside it."""
    model, inputs = zoo_inputs("gpt")
    report = export(model, inputs, tmp_path, "ort", 20, validate=("cpu", "cuda"))
    if not HAS_CUDA:
        pytest.skip("CUDAExecutionProvider and a CUDA device are not available")
    assert all(r["passed"] and r["max_abs_error"] < 1e-4 for r in report.extra["ort"] if r["provider"] == "cuda")
    assert any(n.startswith("cuda: validated with TF32 off") for n in report.notes)


@pytest.mark.parametrize("opset", [17, 20, 23])
@pytest.mark.parametrize("target", ["onnx", "ort"])
def test_half_export_of_a_norm_reading_a_float32_stream(tmp_path, target, opset):
    """Mamba's fp16 model keeps its residual stream in float32 (residual_in_fp32) and norms it with a float16
    weight: torch computes in the input's dtype, onnxruntime's norm ops type Y as the scale, so the scale is cast
    like the input (the file failed to load before), and the float32 output stays float32 in the ONNX file."""

    class Fp32Stream(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(16, 16)
            self.norm = nn.RMSNorm(16, eps=1e-6)

        def forward(self, x):
            return self.norm(x.float() + self.lin(x).float())

    torch.manual_seed(0)
    report = export(Fp32Stream().eval(), Inputs((torch.randn(2, 5, 16),)), tmp_path, target, opset,
                    dtype=torch.float16)
    m = onnx.load(tmp_path / "m.onnx")
    assert m.graph.output[0].type.tensor_type.elem_type == onnx.TensorProto.FLOAT
    assert report.passed and report.extra["fused_norm_ops"] == {"rmsnorm": 1}
    assert {r["provider"] for r in report.extra["ort"]} == {"cpu"}


def test_opset17_reductions_lose_opset18_attributes(tmp_path):
    """T5's fp16 clamp (isinf(x).any()) came down to opset 17 as ReduceMax with opset 18's noop_with_empty_axes:
    the checker rejected it and onnxruntime refused to load it. Reduce* at 17 take axes as an attribute only."""

    class AnyInf(nn.Module):
        def __init__(self):
            super().__init__()
            self.norm = nn.LayerNorm(8)

        def forward(self, x):
            big = torch.where(torch.isinf(x).any(), torch.tensor(0.5), torch.tensor(1.0))
            return self.norm(x * big) + x.amax(dim=-1, keepdim=True)

    export(AnyInf().eval(), Inputs((torch.randn(2, 3, 8),)), tmp_path, "onnx", 17)
    m = onnx.load(tmp_path / "m.onnx")
    onnx.checker.check_model(m, full_check=True)
    reduces = [n for n in m.graph.node if n.op_type in ("ReduceMax", "ReduceMin", "ReduceMean")]
    assert reduces and all(a.name != "noop_with_empty_axes" for n in reduces for a in n.attribute)
    assert all(len(n.input) == 1 for n in reduces)


def test_device_cuda_fuses_residual_add_and_norm(cli, tmp_path):
    """Measured on an H100: Skip*LayerNormalization is 1.64x faster than Add + norm (fp16), so --device cuda fuses
    them; --no-skip-fusion overrides; an unknown device is refused before the model loads."""
    out = tmp_path / "m.onnx"
    # --target ort: the fusion writes onnxruntime's own ops, which the default --target onnx (issue 30) never does
    code, stdout, stderr = cli("export", "zoo:bert", "-o", out, "--device", "cuda", "--target", "ort", "--json")
    assert code == 0, stderr
    d = json.loads(stdout)
    assert d["after"].get("com.microsoft.SkipLayerNormalization") == 4 and d["after"].get("LayerNormalization") == 1
    code, stdout, stderr = cli("export", "zoo:bert", "-o", tmp_path / "n.onnx", "--device", "cuda", "--target", "ort",
                               "--no-skip-fusion", "--json")
    assert code == 0 and json.loads(stdout)["after"].get("LayerNormalization") == 5
    code, stdout, stderr = cli("export", "zoo:nope", "-o", tmp_path / "x.onnx", "--device", "tpu")
    assert code == 2 and "unknown --device 'tpu'" in stderr and not (tmp_path / "x.onnx").exists()


def test_skip_fusion_is_opt_in(tmp_path):
    """Measured slower on onnxruntime CPU, so --target ort leaves Add + norm unless --skip-fusion asks."""
    model, inputs = zoo_inputs("bert")
    report = export(model, inputs, tmp_path, "ort", 18)
    types, _ = node_types(tmp_path / "m.onnx")
    assert not any(op.startswith("Skip") for _, op in types) and types[("", "LayerNormalization")] == 5
    assert any("--skip-fusion" in n for n in report.notes)


@pytest.mark.parametrize("target", ["onnx", "ort"])
@pytest.mark.parametrize("name", ["gpt", "llama"])
def test_fp16_export_keeps_dtype_and_fuses(cli, tmp_path, name, target):
    out = tmp_path / "m16.onnx"
    code, stdout, stderr = cli("export", f"zoo:{name}", "--dtype", "float16", "--target", target, "-o", out,
                               "--json", "--no-baseline")
    assert code == 0, stderr
    report = json.loads(stdout)
    m = onnx.load(str(out))
    assert m.graph.output[0].type.tensor_type.elem_type == onnx.TensorProto.FLOAT16
    assert sum(report["extra"]["fused_norm_ops"].values()) == sum(report["extra"]["norm_sites"].values()) == 5
    assert report["validation"] and all(v["passed"] for v in report["validation"])


def test_bf16_on_cpu_provider_is_a_clear_error(cli, tmp_path):
    out = tmp_path / "bf16.onnx"
    code, _, stderr = cli("export", "zoo:llama", "--dtype", "bfloat16", "--target", "ort", "-o", out)
    assert code == 2 and not out.exists()
    assert "no kernel for that op at this dtype" in stderr and "--validate none" in stderr
    assert len(stderr.strip().splitlines()) == 1
    code, _, stderr = cli("export", "zoo:llama", "--dtype", "bfloat16", "--target", "ort", "-o", out,
                          "--validate", "none", "--no-baseline")
    assert code == 0 and out.exists(), stderr
    assert onnx.load(str(out)).graph.output[0].type.tensor_type.elem_type == onnx.TensorProto.BFLOAT16


def test_skip_fusion_note_only_where_an_add_feeds_a_norm(tmp_path):
    model, inputs = zoo_inputs("resnet")
    report = export(model, inputs, tmp_path, "ort", 20)
    assert not any("--skip-fusion" in n for n in report.notes)
    model, inputs = zoo_inputs("llama")
    report = export(model, inputs, tmp_path, "ort", 20)
    assert any("--skip-fusion" in n for n in report.notes)


def test_external_data_sidecar_over_the_size_limit(tmp_path, monkeypatch):
    """Above protobuf's 2 GB the weights go to a .data sidecar; the threshold is lowered to exercise the path."""
    import normconv.onnx.export as ex

    monkeypatch.setattr(ex, "EXTERNAL_DATA_BYTES", 0)
    model, inputs = zoo_inputs("llama")
    report = export(model, inputs, tmp_path, "ort", 20)
    assert report.extra["external_data"] == "m.onnx.data" and report.passed
    assert sorted(p.name for p in tmp_path.iterdir()) == ["m.onnx", "m.onnx.data"]
    m = onnx.load(str(tmp_path / "m.onnx"), load_external_data=False)
    assert any(t.data_location == onnx.TensorProto.EXTERNAL for t in m.graph.initializer)
    sess = ort.InferenceSession(str(tmp_path / "m.onnx"), providers=["CPUExecutionProvider"])
    ids = inputs.args[0]
    out = sess.run(None, {sess.get_inputs()[0].name: ids.numpy()})[0]
    with torch.no_grad():
        ref = model(ids)
    np.testing.assert_allclose(out, ref.numpy(), atol=1e-4, rtol=1e-4)


def test_export_runs_the_original_once_and_reuses_it_for_the_trust_check(tmp_path):
    # the original's output feeds the trace's trust check and the torch check after the passes: the model runs 4
    # times (the original, the traced graph's shape propagation, the folded model, the ONNX exporter's trace); was 6.
    # Dynamic dimensions (the default since issue 30) add one run of the original per size each is checked at
    from fold_helpers import randomize_bn

    model = randomize_bn(nn.Sequential(*[nn.Sequential(nn.Conv2d(4, 4, 3, padding=1), nn.BatchNorm2d(4), nn.ReLU())
                                         for _ in range(3)]))
    calls = [0]
    model[0][0].register_forward_hook(lambda *_: calls.__setitem__(0, calls[0] + 1))
    report = export_onnx(model, torch.randn(2, 4, 6, 6), str(tmp_path / "chain.onnx"), static=True)
    assert calls[0] == 4 and report.passed and not report.extra["fused_norm_ops"]  # every BN folded
    assert [v.label for v in report.validation][0] == "torch, after canonicalize + fold"
    calls[0] = 0
    report = export_onnx(model, torch.randn(2, 4, 6, 6), str(tmp_path / "dyn.onnx"))
    dims = {d["name"]: d["checked"] for d in report.extra["dynamic_dims"] if not d.get("pinned")}
    assert sorted(dims) == ["batch", "height", "width"] and report.passed
    assert all(len(sizes) == 3 for sizes in dims.values()) and calls[0] == 4 + 2 * len(dims)
