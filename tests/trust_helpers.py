"""What the trust tests share: a one-line refusal checked on the command line, a tiny Hugging Face folder (sharded or
one file), and a fingerprint of files that must not change."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import warnings
from pathlib import Path

import torch
import torch.nn as nn

# every command that reads a model folder in memory, with the flags it needs to get as far as writing
IN_MEMORY = {
    "inspect": [],
    "fold": ["-o", "{out}.pt"],
    "canonicalize": ["-o", "{out}.pt"],
    "swap": ["-o", "{out}.pt"],
    "rotate": ["-o", "{out}.pt"],
    "deepnorm": ["-o", "{out}.pt"],
    "export": ["-o", "{out}.onnx", "--no-baseline"],
}
# the streaming commands: a folder in, a new folder out
STREAMED = {"swap": ["--stream", "-o", "{out}"], "fold": ["--stream", "-o", "{out}"]}


def one_line_error(cli, *args, match: str | tuple[str, ...], code: int = 2) -> str:
    """The command fails with ``code`` and exactly one line on stderr, ``error: ...`` containing ``match`` (every
    string of it), and no traceback."""
    rc, out, err = cli(*args)
    assert rc == code, (rc, out, err)
    lines = [line for line in err.strip().splitlines() if line]
    assert len(lines) == 1 and lines[0].startswith("error: "), err
    for m in (match,) if isinstance(match, str) else match:
        assert m in lines[0], (m, lines[0])
    assert "Traceback" not in out + err
    return lines[0]


def command_args(command: str, folder: Path, out: Path, table: dict[str, list[str]] = IN_MEMORY) -> list[str]:
    return [command, str(folder), *(a.format(out=out) for a in table[command])]


def gpt2(n_layer: int = 2):
    from transformers import GPT2Config, GPT2LMHeadModel

    return GPT2LMHeadModel(GPT2Config(vocab_size=100, n_embd=32, n_layer=n_layer, n_head=4, n_positions=64,
                                      use_cache=False, bos_token_id=0, eos_token_id=0))


def saved_folder(folder: Path, shard: str | None = "20KB", build=gpt2) -> nn.Module:
    """A tiny GPT-2 (random LayerNorm gains and biases) saved with save_pretrained: sharded when ``shard``."""
    warnings.filterwarnings("ignore")
    torch.manual_seed(0)
    model = build().eval()
    with torch.no_grad():
        for m in model.modules():
            if isinstance(m, nn.LayerNorm):
                m.weight.normal_(1.0, 0.2)
                m.bias.normal_(0.0, 0.2)
    if shard:
        model.save_pretrained(folder, max_shard_size=shard)
    else:
        model.save_pretrained(folder)
    return model


def index_of(folder: Path) -> dict:
    return json.loads((folder / "model.safetensors.index.json").read_text())


def write_index(folder: Path, index: dict) -> None:
    (folder / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))


def fingerprint(*paths: Path) -> dict[str, tuple[str, int, float]]:
    """sha256, size and mtime of every file under ``paths`` (symlinks followed)."""
    out = {}
    for root in paths:
        files = [root] if root.is_file() else sorted(p for p in root.rglob("*") if p.is_file())
        for p in files:
            st = p.stat()
            out[str(p)] = (hashlib.sha256(p.read_bytes()).hexdigest(), st.st_size, st.st_mtime)
    return out


def hub_snapshot(tmp_path: Path, source: Path) -> tuple[Path, Path]:
    """A Hugging Face cache layout of ``source``: models--x/blobs/<sha> holding the files, and
    models--x/snapshots/rev/<name> -> ../../blobs/<sha>. Returns (snapshot folder, blobs folder)."""
    repo = tmp_path / "hub" / "models--user--tiny"
    blobs, snap = repo / "blobs", repo / "snapshots" / "abc123"
    blobs.mkdir(parents=True)
    snap.mkdir(parents=True)
    for f in sorted(source.iterdir()):
        digest = hashlib.sha256(f.read_bytes()).hexdigest()
        shutil.copy(f, blobs / digest)
        os.symlink(os.path.join("..", "..", "blobs", digest), snap / f.name)
    return snap, blobs
