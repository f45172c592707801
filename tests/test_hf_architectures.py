"""Which model class a Hugging Face folder means, as transformers resolves it, in memory and --stream alike: a name
in ``architectures`` transformers has no class of is one line and exit 2 (never the base model in its place, whose
missing head the folder did not name); with no ``architectures``, the base model transformers' AutoModel builds,
unless the checkpoint is a model with a head's; a base model's rewritten embedding is never left tied to a head
the proof did not run (config.json: tie_word_embeddings = false)."""

from __future__ import annotations

import json
import warnings

import pytest
import torch

from tests.trust_helpers import one_line_error, saved_folder

MODES = [[], ["--stream"]]


def _gpt2_base():
    from transformers import GPT2Config, GPT2Model

    return GPT2Model(GPT2Config(vocab_size=100, n_embd=32, n_layer=2, n_head=4, n_positions=64, use_cache=False,
                                bos_token_id=0, eos_token_id=0))


def _edit_config(folder, architectures):
    config = json.loads((folder / "config.json").read_text())
    if architectures is None:
        config.pop("architectures", None)
    else:
        config["architectures"] = architectures
    (folder / "config.json").write_text(json.dumps(config))
    return config


@pytest.mark.parametrize("architectures,match", [(["EvilForCausalLM"], ("'EvilForCausalLM'", "not a transformers model class", "GPT2LMHeadModel")),
                                                 (None, ("names no architectures", "transformer.", "GPT2LMHeadModel"))],
                         ids=["unknown name", "absent, a head's checkpoint"])
@pytest.mark.parametrize("mode", MODES, ids=["in memory", "stream"])
def test_a_folder_whose_head_is_not_named_is_refused(cli, tmp_path, architectures, match, mode):
    folder, out = tmp_path / "lm", tmp_path / "out"
    saved_folder(folder, shard=None)  # a GPT2LMHeadModel: its head tied to wte
    _edit_config(folder, architectures)
    one_line_error(cli, "swap", folder, "--to", "rmsnorm", *mode, "-o", out, match=match)
    assert not out.exists()


@pytest.mark.parametrize("architectures", [None, ["GPT2Model"]], ids=["absent", "named"])
def test_a_base_model_folder_is_rewritten_as_the_base_model_and_never_left_tied(cli, tmp_path, architectures):
    from transformers import AutoModel, AutoModelForCausalLM

    folder = tmp_path / "base"
    saved_folder(folder, shard=None, build=_gpt2_base)
    assert _edit_config(folder, architectures).get("tie_word_embeddings", True)
    warnings.filterwarnings("ignore")
    original = AutoModel.from_pretrained(folder).eval()
    written = []
    for mode in MODES:
        out = tmp_path / f"out{len(mode)}"
        rc, _, err = cli("--quiet", "swap", folder, "--to", "rmsnorm", *mode, "-o", out)
        assert rc == 0, err
        config = json.loads((out / "config.json").read_text())
        assert config["architectures"] == ["GPT2Model"] and config["tie_word_embeddings"] is False, config
        model = AutoModel.from_pretrained(out).eval()
        assert type(model).__name__ == "GPT2Model"
        for i, shape in enumerate([(1, 7), (3, 13)]):
            ids = torch.randint(0, 100, shape, generator=torch.Generator().manual_seed(i))
            with torch.no_grad():
                a, b = original(ids).last_hidden_state, model(ids).last_hidden_state
            assert (a - b).abs().max() <= 1e-5 * a.abs().max(), shape
        # a head class built from the folder does not tie its head to the centered embedding
        head = AutoModelForCausalLM.from_pretrained(out)
        assert not torch.equal(head.lm_head.weight, head.transformer.wte.weight)
        written.append(model.state_dict())
    assert written[0].keys() == written[1].keys()  # in memory and --stream write the same model
    assert all(torch.allclose(written[0][k], written[1][k], atol=1e-6) for k in written[0])
