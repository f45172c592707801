"""A folder out of a model whose tied tensors the rewrite splits: config.json says tie_word_embeddings = false, and
every tensor the architecture built so holds apart is saved under its own key (``io.hf_output._ties_untied``, asked
of the architecture itself on the meta device). BERT's masked-LM decoder bias is its prediction bias only while tied;
BART's encoder and decoder embeddings are its shared one only while tied. Both were refused (exit 2); a bias shared
and saved once came back from from_pretrained at its initial value."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file


def _bert(tmp_path):
    from transformers import BertConfig, BertForMaskedLM

    torch.manual_seed(0)
    m = BertForMaskedLM(BertConfig(vocab_size=128, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                                   intermediate_size=64, max_position_embeddings=64)).eval()
    with torch.no_grad():
        m.cls.predictions.bias.normal_()  # a trained masked-LM bias is not zero
    return m, lambda ids: {"input_ids": ids}


def _bart(tmp_path):
    from transformers import BartConfig, BartForConditionalGeneration

    torch.manual_seed(0)
    m = BartForConditionalGeneration(BartConfig(
        vocab_size=128, d_model=32, encoder_layers=2, decoder_layers=2, encoder_attention_heads=4,
        decoder_attention_heads=4, encoder_ffn_dim=64, decoder_ffn_dim=64, max_position_embeddings=64)).eval()
    return m, lambda ids: {"input_ids": ids, "decoder_input_ids": ids[:, :3]}


@pytest.mark.parametrize("build", [_bert, _bart])
def test_a_split_tie_is_written_as_a_folder_that_loads_back_equal(cli, tmp_path, build):
    model, feed = build(tmp_path)
    model.save_pretrained(tmp_path / "in")
    code, _, err = cli("swap", tmp_path / "in", "--to", "rmsnorm", "--partial", "-o", tmp_path / "out")
    assert code == 0, err
    back = type(model).from_pretrained(tmp_path / "out").eval()
    assert back.config.tie_word_embeddings is False
    written = load_file(tmp_path / "out" / "model.safetensors")
    state = back.state_dict()
    assert all(k in written for k in state if not k.endswith("position_ids")), sorted(set(state) - set(written))
    for shape in ((1, 7), (3, 12)):  # sizes the command never ran
        ids = torch.randint(4, 128, shape, generator=torch.Generator().manual_seed(shape[1]))
        with torch.no_grad():
            ref, got = model(**feed(ids)).logits, back(**feed(ids)).logits
        assert ref.abs().max() > 0.1 and (ref - got).abs().max() <= 1e-4 * ref.abs().max()
