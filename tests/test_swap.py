"""swap: exact LayerNorm -> RMSNorm on pre-LN models (zoo gpt, HF GPT-2), refusals with reasons, approximate
mode with measured drift, RMSNorm -> LayerNorm, the CLI's exit codes, and a property test on random stacks."""

from __future__ import annotations

import json

import pytest
import torch
import torch.nn as nn
from hypothesis import given, settings
from hypothesis import strategies as st

from normconv.errors import NormconvError
from normconv.models import ZOO
from normconv.api import swap
from normconv.nn.modules import BiasAfterNorm
from normconv.nn.rmsnorm import RMSNorm
from normconv.passes.swap_norm import SwapWhy
from normconv.verify import Inputs, run

FP32_TOL = dict(atol=1e-4, rtol=1e-4)  # the documented fp32 tolerance of exact passes (verify.DEFAULT_TOLERANCE)


def _zoo(name):
    z = ZOO[name]
    return z.build(), Inputs(z.example_inputs())


def _count(model, cls):
    return sum(type(m) is cls for m in model.modules())


def _assert_same_logits(ref, new):
    torch.testing.assert_close(new, ref, **FP32_TOL)
    assert torch.equal(new.argmax(-1), ref.argmax(-1))


def _randomize_norms(model, seed=0):
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for m in model.modules():
            if isinstance(m, nn.LayerNorm):
                m.weight.copy_(1 + 0.3 * torch.randn(m.weight.shape, generator=g))
                m.bias.copy_(0.3 * torch.randn(m.bias.shape, generator=g))
    return model


# -- exact ----------------------------------------------------------------------------------------------------


def test_zoo_gpt_swaps_exactly_and_unties_the_embedding():
    model, inputs = _zoo("gpt")
    assert model.lm_head.weight is model.wte.weight
    new, report = swap(model, inputs)
    _assert_same_logits(run(model, inputs), run(new, inputs))
    assert _count(new, nn.LayerNorm) == 0 and _count(new, RMSNorm) == 5
    assert all(m.eps == 1e-5 for m in new.modules() if isinstance(m, RMSNorm))
    # the tie is cut: the embedding is centered, lm_head keeps the original rows (plus the folded ln_f bias)
    assert new.lm_head.weight is not new.wte.weight
    assert torch.equal(new.lm_head.weight, model.wte.weight)
    assert new.wte.weight.mean(1).abs().max() < 1e-6
    assert new.lm_head.bias is not None
    assert any("untied wte.weight" in n for n in report.notes)
    assert report.extra["exact"] and report.extra["argmax_agreement"] == 1.0
    assert model.lm_head.weight is model.wte.weight and _count(model, nn.LayerNorm) == 5  # input untouched


def test_hf_gpt2_swaps_exactly():
    from hf_tiny import tiny_gpt2

    model, inputs = tiny_gpt2()
    _randomize_norms(model)  # HF initializes LN to (1, 0): give the bias fold something to do
    new, report = swap(model, inputs)
    _assert_same_logits(run(model, inputs).logits, run(new, inputs).logits)
    assert _count(new, nn.LayerNorm) == 0 and _count(new, RMSNorm) == 5
    # Conv1D weights are (in, out): the centered axis is the output one
    w = new.transformer.h[0].attn.c_proj.weight
    assert w.mean(1).abs().max() < 1e-6 and w.mean(0).abs().max() > 1e-4
    assert new.lm_head.weight is not new.transformer.wte.weight
    assert new.config.tie_word_embeddings is False
    new.tie_weights()  # Hugging Face must not re-tie the centered embedding to the head
    _assert_same_logits(run(model, inputs).logits, run(new, inputs).logits)


@pytest.mark.parametrize("name", ["opt", "gpt_neo", "gpt_neox"])
def test_more_hf_pre_ln_decoders_swap_exactly(name):
    """Pre-LN decoders nobody here wrote: OPT (learned positions with an offset), GPT-Neo (tied head),
    GPT-NeoX (parallel residual): every LayerNorm becomes RMSNorm and the logits stay the same."""
    from hf_tiny import TINY_PRE_LN

    model, inputs = TINY_PRE_LN[name]()
    _randomize_norms(model)
    n_ln = _count(model, nn.LayerNorm)
    new, report = swap(model, inputs)
    _assert_same_logits(run(model, inputs).logits, run(new, inputs).logits)
    assert _count(new, nn.LayerNorm) == 0 and _count(new, RMSNorm) == n_ln == 5
    assert report.extra["exact"] and report.extra["argmax_agreement"] == 1.0


def test_round_trip_back_to_layernorm_is_exact():
    model, inputs = _zoo("gpt")
    rms, _ = swap(model, inputs)
    back, report = swap(rms, inputs, to="layernorm")
    _assert_same_logits(run(model, inputs), run(back, inputs))
    assert _count(back, nn.LayerNorm) == 5 and report.extra["exact"]
    assert all(m.bias is None for m in back.modules() if isinstance(m, nn.LayerNorm))


# -- refusals and approximate ---------------------------------------------------------------------------------


@pytest.mark.parametrize("name", ["bert", "seq2seq"])
def test_post_ln_is_refused_then_approximate_reports_drift(name):
    model, inputs = _zoo(name)
    with pytest.raises(NormconvError, match="post-LN"):
        swap(model, inputs)
    new, report = swap(model, inputs, approximate=True)
    assert _count(new, nn.LayerNorm) == 0
    drift = report.extra["drift"]
    assert drift["max_abs_error"] > 1e-3 and drift["cosine"] < 1.0
    assert not report.extra["exact"] and report.extra["refused"] > 0
    assert any("approximate swap" in n for n in report.notes)


def test_llama_to_layernorm_refused_then_approximate():
    model, inputs = _zoo("llama")
    with pytest.raises(NormconvError, match="not zero-mean"):
        swap(model, inputs, to="layernorm")
    new, report = swap(model, inputs, to="layernorm", approximate=True)
    lns = [m for m in new.modules() if isinstance(m, nn.LayerNorm)]
    assert len(lns) == 5 and all(m.eps == 1e-6 and m.bias is None for m in lns)
    assert report.extra["drift"]["max_abs_error"] > 1e-3


def test_rmsnorm_eps_none_carried_as_dtype_epsilon():
    model = nn.Sequential(nn.Linear(8, 16), nn.RMSNorm(16, eps=None))
    new, _ = swap(model, Inputs((torch.randn(3, 8),)), to="layernorm", approximate=True)
    assert new[1].eps == torch.finfo(torch.float32).eps


class _Block(nn.Module):
    def __init__(self, d, kind="ok"):
        super().__init__()
        self.kind = kind
        self.ln = nn.LayerNorm(d)
        self.fc = nn.Linear(d, d)

    def forward(self, x):
        if self.kind == "relu_writer":  # x + relu(fc(ln(x))): the writer is a ReLU
            return x + torch.relu(self.fc(self.ln(x)))
        if self.kind == "relu_consumer":  # x + fc(relu(ln(x))): the norm's bias cannot fold through ReLU
            return x + self.fc(torch.relu(self.ln(x)))
        return x + self.fc(self.ln(x))


class _Stack(nn.Module):
    def __init__(self, kind="ok", embed=True, return_stream=False, d=16):
        super().__init__()
        self.inp = nn.Linear(6, d) if embed else nn.Identity()
        self.block = _Block(d, kind)
        self.ln_f = nn.LayerNorm(d)
        self.head = nn.Linear(d, 5)
        self.return_stream = return_stream

    def forward(self, x):
        x = self.block(self.inp(x))
        y = self.head(self.ln_f(x))
        return (y, x) if self.return_stream else y


@pytest.mark.parametrize("kwargs,why", [
    (dict(kind="relu_writer"), "not a linear layer or an embedding"),
    (dict(return_stream=True), "also read by the model.s output"),
])
def test_structural_refusals_name_the_site_and_reason(kwargs, why):
    model = _randomize_norms(_Stack(**kwargs).eval())
    inputs = Inputs((torch.randn(2, 3, 6),))
    with pytest.raises(NormconvError, match=why):
        swap(model, inputs)
    _, report = swap(model, inputs, approximate=True)
    assert report.extra["drift"]["max_abs_error"] > 0


def _kept_bias_sites(report):
    return [s.target for s in report.sites if s.pass_name == "swap" and s.code == SwapWhy.BIAS_KEPT]


def test_a_bias_no_linear_takes_stays_an_add_after_the_rmsnorm():
    """x + fc(relu(ln(x))): no linear reads the norm directly, so its bias cannot fold; RMSNorm(x) * g + b is the
    same sum on the centered stream: exact, the bias an add after the RMSNorm."""
    model = _randomize_norms(_Stack(kind="relu_consumer").eval())
    inputs = Inputs((torch.randn(2, 3, 6),))
    new, report = swap(model, inputs)
    assert report.passed and report.extra["exact"]
    assert _kept_bias_sites(report) == ["block.ln"]
    assert isinstance(new.block.ln, BiasAfterNorm) and isinstance(new.block.ln.norm, RMSNorm)
    torch.testing.assert_close(new.block.ln.bias, model.block.ln.bias)
    assert isinstance(new.ln_f, RMSNorm)  # its bias still folds into the head
    x2 = Inputs((torch.randn(3, 5, 6),))
    torch.testing.assert_close(run(new, x2), run(model, x2), **FP32_TOL)


@pytest.mark.parametrize("factory,kept", [("tiny_mobilevit", 3), ("trained_dinov2", 1)])
def test_hf_vision_norms_feeding_a_transpose_or_the_output_swap_exactly(factory, kept, cli, tmp_path):
    """MobileViT folds each stage's last LayerNorm back into patches (a transpose); DINOv2 returns its final
    LayerNorm's output: their biases stay adds after the RMSNorms, and the swap is exact."""
    pytest.importorskip("transformers")
    import tests.hf_tiny as hf

    model, inputs = getattr(hf, factory)()  # LayerNorm affines and BatchNorm statistics randomized
    new, report = swap(model, inputs)
    assert report.passed and report.extra["exact"] and report.extra["refused"] == 0
    assert len(_kept_bias_sites(report)) == kept
    assert _count(new, nn.LayerNorm) == 0
    ref, out = run(model, inputs), run(new, inputs)
    err = (out.last_hidden_state - ref.last_hidden_state).abs().max() / ref.last_hidden_state.abs().max()
    assert err < 1e-5
    # written as .pt with torch's own modules, loaded back and run
    code, _, err_text = cli("swap", f"tests.hf_tiny:{factory}", "--to", "rmsnorm", "-o", tmp_path / "s.pt")
    assert code == 0, err_text
    loaded = torch.load(tmp_path / "s.pt", weights_only=False)
    assert not any(type(m).__module__.startswith("normconv") for m in loaded.modules())
    torch.testing.assert_close(loaded(*inputs.args).last_hidden_state, model(*inputs.args).last_hidden_state,
                               **FP32_TOL)


def test_stream_from_the_raw_input_is_refused():
    model = _randomize_norms(_Stack(embed=False).eval())
    with pytest.raises(NormconvError, match="model input"):
        swap(model, Inputs((torch.randn(2, 3, 16),)))


class _TwoStreams(nn.Module):
    """A pre-LN stack (exact) beside a LayerNorm of a ReLU's output (no weights center a ReLU)."""

    def __init__(self, d=16):
        super().__init__()
        self.stack, self.side, self.side_ln = _Stack(d=d), nn.Linear(6, d), nn.LayerNorm(d)

    def forward(self, x):
        return self.stack(x), self.side_ln(torch.relu(self.side(x)))


def test_partial_swaps_the_exact_sites_and_keeps_the_others():
    model = _randomize_norms(_TwoStreams().eval())
    inputs = Inputs((torch.randn(2, 3, 6),))
    with pytest.raises(NormconvError, match="Pass --partial to swap only the exact sites"):
        swap(model, inputs)
    new, report = swap(model, inputs, partial=True)
    assert isinstance(new.stack.block.ln, nn.RMSNorm) and isinstance(new.stack.ln_f, nn.RMSNorm)
    assert type(new.side_ln) is nn.LayerNorm  # kept, and said why
    assert report.passed and report.extra["exact"] and report.extra["partial"]
    assert (report.extra["swapped"], report.extra["refused"]) == (2, 1)
    kept = [s for s in report.sites if s.pass_name == "swap" and not s.applied]
    assert [s.target for s in kept] == ["side_ln"] and "not a linear layer" in kept[0].reason
    assert any(n.startswith("--partial: 2 of 3 layernorm sites swapped exactly") for n in report.notes)
    x2 = Inputs((torch.randn(3, 5, 6),))  # another shape: still exact
    for a, b in zip(run(new, x2), run(model, x2)):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-4)


def test_partial_with_no_exact_site_or_with_approximate_is_refused():
    model = _randomize_norms(_Stack(kind="relu_writer").eval())
    inputs = Inputs((torch.randn(2, 3, 6),))
    with pytest.raises(NormconvError, match="--partial: no site can be swapped exactly"):
        swap(model, inputs, partial=True)
    with pytest.raises(NormconvError, match="choose --partial .* or --approximate"):
        swap(model, inputs, partial=True, approximate=True)


# -- property: random pre-LN stacks swap exactly ---------------------------------------------------------------


class _PreLNStack(nn.Module):
    def __init__(self, d, hidden, depth, bias, eps, embed, head_bias):
        super().__init__()
        self.inp = nn.Embedding(50, d) if embed else nn.Linear(7, d, bias=bias)
        self.lns = nn.ModuleList(nn.LayerNorm(d, eps=eps) for _ in range(2 * depth))
        self.fc1 = nn.ModuleList(nn.Linear(d, hidden, bias=bias) for _ in range(depth))
        self.fc2 = nn.ModuleList(nn.Linear(hidden, d, bias=bias) for _ in range(depth))
        self.proj = nn.ModuleList(nn.Linear(d, d, bias=bias) for _ in range(depth))
        self.ln_f = nn.LayerNorm(d, eps=eps)
        self.head = nn.Linear(d, 11, bias=head_bias)

    def forward(self, x):
        h = self.inp(x)
        for i in range(len(self.fc1)):
            h = h + self.proj[i](self.lns[2 * i](h))
            h = h + self.fc2[i](torch.nn.functional.gelu(self.fc1[i](self.lns[2 * i + 1](h))))
        return self.head(self.ln_f(h))


@settings(max_examples=60, deadline=None)
@given(d=st.integers(4, 48), hidden=st.integers(4, 64), depth=st.integers(1, 3), bias=st.booleans(),
       eps=st.sampled_from([1e-12, 1e-6, 1e-5, 1e-3, 0.1]), embed=st.booleans(), head_bias=st.booleans(),
       seed=st.integers(0, 2**16))
def test_random_pre_ln_stacks_swap_exactly(d, hidden, depth, bias, eps, embed, head_bias, seed):
    torch.manual_seed(seed)
    model = _randomize_norms(_PreLNStack(d, hidden, depth, bias, eps, embed, head_bias).eval(), seed)
    x = torch.randint(0, 50, (2, 5)) if embed else torch.randn(2, 5, 7)
    inputs = Inputs((x,))
    new, report = swap(model, inputs)
    _assert_same_logits(run(model, inputs), run(new, inputs))
    assert _count(new, nn.LayerNorm) == 0 and _count(new, RMSNorm) == 2 * depth + 1
    assert all(m.eps == eps for m in new.modules() if isinstance(m, RMSNorm))


# -- the command line ----------------------------------------------------------------------------------------


def test_cli_exact_writes_a_model_with_the_same_outputs(cli, tmp_path):
    out = tmp_path / "gpt_rms.pt"
    code, stdout, _ = cli("swap", "zoo:gpt", "--to", "rmsnorm", "-o", out, "--json")
    assert code == 0, stdout
    report = json.loads(stdout)
    assert report["passed"] and report["extra"]["exact"] and report["output"] == str(out)
    assert report["after"]["rmsnorm modules"] == 5 and report["after"]["layernorm modules"] == 0
    saved = torch.load(out, weights_only=False)
    model, inputs = _zoo("gpt")
    _assert_same_logits(run(model, inputs), run(saved, inputs))


def test_cli_post_ln_refused_without_approximate(cli, tmp_path):
    out = tmp_path / "bert.pt"
    code, _, stderr = cli("swap", "zoo:bert", "-o", out)
    assert code == 2 and "post-LN" in stderr and "--approximate" in stderr
    assert not out.exists()
    code, stdout, _ = cli("swap", "zoo:bert", "--approximate", "-o", out, "--json")
    assert code == 0 and out.exists()
    drift = json.loads(stdout)["extra"]["drift"]
    assert drift["max_abs_error"] > 0 and drift["cosine"] < 1


def relu_writer_stack():
    """No site swaps exactly: a ReLU writes the stream both norms read."""
    return _randomize_norms(_Stack(kind="relu_writer").eval()), (torch.randn(2, 3, 6),)


def test_cli_partial_on_a_model_with_no_exact_site_exits_2_and_writes_nothing(cli, tmp_path):
    out = tmp_path / "none.pt"
    code, _, stderr = cli("swap", "tests.test_swap:relu_writer_stack", "--partial", "-o", out)
    assert code == 2 and "--partial: no site can be swapped exactly" in stderr and not out.exists()
    # post-LN BERT: only the embedding LayerNorm reads a stream that can be centered (its bias stays an add)
    code, stdout, _ = cli("swap", "zoo:bert", "--partial", "-o", tmp_path / "bert.pt", "--json")
    assert code == 0 and json.loads(stdout)["extra"]["swapped"] == 1
    out = tmp_path / "gpt.pt"
    code, stdout, _ = cli("swap", "zoo:gpt", "--partial", "-o", out, "--json")  # every site exact: all swapped
    assert code == 0 and json.loads(stdout)["extra"]["swapped"] == 5 and out.exists()


def test_cli_tolerance_miss_exits_1_and_writes_nothing(cli, tmp_path):
    out = tmp_path / "gpt.pt"
    code, _, stderr = cli("swap", "zoo:gpt", "--atol", "0", "--rtol", "0", "-o", out)
    assert code == 1 and "nothing written" in stderr
    assert not out.exists()


def test_cli_bad_target(cli):
    code, _, stderr = cli("swap", "zoo:gpt", "--to", "batchnorm2")  # batchnorm is a target now (BatchNorm models)
    assert code == 2 and "unknown --to" in stderr
    code, _, stderr = cli("swap", "zoo:gpt", "--to", "batchnorm")
    assert code == 2 and "no BatchNorm module to convert" in stderr


def test_functional_layer_norm_becomes_a_module_then_swaps_exactly(cli, tmp_path):
    """F.layer_norm(x, (x.shape[-1],), w, b) inside a block: canonicalize (as swap's first step) makes it a module
    in the traced graph, then swap handles it like any LayerNorm; the result is a GraphModule, said in a note."""
    from torch.fx import GraphModule

    from tests.fixtures.user_models import functional_pre_ln

    model, args = functional_pre_ln()
    new, report = swap(model, Inputs(args))
    assert isinstance(new, GraphModule) and _count(new, RMSNorm) == 3 and _count(new, nn.LayerNorm) == 0
    _assert_same_logits(run(model, Inputs(args)), run(new, Inputs(args)))
    made = [s for s in report.sites if s.pass_name == "canonicalize" and s.applied]
    assert len(made) == 2 and all("functional layernorm" in s.reason and "eps=1e-05" in s.reason for s in made)
    assert report.extra["exact"] and any("GraphModule" in n for n in report.notes)
    # canonicalize on its own leaves a native functional call alone
    from normconv.api import canonicalize

    same, creport = canonicalize(model, Inputs(args))
    assert same is not None and not any(s.applied for s in creport.sites)
    code, _, stderr = cli("swap", "tests.fixtures.user_models:functional_pre_ln", "--to", "rmsnorm",
                          "-o", tmp_path / "s.pt")
    assert code == 0 and (tmp_path / "s.pt").exists(), stderr
    # inspect plans on the model as swap will see it, under the original site names
    code, stdout, _ = cli("inspect", "tests.fixtures.user_models:functional_pre_ln", "--json")
    sites = json.loads(stdout)["sites"]
    plans = {s["target"]: {p["pass"]: p for p in s["plan"]} for s in sites}
    assert set(plans) == {"layer_norm", "layer_norm_1", "ln"}
    assert all(p["swap"]["applied"] and "exact" in p["swap"]["reason"] for p in plans.values())
    assert plans["layer_norm"]["canonicalize"]["reason"] == "already native (functional layernorm)"


def test_disposable_model_is_rewritten_in_place_with_the_same_result(monkeypatch):
    """The command line's own model (Loaded.disposable) is written in place instead of copied, once it is over
    engine.rounding's budget; the result is bit for bit the copying path's, and a caller's model (the API path) is
    left untouched. Under the budget the original is kept (its own rounding may be measured after the passes)."""
    from normconv.commands.swap import swap
    from normconv.engine import rounding
    from normconv.io.load import load

    def run_swap(disposable):
        loaded = load("zoo:gpt")
        loaded.disposable = disposable
        before = {k: v.clone() for k, v in loaded.model.state_dict().items()}
        report, model = swap(loaded)
        assert report.validation[0].passed and report.extra["exact"]
        after = loaded.model.state_dict()
        return [k for k in before if not torch.equal(before[k], after[k])], model.state_dict()

    results = {}
    with monkeypatch.context() as m:
        m.setattr(rounding, "BUDGET_BYTES", 0)  # zoo:gpt counts as large
        for disposable in (False, True):
            changed, results[disposable] = run_swap(disposable)
            assert bool(changed) == disposable  # centered writers land in the loaded tensors only when disposable
    copied, in_place = results[False], results[True]
    assert copied.keys() == in_place.keys()
    assert all(torch.equal(copied[k], in_place[k]) for k in copied)
    changed, kept = run_swap(True)  # the default budget: zoo:gpt is small, its original stays as it was
    assert not changed and all(torch.equal(copied[k], kept[k]) for k in copied)


class _MeanPooled(nn.Module):
    """BEiT / timm's mean-pooled ViTs: blocks, then the patch tokens averaged, then ``fc_norm``, then the head. The
    mean over tokens commutes with centering each token, so the pooled vector the last LayerNorm reads is zero-mean
    too: the swap is exact. A mean over the hidden axis is not (it reads the mean centering removes)."""

    def __init__(self, spelling, d=16):
        super().__init__()
        self.spelling = spelling
        self.inp = nn.Linear(6, d)
        self.blocks = nn.ModuleList(_Block(d) for _ in range(2))
        self.fc_norm = nn.LayerNorm(d)
        self.head = nn.Linear(d, 5)

    def forward(self, x):
        x = self.inp(x)
        for b in self.blocks:
            x = b(x)
        if self.spelling == "keyword":
            x = x[:, 1:].mean(dim=1)
        elif self.spelling == "positional":
            x = x[:, 1:].mean(1)
        elif self.spelling == "function":
            x = torch.mean(x, dim=(1,), keepdim=False)
        else:  # "hidden": a mean over the hidden axis, broadcast back: reads what centering removes
            x = x + x.mean(-1, keepdim=True)
            x = x[:, 0]
        return self.head(self.fc_norm(x))


@pytest.mark.parametrize("spelling", ["keyword", "positional", "function"])
def test_a_mean_over_tokens_before_the_last_norm_swaps_exactly(spelling):
    model = _randomize_norms(_MeanPooled(spelling).eval())
    inputs = Inputs((torch.randn(2, 5, 6),))
    new, report = swap(model, inputs)
    assert report.passed and report.extra["exact"]
    assert _count(new, RMSNorm) == 3 and _count(new, nn.LayerNorm) == 0
    for shape in ((3, 7, 6), (1, 2, 6)):  # fresh inputs at other shapes
        x = torch.randn(shape)
        _assert_same_logits(run(model, Inputs((x,))), run(new, Inputs((x,))))


def test_a_mean_over_the_hidden_axis_is_not_taken_for_a_pooling():
    model = _randomize_norms(_MeanPooled("hidden").eval())
    with pytest.raises(NormconvError, match="cannot be swapped exactly"):
        swap(model, Inputs((torch.randn(2, 5, 6),)))
