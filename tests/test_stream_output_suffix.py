"""--stream writes a Hugging Face folder: an -o whose suffix asks for a file format (.pt, .safetensors, .onnx, ...)
is refused in one line with exit 2 (bad-input), before any work and with nothing written, for swap and fold alike
(a folder named out.pt was written and torch.load of it failed)."""

from __future__ import annotations

import json
import warnings

import pytest
import torch

from tests.hf_tiny import VOCAB
from tests.test_stream_fold import _saved as _saved_resnet


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    from transformers import GPT2Config, GPT2LMHeadModel

    warnings.filterwarnings("ignore")
    root = tmp_path_factory.mktemp("suffix")
    torch.manual_seed(0)
    GPT2LMHeadModel(GPT2Config(vocab_size=VOCAB, n_embd=32, n_layer=2, n_head=4, n_positions=64, use_cache=False,
                               bos_token_id=0, eos_token_id=0)).eval().save_pretrained(root / "gpt2")
    _saved_resnet(root / "resnet")
    return {"swap": (root / "gpt2", ["--to", "rmsnorm"]), "fold": (root / "resnet", [])}


@pytest.mark.parametrize("command", ["swap", "fold"])
@pytest.mark.parametrize("suffix", [".pt", ".PTH", ".bin", ".pkl", ".pt2", ".safetensors", ".onnx"])
def test_a_file_suffix_for_a_stream_s_folder_is_refused(folders, tmp_path, cli, command, suffix):
    src, extra = folders[command]
    out = tmp_path / f"out{suffix}"
    code, stdout, stderr = cli(command, src, *extra, "--stream", "-o", out, "--json")
    assert code == 2, stderr
    assert len(stderr.strip().splitlines()) == 1 and "Traceback" not in stderr
    assert f"-o {out}" in stderr and "writes a Hugging Face folder" in stderr
    report = json.loads(stdout)
    assert report["code"] == "bad-input" and report["exit_code"] == 2 and not report["passed"]
    assert list(tmp_path.iterdir()) == []  # no folder named out.pt, no temp beside it


def test_a_folder_name_with_another_dot_still_streams(folders, tmp_path, cli):
    src, extra = folders["swap"]
    out = tmp_path / "gpt2.rms"  # a dot, but no file format: a folder, as asked
    code, _, stderr = cli("swap", src, *extra, "--stream", "-o", out)
    assert code == 0, stderr
    assert out.is_dir() and (out / "config.json").is_file()
