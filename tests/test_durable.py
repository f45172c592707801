"""Bytes on the device before the rename (io.durable, io.write.save): a writer starts the disk's write-back when it
closes its file, the last check before the rename (a folder loaded back) runs while the disk writes, and the fsync
comes just before the rename. What must hold: a check that fails leaves no output and no temp file in any format;
a written file holds exactly the verified model; the write-back and the sync work on files, ranges and folders."""

from __future__ import annotations

import os
import sys

import pytest
import torch

from normconv.io import durable
from normconv.io.load import load

FORMATS = ("out.pt", "out.pt2", "out.safetensors")


@pytest.mark.parametrize("name", FORMATS)
def test_a_check_that_fails_leaves_nothing_in_every_format(cli, tmp_path, name):
    code, _, stderr = cli("fold", "zoo:deconv", "-o", tmp_path / name, "--atol", "0", "--rtol", "0")
    assert code == 1 and "beyond tolerance" in stderr and "nothing written" in stderr
    assert list(tmp_path.iterdir()) == []  # neither the output nor the temp file its bytes went to


def test_the_written_file_is_the_verified_model(cli, tmp_path):
    """The file holds the model the check passed, on an input neither saw."""
    out = tmp_path / "f.pt"
    code, _, stderr = cli("fold", "zoo:resnet", "-o", out)
    assert code == 0, stderr
    original, folded = load("zoo:resnet"), load(str(out), trust_pickle=True)
    x = torch.randn(3, *original.inputs.args[0].shape[1:], generator=torch.Generator().manual_seed(7))
    with torch.no_grad():
        torch.testing.assert_close(folded.model.eval()(x), original.model.eval()(x), atol=1e-4, rtol=1e-4)
    assert sum(type(m).__name__ == "BatchNorm2d" for m in folded.model.modules()) == 0


def test_writeback_and_sync_on_a_file_a_range_and_a_folder(tmp_path):
    f = tmp_path / "a.bin"
    data = os.urandom(1 << 20)
    fd = os.open(f, os.O_WRONLY | os.O_CREAT)
    try:
        os.write(fd, data)
        kicked = durable.start_writeback(fd)
        assert durable.start_writeback(fd, 4096, 8192) == kicked
    finally:
        os.close(fd)
    if sys.platform.startswith("linux"):
        assert kicked  # sync_file_range exists on every Linux libc
    durable.sync(f)
    folder = tmp_path / "folder"
    (folder / "sub").mkdir(parents=True)
    (folder / "sub" / "b.json").write_text("{}")
    durable.start_writeback_under(folder)
    durable.sync(folder)  # every file and folder under it
    durable.sync_entry(folder)  # the folder holding it (after a rename)
    assert f.read_bytes() == data and (folder / "sub" / "b.json").read_text() == "{}"
    with pytest.raises(OSError):
        durable.sync(tmp_path / "missing")
    durable.sync_entry(tmp_path / "missing" / "x")  # best effort: a folder that is gone is not a failed write


def test_onnx_outputs_are_synced_before_their_rename(cli, tmp_path, monkeypatch):
    """Both ONNX writers (a torch model exported, an .onnx file rewritten) fsync every file they publish while it
    is still under its temp name, and the folder holding it after the rename: the same as io.write.save."""
    from tests import onnx_in_graphs as G

    synced, entries = [], []
    monkeypatch.setattr(durable, "sync", lambda p: synced.append((os.fspath(p), os.path.exists(p))))
    monkeypatch.setattr(durable, "sync_entry", lambda p: entries.append((os.fspath(p), os.path.exists(p))))
    src = G.save(G.layernorm_torch(13), tmp_path / "ln.onnx")
    for args, name in ((("export", "zoo:resnet"), "torch.onnx"), (("export", src, "--target", "onnx"), "in.onnx")):
        synced.clear(), entries.clear()
        code, _, stderr = cli(*args, "-o", tmp_path / name)
        assert code == 0, stderr
        assert [os.path.basename(p) for p, there in synced] == [name] and all(there for _, there in synced)
        assert all(os.path.dirname(p) != str(tmp_path) for p, _ in synced)  # under the temp folder, not yet published
        assert entries == [(str(tmp_path / name), True)]


@pytest.mark.parametrize("size", [0, 1, durable.CHUNK - 1, durable.CHUNK, durable.CHUNK + 1, 3 * durable.CHUNK + 5])
def test_pieces_are_the_bytes_in_order_none_over_a_chunk(size):
    data = os.urandom(size)
    parts = list(durable.pieces(data))
    assert b"".join(p.tobytes() for p in parts) == data
    assert all(0 < p.nbytes <= durable.CHUNK for p in parts) and len(parts) == -(-size // durable.CHUNK)
    floats = torch.randn(3 * durable.CHUNK // 4 + 7)  # a tensor's buffer (4-byte items) counts in bytes
    assert b"".join(p.tobytes() for p in durable.pieces(floats.numpy())) == floats.numpy().tobytes()


def test_a_pickle_written_in_pieces_is_torch_saves_own_bytes(tmp_path):
    """The model file written 1 MiB a call (io.outputs.LatchedFile) is byte for byte what torch.save writes itself."""
    from normconv.io.outputs import latched

    model = torch.nn.Sequential(torch.nn.Linear(1100, 1000), torch.nn.LayerNorm(1000))  # a 4.4 MB weight
    with open(tmp_path / "plain.pt", "wb") as f:  # a file object, as the writer gives torch.save
        torch.save(model.state_dict(), f)
    with latched(str(tmp_path / "pieces.pt")) as f:
        torch.save(model.state_dict(), f)
    assert (tmp_path / "pieces.pt").read_bytes() == (tmp_path / "plain.pt").read_bytes()


def test_the_disk_is_started_on_each_stretch_written_then_on_the_whole_file(tmp_path, monkeypatch):
    """LatchedFile hands the disk each ``_WRITEBACK_EVERY`` bytes as they are written (the write-back of a 1.6 GB
    pickle then runs beside its serialization instead of after it), in order and without gaps, and the whole file
    once more at the close; the bytes are torch.save's own."""
    from normconv.io import outputs

    calls = []
    monkeypatch.setattr(outputs, "_WRITEBACK_EVERY", 1 << 20)
    monkeypatch.setattr(outputs.durable, "start_writeback", lambda fd, offset=0, nbytes=0: calls.append((offset, nbytes)))
    state = torch.nn.Linear(1100, 1000).state_dict()  # a 4.4 MB weight: four stretches and more
    with outputs.latched(str(tmp_path / "pieces.pt")) as f:
        torch.save(state, f)
    with open(tmp_path / "plain.pt", "wb") as f:
        torch.save(state, f)
    assert (tmp_path / "pieces.pt").read_bytes() == (tmp_path / "plain.pt").read_bytes()
    stretches, last = calls[:-1], calls[-1]
    assert len(stretches) >= 4 and last == (0, 0)
    assert stretches[0][0] == 0 and all(a[0] + a[1] == b[0] for a, b in zip(stretches, stretches[1:]))
    assert all(n >= 1 << 20 for _, n in stretches)
    assert stretches[-1][0] + stretches[-1][1] <= (tmp_path / "pieces.pt").stat().st_size
