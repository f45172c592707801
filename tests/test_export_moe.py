"""A Hugging Face mixture of experts exports: transformers 5 runs its experts with ``grouped_mm`` by default
(``aten._grouped_mm`` / ``transformers.grouped_mm_fallback``), for which torch.onnx has no function, so Mixtral,
Qwen2-MoE, Qwen3-MoE and OLMoE failed to export (exit 2, 'No ONNX function found'); transformers' own translation
is used (``onnx.ops.model_translations``)."""

from __future__ import annotations

import onnx
import pytest
import torch

import normconv

from .hf_tiny import lm_onnx_error


def _tiny_mixtral():
    transformers = pytest.importorskip("transformers")
    cfg = transformers.MixtralConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                                     num_key_value_heads=2, vocab_size=100, num_local_experts=4,
                                     num_experts_per_tok=2, use_cache=False)
    torch.manual_seed(0)
    return transformers.MixtralForCausalLM(cfg).eval()


def test_a_mixture_of_experts_exports_with_dynamic_batch_and_sequence(tmp_path):
    model = _tiny_mixtral()
    assert model.get_experts_implementation()[""] == "grouped_mm"  # transformers' default: the op torch.onnx lacks
    ids = torch.randint(0, 100, (2, 16), generator=torch.Generator().manual_seed(0))
    out = tmp_path / "moe.onnx"
    report = normconv.export(model, {"input_ids": ids, "attention_mask": torch.ones_like(ids)}, str(out))
    assert report.passed and report.extra["fused_norm_ops"] == {"rmsnorm": 5}
    assert not any(d.get("pinned") for d in report.extra["dynamic_dims"])
    assert model.get_experts_implementation()[""] == "grouped_mm"  # the user's model as it was
    assert any(n.op_type == "MatMul" for n in onnx.load(str(out)).graph.node)
    assert lm_onnx_error(out, model) <= 1e-5  # other sizes than the example's: other rows per expert
