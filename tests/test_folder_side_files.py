"""A folder out carries the input folder's other files as --stream does: tokenizer, processor, README (a link into
a hub cache copied as the bytes it names, never as a link); weight files of the original and subfolders are left out
and said. Before, the in-memory commands wrote config.json and the weights only: AutoTokenizer failed on the output."""

from __future__ import annotations

import json
import shutil

import pytest


@pytest.mark.parametrize("stream", [False, True])
def test_folder_out_carries_the_tokenizer_and_leaves_the_original_weights(cli, hf_folders, tmp_path, stream):
    src = tmp_path / "in"
    shutil.copytree(hf_folders["gpt2"], src)
    (src / "tokenizer_config.json").write_text(json.dumps({"model_max_length": 64}))
    (src / "card").mkdir()
    (src / "card" / "README.md").write_text("# the model card\n")
    (src / "README.md").symlink_to("card/README.md")  # a file that is a link (as a hub cache snapshot's are)
    (src / "training_args.bin").write_bytes(b"\x00" * 16)
    (src / "runs").mkdir()
    before = {p.name: p.read_bytes() for p in src.iterdir() if p.is_file()}
    args = ("swap", src, "--to", "rmsnorm", "-o", tmp_path / "out") + (("--stream",) if stream else ())
    code, out, err = cli(*args, "--json")
    assert code == 0, err
    got = tmp_path / "out"
    assert json.loads((got / "tokenizer_config.json").read_text()) == {"model_max_length": 64}
    assert not (got / "README.md").is_symlink() and (got / "README.md").read_text() == "# the model card\n"
    assert not (got / "training_args.bin").exists()
    # subfolders left out by both (--stream copied them whole, links as links)
    assert not (got / "runs").exists() and not (got / "card").exists()
    assert any("training_args.bin" in n and "runs/" in n for n in json.loads(out)["notes"])
    assert {p.name: p.read_bytes() for p in src.iterdir() if p.is_file()} == before


def test_a_side_file_linking_out_of_the_folder_is_never_read(cli, hf_folders, tmp_path):
    """tokenizer.json -> a file outside the folder (a key, another model's file): not copied, not read, said;
    the rest of the folder is written (the in-memory folder output copies only what the folder holds)."""
    src = tmp_path / "in"
    shutil.copytree(hf_folders["gpt2"], src)
    secret = tmp_path / "secret.txt"
    secret.write_text("not the model's")
    (src / "tokenizer.json").symlink_to(secret)
    (src / "special_tokens_map.json").write_text("{}")
    code, out, err = cli("swap", src, "--to", "rmsnorm", "-o", tmp_path / "out", "--json")
    assert code == 0, err
    assert not (tmp_path / "out" / "tokenizer.json").exists() and (tmp_path / "out" / "special_tokens_map.json").exists()
    assert any("tokenizer.json" in n and "outside the input folder" in n for n in json.loads(out)["notes"])
