"""The reference-model zoo: its contract, determinism, declared norm sites, and capture by fx and export."""

from __future__ import annotations

from collections import Counter

import pytest
import torch
import torch.fx as fx
import torch.nn as nn
import torch.nn.functional as F

import normconv.models as zoo
from normconv.models import ZOO, get
from normconv.models.halfprec import ChannelsFirstLayerNorm, NoUpcastLayerNorm, NoUpcastRMSNorm
from normconv.models.handwritten import BatchNorm, GemmaRMSNorm, LayerNorm, LlamaRMSNorm, RMSNorm, T5LayerNorm

NAMES = list(ZOO)
KINDS = {"batchnorm", "layernorm", "rmsnorm", "groupnorm", "instancenorm"}

# how an independent count recognizes each site: norm modules (kept as leaves) and functional calls
NATIVE_KINDS = {
    nn.modules.batchnorm._BatchNorm: "batchnorm",
    nn.LayerNorm: "layernorm",
    nn.RMSNorm: "rmsnorm",
    nn.GroupNorm: "groupnorm",
    nn.modules.instancenorm._InstanceNorm: "instancenorm",
}
HANDWRITTEN_KINDS = {
    BatchNorm: "batchnorm",
    LayerNorm: "layernorm",
    RMSNorm: "rmsnorm",  # LlamaRMSNorm is a subclass
    T5LayerNorm: "rmsnorm",
    GemmaRMSNorm: "rmsnorm",
    NoUpcastRMSNorm: "rmsnorm",
    NoUpcastLayerNorm: "layernorm",
    ChannelsFirstLayerNorm: "layernorm",
}
FUNCTIONAL_KINDS = {
    F.batch_norm: "batchnorm",
    F.layer_norm: "layernorm",
    F.rms_norm: "rmsnorm",
    F.group_norm: "groupnorm",
    F.instance_norm: "instancenorm",
}
# sites written inline in a forward: no module or function call to count them by
INLINE_SITES = {"inline_norm": {"layernorm": 1, "rmsnorm": 1}}


def _run(model: nn.Module, inputs: tuple) -> torch.Tensor:
    with torch.no_grad():
        return model(*inputs)


# -- the contract -------------------------------------------------------------------------------------------


def test_zoo_names_and_order():
    assert NAMES == ["resnet", "mobilenet", "conv1d", "conv3d", "deconv", "mlp", "bert", "gpt", "llama", "unet",
                     "seq2seq", "tutorial_bn", "tutorial_ln", "tutorial_rms", "inline_norm", "hf_style_norms",
                     "fp16_overflow", "fp16_raw_features", "nafnet_fp16"]


@pytest.mark.parametrize("name", NAMES)
def test_entry_is_well_formed(name):
    z = ZOO[name]
    assert z.name == name and get(name) is z
    assert z.description and "\n" not in z.description
    assert set(z.norms) <= KINDS and all(n > 0 for n in z.norms.values())
    assert 0 <= z.handwritten <= sum(z.norms.values())
    # every factory and its inputs are importable by name
    assert getattr(zoo, name) is z.build and getattr(zoo, f"{name}_inputs") is z.example_inputs
    assert name in zoo.__all__ and f"{name}_inputs" in zoo.__all__


def test_unknown_name_raises_value_error_naming_the_choices():
    with pytest.raises(ValueError, match=r"unknown zoo model 'nope'; choose from: ") as info:
        get("nope")
    assert all(name in str(info.value) for name in NAMES)


# -- determinism --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", NAMES)
def test_build_is_eval_float32_and_deterministic(name):
    z = ZOO[name]
    a, b = z.build(), z.build()
    assert not any(m.training for m in a.modules())
    tensors = list(a.parameters()) + list(a.buffers())
    assert all(t.dtype == torch.float32 for t in tensors if t.is_floating_point())
    sa, sb = a.state_dict(), b.state_dict()
    assert list(sa) == list(sb)
    assert all(torch.equal(sa[k], sb[k]) for k in sa)


def test_build_leaves_the_global_rng_alone():
    torch.manual_seed(1234)
    expected = torch.rand(3)
    torch.manual_seed(1234)
    ZOO["resnet"].build()
    assert torch.equal(torch.rand(3), expected)


@pytest.mark.parametrize("name", NAMES)
def test_forward_is_finite_and_deterministic(name):
    z = ZOO[name]
    inputs = z.example_inputs()
    assert isinstance(inputs, tuple) and all(2 <= t.shape[0] <= 4 for t in inputs)
    out = _run(z.build(), inputs)
    assert torch.isfinite(out).all()
    assert torch.equal(out, _run(z.build(), z.example_inputs()))


# -- weights that make folding mistakes visible -------------------------------------------------------------


@pytest.mark.parametrize("name", NAMES)
def test_norm_statistics_and_affines_are_not_identity(name):
    model = ZOO[name].build()
    named = dict(model.named_parameters()) | dict(model.named_buffers())
    means = [t for k, t in named.items() if k.rsplit(".", 1)[-1] in ("running_mean", "moving_mean", "rm")]
    variances = [t for k, t in named.items() if k.rsplit(".", 1)[-1] in ("running_var", "moving_var", "rv")]
    assert len(means) == len(variances) == ZOO[name].norms.get("batchnorm", 0)
    for mean, var in zip(means, variances):
        assert mean.abs().max() > 0.5 and (var - 1).abs().max() > 0.5 and (var > 0).all()
    for m in model.modules():
        for p in (getattr(m, "weight", None), getattr(m, "gamma", None)):
            if isinstance(m, tuple(NATIVE_KINDS) + tuple(HANDWRITTEN_KINDS)) and isinstance(p, torch.Tensor):
                assert not torch.equal(p, torch.ones_like(p)) and not torch.equal(p, torch.zeros_like(p))


# -- declared norm sites ------------------------------------------------------------------------------------


class _NormLeafTracer(fx.Tracer):
    """fx tracing that keeps the hand-written norm classes as leaves too, so each call is one node."""

    def is_leaf_module(self, m: nn.Module, qualname: str) -> bool:
        return isinstance(m, tuple(HANDWRITTEN_KINDS)) or super().is_leaf_module(m, qualname)


def _kind(obj, table) -> str | None:
    return next((kind for t, kind in table.items() if isinstance(obj, t)), None)


@pytest.mark.parametrize("name", NAMES)
def test_declared_norm_sites_match_an_independent_count(name):
    z = ZOO[name]
    model = z.build()
    modules = dict(model.named_modules())
    counts: Counter[str] = Counter(INLINE_SITES.get(name, {}))
    handwritten = sum(INLINE_SITES.get(name, {}).values())
    for node in _NormLeafTracer().trace(model).nodes:
        if node.op == "call_module":
            mod = modules[node.target]
            if kind := _kind(mod, HANDWRITTEN_KINDS):
                counts[kind] += 1
                handwritten += 1
            elif kind := _kind(mod, NATIVE_KINDS):
                counts[kind] += 1
        elif node.op == "call_function" and node.target in FUNCTIONAL_KINDS:
            counts[FUNCTIONAL_KINDS[node.target]] += 1
    assert dict(counts) == dict(z.norms)
    assert handwritten == z.handwritten


# -- capture ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", NAMES)
def test_symbolic_trace_matches_eager(name):
    z = ZOO[name]
    model, inputs = z.build(), z.example_inputs()
    traced = fx.symbolic_trace(model)
    torch.testing.assert_close(_run(traced, inputs), _run(model, inputs))


@pytest.mark.parametrize("name", NAMES)
def test_torch_export_matches_eager(name):
    z = ZOO[name]
    model, inputs = z.build(), z.example_inputs()
    program = torch.export.export(model, inputs, strict=False)
    torch.testing.assert_close(_run(program.module(), inputs), _run(model, inputs))


# -- model specifics ----------------------------------------------------------------------------------------


def test_gpt_lm_head_is_tied_to_wte():
    model = ZOO["gpt"].build()
    assert model.lm_head.weight is model.wte.weight


def test_tutorial_batchnorm_trains_like_torch_and_infers_from_moving_stats():
    torch.manual_seed(0)
    x = torch.randn(4, 3, 5, 5)
    ours, ref = BatchNorm(3, num_dims=4), nn.BatchNorm2d(3, momentum=0.1)
    torch.testing.assert_close(ours(x), ref(x))  # training: batch statistics
    torch.testing.assert_close(ours.moving_mean.flatten(), ref.running_mean)
    biased = x.var(dim=(0, 2, 3), unbiased=False)  # the tutorial tracks the biased variance
    torch.testing.assert_close(ours.moving_var.flatten(), 0.9 + 0.1 * biased)
    ours.eval()
    expected = F.batch_norm(x, ours.moving_mean.flatten(), ours.moving_var.flatten(), training=False, eps=1e-5)
    torch.testing.assert_close(ours(x), expected)


@pytest.mark.parametrize("cls", [LlamaRMSNorm, T5LayerNorm, GemmaRMSNorm])
def test_hf_style_norms_keep_half_precision_semantics(cls):
    torch.manual_seed(0)
    norm = cls(8)
    with torch.no_grad():
        norm.weight.uniform_(-0.5, 0.5)
    x = torch.randn(2, 3, 8)
    reference = norm(x)
    half = norm.to(torch.bfloat16)
    out = half(x.to(torch.bfloat16))
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out.float(), reference, rtol=2e-2, atol=2e-2)
