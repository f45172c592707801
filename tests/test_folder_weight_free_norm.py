"""A folder out of a model whose norm class has no parameters (OLMo's OlmoLayerNorm: only normalized_shape, the
norm computed by F.layer_norm without weight or bias): the swap centers the stream's writers and the folder keeps
the class, which now reads a zero-mean stream. It was refused (exit 2, 'model.layers.0.input_layernorm is now
RMSNorm (was OlmoLayerNorm)') though README lists OLMo's weight-free LayerNorm among the exact swaps."""

from __future__ import annotations

import warnings

import torch


def test_olmo_swap_to_a_folder_loads_back_equal(cli, tmp_path):
    from transformers import AutoModelForCausalLM, OlmoConfig, OlmoForCausalLM

    warnings.filterwarnings("ignore")
    torch.manual_seed(0)
    model = OlmoForCausalLM(OlmoConfig(vocab_size=128, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                                       intermediate_size=64, max_position_embeddings=64, pad_token_id=1,
                                       bos_token_id=0, eos_token_id=0)).eval()
    model.save_pretrained(tmp_path / "in")
    code, _, err = cli("swap", tmp_path / "in", "--to", "rmsnorm", "-o", tmp_path / "out")
    assert code == 0, err
    loaded = AutoModelForCausalLM.from_pretrained(str(tmp_path / "out")).eval()
    assert type(loaded.model.layers[0].input_layernorm).__name__ == "OlmoLayerNorm"
    embed = loaded.get_input_embeddings().weight.double()
    assert float(embed.mean(-1).abs().max()) < 1e-6  # a writer, centered
    g = torch.Generator().manual_seed(7)
    for batch, seq in ((1, 7), (3, 13)):
        ids = torch.randint(0, 128, (batch, seq), generator=g)
        with torch.no_grad():
            ref, got = model(input_ids=ids).logits.double(), loaded(input_ids=ids).logits.double()
        assert float((got - ref).abs().max() / ref.abs().max()) < 1e-5
