"""Hugging Face models called the way users call them.

- LMs built with their default config return a KV cache (a DynamicCache) from a plain forward, which torch.export
  cannot capture: every command failed on them. normconv runs the model with use_cache=False unless the caller sets
  it; the rewritten model keeps taking use_cache, and the user's model is untouched.
- A VLM (LLaVA) takes use_cache only through forward's **kwargs, which it hands to its language model: normconv
  passes use_cache=False there too when the config (or its text config) caches. Its torch._check calls
  (aten._is_all_true, which torch's ONNX exporter has no function for) get an ONNX translation of their own.
- A tokenizer's output (a BatchEncoding, a UserDict rather than a dict) was taken as one positional input."""

from __future__ import annotations

import json

import onnx
import torch

from hf_tiny import cached_gpt2, cached_llama, tiny_llava
from transformers import BatchEncoding

from normconv.api import export, fold, inspect, swap


def test_swap_on_an_lm_with_its_default_cache():
    model, inputs = cached_gpt2()
    assert model.config.use_cache
    new, report = swap(model, inputs.kwargs, to="rmsnorm")
    assert report.passed and sum(s.applied for s in report.sites) == 5  # 2 x (ln_1, ln_2) + ln_f, all pre-LN
    ids = torch.randint(0, 100, (3, 11))
    with torch.no_grad():
        ref, out = model(ids), new(ids)
    torch.testing.assert_close(out.logits, ref.logits, atol=1e-5, rtol=1e-4)
    assert out.past_key_values is not None  # the rewritten model still returns its cache when asked
    assert model.config.use_cache and "use_cache" not in inputs.kwargs  # the user's model and inputs unchanged


def test_export_of_an_lm_with_its_default_cache(tmp_path):
    model, inputs = cached_llama()
    path = tmp_path / "llama.onnx"
    report = export(model, inputs.kwargs, str(path), opset=23)
    assert report.passed
    ops = [n.op_type for n in onnx.load(str(path)).graph.node]
    assert ops.count("RMSNormalization") == 5  # the default --target onnx: the standard op at opset 23


def test_cli_inspect_of_an_lm_with_its_default_cache(cli):
    code, out, err = cli("inspect", "hf_tiny:cached_gpt2", "--json")
    assert code == 0, err
    report = json.loads(out)
    assert [s["kind"] for s in report["sites"]] == ["layernorm"] * 5
    assert "use_cache=False" in report["extra"]["inputs"]


def test_inspect_keeps_a_use_cache_the_caller_sets():
    model, inputs = cached_gpt2()
    rep = inspect(model, {**inputs.kwargs, "use_cache": False})
    assert len(rep.sites) == 5


def test_a_tokenizers_batch_encoding_is_keyword_inputs():
    model, inputs = cached_gpt2()
    batch = BatchEncoding({"input_ids": inputs.kwargs["input_ids"],
                           "attention_mask": torch.ones_like(inputs.kwargs["input_ids"])})
    rep = inspect(model, batch)
    assert len(rep.sites) == 5 and "attention_mask=" in rep.extra["inputs"]


def test_a_vlm_taking_use_cache_through_kwargs_is_captured():
    model, inputs = tiny_llava()
    assert model.config.text_config.use_cache and "use_cache" not in inputs.kwargs
    _, report = fold(model, inputs.kwargs)  # refused before: "Found DynamicCache in output" from torch.export
    assert report.passed and report.validation and report.validation[0].max_abs_error < 1e-4
    assert "use_cache" not in inputs.kwargs and model.config.text_config.use_cache  # the user's inputs untouched


def test_a_vlm_exports_with_its_checks_translated(tmp_path):
    model, inputs = tiny_llava()
    path = tmp_path / "llava.onnx"
    report = export(model, inputs.kwargs, str(path), opset=17)  # failed: no ONNX function for aten._is_all_true
    assert report.passed and any(v.label.startswith("onnxruntime") for v in report.validation)
    ops = [n.op_type for n in onnx.load(str(path)).graph.node]
    # the live norms, each one op, none left decomposed: CLIP's LayerNorms whose outputs reach an output (LLaVA reads
    # layer -2; transformers 5.23 returns only what it reads: the pre-LN and layer 0's two LNs; 5.24 returns the vision
    # tower's own outputs too: layer 1's two LNs live) and the language model's 5 RMSNorms
    # (the default --target onnx at opset 17: RMSNorm is the function op normconv.RMSNorm)
    assert ops.count("LayerNormalization") in (3, 5) and ops.count("RMSNorm") == 5
    assert not {"ReduceMean", "Pow", "Sqrt", "Rsqrt"} & set(ops)
