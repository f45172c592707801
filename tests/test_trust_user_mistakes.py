"""Issue 27, class 6: user mistakes end as one line and exit 2, never as an internal error or a hang: --weights with
the right keys and wrong shapes, a config.json whose architectures names something that is not a model class, a
config that describes a model larger than any memory (estimated from its numbers before anything is built), the
same -i NAME given twice."""

from __future__ import annotations

import json
import shutil
import time

import pytest
import torch

from tests.trust_helpers import one_line_error, saved_folder

FACTORY = "tests.fixtures.user_models:small_net"


def test_weights_with_the_right_keys_and_wrong_shapes(cli, tmp_path):
    from tests.fixtures.user_models import small_net

    state = small_net().state_dict()
    name = next(k for k, v in state.items() if v.dim() == 4)
    state[name] = torch.zeros(*(d + 1 for d in state[name].shape))
    weights = tmp_path / "w.pt"
    torch.save(state, weights)
    one_line_error(cli, "fold", FACTORY, "--weights", weights, "-i", "x:2,3,8,8", match=("another shape", name))
    from safetensors.torch import save_file

    save_file(state, tmp_path / "w.safetensors")
    one_line_error(cli, "inspect", FACTORY, "--weights", tmp_path / "w.safetensors", "-i", "x:2,3,8,8",
                   match="another shape")


@pytest.fixture(scope="module")
def template(tmp_path_factory):
    folder = tmp_path_factory.mktemp("mistakes") / "gpt2"
    saved_folder(folder, shard=None)
    return folder


def _with_config(tmp_path, template, **changes):
    folder = tmp_path / "model"
    shutil.copytree(template, folder)
    config = json.loads((folder / "config.json").read_text())
    config.update(changes)
    (folder / "config.json").write_text(json.dumps(config))
    return folder


@pytest.mark.parametrize("name", ["GPT2Tokenizer", "GPT2TokenizerFast", "GPT2Config", "pipeline", "AutoTokenizer"])
def test_architectures_naming_something_that_is_not_a_model(cli, tmp_path, template, name):
    folder = _with_config(tmp_path, template, architectures=[name])
    one_line_error(cli, "inspect", folder, match=("not a transformers model class", name))
    one_line_error(cli, "swap", folder, "--stream", "-o", tmp_path / "out", match="not a transformers model class")


@pytest.mark.parametrize("changes,match", [({"torch_dtype": "int8", "dtype": "int8"}, "cannot be instantiated"),
                                           ({"model_type": "evilgpt"}, "not a readable Hugging Face config")],
                         ids=["integer dtype", "unknown model_type"])
@pytest.mark.parametrize("command", ["swap", "swap --stream"])
def test_a_config_transformers_refuses_is_one_line_in_memory_and_streamed(cli, tmp_path, template, changes, match,
                                                                          command):
    """transformers' own refusal of a config (its multi-line text, or a build it refuses) is the user's mistake:
    one line and exit 2, read in memory or built on the meta device by --stream, nothing written."""
    folder = _with_config(tmp_path, template, **changes)
    out = tmp_path / "out"
    one_line_error(cli, *command.split(" ")[:1], folder, "--to", "rmsnorm", *command.split(" ")[1:], "-o", out,
                   match=match)
    assert not out.exists()


@pytest.mark.parametrize("layers", [1e9, 1000000000, 10 ** 15])
@pytest.mark.parametrize("command", ["inspect", "swap --stream"])
def test_a_config_larger_than_memory_is_refused_before_building(cli, tmp_path, template, layers, command):
    folder = _with_config(tmp_path, template, n_layer=layers)
    name, *flags = command.split()
    t0 = time.perf_counter()
    one_line_error(cli, name, folder, *flags, *(["-o", tmp_path / "out"] if flags else []),
                   match=("refused before building it", "parameters"))
    assert time.perf_counter() - t0 < 60  # estimated from the numbers, not built


def test_a_huge_width_is_refused_too(cli, tmp_path, template):
    folder = _with_config(tmp_path, template, n_embd=10 ** 9)
    one_line_error(cli, "inspect", folder, match="refused before building it")


@pytest.fixture(scope="module")
def efficientnet_b7_like(tmp_path_factory):
    """EfficientNet-B7's config numbers (hidden_dim 2560, num_hidden_layers 64, width 2.0) at depth 0.1 and 32x32
    images: 6.2M parameters, which the transformer-shaped estimate reads as 6.7e9 (25 GiB)."""
    from transformers import EfficientNetConfig, EfficientNetForImageClassification

    torch.manual_seed(0)
    cfg = EfficientNetConfig(width_coefficient=2.0, depth_coefficient=0.1, image_size=32, num_labels=3,
                             hidden_dim=2560)
    folder = tmp_path_factory.mktemp("effnet") / "b7"
    EfficientNetForImageClassification(cfg).save_pretrained(folder)
    return folder


def test_a_config_the_estimate_misreads_is_counted_on_meta_not_refused(cli, efficientnet_b7_like, monkeypatch):
    from normconv.io import config_size

    assert config_size.estimated_parameters(json.loads((efficientnet_b7_like / "config.json").read_text())) > 6e9
    monkeypatch.setattr(config_size, "memory_bytes", lambda: 8 * 2**30)  # a laptop: the estimate is past it
    code, out, err = cli("inspect", efficientnet_b7_like, "--json")
    assert code == 0, err
    assert json.loads(out)["sites"]  # loaded: its BatchNorms listed
    monkeypatch.setattr(config_size, "memory_bytes", lambda: 2**20)  # 1 MiB: the counted model is past it
    one_line_error(cli, "inspect", efficientnet_b7_like, match=("counted on the meta device", "refused before"))


def test_the_same_input_twice_is_refused(cli):
    one_line_error(cli, "fold", "zoo:resnet", "-i", "x:2,3,32,32", "-i", "x:1,3,16,16", match=("'x' twice",))
    one_line_error(cli, "fold", FACTORY, "-i", "x:2,3,8,8", "-i", "x:2,3,8,8", match="twice")
