"""``swap --stream`` of models whose LayerNorm is a class of their own computing the norm by hand or through
F.layer_norm (Cohere's CohereLayerNorm, OLMo's weight-free OlmoLayerNorm): the folder keeps the class, so only the
stream's writers change, as the in-memory swap to a folder does. Both were refused, exit 2 ('handwritten / functional
norm written inline ...: swap replaces norm modules'), though the in-memory swap to a folder is exact."""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.nn as nn

_DEC = dict(vocab_size=128, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64,
            max_position_embeddings=64, pad_token_id=1, bos_token_id=0, eos_token_id=0)


@pytest.mark.parametrize("arch", ["cohere", "olmo"])
def test_a_model_s_own_layernorm_class_streams_exactly(cli, tmp_path, arch):
    import transformers

    warnings.filterwarnings("ignore")
    torch.manual_seed(0)
    config = transformers.AutoConfig.for_model(arch, **_DEC)
    model = transformers.AutoModelForCausalLM.from_config(config).eval()
    with torch.no_grad():
        for m in model.modules():
            if "Norm" in type(m).__name__ and isinstance(getattr(m, "weight", None), nn.Parameter):
                m.weight.normal_(1.0, 0.3)
    model.save_pretrained(tmp_path / "in")
    code, _, err = cli("swap", tmp_path / "in", "--to", "rmsnorm", "--stream", "-o", tmp_path / "out")
    assert code == 0, err
    loaded = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path / "out")).eval()
    norm = loaded.model.layers[0].input_layernorm
    assert type(norm).__name__ == type(model.model.layers[0].input_layernorm).__name__  # the class kept
    embed = loaded.get_input_embeddings().weight.double()
    assert float(embed.mean(-1).abs().max()) < 1e-6  # a writer, centered
    g = torch.Generator().manual_seed(7)
    for batch, seq in ((1, 7), (3, 13)):
        ids = torch.randint(0, 128, (batch, seq), generator=g)
        with torch.no_grad():
            ref, got = model(input_ids=ids).logits.double(), loaded(input_ids=ids).logits.double()
        assert float((got - ref).abs().max() / ref.abs().max()) < 1e-5
