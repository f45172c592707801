"""Issue 27, class 2: which weights a folder means. normconv reads, in memory and --stream, exactly the files
``from_pretrained`` loads (transformers' own resolution, checked against transformers' own function on every layout);
a folder holding a single file and an index of the same format is ambiguous and refused in one line by every command
that reads a folder, nothing written."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from normconv.errors import NormconvError
from normconv.io import hf_folder
from normconv.io.load import load
from normconv.stream.checkpoint import Checkpoint
from tests.trust_helpers import IN_MEMORY, STREAMED, command_args, fingerprint, one_line_error, saved_folder

SHARDS = ["model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"]
BIN_SHARDS = ["pytorch_model-00001-of-00002.bin", "pytorch_model-00002-of-00002.bin"]


def _layout(folder: Path, names: list[str], explicit: str | None = None) -> None:
    """Placeholder files named as a folder would hold them (resolution reads names and indexes only)."""
    folder.mkdir()
    config = {"model_type": "gpt2"} | ({"transformers_weights": explicit} if explicit else {})
    (folder / "config.json").write_text(json.dumps(config))
    for name in names:
        if name.startswith("@"):  # a dangling link of that name (os.path.isfile: no file)
            (folder / name[1:]).symlink_to("/nonexistent/" + name[1:])
        elif name.endswith(".index.json"):
            shards = BIN_SHARDS if name.startswith("pytorch") else SHARDS
            (folder / name).write_text(json.dumps({"metadata": {}, "weight_map": {"a": shards[0], "b": shards[1]}}))
            for s in shards:
                (folder / s).write_bytes(b"")
        else:
            (folder / name).write_bytes(b"")


LAYOUTS = [
    (["model.safetensors"], None),
    (["model.safetensors.index.json"], None),
    (["pytorch_model.bin"], None),
    (["pytorch_model.bin.index.json"], None),
    (["model.safetensors", "pytorch_model.bin"], None),
    (["model.safetensors.index.json", "pytorch_model.bin"], None),
    (["model.safetensors", "pytorch_model.bin.index.json"], None),
    (["model.safetensors.index.json", "pytorch_model.bin.index.json"], None),
    (["@model.safetensors", "model.safetensors.index.json"], None),
    (["@model.safetensors", "@model.safetensors.index.json", "pytorch_model.bin"], None),
    (["model.safetensors", "custom.safetensors"], "custom.safetensors"),
    (["model.safetensors", "custom.safetensors.index.json"], "custom.safetensors.index.json"),
]


@pytest.mark.parametrize("names,explicit", LAYOUTS)
def test_the_files_normconv_reads_are_the_ones_from_pretrained_loads(tmp_path, names, explicit):
    from transformers.modeling_utils import _get_resolved_checkpoint_files

    folder = tmp_path / "m"
    _layout(folder, names, explicit)
    if explicit and explicit.endswith(".index.json"):
        (folder / explicit).write_text(json.dumps({"metadata": {}, "weight_map": {"a": SHARDS[0]}}))
    theirs, _ = _get_resolved_checkpoint_files(str(folder), variant=None, gguf_file=None, use_safetensors=None,
                                               user_agent={}, is_remote_code=False,
                                               transformers_explicit_filename=explicit)
    ours = hf_folder.resolve(folder, headers=False)
    assert sorted(str(Path(f).resolve()) for f in theirs) == sorted(str(f.resolve()) for f in ours.files)


@pytest.mark.parametrize("single,index", [("model.safetensors", "model.safetensors.index.json"),
                                          ("pytorch_model.bin", "pytorch_model.bin.index.json")])
def test_a_single_file_beside_an_index_is_ambiguous(tmp_path, single, index):
    folder = tmp_path / "m"
    _layout(folder, [single, index])
    with pytest.raises(NormconvError, match="ambiguous"):
        hf_folder.resolve(folder, headers=False)


@pytest.fixture(scope="module")
def ambiguous(tmp_path_factory):
    """A real folder with both model.safetensors (one model) and an index with shards (another model)."""
    root = tmp_path_factory.mktemp("ambiguous")
    saved_folder(root / "single", shard=None)
    torch.manual_seed(1)
    saved_folder(root / "sharded")
    folder = root / "both"
    shutil.copytree(root / "sharded", folder)
    shutil.copy(root / "single" / "model.safetensors", folder / "model.safetensors")
    return folder


@pytest.mark.parametrize("command", sorted(IN_MEMORY))
def test_every_command_refuses_an_ambiguous_folder_in_memory(cli, tmp_path, ambiguous, command):
    before = fingerprint(ambiguous)
    one_line_error(cli, *command_args(command, ambiguous, tmp_path / "result"), match=("ambiguous",
                                                                                       "model.safetensors"))
    assert fingerprint(ambiguous) == before and not list(tmp_path.iterdir())


@pytest.mark.parametrize("command", sorted(STREAMED))
def test_every_command_refuses_an_ambiguous_folder_streamed(cli, tmp_path, ambiguous, command):
    before = fingerprint(ambiguous)
    one_line_error(cli, *command_args(command, ambiguous, tmp_path / "result", STREAMED), match="ambiguous")
    assert fingerprint(ambiguous) == before and not list(tmp_path.iterdir())


def test_the_named_weights_are_read_in_memory_and_streamed(tmp_path):
    """config.json's transformers_weights names the file from_pretrained loads: normconv reads that one, not the
    model.safetensors beside it, in memory and --stream."""
    a, b = tmp_path / "a", tmp_path / "b"
    saved_folder(a, shard=None)
    torch.manual_seed(3)
    model_b = saved_folder(b, shard=None)
    shutil.copy(b / "model.safetensors", a / "custom.safetensors")
    config = json.loads((a / "config.json").read_text())
    config["transformers_weights"] = "custom.safetensors"
    (a / "config.json").write_text(json.dumps(config))
    loaded = load(str(a), check=False)
    for k, v in model_b.state_dict().items():
        assert torch.equal(loaded.model.state_dict()[k], v), k
    assert set(Checkpoint(a).weight_map.values()) == {"custom.safetensors"}


def test_stream_says_what_from_pretrained_would_load_when_it_is_not_safetensors(tmp_path):
    folder = tmp_path / "m"
    _layout(folder, ["pytorch_model.bin"])
    with pytest.raises(NormconvError, match="no safetensors weights.*pytorch_model.bin"):
        Checkpoint(folder)


def _dangling_single(folder: Path) -> None:
    (folder / "model.safetensors").symlink_to("/nonexistent/model.safetensors")


def _dot_slash_shards(folder: Path) -> None:
    index = json.loads((folder / "model.safetensors.index.json").read_text())
    index["weight_map"] = {k: f"./{v}" for k, v in index["weight_map"].items()}
    (folder / "model.safetensors.index.json").write_text(json.dumps(index))


@pytest.mark.parametrize("edit", [_dangling_single, _dot_slash_shards], ids=["dangling model.safetensors link",
                                                                             "index naming ./shard"])
def test_a_layout_from_pretrained_loads_is_read_in_memory_and_streamed(cli, tmp_path, edit):
    """Where from_pretrained loads a folder (a dangling model.safetensors link it skips, an index naming its shards
    ./x), normconv reads the same weights in memory and --stream: each output loads and computes the original's
    logits at two shapes."""
    from transformers import AutoModelForCausalLM

    folder = tmp_path / "m"
    original = saved_folder(folder)
    edit(folder)
    AutoModelForCausalLM.from_pretrained(folder)  # transformers loads this layout
    for mode in ([], ["--stream"]):
        out = tmp_path / f"out{len(mode)}"
        rc, _, err = cli("--quiet", "swap", folder, "--to", "rmsnorm", *mode, "-o", out)
        assert rc == 0, err
        back = AutoModelForCausalLM.from_pretrained(out).eval()
        for i, shape in enumerate([(1, 7), (3, 13)]):
            ids = torch.randint(0, 100, shape, generator=torch.Generator().manual_seed(i))
            with torch.no_grad():
                a, b = original(ids).logits, back(ids).logits
            assert (a - b).abs().max() <= 1e-5 * a.abs().max(), (mode, shape)
