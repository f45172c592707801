"""One code per cause, with and without --stream: a refusal a pass makes (no LayerNorm to swap, a post-LN model,
LED's too, which the meta device cannot capture, BatchNorms the stream cannot fold) has --json code ``refused`` both ways (--stream said ``bad-input``), and fold
--stream of a model without BatchNorm does what the in-memory fold does: exit 0, the model written unchanged and
verified (it was refused with bad-input)."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch

from normconv.passes import fold_batchnorm
from normconv.stream import fold as stream_fold
from tests.hf_tiny import VOCAB, saved_folder as _save
from tests.test_stream_fold import _saved as _saved_resnet


def _t5():
    from transformers import T5Config, T5ForConditionalGeneration

    return T5ForConditionalGeneration(T5Config(vocab_size=VOCAB, d_model=32, d_kv=8, d_ff=64, num_layers=2,
                                               num_heads=4, use_cache=False, decoder_start_token_id=0))


def _bert():
    from transformers import BertConfig, BertModel

    return BertModel(BertConfig(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                                intermediate_size=64, max_position_embeddings=64))


def _gpt2():
    from transformers import GPT2Config, GPT2LMHeadModel

    return GPT2LMHeadModel(GPT2Config(vocab_size=VOCAB, n_embd=32, n_layer=2, n_head=4, n_positions=64,
                                      use_cache=False, bos_token_id=0, eos_token_id=0))


def _run(cli, *args):
    code, stdout, stderr = cli(*map(str, args), "--json")
    return code, json.loads(stdout), stderr


def _led():
    """Post-LN, and its forward branches on the input's values (global attention): the meta device cannot capture
    it, so --stream plans it as in memory (it failed with cannot-capture)."""
    from transformers import LEDConfig, LEDForConditionalGeneration

    return LEDForConditionalGeneration(LEDConfig(
        vocab_size=VOCAB, d_model=32, encoder_layers=2, decoder_layers=2, encoder_attention_heads=4,
        decoder_attention_heads=4, encoder_ffn_dim=64, decoder_ffn_dim=64, max_encoder_position_embeddings=64,
        max_decoder_position_embeddings=64, attention_window=[4, 4]))


@pytest.mark.parametrize("family, says", [("t5", "has no layernorm to swap"), ("bert", "post-LN"),
                                          ("led", "post-LN")])
def test_a_swap_refusal_has_one_code_with_and_without_stream(tmp_path, cli, family, says):
    src = tmp_path / "in"
    _save({"t5": _t5, "bert": _bert, "led": _led}[family], src)
    codes = []
    for stream in ([], ["--stream"]):
        code, report, stderr = _run(cli, "swap", src, "--to", "rmsnorm", "-o", tmp_path / f"out{len(stream)}",
                                    *stream)
        assert code == 2 and says in stderr and len(stderr.strip().splitlines()) == 1
        assert report["exit_code"] == 2 and not report["passed"]
        codes.append(report["code"])
    assert codes == ["refused", "refused"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["in"]


def test_fold_stream_of_a_model_without_batchnorm_writes_it_unchanged_as_in_memory(tmp_path, cli):
    from transformers import GPT2LMHeadModel

    src = tmp_path / "in"
    model = _save(_gpt2, src)
    outputs = {}
    for stream in ([], ["--stream"]):
        out = tmp_path / f"out{len(stream)}"
        code, report, stderr = _run(cli, "fold", src, "-o", out, *stream)
        assert code == 0, stderr
        assert report["passed"] and "the model has no BatchNorm; it is unchanged" in report["notes"]
        outputs[len(stream)] = out
    new = GPT2LMHeadModel.from_pretrained(outputs[1]).eval()
    for batch, seq in ((2, 9), (1, 17)):
        ids = torch.randint(0, VOCAB, (batch, seq), generator=torch.Generator().manual_seed(seq))
        with torch.no_grad():
            assert torch.equal(new(ids).logits, model(ids).logits)
    written = dict(new.state_dict())
    assert all(torch.equal(written[k], v) for k, v in model.state_dict().items())


def test_fold_stream_of_batchnorms_it_cannot_fold_is_refused_with_the_refused_code(tmp_path, cli, monkeypatch):
    src = tmp_path / "in"
    _saved_resnet(src)
    analyze = fold_batchnorm.analyze

    def forward_only(*a, **k):  # every BatchNorm folds into the layer after it only: not what --stream streams
        return [dataclasses.replace(d, direction="forward") for d in analyze(*a, **k)]

    monkeypatch.setattr(stream_fold.fold_batchnorm, "analyze", forward_only)
    code, report, stderr = _run(cli, "fold", src, "--stream", "-o", tmp_path / "out")
    assert code == 2 and "can be folded into the layer before it" in stderr
    assert report["code"] == "refused" and report["exit_code"] == 2
    assert sorted(p.name for p in tmp_path.iterdir()) == ["in"]


def test_a_model_without_a_list_of_blocks_is_refused_with_the_way_that_takes_it():
    """--stream verifies block by block along the model's nn.ModuleList; a model with none (an HF timm_wrapper
    folder: timm's stages are nn.Sequential) is refused as such (code refused, not bad-input), and the hint names
    the in-memory command, which takes it."""
    import torch.nn as nn

    from normconv.errors import Code, NormconvError
    from normconv.stream.blocks import blocks

    stages = nn.Sequential(nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4), nn.ReLU())
    with pytest.raises(NormconvError) as caught:
        blocks(stages)
    assert caught.value.code is Code.REFUSED
    assert "without --stream" in caught.value.hint
