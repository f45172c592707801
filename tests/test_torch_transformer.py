"""torch.nn.TransformerEncoder / TransformerDecoder / Transformer inside a user's model: every command sees their
norms (fx's default tracer made them leaves, so the norms were invisible), and a rewritten encoder layer no
longer runs torch's fused fast path, which hard-codes LayerNorm math whatever module ``norm1`` now is."""

from __future__ import annotations

import onnx
import onnxruntime as ort
import pytest
import torch
import torch.nn as nn

import normconv
from normconv.nn.rmsnorm import RMSNorm
from normconv.verify import Inputs, run

D = 32


class Encoder(nn.Module):
    def __init__(self, norm_first, batch_first):
        super().__init__()
        self.emb = nn.Embedding(50, D)
        layer = nn.TransformerEncoderLayer(D, 4, 64, dropout=0.0, norm_first=norm_first, batch_first=batch_first)
        self.enc = nn.TransformerEncoder(layer, 2)
        self.head = nn.Linear(D, 10)

    def forward(self, ids):
        return self.head(self.enc(self.emb(ids)))


class Seq2Seq(nn.Module):
    def __init__(self, norm_first, batch_first):
        super().__init__()
        self.t = nn.Transformer(D, 4, 2, 2, 64, dropout=0.0, norm_first=norm_first, batch_first=batch_first)

    def forward(self, src, tgt):
        return self.t(src, tgt)


class Decoder(nn.Module):
    def __init__(self, norm_first, batch_first):
        super().__init__()
        layer = nn.TransformerDecoderLayer(D, 4, 64, dropout=0.0, norm_first=norm_first, batch_first=batch_first)
        self.dec = nn.TransformerDecoder(layer, 2, norm=nn.LayerNorm(D))

    def forward(self, tgt, memory):
        return self.dec(tgt, memory)


def _seq(bf, n, s):
    return torch.randn(n, s, D) if bf else torch.randn(s, n, D)


def _build(kind, nf, bf, n=2):
    torch.manual_seed(0)
    if kind == "encoder":
        return Encoder(nf, bf).eval(), Inputs((torch.randint(0, 50, (n, 5) if bf else (5, n)),))
    if kind == "decoder":
        return Decoder(nf, bf).eval(), Inputs((_seq(bf, n, 4), _seq(bf, n, 6)))
    return Seq2Seq(nf, bf).eval(), Inputs((_seq(bf, n, 5), _seq(bf, n, 4)))


def _norm_calls(model, inputs):
    """Norm modules that run, counted by forward hooks (outside normconv)."""
    seen = []
    hs = [m.register_forward_hook(lambda m, i, o, name=name: seen.append(name))
          for name, m in model.named_modules() if isinstance(m, nn.LayerNorm)]
    try:
        run(model, inputs)
    finally:
        for h in hs:
            h.remove()
    return sorted(set(seen))


CASES = [(k, nf, bf) for k in ("encoder", "decoder", "transformer") for nf in (True, False) for bf in (True, False)]


@pytest.mark.parametrize("kind,nf,bf", CASES)
def test_inspect_finds_every_norm_the_forward_runs(kind, nf, bf):
    model, inputs = _build(kind, nf, bf)
    report = normconv.inspect(model, inputs)
    targets = sorted(s["target"] for s in report.sites)
    assert targets == _norm_calls(model, inputs) and targets
    placement = {s["placement"] for s in report.sites}
    want, other = ("pre-norm", "post-norm") if nf else ("post-norm", "pre-norm")
    assert want in placement and other not in placement


@pytest.mark.parametrize("kind,nf,bf", [c for c in CASES if c[0] != "decoder" or c[2]])
def test_export_fuses_every_norm_and_matches_onnxruntime(kind, nf, bf, tmp_path):
    model, inputs = _build(kind, nf, bf)
    path = tmp_path / "m.onnx"
    report = normconv.export(model, inputs, str(path), baseline=False, repeats=1)
    assert report.passed
    ops = [n.op_type for n in onnx.load(str(path)).graph.node]
    assert ops.count("LayerNormalization") + ops.count("SkipLayerNormalization") == len(_norm_calls(model, inputs))
    # onnxruntime on fresh inputs of another batch size, against torch (checked here, outside normconv)
    _, other = _build(kind, nf, bf, n=2)
    sess = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    feed = {i.name: a.numpy() for i, a in zip(sess.get_inputs(), other.args)}
    torch.testing.assert_close(torch.from_numpy(sess.run(None, feed)[0]), run(model, other), atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("bf", [True, False])
def test_deepnorm_sees_post_ln_encoder_layers(bf):
    model, inputs = _build("encoder", False, bf)
    new, report = normconv.deepnorm(model, inputs)
    applied = [s.target for s in report.sites if s.applied]
    assert len(applied) == 4  # norm1 (attention) and norm2 (ffn) of both layers
    alpha = (2 * 2) ** 0.25
    assert new.enc.layers[0].norm1.eps == pytest.approx(model.enc.layers[0].norm1.eps / alpha**2)


@pytest.mark.parametrize("bf", [True, False])
def test_deepnorm_on_post_ln_transformer_reads_the_encoder_through_its_final_norm(bf):
    """nn.Transformer's decoder reads the memory after encoder.norm: that final norm must not hide which stack is
    the encoder (it was refused as "two post-LN stacks, neither reading the other's output")."""
    model, inputs = _build("transformer", False, bf)
    new, report = normconv.deepnorm(model, inputs)
    assert report.extra["arch"] == "encoder-decoder"
    applied = [s.target for s in report.sites if s.applied]
    assert len(applied) == 2 * 2 + 2 * 3  # encoder: attention, ffn; decoder: self-, cross-attention, ffn
    n = m = 2  # the paper's encoder-decoder constants, decoder alpha = (3M)^(1/4)
    dec_alpha = (3 * m) ** 0.25
    enc_alpha = 0.81 * (n**4 * m) ** (1 / 16)
    assert new.t.decoder.layers[0].norm3.eps == pytest.approx(model.t.decoder.layers[0].norm3.eps / dec_alpha**2)
    assert new.t.encoder.layers[1].norm2.eps == pytest.approx(model.t.encoder.layers[1].norm2.eps / enc_alpha**2)
    # alpha = 1 without beta is the identity instance: the original model, at another batch size
    same, _ = normconv.deepnorm(model, inputs, alpha=1.0, beta_mode="none")
    _, other = _build("transformer", False, bf, n=3)
    torch.testing.assert_close(run(same, other), run(model, other), atol=1e-5, rtol=1e-5)


def test_replaced_norm_turns_off_torchs_fused_encoder_path():
    """batch_first post-LN encoder in eval/no_grad takes torch._transformer_encoder_layer_fwd, which reads
    norm1.weight/bias as a LayerNorm: after the (approximate) swap it must run the RMSNorm modules instead."""
    model, inputs = _build("encoder", False, True)
    new, report = normconv.swap(model, inputs, approximate=True)
    assert sum(isinstance(m, RMSNorm) for m in new.modules()) == 4
    with torch.no_grad():  # the fast path's condition: eval, no grad
        fast = new(*inputs.args)
    with torch.enable_grad():  # parameters require grad: torch takes the module-by-module path
        slow = new(*inputs.args).detach()
    torch.testing.assert_close(fast, slow, atol=1e-5, rtol=1e-5)
    # the user's model keeps its fast path and its output
    assert model.enc.layers[0].activation_relu_or_gelu == 1


@pytest.mark.parametrize("bf", [True, False])
def test_pre_ln_encoder_with_final_norm_swaps_exactly(bf):
    """MultiheadAttention's out_proj reaches the stream through a transpose (batch_first) or views: exact."""
    torch.manual_seed(0)
    model = Encoder(True, bf)
    model.enc.norm = nn.LayerNorm(D)
    model.eval()
    for m in model.modules():
        if isinstance(m, nn.LayerNorm):
            nn.init.normal_(m.weight, 1, 0.3)
            nn.init.normal_(m.bias, 0, 0.3)
    ids = torch.randint(0, 50, (2, 5) if bf else (5, 2))
    new, report = normconv.swap(model, ids)
    assert sum(isinstance(m, RMSNorm) for m in new.modules()) == 5
    other = Inputs((torch.randint(0, 50, (3, 7) if bf else (7, 3)),))
    torch.testing.assert_close(run(new, other), run(model, other), atol=1e-5, rtol=1e-4)


def test_pre_ln_encoder_without_final_norm_is_refused_with_the_reader():
    model, inputs = _build("encoder", True, True)
    with pytest.raises(normconv.NormconvError, match="is also read by"):
        normconv.swap(model, inputs)
