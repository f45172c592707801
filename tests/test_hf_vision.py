"""Hugging Face vision models nobody on the team wrote (ResNet, MobileNetV2, ConvNeXt from tiny configs):
detection counts, BatchNorm folded exactly, and export with every remaining norm as one op, validated in ORT."""

from __future__ import annotations

from collections import Counter

import onnx
import pytest
import torch

from normconv.graph.detect import find_norms
from normconv.api import export as export_onnx
from normconv.graph.capture import capture
from normconv.api import fold
from normconv.verify import run

from fold_helpers import randomize_bn
from hf_tiny import TINY_VISION

pytest.importorskip("transformers")

# what inspect must find: (kind, count); the HF classes' own norms (ConvNeXt's channels-first LN is hand-written)
EXPECTED = {"resnet": {"batchnorm": 6}, "mobilenetv2": {"batchnorm": 52}, "convnext": {"layernorm": 5}}


@pytest.fixture(scope="module", params=list(TINY_VISION))
def vision(request):
    model, inputs = TINY_VISION[request.param]()
    randomize_bn(model)  # running stats far from (0, 1): a wrong fold shows in the outputs
    return request.param, model, inputs


def test_detected_sites(vision):
    name, model, inputs = vision
    norms = find_norms(capture(model, inputs))
    assert dict(Counter(s.kind for s in norms)) == EXPECTED[name]
    assert all(s.eps > 0 for s in norms)


def test_fold_folds_every_batchnorm_exactly(vision):
    name, model, inputs = vision
    reference = run(model, inputs)
    folded, report = fold(model, inputs)
    expected = EXPECTED[name].get("batchnorm", 0)
    assert sum(s.applied for s in report.sites) == expected and len(report.sites) == expected
    assert not any(isinstance(m, torch.nn.modules.batchnorm._BatchNorm) for m in folded.modules())
    out, ref = run(folded, inputs), reference
    ref_t = ref.last_hidden_state if hasattr(ref, "last_hidden_state") else ref[0]
    out_t = out.last_hidden_state if hasattr(out, "last_hidden_state") else out[0]
    assert ref_t.abs().max() > 0.1  # the check below compares real signal, not zeros
    torch.testing.assert_close(out_t, ref_t, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("target", ["onnx", "ort"])
def test_export_one_op_per_norm_and_validates(vision, tmp_path, target):
    name, model, inputs = vision
    report = export_onnx(model, inputs, tmp_path / "m.onnx", target, 20, baseline=False, repeats=0)
    ops = Counter(n.op_type for n in onnx.load(str(tmp_path / "m.onnx")).graph.node)
    assert ops["BatchNormalization"] == 0  # every BN folded before export
    assert sum(report.extra["fused_norm_ops"].values()) == EXPECTED[name].get("layernorm", 0)
    left = report.extra["leftover_decomposed_ops"]
    assert left.get("ReduceMean", 0) <= 1 and not {"Pow", "Sqrt", "Reciprocal"} & set(left)  # 1: the pooler
    assert report.extra["ort"] and all(r["passed"] for r in report.extra["ort"])
