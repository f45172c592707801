"""Progress of long work (issue 32): the phases show on stderr when it is a terminal, never on stdout (--json stays
one JSON object), and not at all with --quiet or when stderr is a file or a pipe. The terminal is a real
pseudo-terminal around a fresh ``normconv`` process."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import warnings

import pytest
import torch
import torch.nn as nn

from normconv.quiet import end_progress, phase, progress_active, progress_display

PHASES = ("load: zoo:resnet", "capture", "rewrite: fold", "verify: shape 1/2", "verify: shape 2/2", "write: ")


def _normconv(*args: str, tty: bool = True) -> tuple[int, str, str]:
    """Run the command line with stderr on a pseudo-terminal (``tty``) or a pipe: (exit code, stdout, stderr)."""
    cmd = [sys.executable, "-m", "normconv.cli", *map(str, args)]
    env = dict(os.environ, COLUMNS="200", HF_HUB_OFFLINE="1")
    if not tty:
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=600, env=env)
        return done.returncode, done.stdout, done.stderr
    master, slave = os.openpty()
    chunks: list[bytes] = []

    def drain() -> None:
        while True:
            try:
                data = os.read(master, 65536)
            except OSError:  # the other end closed (EIO)
                return
            if not data:
                return
            chunks.append(data)

    reader = threading.Thread(target=drain)
    reader.start()
    try:
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=slave, stdin=subprocess.DEVNULL, env=env)
        os.close(slave)
        out, _ = proc.communicate(timeout=600)
    finally:
        reader.join(timeout=30)
        os.close(master)
    return proc.returncode, out.decode(), b"".join(chunks).decode(errors="replace")


def test_phases_show_on_a_terminal_and_json_stays_json(tmp_path):
    code, out, err = _normconv("fold", "zoo:resnet", "-o", tmp_path / "f.pt", "--json")
    assert code == 0, err[-2000:]
    assert json.loads(out)["command"] == "fold"  # stdout: the report alone
    for phase in PHASES:
        assert phase in err, (phase, err[-3000:])


def test_quiet_and_a_pipe_show_nothing(tmp_path):
    code, out, err = _normconv("--quiet", "fold", "zoo:resnet", "-o", tmp_path / "f.pt", "--json")
    assert code == 0
    assert json.loads(out)["command"] == "fold"
    assert not any(p in err for p in ("load:", "capture", "verify:", "rewrite:")), err[-2000:]
    code, out, err = _normconv("fold", "zoo:resnet", "-o", tmp_path / "g.pt", "--json", tty=False)
    assert code == 0
    assert json.loads(out)["command"] == "fold"
    assert err == ""  # not a terminal: no display at all


def test_stream_shows_tensors_and_blocks(tmp_path):
    from transformers import GPT2Config, GPT2LMHeadModel

    warnings.filterwarnings("ignore")
    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(vocab_size=100, n_embd=32, n_layer=3, n_head=4, n_positions=64,
                                       use_cache=False, bos_token_id=0, eos_token_id=0)).eval()
    with torch.no_grad():
        for m in model.modules():
            if isinstance(m, nn.LayerNorm):
                m.weight.normal_(1.0, 0.2)
    model.save_pretrained(tmp_path / "src", max_shard_size="20KB")
    code, out, err = _normconv("swap", tmp_path / "src", "--to", "rmsnorm", "--stream", "-o", tmp_path / "out",
                               "--json")
    assert code == 0, err[-2000:]
    assert json.loads(out)["extra"]["streamed"] is True
    for phase in ("capture: on the meta device", "read + rewrite + verify + write: embeddings, final norm, head",
                  "read + rewrite + verify + write: block 1/3", "read + rewrite + verify + write: block 3/3",
                  "fsync + read back checksums"):
        assert phase in err, (phase, err[-3000:])


def test_phase_is_a_no_op_without_a_display_and_shows_with_one():
    from rich.console import Console
    import io

    assert not progress_active()
    phase("capture")  # nothing on: nothing happens, nothing raises
    buf = io.StringIO()
    with progress_display(True, Console(file=buf, force_terminal=True, width=120)):
        assert progress_active()
        phase("verify", 2, 2, detail="shape")
        end_progress()  # ended early (before a report): the block's end is then a no-op
        assert not progress_active()
        phase("write")  # after finish: not shown
    assert "verify: shape 2/2" in buf.getvalue()
    assert "write" not in buf.getvalue()
