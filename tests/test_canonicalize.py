"""canonicalize: every hand-written norm -> its native module, exactly; refusals carry reasons."""

from __future__ import annotations

import json

import pytest
import torch
import torch.fx as fx
import torch.nn as nn
from hypothesis import given, settings
from hypothesis import strategies as st

from normconv.graph.detect import find_norms
from normconv.graph.capture import capture
from normconv.models import ZOO
from normconv.api import canonicalize
from normconv.passes.canonicalize import CANONICALIZE, Float32Norm, plan
from normconv.verify import Inputs, compare, run

import hf_tiny
from normconv.models.handwritten import BatchNorm, GemmaRMSNorm, LayerNorm, LlamaRMSNorm, T5LayerNorm

NATIVE = {"batchnorm": nn.modules.batchnorm._BatchNorm, "layernorm": nn.LayerNorm, "rmsnorm": nn.RMSNorm,
          "instancenorm": nn.modules.instancenorm._InstanceNorm}


def zoo_case(name):
    z = ZOO[name]
    return z.build(), Inputs(z.example_inputs())


def count(model, kind):
    return sum(isinstance(m, NATIVE[kind]) for m in model.modules())


def handwritten_left(model, inputs):
    return [s.target for s in find_norms(capture(model, inputs)) if s.source == "handwritten"]


def applied(report):
    return [s for s in report.sites if s.applied]


# -- the zoo's hand-written norms ------------------------------------------------------------------------

# zoo model -> native modules expected afterwards (kind -> count), and whether the result is a GraphModule
ZOO_EXPECT = {
    "tutorial_bn": ({"batchnorm": 3}, False),
    "tutorial_ln": ({"layernorm": 3}, False),
    "tutorial_rms": ({"rmsnorm": 5}, False),
    "inline_norm": ({"layernorm": 1, "rmsnorm": 1}, True),
    "hf_style_norms": ({"rmsnorm": 5}, False),
}


@pytest.mark.parametrize("name", sorted(ZOO_EXPECT))
def test_zoo_handwritten_norms_become_native(name):
    model, inputs = zoo_case(name)
    before_types = [type(m).__name__ for m in model.modules()]
    new, report = canonicalize(model, inputs)
    expect, graph = ZOO_EXPECT[name]
    assert report.validation[0].passed
    assert report.validation[0].max_abs_error < 1e-5
    assert compare(run(model, inputs), run(new, inputs), 1e-5, 1e-5).passed
    assert len(applied(report)) == ZOO[name].handwritten
    assert handwritten_left(new, inputs) == []
    for kind, n in expect.items():
        assert count(new, kind) == n, kind
        assert report.after[f"{kind} modules"] == n and report.before[f"{kind} modules"] == 0
    assert report.after["parameters"] == report.before["parameters"]
    assert isinstance(new, fx.GraphModule) == graph
    if not graph:
        assert type(new) is type(model)  # the user's own class comes back
    assert [type(m).__name__ for m in model.modules()] == before_types  # the input model is untouched


def test_tutorial_bn_state_dict_names_and_values():
    model, inputs = zoo_case("tutorial_bn")
    new, report = canonicalize(model, inputs)
    sd, old = new.state_dict(), model.state_dict()
    assert not any(k.endswith(("gamma", "beta", "moving_mean", "moving_var")) for k in sd)
    for i in (1, 2, 3):
        bn = getattr(new, f"bn{i}")
        assert isinstance(bn, nn.BatchNorm1d if i == 3 else nn.BatchNorm2d) and not bn.training
        torch.testing.assert_close(sd[f"bn{i}.weight"], old[f"bn{i}.gamma"].flatten())  # (1, C, 1, 1) -> (C,)
        torch.testing.assert_close(sd[f"bn{i}.running_var"], old[f"bn{i}.moving_var"].flatten())
    reason = next(s.reason for s in report.sites if s.target == "bn1")
    assert "bn1.gamma -> bn1.weight" in reason and "bn1.moving_mean -> bn1.running_mean" in reason


def test_gemma_weight_is_one_plus_w_and_eps_carried():
    model, inputs = zoo_case("hf_style_norms")
    new, _ = canonicalize(model, inputs)
    old_g = model.model.layers[0].post_attention_layernorm
    new_g = new.model.layers[0].post_attention_layernorm
    assert isinstance(old_g, GemmaRMSNorm) and isinstance(new_g, nn.RMSNorm)
    torch.testing.assert_close(new_g.weight, 1 + old_g.weight)
    assert new_g.eps == 1e-6 and new.model.layers[0].input_layernorm.eps == 1e-5
    assert isinstance(model.model.norm, T5LayerNorm) and isinstance(new.model.norm, nn.RMSNorm)


def test_plan_matches_what_the_pass_does():
    for name in ("inline_norm", "hf_style_norms"):
        model, inputs = zoo_case(name)
        cap = capture(model, inputs)
        planned = plan(cap, find_norms(cap))
        result = CANONICALIZE(model, cap)
        assert [(s.target, s.applied, s.reason) for s in planned] == \
            [(s.target, s.applied, s.reason) for s in result.sites]


# -- tiny Hugging Face models (torch.export capture, module-form sites) ----------------------------------


@pytest.mark.parametrize("name,sites", [("llama", 5), ("t5", 12), ("gemma", 5)])
def test_hf_tiny_models(name, sites):
    model, inputs = hf_tiny.TINY[name]()
    new, report = canonicalize(model, inputs)
    assert report.validation[0].passed and report.validation[0].max_abs_error < 1e-5
    assert len(applied(report)) == sites and len(report.sites) == sites
    assert count(new, "rmsnorm") == sites and count(model, "rmsnorm") == 0
    assert type(new) is type(model)
    assert handwritten_left(new, inputs) == []
    if name == "gemma":
        w = model.model.norm.weight
        torch.testing.assert_close(new.model.norm.weight, 1 + w)


# -- half precision: the float32-compute behaviour is kept ---------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_half_precision_hf_style_norms(dtype):
    model, inputs = zoo_case("hf_style_norms")
    model = model.to(dtype)
    new, report = canonicalize(model, inputs)
    assert report.validation[0].passed
    assert handwritten_left(new, inputs) == []
    # Gemma's (1 + w) in float32 cannot live in a half weight: kept in float32 between casts, bit-exact
    gemma = new.model.layers[0].post_attention_layernorm
    assert isinstance(gemma, Float32Norm) and gemma.norm.weight.dtype == torch.float32
    x = (torch.randn(4, 16, 32, generator=torch.Generator().manual_seed(1)) * 30).to(dtype)
    with torch.no_grad():
        assert torch.equal(gemma(x), model.model.layers[0].post_attention_layernorm(x))
        # Llama-style: native half RMSNorm computes in float32 and rounds once (Llama rounds twice): <= 1 ulp
        llama_old, llama_new = model.model.layers[0].input_layernorm, new.model.layers[0].input_layernorm
        assert isinstance(llama_old, LlamaRMSNorm) and isinstance(llama_new, nn.RMSNorm)
        a, b = llama_old(x).float(), llama_new(x).float()
        ulp = torch.finfo(dtype).eps * a.abs().clamp_min(torch.finfo(dtype).tiny)
        assert ((a - b).abs() <= ulp * 1.01).all()
        # statistics in float32: activations whose squares overflow half stay finite
        big = torch.full((2, 32), 300.0, dtype=dtype)
        assert llama_new(big).isfinite().all() and llama_old(big).isfinite().all()


def test_half_precision_hf_gemma_bit_exact():
    model, inputs = hf_tiny.tiny_gemma()
    model = model.to(torch.float16)
    new, report = canonicalize(model, inputs)
    assert report.validation[0].max_abs_error == 0.0
    assert all(isinstance(new.model.layers[i].input_layernorm, Float32Norm) for i in range(2))


def test_mixed_dtype_sites():
    """Half input, float32 weight: T5 computes and returns float32 (kept exactly by Float32Norm); Llama rounds
    to half before its float32 scale, which no single native op does: refused with the measured difference."""
    x = torch.randn(2, 4, 16, generator=torch.Generator().manual_seed(0)).half()
    t5 = nn.Sequential(nn.Identity(), T5LayerNorm(16)).eval()
    new, report = canonicalize(t5, Inputs((x,)))
    assert isinstance(new[1], Float32Norm) and new[1].out_dtype == torch.float32
    assert run(new, Inputs((x,))).dtype == torch.float32 and report.validation[0].max_abs_error < 1e-6
    llama = nn.Sequential(nn.Identity(), LlamaRMSNorm(16)).eval()
    with torch.no_grad():
        llama[1].weight.uniform_(0.5, 1.5)
    new, report = canonicalize(llama, Inputs((x,)))
    assert not applied(report) and "differs from the norm on the recorded input" in report.sites[0].reason


# -- other hand-written forms ---------------------------------------------------------------------------


class InlineInstanceNorm(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(3, 8, 3, padding=1)
        self.w = nn.Parameter(torch.rand(1, 8, 1, 1) + 0.5)
        self.b = nn.Parameter(torch.randn(1, 8, 1, 1))

    def forward(self, x):
        x = self.conv(x)
        u = x.mean((2, 3), keepdim=True)
        v = x.var((2, 3), keepdim=True, unbiased=False)
        return torch.relu((x - u) / torch.sqrt(v + 1e-5) * self.w + self.b)


class WeightOnlyLN(nn.Module):
    def __init__(self, h=16):
        super().__init__()
        self.g = nn.Parameter(torch.rand(h) + 0.5)

    def forward(self, x):
        m = x.mean(-1, keepdim=True)
        return (x - m) * torch.rsqrt(((x - m) ** 2).mean(-1, keepdim=True) + 1e-5) * self.g


class NoEpsRMS(nn.Module):
    def __init__(self, h=16):
        super().__init__()
        self.w = nn.Parameter(torch.rand(h) + 0.5)

    def forward(self, x):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True)) * self.w


class Wrap(nn.Module):
    def __init__(self, norm):
        super().__init__()
        self.fc = nn.Linear(16, 16)
        self.norm = norm

    def forward(self, x):
        return self.norm(self.fc(x))


def test_inline_instance_norm():
    torch.manual_seed(0)
    model, inputs = InlineInstanceNorm().eval(), Inputs((torch.randn(2, 3, 8, 8),))
    new, report = canonicalize(model, inputs)
    assert report.validation[0].passed and report.validation[0].max_abs_error < 1e-5
    assert isinstance(new, fx.GraphModule) and count(new, "instancenorm") == 1
    (norm,) = [m for m in new.modules() if isinstance(m, nn.InstanceNorm2d)]
    assert norm.affine and norm.eps == 1e-5 and not norm.track_running_stats
    assert "InstanceNorm2d" in applied(report)[0].reason


def test_weight_only_layernorm_gets_no_bias_and_eps_zero_is_kept():
    torch.manual_seed(0)
    inputs = Inputs((torch.randn(2, 5, 16),))
    new, report = canonicalize(Wrap(WeightOnlyLN()).eval(), inputs)
    assert isinstance(new.norm, nn.LayerNorm) and new.norm.bias is None and report.validation[0].passed
    new, report = canonicalize(Wrap(NoEpsRMS()).eval(), inputs)  # eps 0 inside the sqrt: native eps=0.0 is exact
    assert isinstance(new.norm, nn.RMSNorm) and new.norm.eps == 0.0
    assert report.validation[0].max_abs_error < 1e-5


class ModuleAndInline(nn.Module):
    """A hand-written BN module and an inline RMSNorm in one traced graph, plus a LayerNorm module called twice."""

    def __init__(self):
        super().__init__()
        self.ln = LayerNorm(16)
        self.fc = nn.Linear(16, 16)
        self.w = nn.Parameter(torch.rand(16) + 0.5)
        self.bn = BatchNorm(4, num_dims=2)
        with torch.no_grad():
            self.bn.moving_var.uniform_(0.5, 2.0)
            self.bn.moving_mean.normal_()

    def forward(self, x):
        h = self.fc(self.ln(x))
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + 1e-6) * self.w
        return self.bn(h.mean(-1)), self.ln(h)


def test_graph_rewrite_with_module_and_inline_sites():
    torch.manual_seed(0)
    model, inputs = ModuleAndInline().eval(), Inputs((torch.randn(3, 4, 16),))
    new, report = canonicalize(model, inputs)
    by_reason = {s.target: s for s in report.sites}
    assert by_reason["bn"].applied and isinstance(new.bn, nn.BatchNorm1d) and not new.bn.training
    assert isinstance(new, fx.GraphModule) and count(new, "rmsnorm") == 1
    # the LayerNorm module called twice: one native module at both calls, its weight still one tensor
    twice = [s for s in report.sites if s.target == "ln"]
    assert len(twice) == 2 and all(s.applied for s in twice) and isinstance(new.ln, nn.LayerNorm)
    assert [n.target for n in new.graph.nodes if n.op == "call_module" and n.target == "ln"] == ["ln", "ln"]
    assert "bn.gamma" not in new.state_dict() and "bn.running_var" in new.state_dict()
    assert report.validation[0].passed and report.validation[0].max_abs_error < 1e-5


# -- refusals --------------------------------------------------------------------------------------------


class StatReused(nn.Module):  # the mean square feeds other code too
    def __init__(self):
        super().__init__()
        self.w = nn.Parameter(torch.rand(16) + 0.5)

    def forward(self, x):
        ms = x.pow(2).mean(-1, keepdim=True)
        return x * torch.rsqrt(ms + 1e-6) * self.w + ms


class ChannelsFirstLN(nn.Module):  # ConvNeXt-style LN over dim 1
    def __init__(self):
        super().__init__()
        self.w = nn.Parameter(torch.rand(8) + 0.5)
        self.b = nn.Parameter(torch.randn(8))

    def forward(self, x):
        u = x.mean(1, keepdim=True)
        v = (x - u).pow(2).mean(1, keepdim=True)
        return self.w[:, None, None] * ((x - u) / torch.sqrt(v + 1e-6)) + self.b[:, None, None]


class ChannelsFirstRMS(nn.Module):  # RMSNorm over the channels of (N, C, L), no upcast
    def __init__(self):
        super().__init__()
        self.weight = nn.Parameter(torch.rand(8) + 0.5)

    def forward(self, x):
        return x * torch.rsqrt(x.pow(2).mean(1, keepdim=True) + 1e-6) * self.weight[:, None]


class TwoDimsLN(nn.Module):  # LayerNorm over (C, H) of (N, C, H, W), weight (C, H, 1)
    def __init__(self):
        super().__init__()
        self.weight = nn.Parameter(torch.rand(8, 5, 1) + 0.5)

    def forward(self, x):
        u = x.mean((1, 2), keepdim=True)
        v = x.var((1, 2), keepdim=True, unbiased=False)
        return (x - u) / torch.sqrt(v + 1e-5) * self.weight


@pytest.mark.parametrize("model,x,x2,dims,native", [
    (ChannelsFirstLN(), torch.randn(2, 8, 5, 5), torch.randn(1, 8, 7, 3), (-3,), nn.LayerNorm),
    (ChannelsFirstRMS(), torch.randn(2, 8, 7), torch.randn(3, 8, 4), (-2,), nn.RMSNorm),
    (TwoDimsLN(), torch.randn(2, 8, 5, 6), torch.randn(1, 8, 5, 2), (-3, -2), nn.LayerNorm),
])
def test_norm_over_non_trailing_dims_becomes_a_native_norm_on_moved_dims(tmp_path, model, x, x2, dims, native):
    """NAFNet / ConvNeXt channels-first norms: the native norm on x.movedim(dims, -1), moved back; exact at another
    shape, and exported as one fused norm op between two Transposes."""
    from normconv.api import export
    from normconv.nn.modules import MovedDimNorm

    model = model.eval()
    new, report = canonicalize(model, Inputs((x,)))
    assert [s.applied for s in report.sites if s.pass_name == "canonicalize"] == [True]
    moved = [m for m in new.modules() if isinstance(m, MovedDimNorm)]
    assert len(moved) == 1 and moved[0].dims == dims and isinstance(moved[0].norm, native)
    with torch.no_grad():
        assert (new(x2) - model(x2)).abs().max() < 1e-5
    onnx_report = export(model, (x,), tmp_path / "m.onnx", repeats=0)
    assert onnx_report.passed and sum(onnx_report.extra["fused_norm_ops"].values()) == 1
    assert onnx_report.after.get("Transpose") == 2 and "ReduceMean" not in onnx_report.after


def test_moved_dim_norm_is_written_in_torch_only_form(cli, tmp_path):
    from normconv.io.outputs import normconv_parts

    out = tmp_path / "naf.pt"
    code, _, err = cli("canonicalize", "zoo:nafnet_fp16", "-o", str(out))
    assert code == 0, err
    model, inputs = zoo_case("nafnet_fp16")
    loaded = torch.load(out, weights_only=False)
    assert normconv_parts(loaded) == []
    assert compare(run(model, inputs), run(loaded, inputs), 1e-5, 1e-5).passed


class EpsOutsideSqrt(nn.Module):
    def __init__(self):
        super().__init__()
        self.w = nn.Parameter(torch.rand(16) + 0.5)

    def forward(self, x):
        m = x.mean(-1, keepdim=True)
        v = ((x - m) ** 2).mean(-1, keepdim=True)
        return (x - m) / (torch.sqrt(v) + 1e-5) * self.w


class TiedScale(nn.Module):  # the norm's scale is also the next layer's parameter
    def __init__(self):
        super().__init__()
        self.norm = LlamaRMSNorm(16)
        self.other = nn.Module()
        self.other.scale = self.norm.weight

    def forward(self, x):
        return self.norm(x) * self.other.scale


class KeywordCall(nn.Module):
    def __init__(self):
        super().__init__()
        self.norm = LayerNorm(16)

    def forward(self, x):
        return self.norm(x=x)


@pytest.mark.parametrize("model,x,why", [
    (StatReused(), torch.randn(2, 4, 16), "intermediate value of the norm is used outside it"),
    (TiedScale(), torch.randn(2, 4, 16), "is shared with other.scale"),
    (KeywordCall(), torch.randn(2, 4, 16), "called with 0 positional and 1 keyword"),
])
def test_refusals_report_reasons_and_leave_the_model_unchanged(model, x, why):
    inputs = Inputs((x,))
    new, report = canonicalize(model.eval(), inputs)
    ours = [s for s in report.sites if s.pass_name == "canonicalize"]
    assert ours and not any(s.applied for s in ours)
    assert any(why in s.reason for s in ours), [s.reason for s in ours]
    assert report.validation[0].max_abs_error == 0.0
    assert "no hand-written norm was replaced; the model is unchanged" in report.notes


def test_eps_outside_sqrt_is_not_a_norm_site_and_is_left_alone():
    inputs = Inputs((torch.randn(2, 4, 16),))
    new, report = canonicalize(EpsOutsideSqrt().eval(), inputs)
    assert not applied(report) and report.validation[0].max_abs_error == 0.0
    assert type(new) is EpsOutsideSqrt


def test_inline_norm_in_an_exported_graph_is_refused():
    model, inputs = zoo_case("inline_norm")
    new, report = canonicalize(model, inputs, method="torch.export")
    inline = [s for s in report.sites if s.target in ("add_1", "mul_3") or "inline" in s.reason]
    assert inline and all(not s.applied and "torch.export graph" in s.reason for s in inline)
    assert type(new) is type(model)


# -- property: random hand-written norm modules canonicalize exactly ------------------------------------


class RandomNorm(nn.Module):
    def __init__(self, kind, h, eps, weight, bias, upcast):
        super().__init__()
        self.kind, self.eps, self.upcast = kind, eps, upcast
        self.w = nn.Parameter(torch.rand(h) + 0.5) if weight else None
        self.b = nn.Parameter(torch.randn(h)) if bias else None

    def forward(self, x):
        h = x.float() if self.upcast else x
        if self.kind == "layernorm":
            m = h.mean(-1, keepdim=True)
            y = (h - m) / torch.sqrt(h.var(-1, keepdim=True, unbiased=False) + self.eps)
        else:
            y = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        y = y.to(x.dtype)
        if self.w is not None:
            y = y * self.w
        if self.b is not None:
            y = y + self.b
        return y


@settings(max_examples=20, deadline=None)
@given(kind=st.sampled_from(["layernorm", "rmsnorm"]), h=st.integers(2, 48),
       eps=st.sampled_from([1e-12, 1e-6, 1e-5, 1e-3, 0.1]), weight=st.booleans(), bias=st.booleans(),
       upcast=st.booleans(), seed=st.integers(0, 1000))
def test_random_handwritten_norms_canonicalize_exactly(kind, h, eps, weight, bias, upcast, seed):
    if kind == "rmsnorm":
        bias = False
    g = torch.Generator().manual_seed(seed)
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(h, h), RandomNorm(kind, h, eps, weight, bias, upcast)).eval()
    inputs = Inputs((torch.randn(3, 7, h, generator=g) * 4,))
    new, report = canonicalize(model, inputs)
    assert len(applied(report)) == 1, [s.reason for s in report.sites]
    assert count(new, kind) == 1
    assert report.validation[0].passed and report.validation[0].max_abs_error < 1e-4


# -- command line ---------------------------------------------------------------------------------------


def test_cli_writes_a_loadable_model_and_json_shape(cli, tmp_path):
    out = tmp_path / "ln.pt"
    code, stdout, _ = cli("canonicalize", "zoo:tutorial_ln", "-o", out, "--json")
    assert code == 0, stdout
    doc = json.loads(stdout)
    assert {"command", "model", "output", "sites", "validation", "before", "after", "notes"} <= set(doc)
    assert doc["command"] == "canonicalize" and doc["output"] == str(out) and doc["passed"]
    assert [s["applied"] for s in doc["sites"]] == [True] * 3
    assert set(doc["sites"][0]) == {"pass", "target", "applied", "code", "reason"} and doc["sites"][0]["code"]
    assert doc["before"]["layernorm modules"] == 0 and doc["after"]["layernorm modules"] == 3
    from normconv.io.load import load

    loaded = load(str(out))  # native modules and the zoo's classes only: no --trust-pickle needed
    assert count(loaded.model, "layernorm") == 3
    ref_model, inputs = zoo_case("tutorial_ln")
    assert compare(run(ref_model, inputs), run(loaded.model, inputs), 1e-5, 1e-5).passed


def test_cli_table_output(cli):
    code, stdout, _ = cli("canonicalize", "zoo:inline_norm")
    assert code == 0
    assert "canonicalize: 2 applied, 2 skipped" in stdout and "PASSED" in stdout
    assert "torch.fx.GraphModule" in stdout


def test_cli_tolerance_miss_exits_1_and_writes_nothing(cli, tmp_path):
    out = tmp_path / "out.pt"
    code, stdout, stderr = cli("canonicalize", "zoo:tutorial_ln", "-o", out, "--atol", "0", "--rtol", "0", "--json")
    assert code == 1
    assert "outputs differ beyond tolerance" in stderr and "nothing written" in stderr
    assert not out.exists() and not list(tmp_path.iterdir())
    assert json.loads(stdout)["passed"] is False


def test_cli_bad_input_exits_2(cli, tmp_path):
    code, _, stderr = cli("canonicalize", str(tmp_path / "missing.pt"))
    assert code == 2 and stderr.startswith("error: ") and len(stderr.strip().splitlines()) == 1
    code, _, stderr = cli("canonicalize", "zoo:tutorial_ln", "-o", tmp_path / "no" / "such" / "dir.pt")
    assert code == 2 and "does not exist" in stderr


class _FreeSizeNorms(nn.Module):
    """Hand-written norms over axes whose size the model leaves free (users' GroupNorm via reshape, InstanceNorm via
    flatten, a per-channel norm over time, a LayerNorm over C, H, W without affine), after a conv."""

    def __init__(self, how: str, rank: int):
        super().__init__()
        self.how = how
        self.conv = (nn.Conv2d if rank == 4 else nn.Conv1d)(8, 8, 3, padding=1)

    def forward(self, x):
        y = self.conv(x)
        n = y.shape[0]
        if self.how == "group":
            z = y.reshape(n, 2, -1)
        elif self.how == "instance":
            z = y.flatten(2)
        else:
            z = y
        dims = (1, 2, 3) if self.how == "chw" else (-1,)
        mu = z.mean(dim=dims, keepdim=True)
        var = ((z - mu) ** 2).mean(dim=dims, keepdim=True)
        return ((z - mu) / torch.sqrt(var + 1e-5)).reshape(y.shape)


@pytest.mark.parametrize("how, shape, other", [("group", (2, 8, 6, 6), (3, 8, 5, 7)),
                                               ("instance", (2, 8, 6, 6), (1, 8, 10, 10)),
                                               ("time", (2, 8, 16), (3, 8, 11)),
                                               ("chw", (2, 8, 6, 6), (1, 8, 9, 9))])
def test_a_norm_over_free_sizes_is_never_passed_pinned_to_the_example(how, shape, other):
    """A native LayerNorm(normalized_shape) pins the sizes the hand-written norm leaves free. The check's second shape
    now moves a small image's sides (from 4, was 8) and a conv signal's length, so such a rewrite fails its proof
    (exit 1) instead of passing and raising at the next size; a rewrite that passes runs at every size."""
    from normconv.errors import VerificationError

    torch.manual_seed(0)
    model = _FreeSizeNorms(how, len(shape)).eval()
    try:
        new, report = canonicalize(model, torch.randn(shape))
    except VerificationError as exc:
        # a view of G groups per sample is GroupNorm / InstanceNorm, any size (graph.grouped): never this failure
        assert how == "time", str(exc)  # over (C, H, W): GroupNorm(1, C), any size
        assert "fails where the original runs (RuntimeError: Given normalized_shape" in str(exc), str(exc)
        return
    assert report.passed
    for s in (other, shape):
        x = torch.randn(s)
        assert compare(run(model, Inputs((x,))), run(new, Inputs((x,)))).passed


def test_a_functional_norm_over_a_slice_of_its_input_s_shape():
    """F.layer_norm(y, y.shape[-1:]): the shape is a traced slice of the input's sizes (a Node, not a tuple): every
    command said 'TypeError: Node object is not iterable' (exit 3). Now the site reads its sizes off the input."""
    import torch.nn.functional as F

    class Blk(nn.Module):
        def __init__(self):
            super().__init__()
            self.conv = nn.Conv2d(8, 8, 3, padding=1)

        def forward(self, x):
            y = self.conv(x)
            return F.layer_norm(y, y.shape[-2:]) + F.rms_norm(y, y.size()[1:])

    from normconv.api import inspect

    x = torch.randn(2, 8, 6, 6)
    sites = inspect(Blk().eval(), x).sites
    assert sorted((s["kind"], tuple(s["normalized_shape"])) for s in sites) == [("layernorm", (6, 6)),
                                                                                ("rmsnorm", (8, 6, 6))]
    new, report = canonicalize(Blk().eval(), x)
    assert report.passed
