"""swap --stream of an encoder-decoder (Pegasus: one embedding tied to the encoder's, the decoder's and the head;
scaled embeddings, sinusoidal positions, two stacks of blocks): the centered embeddings written under their own
names, the tied names keeping the original values, every block of both stacks compared minus its mean, and the
output loaded with from_pretrained equal to the original at two shapes."""

from __future__ import annotations

import json
import warnings

import pytest
import torch

from tests.hf_tiny import VOCAB, saved_folder


def _pegasus():
    from transformers import PegasusConfig, PegasusForConditionalGeneration

    return PegasusForConditionalGeneration(PegasusConfig(
        vocab_size=VOCAB, d_model=32, encoder_layers=2, decoder_layers=2, encoder_attention_heads=4,
        decoder_attention_heads=4, encoder_ffn_dim=64, decoder_ffn_dim=64, max_position_embeddings=64,
        scale_embedding=True, use_cache=False, pad_token_id=0, eos_token_id=1, decoder_start_token_id=0))


@pytest.fixture(scope="module")
def pegasus(tmp_path_factory):
    """(folder, model): random weights (every norm's gain and bias not 1 / 0), one embedding tied four ways."""
    folder = tmp_path_factory.mktemp("pegasus") / "in"
    return folder, saved_folder(_pegasus, folder, norms=0.2)


def _inputs(batch, seq, dec):
    g = torch.Generator().manual_seed(batch * 100 + seq)
    return {"input_ids": torch.randint(2, VOCAB, (batch, seq), generator=g),
            "decoder_input_ids": torch.randint(2, VOCAB, (batch, dec), generator=g)}


def _block_means(model, inputs) -> float:
    """The largest |mean over the hidden axis| of any block output of either stack."""
    worst = [0.0]

    def hook(m, a, out):
        h = out[0] if isinstance(out, (tuple, list)) else out
        worst[0] = max(worst[0], float(h.double().mean(-1).abs().max()))

    hooks = [layer.register_forward_hook(hook) for layer in [*model.model.encoder.layers, *model.model.decoder.layers]]
    with torch.no_grad():
        model(**inputs)
    for h in hooks:
        h.remove()
    return worst[0]


def test_a_stream_of_an_encoder_decoder_centers_each_embedding_under_its_own_name(pegasus, tmp_path, cli):
    from transformers import PegasusForConditionalGeneration

    src, model = pegasus
    out = tmp_path / "out"
    code, stdout, stderr = cli("swap", src, "--to", "rmsnorm", "--stream", "-o", out, "--json")
    assert code == 0, stderr
    report = json.loads(stdout)
    assert report["passed"]
    # the tie named as it is: the encoder's embedding untied from the shared one, not from itself
    untie = [n for n in report["notes"] if n.startswith("untied model.encoder.embed_tokens.weight")]
    assert untie and untie[0].startswith("untied model.encoder.embed_tokens.weight from model.shared.weight")
    assert "from model.encoder.embed_tokens.weight" not in untie[0]

    warnings.filterwarnings("ignore")
    new = PegasusForConditionalGeneration.from_pretrained(out).eval()
    params = dict(new.named_parameters(remove_duplicate=False))
    original = model.model.shared.weight.detach()
    for name in ("model.encoder.embed_tokens.weight", "model.decoder.embed_tokens.weight"):
        assert float(params[name].detach().double().mean(-1).abs().max()) < 1e-6, name  # centered
        assert torch.allclose(params[name].detach(), original - original.mean(-1, keepdim=True), atol=1e-6)
    for name in ("model.shared.weight", "lm_head.weight"):
        assert torch.equal(params[name].detach(), original), name  # the head keeps the original values
    for shape in ((2, 9, 5), (1, 13, 7)):
        inputs = _inputs(*shape)
        with torch.no_grad():
            ref, got = model(**inputs).logits, new(**inputs).logits
        assert float((ref - got).abs().max()) <= 1e-5 * float(ref.abs().max())
        # what the output promises: every block of both stacks writes a zero-mean stream (each LayerNorm = RMSNorm)
        assert _block_means(new, inputs) < 1e-5
        assert _block_means(model, inputs) > 1e-3  # (the original's is not: the check above means something)


def test_both_stacks_are_compared_block_by_block(pegasus, tmp_path, cli):
    src, _ = pegasus
    code, stdout, stderr = cli("swap", src, "--to", "rmsnorm", "--stream", "-o", tmp_path / "out", "--json")
    assert code == 0, stderr
    blocks = json.loads(stdout)["extra"]["blocks"]
    assert len(blocks) == 2 * 4 and all(b["passed"] for b in blocks)  # 2 encoder + 2 decoder blocks, two shapes
    assert {b["block"] for b in blocks} == {0, 1, 2, 3}


def test_a_decoder_stream_left_uncentered_fails_at_a_decoder_block(pegasus, tmp_path, cli, monkeypatch):
    """LayerNorm is blind to a mean shift: the final outputs cannot see a decoder embedding left as it was (its
    stream no longer zero-mean, each LayerNorm no longer an RMSNorm); the decoder's block check does."""
    from normconv.stream import swap as streaming

    src, _ = pegasus
    rewrite = streaming._rewrite

    def wrong(*a, **k):
        produce, *rest = rewrite(*a, **k)

        def produce_wrong(name, t, source):
            return t if name == "model.decoder.embed_tokens.weight" else produce(name, t, source)

        return (produce_wrong, *rest)

    monkeypatch.setattr(streaming, "_rewrite", wrong)
    out = tmp_path / "out"
    code, stdout, stderr = cli("swap", src, "--to", "rmsnorm", "--stream", "-o", out, "--json")
    assert code == 1 and "model.decoder.layers.0" in stderr and "nothing written" in stderr
    report = json.loads(stdout)
    assert report["code"] == "not-verified"
    finals = [v for v in report["validation"] if "final outputs" in v["label"] or "second shape" in v["label"]]
    assert finals and all(v["passed"] for v in finals)  # what the block check alone catches
    assert not out.exists()
