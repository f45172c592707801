"""normconv deepnorm: constants, site detection, forward/gradient equivalence with a hand-written
LN(alpha*x + f(x)), beta init statistics, fused q/k/v slices, refusals, CLI exit codes, save / reload."""

from __future__ import annotations

import copy
import json
import math

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from hf_tiny import tiny_bart, tiny_bert, tiny_gpt2
from normconv.graph.detect import find_norms
from normconv.errors import NormconvError
from normconv.graph.capture import capture
from normconv.api import deepnorm as api_deepnorm, inspect as normconv_inspect
from normconv.io.load import load
from normconv.models import get
from normconv.models.transformer import PostLNEncoderLayer
from normconv.passes import deepnorm as dn
from normconv.verify import Inputs


def zoo(name):
    e = get(name)
    return e.build(), Inputs(tuple(e.example_inputs()))


def strip_hooks(model: nn.Module) -> nn.Module:
    """The rewritten model's own modules and weights with normconv's hooks removed (eps is restored by the caller)."""
    ref = copy.deepcopy(model)
    for m in ref.modules():
        m._forward_hooks.clear()
        m._forward_pre_hooks.clear()
    return ref


def applied(report):
    return [s for s in report.sites if s.applied]


# -- constants: the paper's table 1 -------------------------------------------------------------------------


@pytest.mark.parametrize("n", [1, 2, 6, 18, 100])
def test_encoder_and_decoder_only_constants(n):
    assert dn.constants("encoder", n=n) == {"encoder": pytest.approx(((2 * n) ** 0.25, (8 * n) ** -0.25))}
    assert dn.constants("decoder", m=n) == {"decoder": pytest.approx(((2 * n) ** 0.25, (8 * n) ** -0.25))}


def test_encoder_decoder_constants_from_the_table():
    c = dn.constants("encoder-decoder", n=1, m=1)
    assert c["encoder"] == pytest.approx((0.81, 0.87))
    assert c["decoder"] == pytest.approx((3 ** 0.25, 12 ** -0.25))
    c = dn.constants("encoder-decoder", n=6, m=6)  # the paper's 6L-6L base setting
    assert c["encoder"] == pytest.approx((0.81 * (6 ** 5) ** (1 / 16), 0.87 * (6 ** 5) ** (-1 / 16)))
    assert c["encoder"][0] == pytest.approx(1.4179, abs=1e-4)  # 0.81 * 7776^(1/16)
    assert c["decoder"] == pytest.approx((18 ** 0.25, 72 ** -0.25))
    # 100-layer encoder-only: alpha = 200^(1/4) ~ 3.76, beta = 800^(-1/4) ~ 0.188
    assert dn.constants("encoder", n=100)["encoder"] == pytest.approx((3.7606, 0.18803), abs=1e-4)


def test_constants_refuse_bad_input():
    with pytest.raises(NormconvError, match="architecture"):
        dn.constants("mixture", n=2)
    with pytest.raises(NormconvError, match="N >= 1"):
        dn.constants("encoder", n=0)


# -- site detection ----------------------------------------------------------------------------------------


def test_zoo_bert_sites_and_roles():
    model, inputs = zoo("bert")
    new, report = api_deepnorm(model, inputs, beta_mode="none")
    assert [s.target for s in applied(report)] == ["layers.0.attn_norm", "layers.0.ffn_norm",
                                                   "layers.1.attn_norm", "layers.1.ffn_norm"]
    skipped = {s.target: s.reason for s in report.sites if not s.applied}
    assert list(skipped) == ["embed_norm"] and "after-embedding" in skipped["embed_norm"]
    assert report.extra["arch"] == "encoder"
    assert report.extra["stacks"]["encoder"]["layers"] == 2
    subs = {r["norm"]: r for r in report.extra["sublayers"]}
    attn = subs["layers.0.attn_norm"]
    assert attn["kind"] == "attention" and attn["branch"] == "layers.0.attn.out_proj"
    assert attn["projections"] == {"q": ["layers.0.attn.q_proj"], "k": ["layers.0.attn.k_proj"],
                                   "v": ["layers.0.attn.v_proj"], "out": ["layers.0.attn.out_proj"]}
    assert subs["layers.1.ffn_norm"]["projections"] == {"ffn": ["layers.1.fc1", "layers.1.fc2"]}


def test_zoo_seq2seq_counts_encoder_and_decoder():
    model, inputs = zoo("seq2seq")
    new, report = api_deepnorm(model, inputs)
    assert len(applied(report)) == 10 and len(report.sites) == 10
    assert report.extra["arch"] == "encoder-decoder"
    stacks = report.extra["stacks"]
    assert stacks["encoder"]["layers"] == 2 and stacks["decoder"]["layers"] == 2
    c = dn.constants("encoder-decoder", n=2, m=2)
    assert stacks["encoder"]["alpha"] == pytest.approx(c["encoder"][0])
    assert stacks["decoder"]["beta"] == pytest.approx(c["decoder"][1])
    subs = {r["norm"]: r for r in report.extra["sublayers"]}
    assert sum(r["stack"] == "encoder" for r in subs.values()) == 4
    assert sum(r["stack"] == "decoder" for r in subs.values()) == 6
    cross = subs["decoder.1.cross_attn_norm"]
    assert cross["kind"] == "cross-attention" and cross["projections"]["v"] == ["decoder.1.cross_attn.v_proj"]
    assert subs["decoder.0.attn_norm"]["kind"] == "attention"
    # decoder sublayers (cross-attention included) get the decoder beta
    w = new.decoder[1].cross_attn.v_proj.weight
    assert float(w.detach().std()) == pytest.approx(c["decoder"][1] * math.sqrt(2 / 64), rel=0.2)


def test_hf_bert_sites_and_roles():
    model, inputs = tiny_bert()
    new, report = api_deepnorm(model, inputs, beta_mode="none")
    assert len(applied(report)) == 4
    assert [s.target for s in report.sites if not s.applied] == ["embeddings.LayerNorm"]
    assert report.extra["stacks"]["encoder"]["layers"] == 2 and report.extra["capture"] == "torch.export"
    subs = {r["norm"]: r for r in report.extra["sublayers"]}
    p = subs["encoder.layer.1.attention.output.LayerNorm"]["projections"]
    assert p == {"q": ["encoder.layer.1.attention.self.query"], "k": ["encoder.layer.1.attention.self.key"],
                 "v": ["encoder.layer.1.attention.self.value"], "out": ["encoder.layer.1.attention.output.dense"]}
    assert subs["encoder.layer.0.output.LayerNorm"]["projections"] == {
        "ffn": ["encoder.layer.0.intermediate.dense", "encoder.layer.0.output.dense"]}


def test_plan_shows_what_the_command_does():
    model, inputs = zoo("seq2seq")
    cap = capture(model, inputs)
    planned = {(s.target, s.applied) for s in dn.plan(cap, find_norms(cap))}
    _, report = api_deepnorm(model, inputs)
    assert planned == {(s.target, s.applied) for s in report.sites}


def test_single_causal_stack_is_a_decoder():
    class Dec(nn.Module):
        def __init__(self):
            super().__init__()
            self.emb = nn.Embedding(50, 32)
            self.blocks = nn.ModuleList(PostLNEncoderLayer(32, 4, 64, 1e-5, causal=True) for _ in range(3))

        def forward(self, ids):
            x = self.emb(ids)
            for b in self.blocks:
                x = b(x)
            return x

    torch.manual_seed(0)
    ids = torch.randint(0, 50, (2, 8))
    _, report = api_deepnorm(Dec(), Inputs((ids,)))
    assert report.extra["arch"] == "decoder"
    assert report.extra["stacks"]["decoder"]["alpha"] == pytest.approx(6 ** 0.25)  # (2M)^(1/4), M = 3


def test_layer_count_and_constant_overrides():
    model, inputs = zoo("bert")
    _, r = api_deepnorm(model, inputs, n_layers=6)
    assert r.extra["stacks"]["encoder"]["alpha"] == pytest.approx(12 ** 0.25)
    assert r.extra["stacks"]["encoder"]["counted_from"] == "given"
    new, r = api_deepnorm(model, inputs, alpha=3.0, beta_mode="none")
    assert new.layers[0].attn_norm.eps == pytest.approx(1e-12 / 9)
    assert r.passed


# -- forward and gradient equivalence with a hand-written LN(alpha*x + f(x)) ---------------------------------


def bert_reference(m, ids, alpha, eps):
    """Zoo BertEncoder with every post-LN sublayer written out as LN(alpha*x + f(x))."""
    pos = torch.arange(ids.shape[1])
    x = m.embed_norm(m.word_embeddings(ids) + m.position_embeddings(pos))
    for layer in m.layers:
        x = F.layer_norm(alpha * x + layer.attn(x), x.shape[-1:], layer.attn_norm.weight, layer.attn_norm.bias, eps)
        x = F.layer_norm(alpha * x + layer.ffn(x), x.shape[-1:], layer.ffn_norm.weight, layer.ffn_norm.bias, eps)
    return x


def grads_match(new, ref, run_new, run_ref, atol):
    torch.manual_seed(1)
    out_new, out_ref = run_new(new), run_ref(ref)
    probe = torch.randn_like(out_new)
    (out_new * probe).sum().backward()
    (out_ref * probe).sum().backward()
    assert torch.allclose(out_new, out_ref, atol=atol, rtol=0), float((out_new - out_ref).abs().max())
    ref_params = dict(ref.named_parameters())
    # one scale for all: a gradient that is zero in exact arithmetic (attention key bias) is float noise
    scale = max(float(q.grad.abs().max()) for q in ref_params.values() if q.grad is not None)
    checked = 0
    for name, p in new.named_parameters():
        q = ref_params[name]
        if p.grad is None:
            assert q.grad is None or not q.grad.any()
            continue
        assert torch.allclose(p.grad, q.grad, atol=atol * scale, rtol=0), (name, float((p.grad - q.grad).abs().max()))
        checked += 1
    return checked


@pytest.mark.parametrize("dtype,atol", [(torch.float64, 1e-10), (torch.float32, 1e-4)])
def test_zoo_bert_forward_and_gradients_equal_reference(dtype, atol):
    model, inputs = zoo("bert")
    (ids,) = inputs.args
    model = model.to(dtype)
    new, report = api_deepnorm(model, Inputs((ids,)), beta_mode="init")
    alpha = report.extra["stacks"]["encoder"]["alpha"]
    ref = strip_hooks(new)  # the same weights (beta-initialized), plain modules
    new.train(), ref.train()  # training mode: the zoo models have no dropout, so both are deterministic
    checked = grads_match(new, ref, lambda m: m(ids), lambda m: bert_reference(m, ids, alpha, 1e-12), atol)
    assert checked == len(list(new.parameters()))
    assert report.passed


def test_large_eps_is_rescaled_exactly():
    """With eps 0.5 an eps mistake shows: LN_eps(alpha x + f) needs eps/alpha^2 after dividing by alpha."""
    from normconv.models.transformer import BertEncoder

    torch.manual_seed(0)
    model = BertEncoder(layers=3, eps=0.5).double()
    ids = get("bert").example_inputs()[0]
    new, report = api_deepnorm(model, Inputs((ids,)), beta_mode="none")
    alpha = report.extra["stacks"]["encoder"]["alpha"]
    ref = strip_hooks(new)
    checked = grads_match(new, ref, lambda m: m(ids), lambda m: bert_reference(m, ids, alpha, 0.5), 1e-10)
    assert checked == len(list(new.parameters()))
    wrong = copy.deepcopy(new)
    for layer in wrong.layers:
        layer.attn_norm.eps = layer.ffn_norm.eps = 0.5  # the residual scaling without the eps correction
    with torch.no_grad():
        assert (wrong(ids) - bert_reference(ref, ids, alpha, 0.5)).abs().max() > 1e-2


def hf_reference(model, alpha):
    """HF BERT with BertSelfOutput / BertOutput rewritten by hand as LN(alpha * input_tensor + dense(h))."""
    for layer in model.encoder.layer:
        for mod in (layer.attention.output, layer.output):
            def forward(hidden_states, input_tensor, mod=mod):
                ln = mod.LayerNorm
                return F.layer_norm(alpha * input_tensor + mod.dropout(mod.dense(hidden_states)),
                                    ln.normalized_shape, ln.weight, ln.bias, 1e-12)
            mod.forward = forward
    return model


@pytest.mark.parametrize("dtype,atol", [(torch.float64, 1e-10), (torch.float32, 1e-4)])
def test_hf_bert_forward_and_gradients_equal_reference(dtype, atol):
    model, inputs = tiny_bert()
    model = model.to(dtype)
    new, report = api_deepnorm(model, inputs, beta_mode="rescale")
    alpha = report.extra["stacks"]["encoder"]["alpha"]
    ref = hf_reference(strip_hooks(new), alpha)
    new.eval(), ref.eval()  # dropout off; gradients still flow
    run = lambda m: m(**inputs.kwargs).last_hidden_state  # noqa: E731
    checked = grads_match(new, ref, run, run, atol)
    assert checked > 20


def test_native_eps_is_divided_and_state_dict_keys_are_intact():
    model, inputs = zoo("bert")
    new, report = api_deepnorm(model, inputs)
    alpha = report.extra["stacks"]["encoder"]["alpha"]
    assert type(new) is type(model)
    assert list(new.state_dict()) == list(model.state_dict())
    assert all(p.requires_grad for p in new.parameters())
    assert new.layers[1].ffn_norm.eps == pytest.approx(1e-12 / alpha ** 2)
    assert new.embed_norm.eps == 1e-12  # not a residual sublayer: untouched
    assert model.layers[1].ffn_norm.eps == 1e-12 and not hasattr(model, dn.MARKER)  # the input model is not mutated


def test_handwritten_norm_module_gets_an_input_prehook():
    class MyLN(nn.Module):
        def __init__(self, d):
            super().__init__()
            self.weight = nn.Parameter(torch.ones(d) + 0.1 * torch.randn(d))

        def forward(self, x):
            mu = x.mean(-1, keepdim=True)
            return (x - mu) * torch.rsqrt(((x - mu) ** 2).mean(-1, keepdim=True) + 1e-5) * self.weight

    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.blocks = nn.ModuleList(nn.Sequential(nn.Linear(16, 32), nn.GELU(), nn.Linear(32, 16)) for _ in range(2))
            self.norms = nn.ModuleList(MyLN(16) for _ in range(2))

        def forward(self, x):
            for f, n in zip(self.blocks, self.norms):
                x = n(x + f(x))
            return x

    torch.manual_seed(0)
    x = torch.randn(4, 16)
    net = Net()
    new, report = api_deepnorm(net, Inputs((x,)), beta_mode="none")
    assert len(applied(report)) == 2 and report.passed
    a = report.extra["stacks"]["encoder"]["alpha"]
    assert a == pytest.approx(4 ** 0.25)  # N counted from the numbered blocks: 2
    ref = net.norms[1](a * (h := net.norms[0](a * x + net.blocks[0](x))) + net.blocks[1](h))
    assert torch.allclose(new(x), ref, atol=1e-5)


# -- beta ------------------------------------------------------------------------------------------------------


def xavier_std(w, gain):
    return gain * math.sqrt(2.0 / (w.shape[0] + w.shape[1]))


def test_init_statistics_match_xavier_gain_beta():
    model, inputs = zoo("bert")
    new, report = api_deepnorm(model, inputs, n_layers=50, seed=3)  # beta = 400^(-1/4) ~ 0.224
    beta = report.extra["stacks"]["encoder"]["beta"]
    assert beta == pytest.approx(400 ** -0.25)
    # pool the normalized weights of a role: w / expected std ~ N(0, 1); n samples -> std error 1/sqrt(2n)
    for names, gain in ((["attn.v_proj", "attn.out_proj", "fc1", "fc2"], beta), (["attn.q_proj", "attn.k_proj"], 1.0)):
        with torch.no_grad():
                z = torch.cat([(new.get_parameter(f"layers.{i}.{n}.weight") /
                            xavier_std(new.get_parameter(f"layers.{i}.{n}.weight"), gain)).flatten()
                           for i in range(2) for n in names])
        err = 4 / math.sqrt(2 * z.numel())  # 4 standard errors
        assert abs(float(z.std()) - 1.0) < err, (names, float(z.std()))
        assert abs(float(z.mean())) < 4 / math.sqrt(z.numel())
    # biases are left as they were; a fixed seed gives the same init
    assert torch.equal(new.layers[0].fc1.bias, model.layers[0].fc1.bias)
    again, _ = api_deepnorm(model, inputs, n_layers=50, seed=3)
    assert torch.equal(again.layers[1].fc2.weight, new.layers[1].fc2.weight)


def test_rescale_and_none_modes():
    model, inputs = zoo("bert")
    new, report = api_deepnorm(model, inputs, beta_mode="rescale")
    beta = report.extra["stacks"]["encoder"]["beta"]
    for n in ("attn.v_proj", "attn.out_proj", "fc1", "fc2"):
        for t in ("weight", "bias"):
            assert torch.allclose(new.get_parameter(f"layers.0.{n}.{t}"), beta * model.get_parameter(f"layers.0.{n}.{t}"))
    for n in ("attn.q_proj", "attn.k_proj"):
        assert torch.equal(new.get_parameter(f"layers.1.{n}.weight"), model.get_parameter(f"layers.1.{n}.weight"))
    same, _ = api_deepnorm(model, inputs, beta_mode="none")
    for (k, a), b in zip(same.state_dict().items(), model.state_dict().values()):
        assert torch.equal(a, b), k


class FusedAttention(nn.Module):
    """One Linear(E, 3E) for q | k | v, split with chunk (the HF GPT-2 c_attn layout, as nn.Linear)."""

    def __init__(self, e=16, heads=2):
        super().__init__()
        self.h, self.qkv, self.out = heads, nn.Linear(e, 3 * e), nn.Linear(e, e)

    def forward(self, x):
        q, k, v = self.qkv(x).chunk(3, dim=-1)
        q, k, v = (t.unflatten(-1, (self.h, -1)).transpose(1, 2) for t in (q, k, v))
        o = torch.softmax(q @ k.transpose(-2, -1) / 4.0, dim=-1) @ v
        return self.out(o.transpose(1, 2).flatten(2))


class MHABlock(nn.Module):
    def __init__(self, e=16):
        super().__init__()
        self.mha = nn.MultiheadAttention(e, 2, batch_first=True)
        self.norm = nn.LayerNorm(e)

    def forward(self, x):
        return self.norm(x + self.mha(x, x, x, need_weights=False)[0])


class FusedBlock(nn.Module):
    def __init__(self, e=16):
        super().__init__()
        self.attn, self.norm = FusedAttention(e), nn.LayerNorm(e)

    def forward(self, x):
        return self.norm(x + self.attn(x))


@pytest.mark.parametrize("block,weight,bias", [(FusedBlock, "attn.qkv.weight", "attn.qkv.bias"),
                                               (MHABlock, "mha.in_proj_weight", "mha.in_proj_bias")])
def test_fused_qkv_gets_only_its_v_slice_scaled(block, weight, bias):
    torch.manual_seed(0)
    net = nn.Sequential(block(), block())
    x = torch.randn(2, 5, 16)
    new, report = api_deepnorm(net, Inputs((x,)), beta_mode="rescale")
    beta = report.extra["stacks"]["encoder"]["beta"]
    assert report.passed and len(applied(report)) == 2
    for i in range(2):
        w0, w1 = net.get_parameter(f"{i}.{weight}"), new.get_parameter(f"{i}.{weight}")
        b0, b1 = net.get_parameter(f"{i}.{bias}"), new.get_parameter(f"{i}.{bias}")
        assert torch.equal(w1[:32], w0[:32]) and torch.equal(b1[:32], b0[:32])  # q, k rows untouched
        assert torch.allclose(w1[32:], beta * w0[32:]) and torch.allclose(b1[32:], beta * b0[32:])
    roles = report.extra["sublayers"][0]["projections"]
    assert roles["v"][0].endswith("[32:48]") and roles["q"][0].endswith("[0:16]")


class PerHeadFusedAttention(FusedAttention):
    """DeBERTa (v1) layout: the fused projection is viewed as (heads, q|k|v per head) and chunked there, so v is
    every head's last third: rows that are not one slice of W."""

    def forward(self, x):
        qkv = self.qkv(x).unflatten(-1, (self.h, -1)).transpose(1, 2)  # (B, H, L, 3 * head_dim)
        q, k, v = qkv.chunk(3, dim=-1)
        o = torch.softmax(q @ k.transpose(-2, -1) / 4.0, dim=-1) @ v
        return self.out(o.transpose(1, 2).flatten(2))


class PerHeadFusedBlock(FusedBlock):
    def __init__(self, e=16):
        super().__init__(e)
        self.attn = PerHeadFusedAttention(e)


def test_a_split_of_reshaped_heads_claims_no_rows():
    """A chunk taken after the features were reshaped into heads is not a q | k | v slice of W: no role is given
    rows there (scaling rows [32:48] would scale parts of q and k), the refusal says what was found."""
    torch.manual_seed(0)
    net = nn.Sequential(PerHeadFusedBlock(), PerHeadFusedBlock())
    with pytest.raises(NormconvError, match=r"without a recognisable value / output projection|without a "
                                            r"recognisable value projection \(found out=0\.attn\.out;"):
        api_deepnorm(net, Inputs((torch.randn(2, 5, 16),)))


# -- refusals ---------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", ["gpt", "llama"])
def test_pre_ln_zoo_models_are_refused(name):
    model, inputs = zoo(name)
    with pytest.raises(NormconvError, match="pre-LN model"):
        api_deepnorm(model, inputs)


def test_hf_gpt2_is_refused_as_pre_ln():
    model, inputs = tiny_gpt2()
    with pytest.raises(NormconvError, match="pre-LN model"):
        api_deepnorm(model, inputs)


def test_second_application_is_refused():
    model, inputs = zoo("bert")
    new, _ = api_deepnorm(model, inputs)
    with pytest.raises(NormconvError, match=f"already DeepNorm-rescaled.*{dn.MARKER}"):
        api_deepnorm(new, inputs)
    new.__dict__.pop(dn.MARKER)  # the hooks alone still give it away
    with pytest.raises(NormconvError, match="already carries normconv DeepNorm hooks"):
        api_deepnorm(new, inputs)


def test_unidentified_sublayer_is_refused_with_its_reason():
    class Gate(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = nn.Linear(16, 16)
            self.norm = nn.LayerNorm(16)

        def forward(self, x):
            return self.norm(x + torch.tanh(self.fc(x)))  # f(x) ends in an op, not a module

    torch.manual_seed(0)
    with pytest.raises(NormconvError, match=r"norm cannot be rewritten|sublayer not identified: f\(x\) ends in tanh"):
        api_deepnorm(nn.Sequential(Gate(), Gate()), Inputs((torch.randn(2, 16),)))


def test_arch_that_contradicts_the_graph_is_refused():
    model, inputs = zoo("seq2seq")
    with pytest.raises(NormconvError, match="encoder and a decoder"):
        api_deepnorm(model, inputs, arch="encoder")
    model, inputs = zoo("bert")
    with pytest.raises(NormconvError, match="one post-LN stack"):
        api_deepnorm(model, inputs, arch="encoder-decoder")
    with pytest.raises(NormconvError, match="beta mode"):
        api_deepnorm(model, inputs, beta_mode="sometimes")


# -- CLI -----------------------------------------------------------------------------------------------------


def test_cli_writes_a_model_that_reloads_and_behaves(cli, tmp_path):
    out = tmp_path / "bert_dn.pt"
    code, stdout, stderr = cli("deepnorm", "zoo:bert", "-o", out, "--json")
    assert code == 0, stderr
    rep = json.loads(stdout)
    assert rep["output"] == str(out) and rep["passed"]
    assert sum(s["applied"] for s in rep["sites"]) == 4 and rep["extra"]["arch"] == "encoder"
    loaded = load(str(out), trust_pickle=True)
    model, inputs = zoo("bert")
    assert list(loaded.model.state_dict()) == list(model.state_dict())
    assert getattr(loaded.model, dn.MARKER)["alpha"]["encoder"] == pytest.approx(2 ** 0.5)
    # it still computes LN(alpha*x + f(x)) on its weights, and trains
    assert dn.check_against_reference(loaded.model, inputs).passed
    loaded.model.train()
    loaded.model(*inputs.args).sum().backward()
    assert loaded.model.layers[0].attn.v_proj.weight.grad is not None
    # a second application of the saved model is refused
    code, _, stderr = cli("deepnorm", out, "--trust-pickle")
    assert code == 2 and "already DeepNorm-rescaled" in stderr


def test_cli_table_and_refusals(cli, tmp_path):
    code, stdout, _ = cli("deepnorm", "zoo:seq2seq", "--rescale")
    assert code == 0 and "cross-attention" in stdout and "10 applied" in stdout
    code, _, stderr = cli("deepnorm", "zoo:gpt", "-o", tmp_path / "x.pt")
    assert code == 2 and "pre-LN model" in stderr and not (tmp_path / "x.pt").exists()
    code, _, stderr = cli("deepnorm", "zoo:bert", "--init", "--rescale")
    assert code == 2 and "choose one of" in stderr
    code, _, stderr = cli("deepnorm", "zoo:bert", "--arch", "sideways")
    assert code == 2 and "unknown --arch" in stderr
    code, _, stderr = cli("deepnorm", "zoo:bert", "--alpha", "-1")
    assert code == 2 and "positive" in stderr
    code, _, stderr = cli("deepnorm", "zoo:bert", "-o", tmp_path / "w.safetensors")
    assert code == 2 and "weights only" in stderr


def test_cli_hf_folder(cli, hf_folders, tmp_path):
    code, stdout, stderr = cli("deepnorm", hf_folders["bert"], "--no-beta", "--layers", "8", "--json")
    assert code == 0, stderr
    rep = json.loads(stdout)
    assert rep["extra"]["stacks"]["encoder"]["alpha"] == pytest.approx(16 ** 0.25)
    code, _, stderr = cli("deepnorm", hf_folders["gpt2"])
    assert code == 2 and "pre-LN" in stderr


def test_cli_reference_check_miss_exits_1_and_writes_nothing(cli, tmp_path):
    out = tmp_path / "strict.pt"
    # zero tolerance: float rounding between eps/alpha^2 + hook and the literal formula (~1e-7) is a miss
    code, stdout, stderr = cli("deepnorm", "zoo:bert", "-o", out, "--atol", "0", "--rtol", "0")
    assert code == 1 and "differs from LN(alpha*x + f(x))" in stderr and "nothing written" in stderr
    assert not out.exists() and "FAILED" in stdout


def test_hf_bart_encoder_decoder_constants_sites_and_reference():
    """A post-LN encoder-decoder nobody here wrote: N and M counted, the paper's encoder-decoder constants,
    self-, cross-attention and FFN sublayers rescaled, embedding norms left with a reason."""
    model, inputs = tiny_bart()
    new, report = api_deepnorm(model, inputs)
    enc, dec = report.extra["stacks"]["encoder"], report.extra["stacks"]["decoder"]
    assert report.extra["arch"] == "encoder-decoder" and enc["layers"] == 2 and dec["layers"] == 2
    n = m = 2
    assert enc["alpha"] == pytest.approx(0.81 * (n ** 4 * m) ** (1 / 16))
    assert enc["beta"] == pytest.approx(0.87 * (n ** 4 * m) ** (-1 / 16))
    assert dec["alpha"] == pytest.approx((3 * m) ** 0.25) and dec["beta"] == pytest.approx((12 * m) ** -0.25)
    applied = [s.target for s in report.sites if s.applied]
    assert len(applied) == 10 and sum("encoder_attn_layer_norm" in t for t in applied) == 2
    skipped = {s.target: s.reason for s in report.sites if not s.applied}
    assert set(skipped) == {"encoder.layernorm_embedding", "decoder.layernorm_embedding"}
    assert all("not a post-LN residual sublayer" in r for r in skipped.values())
    assert report.validation[0].passed and report.validation[0].max_abs_error < 1e-5


# -- attention written with F.scaled_dot_product_attention in a user's own post-LN model (issue 12) ----------


def _beta_touches(net, new, beta, scaled, kept):
    """``scaled`` (name -> row slice or None) is beta * the original, weight and bias; ``kept`` is unchanged."""
    for name, rows in scaled.items():
        for suffix in ("weight", "bias"):
            w0, w1 = net.get_parameter(f"{name}.{suffix}"), new.get_parameter(f"{name}.{suffix}")
            sl = slice(None) if rows is None else slice(*rows)
            assert torch.allclose(w1[sl], beta * w0[sl], rtol=1e-6, atol=0), (name, suffix)
            assert not torch.allclose(w1[sl], w0[sl])
    for name, rows in kept.items():
        for suffix in ("weight", "bias"):
            w0, w1 = net.get_parameter(f"{name}.{suffix}"), new.get_parameter(f"{name}.{suffix}")
            sl = slice(None) if rows is None else slice(*rows)
            assert torch.equal(w1[sl], w0[sl]), (name, suffix)


@pytest.mark.parametrize("fused", [True, False])
def test_sdpa_bert_roles_read_from_the_graph(fused):
    from tests.fixtures.user_models import sdpa_bert

    net, (ids,) = sdpa_bert(fused=fused)
    before = copy.deepcopy(net.state_dict())
    new, report = api_deepnorm(net, Inputs((ids,)), beta_mode="rescale")
    assert report.passed and len(applied(report)) == 6  # 3 layers x (attention, FFN)
    beta = report.extra["stacks"]["encoder"]["beta"]
    assert beta == pytest.approx(24 ** -0.25) and report.extra["stacks"]["encoder"]["alpha"] == pytest.approx(6 ** 0.25)
    # forward equals the literal LN(alpha*x + f(x)), also at another sequence length and batch size
    assert dn.check_against_reference(new, Inputs((ids,))).max_abs_error < 1e-5
    assert dn.check_against_reference(new, Inputs((torch.randint(0, 50, (3, 11)),))).passed
    # beta on v, out and the FFN only
    for i in range(3):
        a = f"layer.{i}.attention"
        proj = {"v": [f"{a}.qkv[64:96]" if fused else f"{a}.value"], "out": [f"{a}.dense"]}
        sub = report.extra["sublayers"][2 * i]["projections"]
        assert sub["v"] == proj["v"] and sub["out"] == proj["out"]
        qk = {f"{a}.qkv": (0, 64)} if fused else {f"{a}.query": None, f"{a}.key": None}
        v = {f"{a}.qkv": (64, 96)} if fused else {f"{a}.value": None}
        _beta_touches(net, new, beta, {**v, f"{a}.dense": None, f"layer.{i}.intermediate": None,
                                       f"layer.{i}.output": None},
                      {**qk, f"{a}.LayerNorm": None, f"layer.{i}.LayerNorm": None})
    assert all(torch.equal(t, net.state_dict()[k]) for k, t in before.items())  # the user's model untouched


def test_unidentified_value_projection_names_found_roles_and_takes_flags():
    from tests.fixtures.user_models import einsum_bert

    net, (ids,) = einsum_bert()
    with pytest.raises(NormconvError, match=r"without a recognisable value projection \(found "
                                            r"out=layer\.0\.attention\.dense; name them with --value-proj"):
        api_deepnorm(net, Inputs((ids,)))
    new, report = api_deepnorm(net, Inputs((ids,)), beta_mode="rescale",
                               value_proj=["layer.*.attention.value"], out_proj=["*.attention.dense"])
    beta = report.extra["stacks"]["encoder"]["beta"]
    assert report.passed and len(applied(report)) == 6
    assert dn.check_against_reference(new, Inputs((torch.randint(0, 50, (3, 11)),))).passed
    for i in range(3):
        a = f"layer.{i}.attention"
        _beta_touches(net, new, beta, {f"{a}.value": None, f"{a}.dense": None, f"layer.{i}.output": None},
                      {f"{a}.query": None, f"{a}.key": None})
    with pytest.raises(NormconvError, match=r"--value-proj '\*\.nothere' matches no linear"):
        api_deepnorm(net, Inputs((ids,)), value_proj=["*.nothere"])


def test_cli_value_and_out_proj_flags(cli, tmp_path):
    spec = "tests.fixtures.user_models:einsum_bert"
    code, _, stderr = cli("deepnorm", spec)
    assert code == 2 and "found out=layer.0.attention.dense" in stderr and "--value-proj" in stderr
    out = tmp_path / "dn.pt"
    code, stdout, stderr = cli("deepnorm", spec, "--value-proj", "*.attention.value", "--out-proj",
                               "*.attention.dense", "-o", out, "--json")
    assert code == 0, stderr
    rep = json.loads(stdout)
    assert rep["passed"] and rep["extra"]["sublayers"][0]["projections"]["v"] == ["layer.0.attention.value"]
    assert dn.check_against_reference(load(str(out), trust_pickle=True).model,
                                      Inputs((torch.randint(0, 50, (2, 9)),))).passed


def test_embedding_residual_before_the_stack_is_left_with_its_reason():
    """wav2vec2 / HuBERT: LN(x + positional conv(x)) before the first layer is post-LN in shape, but its f(x) is
    the embeddings' convolution, not a sublayer of the stack: DeepNorm rewrites the layers and leaves it, saying why."""
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    cfg = transformers.Wav2Vec2Config(hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64,
                                      conv_dim=(16, 16), conv_stride=(5, 2), conv_kernel=(10, 3),
                                      num_conv_pos_embeddings=8, num_conv_pos_embedding_groups=4)
    model = transformers.Wav2Vec2Model(cfg).eval()
    new, report = api_deepnorm(model, Inputs((), {"input_values": torch.randn(2, 800)}))
    assert report.passed and report.extra["stacks"]["encoder"]["layers"] == 2
    by_target = {s.target: s for s in report.sites}
    assert not by_target["encoder.layer_norm"].applied
    assert "the embeddings' own residual" in by_target["encoder.layer_norm"].reason
    assert sum(s.applied for s in report.sites) == 4  # attention and FFN norms of both layers


def test_encoder_output_read_through_a_transpose_links_the_stacks():
    """FSMT (fairseq layout): the encoder's last post-LN output reaches the decoder's cross-attention transposed
    (T x B x C -> B x T x C): the decoder still reads the encoder, so the model is one encoder-decoder."""
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    cfg = transformers.FSMTConfig(langs=["en", "de"], src_vocab_size=64, tgt_vocab_size=64, d_model=32,
                                  encoder_layers=2, decoder_layers=3, encoder_attention_heads=4,
                                  decoder_attention_heads=4, encoder_ffn_dim=64, decoder_ffn_dim=64,
                                  max_position_embeddings=64, pad_token_id=1, use_cache=False)
    model = transformers.FSMTModel(cfg).eval()
    g = torch.Generator().manual_seed(0)
    inputs = Inputs((), {"input_ids": torch.randint(3, 64, (2, 7), generator=g),
                         "decoder_input_ids": torch.randint(3, 64, (2, 5), generator=g)})
    # FSMT branches on `padding_mask.any()`: the capture takes it as these inputs (no padding) do, said and accepted
    new, report = api_deepnorm(model, inputs, accept_specialized=True)
    assert report.passed and report.extra["arch"] == "encoder-decoder" and report.extra["specialized"]
    assert {k: v["layers"] for k, v in report.extra["stacks"].items()} == {"encoder": 2, "decoder": 3}


def test_a_softmax_that_is_not_the_attention_does_not_name_the_roles():
    """ConvBERT: a dynamic-conv kernel softmax (of a linear's output) runs before the q @ k^T softmax in the same
    sublayer; the roles come from the dot-product attention."""
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    cfg = transformers.ConvBertConfig(vocab_size=64, hidden_size=32, embedding_size=32, num_hidden_layers=2,
                                      num_attention_heads=4, intermediate_size=64, max_position_embeddings=64)
    model = transformers.ConvBertModel(cfg).eval()
    inputs = Inputs((), {"input_ids": torch.randint(3, 64, (2, 8), generator=torch.Generator().manual_seed(0))})
    new, report = api_deepnorm(model, inputs)
    assert report.passed and report.extra["stacks"]["encoder"]["layers"] == 2
    roles = report.extra["sublayers"][0]["projections"]
    assert roles["v"] == ["encoder.layer.0.attention.self.value"] and roles["q"] == ["encoder.layer.0.attention.self.query"]


class _Towers(nn.Module):
    """Two post-LN encoders (2 and 3 layers) that read only their own input; their pooled outputs meet at the end."""

    def __init__(self, d=32):
        super().__init__()
        from tests.fixtures.user_models import SDPABert

        self.text, self.image = SDPABert(layers=2, d=d), SDPABert(layers=3, d=d)

    def forward(self, a, b):
        return self.text(a).mean(1) * self.image(b).mean(1)


class _Coupled(nn.Module):
    """LiLT's text and layout streams: each post-LN sublayer's branch also reads the other stream."""

    def __init__(self, d=32, layers=2):
        super().__init__()
        self.emb = nn.Embedding(50, d)
        self.fa, self.fb = (nn.ModuleList(nn.Linear(d, d) for _ in range(layers)) for _ in range(2))
        self.na, self.nb = (nn.ModuleList(nn.LayerNorm(d) for _ in range(layers)) for _ in range(2))

    def forward(self, ids):
        x = y = self.emb(ids)
        for fa, fb, na, nb in zip(self.fa, self.fb, self.na, self.nb):
            x, y = na(x + fa(x + y)), nb(y + fb(y * x))
        return x + y


def test_independent_towers_are_each_an_encoder():
    torch.manual_seed(0)
    net = _Towers().eval()
    a, b = torch.randint(0, 50, (2, 7)), torch.randint(0, 50, (2, 5))
    new, report = api_deepnorm(net, Inputs((a, b)))
    assert report.passed and len(applied(report)) == 10  # (2 + 3 layers) x (attention, FFN)
    stacks = report.extra["stacks"]
    assert {k: (v["layers"], v["alpha"]) for k, v in stacks.items()} == \
        {"encoder 1": (2, pytest.approx(4 ** 0.25)), "encoder 2": (3, pytest.approx(6 ** 0.25))}
    assert "text.layer.0" in stacks["encoder 1"]["counted_from"]
    assert dn.check_against_reference(new, Inputs((torch.randint(0, 50, (3, 9)), torch.randint(0, 50, (3, 4))))).passed
    with pytest.raises(NormconvError, match="two independent post-LN encoder towers: leave out --arch"):
        api_deepnorm(net, Inputs((a, b)), arch="encoder-decoder")


def test_coupled_streams_are_refused_in_words():
    torch.manual_seed(0)
    with pytest.raises(NormconvError, match=r"two post-LN stacks reading each other's output \(coupled streams"):
        api_deepnorm(_Coupled().eval(), Inputs((torch.randint(0, 50, (2, 7)),)))


class _Rejoined(_Towers):
    """The two towers' streams meet on the residual path (x + W y enters each next layer): the residual chains
    break at every layer into pieces that are not towers."""

    def __init__(self, d=32):
        super().__init__(d)
        self.mix = nn.ModuleList(nn.Linear(d, d) for _ in range(2))

    def forward(self, a, b):
        x, y = self.text.ln(self.text.emb(a)), self.image.ln(self.image.emb(b))
        for i in range(2):
            x, y = self.text.layer[i](x + self.mix[i](y)), self.image.layer[i](y + self.mix[i](x))
        return x + y


def test_streams_rejoined_on_the_residual_are_not_towers():
    # each 1-layer piece would otherwise get N = 1 constants
    with pytest.raises(NormconvError, match=r"separate post-LN stacks"):
        api_deepnorm(_Rejoined().eval(), Inputs((torch.randint(0, 50, (2, 7)), torch.randint(0, 50, (2, 7)))))


class _XLMAttention(nn.Module):
    """XLM / Flaubert attention: k and v joined behind an empty KV cache (cat with a 0-element past)."""

    def __init__(self, d=32, heads=4):
        super().__init__()
        self.h = heads
        self.q_lin, self.k_lin, self.v_lin, self.out_lin = (nn.Linear(d, d) for _ in range(4))
        self.register_buffer("past", torch.zeros(0), persistent=False)

    def forward(self, x, mask):
        b, n, d = x.shape
        q, k, v = (f(x).view(b, n, self.h, d // self.h).transpose(1, 2) for f in (self.q_lin, self.k_lin, self.v_lin))
        k, v = (torch.cat([self.past.view(b, self.h, 0, d // self.h), t], dim=-2) for t in (k, v))
        scores = torch.matmul(q / (d // self.h) ** 0.5, k.transpose(2, 3))
        scores = scores.masked_fill((mask == 0).view(b, 1, 1, n), torch.finfo(scores.dtype).min)
        o = torch.matmul(torch.softmax(scores.float(), dim=-1).type_as(scores), v)
        return self.out_lin(o.transpose(1, 2).reshape(b, n, d))


class _XLM(nn.Module):
    """XLM / Flaubert's layout: parallel ModuleLists indexed by layer, and the padding mask applied to the stream
    after every layer (h *= mask[..., None])."""

    def __init__(self, layers=3, d=32):
        super().__init__()
        self.emb, self.layer_norm_emb = nn.Embedding(50, d), nn.LayerNorm(d)
        self.attentions = nn.ModuleList(_XLMAttention(d) for _ in range(layers))
        self.layer_norm1 = nn.ModuleList(nn.LayerNorm(d) for _ in range(layers))
        self.ffns = nn.ModuleList(nn.Sequential(nn.Linear(d, 4 * d), nn.GELU(), nn.Linear(4 * d, d))
                                  for _ in range(layers))
        self.layer_norm2 = nn.ModuleList(nn.LayerNorm(d) for _ in range(layers))

    def forward(self, ids, mask):
        h = self.layer_norm_emb(self.emb(ids)) * mask[..., None].to(torch.float32)
        for att, ln1, ffn, ln2 in zip(self.attentions, self.layer_norm1, self.ffns, self.layer_norm2):
            h = ln1(h + att(h, mask))
            h = ln2(h + ffn(h))
            h = h * mask[..., None].to(h.dtype)
        return h


def test_xlm_layout_is_one_stack_of_n_layers():
    torch.manual_seed(0)
    ids, mask = torch.randint(0, 50, (2, 7)), torch.ones(2, 7, dtype=torch.long)
    mask[1, 5:] = 0
    net = _XLM().eval()
    new, report = api_deepnorm(net, Inputs((ids, mask)))
    assert report.passed and len(applied(report)) == 6
    enc = report.extra["stacks"]["encoder"]
    assert enc["layers"] == 3 and enc["alpha"] == pytest.approx(6 ** 0.25)  # 3 layers, not 6 blocks or 3 stacks
    assert "layer_norm1, layer_norm2" in enc["counted_from"]
    v = [s["projections"]["v"] for s in report.extra["sublayers"] if s["kind"] == "attention"]
    assert v == [[f"attentions.{i}.v_lin"] for i in range(3)]  # read through the empty cache
    assert dn.check_against_reference(new, Inputs((ids, mask))).passed


class _BranchNormed(nn.Module):
    """OLMo 2: each layer adds LN(f(x)) to the stream (the branch is normed), and a final norm reads x + LN(f(x))."""

    def __init__(self, d=32, layers=2):
        super().__init__()
        self.emb = nn.Embedding(50, d)
        self.fc = nn.ModuleList(nn.Linear(d, d) for _ in range(layers))
        self.post = nn.ModuleList(nn.RMSNorm(d) for _ in range(layers))
        self.norm = nn.RMSNorm(d)

    def forward(self, ids):
        h = self.emb(ids)
        for fc, post in zip(self.fc, self.post):
            h = h + post(fc(h))
        return self.norm(h)


def test_branch_normed_layers_are_refused_in_words():
    with pytest.raises(NormconvError, match=r"the layers normalize their branches \(x \+ LN\(f\(x\)\), as OLMo 2\), "
                                            r"not the residual stream: norm reads"):
        api_deepnorm(_BranchNormed().eval(), Inputs((torch.randint(0, 50, (2, 7)),)))


class _PooledMemory(nn.Module):
    """An encoder-decoder whose decoder reads the encoder through pooled memory added in a branch (no attention
    over the memory to recognise): the dataflow tells the decoder from the encoder (LED's case)."""

    def __init__(self, d=32):
        super().__init__()
        from tests.fixtures.user_models import SDPABert

        self.encoder, self.decoder = SDPABert(layers=2, d=d), SDPABert(layers=2, d=d)
        self.mix = nn.ModuleList(nn.Linear(d, d) for _ in range(2))
        self.mix_ln = nn.ModuleList(nn.LayerNorm(d) for _ in range(2))

    def forward(self, src, tgt):
        memory = self.encoder(src).mean(1, keepdim=True)
        h = self.decoder.ln(self.decoder.emb(tgt))
        for layer, mix, ln in zip(self.decoder.layer, self.mix, self.mix_ln):
            h = ln(h + mix(h + memory))
            h = layer(h)
        return h


def test_a_decoder_reading_pooled_memory_is_told_by_dataflow():
    torch.manual_seed(0)
    net = _PooledMemory().eval()
    new, report = api_deepnorm(net, Inputs((torch.randint(0, 50, (2, 7)), torch.randint(0, 50, (2, 5)))))
    assert report.passed and report.extra["arch"] == "encoder-decoder"
    stacks = report.extra["stacks"]
    assert stacks["encoder"]["layers"] == 2 and stacks["decoder"]["layers"] == 2
    assert stacks["decoder"]["alpha"] == pytest.approx(6 ** 0.25)  # (3M)^(1/4), the table's decoder row


def test_a_branch_ending_in_a_reshaped_linear_is_that_linear():
    # GPT-1's Conv1D computes addmm on x.view(-1, D) and views the result back: f(x) ends in a view, which scaling
    # commutes with, so the module computing it is the branch (was "f(x) ends in view")
    from hf_tiny import tiny_openai_gpt

    model, inputs = tiny_openai_gpt()
    new, report = api_deepnorm(model, inputs)
    assert report.passed and len(applied(report)) == 4
    subs = {r["norm"]: r for r in report.extra["sublayers"]}
    assert subs["h.0.ln_1"]["branch"] == "h.0.attn.c_proj" and subs["h.0.ln_2"]["branch"] == "h.0.mlp.c_proj"
    assert subs["h.0.ln_1"]["projections"]["v"] == ["h.0.attn.c_attn[64:96]"]


def test_attention_probabilities_reshaped_before_the_value_product_still_name_v():
    # DeBERTa-v2: softmax -> dropout -> view(B*H, L, L) -> bmm(probs, v): v is found past the view (was "attention
    # without a recognisable value projection")
    from hf_tiny import tiny_deberta_v2

    model, inputs = tiny_deberta_v2()
    new, report = api_deepnorm(model, inputs)
    assert report.passed and len(applied(report)) == 4
    subs = {r["norm"]: r for r in report.extra["sublayers"]}
    p = subs["encoder.layer.1.attention.output.LayerNorm"]["projections"]
    assert p["v"] == ["encoder.layer.1.attention.self.value_proj"]
    assert p["out"] == ["encoder.layer.1.attention.output.dense"]


def test_shared_layers_are_rewritten_once_for_every_call():
    # ALBERT runs one layer 3 times: N = 3 layer runs; eps / alpha^2 and one hook per module act at every call
    from hf_tiny import tiny_albert

    from normconv.nn.modules import BranchScale

    model, inputs = tiny_albert()
    new, report = api_deepnorm(model, inputs)
    stack = report.extra["stacks"]["encoder"]
    assert report.passed and stack["layers"] == 3 and "shared" in stack["counted_from"]
    assert stack["alpha"] == pytest.approx(6 ** 0.25)
    layer = "encoder.albert_layer_groups.0.albert_layers.0"
    assert [r["norm"] for r in report.extra["sublayers"]] == [f"{layer}.attention.LayerNorm",
                                                             f"{layer}.full_layer_layer_norm"]
    norm = new.get_submodule(f"{layer}.attention.LayerNorm")
    original = model.get_submodule(f"{layer}.attention.LayerNorm")
    assert norm.eps == pytest.approx(original.eps / stack["alpha"] ** 2)  # divided once, not per call
    dense = new.get_submodule(f"{layer}.attention.dense")
    assert sum(isinstance(h, BranchScale) for h in dense._forward_hooks.values()) == 1


def test_a_shared_norm_with_a_call_that_is_no_sublayer_is_refused_in_words():
    class SharedNorm(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc1, self.fc2, self.norm = nn.Linear(16, 16), nn.Linear(16, 16), nn.LayerNorm(16)

        def forward(self, x):
            x = self.norm(x)  # the same module as an input norm: eps / alpha^2 would change this call too
            x = self.norm(x + self.fc1(x))
            return self.norm(x + self.fc2(x))

    torch.manual_seed(0)
    with pytest.raises(NormconvError, match=r"norm module norm is called at 3 places, 2 of them post-LN sublayers"):
        api_deepnorm(SharedNorm().eval(), Inputs((torch.randn(2, 5, 16),)))


class _MaskedProbsLayer(nn.Module):
    """Post-LN attention whose probabilities are zeroed at masked keys after the softmax (SEW-D's XSoftmax)."""

    def __init__(self, d=16):
        super().__init__()
        self.q, self.k, self.v, self.o = (nn.Linear(d, d) for _ in range(4))
        self.ln1, self.fc1, self.fc2, self.ln2 = nn.LayerNorm(d), nn.Linear(d, 32), nn.Linear(32, d), nn.LayerNorm(d)

    def forward(self, x, mask):
        scores = self.q(x) @ self.k(x).transpose(-1, -2) / 4.0
        probs = torch.softmax(scores.masked_fill(~mask, -1e4), -1).masked_fill(~mask, 0.0)
        x = self.ln1(x + self.o(probs @ self.v(x)))
        return self.ln2(x + self.fc2(torch.relu(self.fc1(x))))


class _MaskedProbsNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.layers = nn.ModuleList([_MaskedProbsLayer(), _MaskedProbsLayer()])

    def forward(self, x, mask):
        for layer in self.layers:
            x = layer(x, mask)
        return x


def test_probabilities_masked_after_the_softmax_still_name_v():
    torch.manual_seed(0)
    mask = torch.ones(2, 5, 5, dtype=torch.bool)
    mask[:, :, -1] = False
    new, report = api_deepnorm(_MaskedProbsNet().eval(), Inputs((torch.randn(2, 5, 16), mask)))
    assert report.passed and len(applied(report)) == 4
    subs = {r["norm"]: r for r in report.extra["sublayers"]}
    assert subs["layers.0.ln1"]["projections"]["v"] == ["layers.0.v"]


class _SeqFirstAttention(nn.Module):
    """A post-LN block of a batch-first model whose nn.MultiheadAttention runs sequence-first (transposes around it),
    and whose FFN's last linear runs on rows viewed flat and back: each branch reaches the add after its module."""

    def __init__(self, d: int = 32):
        super().__init__()
        self.attn = nn.MultiheadAttention(d, 4)  # batch_first=False
        self.ln1, self.ln2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.up, self.down = nn.Linear(d, 2 * d), nn.Linear(2 * d, d)

    def forward(self, x):  # (B, T, D)
        h = x.transpose(0, 1)
        x = self.ln1(x + self.attn(h, h, h)[0].transpose(0, 1))
        b, t, d = x.shape
        return self.ln2(x + self.down(F.gelu(self.up(x)).reshape(b * t, -1)).reshape(b, t, d))


@pytest.mark.parametrize("shape", [(2, 5, 32), (5, 5, 32)])
def test_a_branch_added_after_a_transpose_is_refused_in_words(shape):
    # its scale would commute with the transpose, but the literal reference needs f(x) as added: before, the reference
    # failed with a broadcasting RuntimeError (exit 3), or, batch == length, subtracted a transposed f (a false exit 1)
    torch.manual_seed(0)
    model = nn.Sequential(_SeqFirstAttention(), _SeqFirstAttention()).eval()
    with pytest.raises(NormconvError, match=r"0\.attn is added to the stream through transpose") as err:
        api_deepnorm(model, Inputs((torch.randn(*shape),)))
    assert err.value.code.name == "REFUSED"
    codes = {s["target"]: p["code"] for s in normconv_inspect(model, torch.randn(*shape)).sites for p in s["plan"]
             if p["pass"] == dn.NAME}
    assert codes["0.ln1"] == codes["1.ln1"] == dn.DeepNormWhy.RESHAPED.value
    assert codes["0.ln2"] == codes["1.ln2"] == dn.DeepNormWhy.RESHAPED.value  # the FFN's reshape outside its linear


def test_a_pre_ln_folder_out_is_refused_as_pre_ln_first(cli, hf_folders, tmp_path):
    """-o FOLDER of a model DeepNorm does not apply to: the pre-LN refusal, not the advice to write a .pt (which
    would then be refused as pre-LN)."""
    code, _, stderr = cli("deepnorm", hf_folders["gpt2"], "-o", tmp_path / "dn")
    assert code == 2 and "pre-LN model" in stderr and "Hugging Face folder" not in stderr, stderr
    assert not (tmp_path / "dn").exists()
    # a post-LN model: the folder itself is refused, naming the .pt to write
    code, _, stderr = cli("deepnorm", hf_folders["bert"], "-o", tmp_path / "dn")
    assert code == 2 and "as a Hugging Face folder" in stderr and "dn.pt" in stderr, stderr
