"""swap's refusals say where in the model's terms: a norm module called twice (BLIP's post_layernorm, on the sequence
and on the pooled token) was 'also called at layer_norm_5', a graph node's name; a per-head norm's input split into
heads (Cohere's q_norm / k_norm) was said to come from 'patch unfolding'."""

from __future__ import annotations

import re
import warnings

import pytest
import torch

import normconv
from normconv.errors import NormconvError
from normconv.verify import Inputs


def test_a_module_called_twice_is_refused_without_a_node_name():
    transformers = pytest.importorskip("transformers")
    warnings.filterwarnings("ignore")
    torch.manual_seed(0)
    cfg = transformers.BlipVisionConfig(hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                                        intermediate_size=64, image_size=32, patch_size=8)
    with pytest.raises(NormconvError) as exc:
        normconv.swap(transformers.BlipVisionModel(cfg).eval(), torch.randn(1, 3, 32, 32))
    message = exc.value.message
    assert "post_layernorm: the same module is called at 2 places, and at another of them: " in message, message
    assert not re.search(r"\blayer_norm_\d", message), message


def test_a_split_into_heads_is_named_as_such():
    transformers = pytest.importorskip("transformers")
    from normconv.graph.capture import capture
    from normconv.graph.detect import find_norms
    from normconv.passes import swap_norm

    warnings.filterwarnings("ignore")
    torch.manual_seed(0)
    cfg = transformers.CohereConfig(vocab_size=128, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                                    intermediate_size=64, max_position_embeddings=64, use_qk_norm=True,
                                    use_cache=False, eos_token_id=0, bos_token_id=0, pad_token_id=0)
    model = transformers.CohereForCausalLM(cfg).eval()
    cap = capture(model, Inputs((), {"input_ids": torch.randint(0, 128, (2, 7))}), "torch.export")
    # as --stream plans it: the folder keeps Cohere's own norm class
    a = swap_norm.analyze(cap, find_norms(cap), "rmsnorm", add_bias=False, keeps_class=True)
    q = next(p for p in a.plans if p.site.target == "model.layers.0.self_attn.q_norm")
    assert "splits the hidden axis into heads" in q.reason and "patch unfolding" not in q.reason, q.reason
    assert "in model.layers.0.self_attn" in q.reason


class _Inline(torch.nn.Module):
    """A norm written as one F.layer_norm call among other work, in a module of its own."""

    def __init__(self, d=16):
        super().__init__()
        self.weight, self.bias = torch.nn.Parameter(torch.ones(d)), torch.nn.Parameter(torch.zeros(d))

    def forward(self, x):
        return torch.nn.functional.layer_norm(x, (x.shape[-1],), self.weight, self.bias, 1e-5) * 2


class _Model(torch.nn.Module):
    def __init__(self, d=16):
        super().__init__()
        self.embed, self.ln, self.fc = torch.nn.Embedding(30, d), _Inline(d), torch.nn.Linear(d, d)

    def forward(self, ids):
        h = self.embed(ids)
        return h + self.fc(self.ln(h))


def test_a_functional_norm_is_named_by_the_module_computing_it():
    """It was named by its graph node (``layer_norm: functional norm written inline in ln``)."""
    with pytest.raises(NormconvError) as exc:
        normconv.swap(_Model().eval(), torch.randint(0, 30, (2, 5)), canonicalize=False)
    assert "; the layernorm in ln: " in exc.value.message, exc.value.message
    assert not re.search(r"\blayer_norm\b", exc.value.message), exc.value.message
