"""``swap --stream``'s folder around the shards: subfolders left out as the in-memory folder writer leaves them (a
Llama-style original/consolidated.00.pth held the original weights beside the rewritten config; a hub cache
snapshot's subfolder links were copied as relative links dangling in OUT), and every file written besides the shards
checksummed a chunk at a time (a 16 GB file was read whole into memory)."""

from __future__ import annotations

import hashlib
import json
import shutil
import tracemalloc

import torch

from normconv.stream.writer import digests


def _judged(src, out) -> float:
    from transformers import AutoModelForCausalLM

    a = AutoModelForCausalLM.from_pretrained(str(src)).eval()
    b = AutoModelForCausalLM.from_pretrained(str(out)).eval()
    g = torch.Generator().manual_seed(7)
    worst = 0.0
    for batch, seq in ((1, 7), (3, 13)):
        ids = torch.randint(0, a.config.vocab_size, (batch, seq), generator=g)
        with torch.no_grad():
            ya, yb = a(input_ids=ids).logits.double(), b(input_ids=ids).logits.double()
        worst = max(worst, float((ya - yb).abs().max() / ya.abs().max()))
    return worst


def test_a_hub_snapshot_s_subfolders_are_left_out_and_said(cli, hf_folders, tmp_path):
    repo = tmp_path / "hub" / "models--t--x"
    (repo / "blobs").mkdir(parents=True)
    snap = repo / "snapshots" / "abc"
    (snap / "sub").mkdir(parents=True)
    (snap / "original").mkdir()
    for f in sorted(hf_folders["gpt2"].iterdir()):
        blob = repo / "blobs" / hashlib.sha256(f.read_bytes()).hexdigest()
        shutil.copyfile(f, blob)
        (snap / f.name).symlink_to(f"../../blobs/{blob.name}")
    (repo / "blobs" / "tok").write_text('{"a": 1}')
    (snap / "sub" / "tokenizer_extra.json").symlink_to("../../../blobs/tok")
    (snap / "original" / "consolidated.00.pth").write_bytes(b"\0" * 4096)  # the original weights
    out = tmp_path / "out"
    code, stdout, stderr = cli("swap", snap, "--to", "rmsnorm", "--stream", "-o", out, "--json")
    assert code == 0, stderr
    assert sorted(p.name for p in out.iterdir() if p.is_dir()) == []  # no original/, no dangling sub/ link
    assert not any(p.is_symlink() for p in out.rglob("*"))
    assert any("original/" in n and "sub/" in n for n in json.loads(stdout)["notes"])
    assert _judged(snap, out) < 2e-6


def test_side_files_are_checksummed_a_chunk_at_a_time(tmp_path):
    (tmp_path / "big.txt").write_bytes(b"x" * (64 << 20))
    (tmp_path / "small.json").write_text("{}")
    tracemalloc.start()
    try:
        got = digests(tmp_path, set())
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    import zlib

    assert got == {"big.txt": zlib.crc32(b"x" * (64 << 20)), "small.json": zlib.crc32(b"{}")}
    assert peak < 16 << 20, peak  # a chunk, not the 64 MB file
