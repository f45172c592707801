"""Issue 27, class 3: every path a model folder names stays inside it. An index whose weight_map names
``../x.safetensors``, an absolute path, or a shard that is a symlink out of the folder is refused in one line (exit 2)
by every command that reads a folder, in memory and --stream, before anything outside is opened or changed. A Hugging
Face cache snapshot (files linking into its own repository's blobs/) is a folder like any other."""

from __future__ import annotations

import json
import os
import shutil
import sys
from pathlib import Path

import pytest

from tests.trust_helpers import (IN_MEMORY, STREAMED, command_args, fingerprint, hub_snapshot, index_of,
                                 one_line_error, saved_folder, write_index)

_OPENED: list[str] = []
_RECORDING = [False]


def _audit(event, args):
    if _RECORDING[0] and event == "open" and isinstance(args[0], (str, bytes, os.PathLike)):
        _OPENED.append(os.path.realpath(os.fsdecode(args[0])))


sys.addaudithook(_audit)  # Python-level opens; safe_open (Rust) is watched below


@pytest.fixture(scope="module")
def template(tmp_path_factory):
    folder = tmp_path_factory.mktemp("paths") / "gpt2"
    saved_folder(folder)
    return folder


@pytest.fixture
def watched(monkeypatch):
    """watched(cli, *args): the command's refusal line, with every path it opened (Python's open,
    safetensors.safe_open) in watched.opened."""
    import safetensors

    real = safetensors.safe_open

    def safe_open(path, *a, **k):
        if _RECORDING[0]:
            _OPENED.append(os.path.realpath(str(path)))
        return real(path, *a, **k)

    monkeypatch.setattr(safetensors, "safe_open", safe_open)
    _OPENED.clear()

    def refused(cli, *args, match):
        _RECORDING[0] = True
        try:
            return one_line_error(cli, *args, match=match)
        finally:
            _RECORDING[0] = False

    refused.opened = _OPENED
    return refused


def _escaping(tmp_path: Path, template: Path, how: str) -> tuple[Path, Path]:
    """A copy of the folder whose first shard lives outside it, named by the index as ``how`` says."""
    folder = tmp_path / "model"
    shutil.copytree(template, folder)
    index = index_of(folder)
    shard = sorted(set(index["weight_map"].values()))[0]
    outside = tmp_path / "outside.safetensors"
    shutil.move(folder / shard, outside)
    if how == "symlink":  # the index names a file in the folder, which links out of it
        os.symlink(outside, folder / shard)
    else:
        name = "../outside.safetensors" if how == "parent" else str(outside)
        index["weight_map"] = {k: (name if v == shard else v) for k, v in index["weight_map"].items()}
        write_index(folder, index)
    return folder, outside


HOWS = ("parent", "absolute", "symlink")


@pytest.mark.parametrize("how", HOWS)
@pytest.mark.parametrize("command", sorted(IN_MEMORY))
def test_a_shard_outside_the_folder_is_refused_in_memory(cli, tmp_path, template, watched, command, how):
    folder, outside = _escaping(tmp_path, template, how)
    before = fingerprint(outside, folder)
    watched(cli, *command_args(command, folder, tmp_path / "result"), match="outside" if how != "parent"
            else "leaves the folder")
    assert fingerprint(outside, folder) == before
    assert str(outside.resolve()) not in watched.opened, "a file outside the folder was opened"
    assert not list(tmp_path.glob("result*"))


@pytest.mark.parametrize("how", HOWS)
@pytest.mark.parametrize("command", sorted(STREAMED))
def test_a_shard_outside_the_folder_is_refused_by_stream(cli, tmp_path, template, watched, command, how):
    folder, outside = _escaping(tmp_path, template, how)
    before = fingerprint(outside, folder)
    watched(cli, *command_args(command, folder, tmp_path / "out", STREAMED),
            match="outside" if how != "parent" else "leaves the folder")
    assert fingerprint(outside, folder) == before  # the issue: the outside file was rewritten to 592 bytes
    assert str(outside.resolve()) not in watched.opened
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model", "outside.safetensors"]


def test_config_and_weights_linking_out_of_the_folder_are_refused(cli, tmp_path, template):
    folder = tmp_path / "model"
    shutil.copytree(template, folder)
    elsewhere = tmp_path / "config.json"
    shutil.move(folder / "config.json", elsewhere)
    os.symlink(elsewhere, folder / "config.json")
    one_line_error(cli, "inspect", folder, match="outside the folder")
    one_line_error(cli, "swap", folder, "--stream", "-o", tmp_path / "out", match="outside the folder")


def test_transformers_weights_naming_a_path_outside_is_refused(cli, tmp_path, template):
    folder = tmp_path / "model"
    shutil.copytree(template, folder)
    config = json.loads((folder / "config.json").read_text())
    config["transformers_weights"] = "../elsewhere.safetensors.index.json"
    (folder / "config.json").write_text(json.dumps(config))
    one_line_error(cli, "inspect", folder, match="leaves the folder")
    one_line_error(cli, "swap", folder, "--stream", "-o", tmp_path / "out", match="leaves the folder")


def test_a_file_the_stream_would_copy_linking_out_is_refused(cli, tmp_path, template):
    folder = tmp_path / "model"
    shutil.copytree(template, folder)
    secret = tmp_path / "secret.txt"
    secret.write_text("not yours")
    os.symlink(secret, folder / "tokenizer.json")  # copy_folder would copy what it points to into the output
    one_line_error(cli, "swap", folder, "--stream", "-o", tmp_path / "out", match="outside the folder")
    assert not (tmp_path / "out").exists()


def test_a_hub_cache_snapshot_reads_like_a_folder(cli, tmp_path, template):
    snap, blobs = hub_snapshot(tmp_path, template)
    rc, out, err = cli("inspect", snap, "--json")
    assert rc == 0, err
    assert json.loads(out)["sites"]
    rc, out, err = cli("swap", snap, "--stream", "-o", tmp_path / "out")
    assert rc == 0, err
    assert (tmp_path / "out" / "config.json").is_file()


def test_a_snapshot_linking_into_another_repository_is_refused(cli, tmp_path, template):
    snap, blobs = hub_snapshot(tmp_path, template)
    other = tmp_path / "hub" / "models--someone--else" / "blobs"
    other.mkdir(parents=True)
    shard = sorted(set(index_of(snap)["weight_map"].values()))[0]
    target = other / "x"
    shutil.copy(snap / shard, target)
    (snap / shard).unlink()
    os.symlink(target, snap / shard)
    one_line_error(cli, "inspect", snap, match="outside the folder")
