"""rotate on models with per-head query / key norms (Qwen3's q_norm / k_norm, Persimmon's q_layernorm / k_layernorm):
those norms read the stream only through q_proj / k_proj, whose outputs the rotation keeps, so they are left as they
are (site code not-on-the-stream) and the rest is rotated exactly; judged on fresh inputs at two shapes. A model whose
stream is written by norms (OLMo2's norms after each sublayer) is refused, naming that norm."""

from __future__ import annotations

import warnings

import pytest
import torch

from normconv.api import rotate
from normconv.errors import Code, NormconvError
from normconv.verify import Inputs

VOCAB = 100
_DEC = dict(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64,
            max_position_embeddings=64, use_cache=False)


def _ids(batch, seq, seed):
    return torch.randint(0, VOCAB, (batch, seq), generator=torch.Generator().manual_seed(seed))


def _hf(cls_name, cfg_name, **cfg):
    import transformers

    warnings.filterwarnings("ignore")
    torch.manual_seed(0)
    model = getattr(transformers, cls_name)(getattr(transformers, cfg_name)(**_DEC, **cfg)).eval()
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():  # trained-looking weights: norm scales and biases away from 1 / 0
        for p in model.parameters():
            p.add_(0.2 * torch.randn(p.shape, generator=g, dtype=p.dtype))
    return model


def _same_outputs(model, new):
    """The rewrite's logits equal the original's at two shapes the rewrite never saw (relative to their scale)."""
    for batch, seq in ((1, 7), (3, 13)):
        ids = _ids(batch, seq, seed=batch * 100 + seq)
        with torch.no_grad():
            ref, got = model(input_ids=ids).logits, new(input_ids=ids).logits
        assert got.shape == ref.shape
        assert float((got - ref).abs().max() / ref.abs().max()) < 1e-5, (batch, seq)


def _codes(report, pass_name):
    return {s.target: s.code.value for s in report.sites if s.pass_name == pass_name}


def test_qwen3_q_k_norms_are_left_and_the_stream_rotated():
    model = _hf("Qwen3ForCausalLM", "Qwen3Config", num_key_value_heads=2, head_dim=8)
    new, report = rotate(model, Inputs((), {"input_ids": _ids(2, 16, 0)}), seed=1)
    _same_outputs(model, new)
    # it really rotated: the embedding changed, the stream norms lost their scales
    assert (new.model.embed_tokens.weight - model.model.embed_tokens.weight).abs().max() > 1e-3
    for norm in (new.model.norm, new.model.layers[0].input_layernorm):  # nothing to compute with: a weight of ones
        assert norm._parameters.get("weight") is None and torch.equal(norm.weight, torch.ones(32))
    # the per-head norms are left as they are, and their sites say why
    for i in range(2):
        attn, old = new.model.layers[i].self_attn, model.model.layers[i].self_attn
        assert torch.equal(attn.q_norm.weight, old.q_norm.weight) and torch.equal(attn.k_norm.weight, old.k_norm.weight)
        for name in ("q_norm", "k_norm"):
            target = f"model.layers.{i}.self_attn.{name}"
            assert _codes(report, "rotate")[target] == "not-on-the-stream"
            assert _codes(report, "fold-scales")[target] == "not-on-the-stream"
    assert _codes(report, "rotate")["model.norm"] == "rotated"
    assert report.extra["scales_folded"] == 5


def test_persimmon_per_head_layernorms_are_left_and_the_stream_rotated(cli, tmp_path):
    """Persimmon's stream LayerNorms go through the exact swap; its q_layernorm / k_layernorm (over a per-head view of
    the fused query_key_value) are left: they blocked the swap, and so rotate (exit 2)."""
    model = _hf("PersimmonForCausalLM", "PersimmonConfig")
    model.save_pretrained(tmp_path / "persimmon")
    code, _, stderr = cli("rotate", tmp_path / "persimmon", "-o", tmp_path / "rot.pt")
    assert code == 0, stderr
    saved = torch.load(tmp_path / "rot.pt", weights_only=False).eval()
    _same_outputs(model, saved)
    layer = saved.model.layers[0]
    assert isinstance(layer.self_attn.q_layernorm, torch.nn.LayerNorm)  # left as it was
    assert torch.equal(layer.self_attn.q_layernorm.weight, model.model.layers[0].self_attn.q_layernorm.weight)
    assert not isinstance(layer.input_layernorm, torch.nn.LayerNorm)  # the stream's norm was swapped, then folded
    new, report = rotate(model, Inputs((), {"input_ids": _ids(2, 16, 0)}), seed=1)
    _same_outputs(model, new)
    assert _codes(report, "swap")["model.layers.1.self_attn.k_layernorm"] == "not-on-the-stream"
    assert _codes(report, "rotate")["model.layers.1.self_attn.k_layernorm"] == "not-on-the-stream"


def test_olmo2_norms_writing_the_stream_are_refused_with_the_reason():
    """OLMo2 normalizes each sublayer's output before the residual add: the stream's writers are norms, whose
    per-feature scale a rotation cannot pass. Its q_norm (over the whole hidden width, after q_proj) is not why."""
    model = _hf("Olmo2ForCausalLM", "Olmo2Config", num_key_value_heads=2)
    with pytest.raises(NormconvError) as err:
        rotate(model, Inputs((), {"input_ids": _ids(2, 16, 0)}))
    assert err.value.code is Code.REFUSED and err.value.pass_name == "rotate"
    assert "feedforward_layernorm is a norm on a sublayer's output" in err.value.message
    assert "q_norm" not in err.value.message
