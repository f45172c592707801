"""The streamed rewrite's positioned writer (stream.writer): each shard fsynced and read back by checksum as soon as
its last tensor is written, while later shards are still being written; a shard written again after its check is read
back again at the end; a byte changed between the write and the check is found, in the writer alone and through
``swap --stream``."""

from __future__ import annotations

import json
import threading

import pytest
import torch
from safetensors.torch import save_file

from normconv.errors import VerificationError
from normconv.stream import swap as streaming
from normconv.stream.checkpoint import Checkpoint
from normconv.stream.writer import PositionedWriter, plan_layout


def _folder(tmp_path):
    """Two shards of three float32 tensors each, with their index: a checkpoint to plan a layout from."""
    src = tmp_path / "in"
    src.mkdir()
    g = torch.Generator().manual_seed(0)
    shards = {f"model-0000{i + 1}-of-00002.safetensors": {f"s{i}.t{j}": torch.randn(64, 32, generator=g)
                                                          for j in range(3)} for i in range(2)}
    for name, tensors in shards.items():
        save_file(tensors, str(src / name), metadata={"format": "pt"})
    index = {"metadata": {}, "weight_map": {k: name for name, ts in shards.items() for k in ts}}
    (src / "model.safetensors.index.json").write_text(json.dumps(index))
    (src / "config.json").write_text("{}")
    tensors = {k: t for ts in shards.values() for k, t in ts.items()}
    return Checkpoint(src), tensors


def _flip(path, at):
    with open(path, "r+b") as f:
        f.seek(at)
        byte = f.read(1)[0]
        f.seek(at)
        f.write(bytes([byte ^ 0x10]))


def _offset(writer, key):
    return writer.layout.at[key][1] + 7


def _checked(writer, shard):
    """The early check of ``shard``'s result, once the writer thread has written its last tensor and started it."""
    for _ in range(1000):
        if shard in writer.checked:
            return writer.checked[shard][1].result(timeout=60)
        threading.Event().wait(0.01)
    raise AssertionError(f"{shard} was never checked")


def test_each_shard_is_checked_as_soon_as_it_is_written_and_not_read_again(tmp_path, monkeypatch):
    ckpt, tensors = _folder(tmp_path)
    out = tmp_path / "out"
    out.mkdir()
    reads = []
    check = PositionedWriter._check
    monkeypatch.setattr(PositionedWriter, "_check",
                        lambda self, shard, buf: reads.append((shard, threading.current_thread().name))
                        or check(self, shard, buf))
    writer = PositionedWriter(out, plan_layout(ckpt, {}))
    keys = list(tensors)
    for k in keys[:3]:  # the first shard whole: its check starts before the second shard's first tensor
        writer.write(k, tensors[k])
    first = next(iter(writer.layout.shards))
    assert _checked(writer, first) == (None, None)
    assert "s1.t0" not in writer.sums  # checked while the second shard was not written yet
    for k in keys[3:]:
        writer.write(k, tensors[k])
    writer.finish()
    assert writer.check() is None
    assert sorted(s for s, _ in reads) == sorted(writer.layout.shards)  # once each, none read again by check()
    assert all(t.startswith("normconv-checker") for _, t in reads)


def test_a_written_tensor_is_held_no_longer_while_the_writer_waits(tmp_path):
    """Once the writer thread has written a tensor and waits for the next, it holds no reference to it: the streamed
    pass reads a later block into a dropped block's buffers only where nothing else holds them (its last tensor
    stayed held by the thread's locals, and was never read into again)."""
    import sys
    import weakref

    ckpt, tensors = _folder(tmp_path)
    out = tmp_path / "out"
    out.mkdir()
    writer = PositionedWriter(out, plan_layout(ckpt, {}))
    try:
        key = next(iter(tensors))
        t = tensors.pop(key).clone()
        gone = weakref.ref(t)
        before = sys.getrefcount(t)
        writer.write(key, t)
        for _ in range(1000):
            if key in writer.sums and writer._queue.empty() and sys.getrefcount(t) == before:
                break
            threading.Event().wait(0.01)
        assert key in writer.sums
        assert sys.getrefcount(t) == before  # neither the queue nor the thread's frame holds it
        del t
        assert gone() is None
    finally:
        writer.close()


def test_a_byte_changed_before_the_early_check_is_found(tmp_path, monkeypatch):
    ckpt, tensors = _folder(tmp_path)
    out = tmp_path / "out"
    out.mkdir()
    synced = PositionedWriter._synced_check

    def flipped(self, shard):
        if shard.startswith("model-00002"):
            _flip(out / shard, _offset(self, "s1.t1"))
        return synced(self, shard)

    monkeypatch.setattr(PositionedWriter, "_synced_check", flipped)
    writer = PositionedWriter(out, plan_layout(ckpt, {}))
    for k, t in tensors.items():
        writer.write(k, t)
    writer.finish()
    assert writer.check() == ("model-00002-of-00002.safetensors", "s1.t1")


@pytest.mark.parametrize("early", [True, False])
def test_a_shard_written_again_after_its_check_is_read_back_again(tmp_path, early):
    """A retried pass writes a checked shard's tensors again: the early result no longer speaks for the file (a
    byte changed after the early check, then one other tensor of that shard written again, is found)."""
    ckpt, tensors = _folder(tmp_path)
    out = tmp_path / "out"
    out.mkdir()
    writer = PositionedWriter(out, plan_layout(ckpt, {}), early=early)
    for k, t in tensors.items():
        writer.write(k, t)
    first = next(iter(writer.layout.shards))
    for _ in range(1000):  # every tensor written (the writer thread writes in order)
        if "s1.t2" in writer.sums:
            break
        threading.Event().wait(0.01)
    if early:
        assert _checked(writer, first) == (None, None)  # the early check ran, on the bytes as written: a pass
    _flip(out / first, _offset(writer, "s0.t2"))
    writer.write("s0.t0", tensors["s0.t0"])  # the same bytes again
    writer.finish()
    assert writer.check() == (first, "s0.t2")


def test_swap_stream_finds_a_byte_changed_before_a_shard_s_early_check(tmp_path, monkeypatch):
    from tests.test_stream import _gpt2, _saved

    src, out = tmp_path / "in", tmp_path / "out"
    _saved(_gpt2, src)
    synced = PositionedWriter._synced_check

    def flipped(self, shard):
        key = next(k for k in sorted(self.layout.at) if k.endswith("h.1.mlp.c_fc.weight"))
        if self.layout.at[key][0] == shard:
            _flip(self.folder / shard, _offset(self, key))
        return synced(self, shard)

    monkeypatch.setattr(PositionedWriter, "_synced_check", flipped)
    with pytest.raises(VerificationError, match=r"swap --stream: block 1: .*h\.1\.mlp\.c_fc\.weight .*read back "
                                                r"differs .*nothing written"):
        streaming.swap(src, out)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["in"]


@pytest.mark.skipif(not hasattr(__import__("os"), "posix_fadvise"), reason="no posix_fadvise here")
@pytest.mark.parametrize("early", [True, False])
def test_each_shard_s_pages_are_dropped_from_the_cache_once_fsynced_and_read_back(tmp_path, monkeypatch, early):
    """After its fsync and its read-back, each shard's clean pages leave the page cache (an output as large as the
    memory would otherwise make the kernel reclaim inside the pass); the bytes stay what was written."""
    import os

    ckpt, tensors = _folder(tmp_path)
    out = tmp_path / "out"
    out.mkdir()
    events = []
    fsync, fadvise = os.fsync, os.posix_fadvise
    monkeypatch.setattr(os, "fsync", lambda fd: events.append(("fsync", os.readlink(f"/proc/self/fd/{fd}")
                                                                   .rsplit("/", 1)[-1])) or fsync(fd))
    monkeypatch.setattr(os, "posix_fadvise", lambda fd, o, n, advice: events.append(
        ("drop" if advice == os.POSIX_FADV_DONTNEED else advice, os.readlink(f"/proc/self/fd/{fd}")
         .rsplit("/", 1)[-1])) or fadvise(fd, o, n, advice))
    writer = PositionedWriter(out, plan_layout(ckpt, {}), early=early)
    for k, t in tensors.items():
        writer.write(k, t)
    writer.finish()
    assert writer.check() is None
    for shard in writer.layout.shards:
        assert ("drop", shard) in events and events.index(("fsync", shard)) < events.index(("drop", shard))
    from safetensors import safe_open

    with safe_open(str(out / writer.layout.at["s1.t2"][0]), framework="pt") as f:
        assert f.get_tensor("s1.t2").equal(tensors["s1.t2"])


@pytest.mark.skipif(not hasattr(__import__("os"), "posix_fadvise"), reason="no posix_fadvise here")
def test_a_source_larger_than_the_memory_has_each_tensor_s_pages_dropped_once_read(tmp_path, monkeypatch):
    """Only where the shards hold more bytes than the machine's memory (its pages cannot all stay cached) is each
    tensor read dropped from the page cache, its own byte range; the values read are the same either way."""
    import os

    ckpt, tensors = _folder(tmp_path)
    dropped = []
    fadvise = os.posix_fadvise
    monkeypatch.setattr(os, "posix_fadvise", lambda fd, o, n, advice: dropped.append((o, n, advice))
                        or fadvise(fd, o, n, advice))
    assert not ckpt.larger_than_memory()  # a few KB
    ckpt.uncached = ckpt.larger_than_memory()
    assert ckpt.get("s0.t1").equal(tensors["s0.t1"]) and dropped == []
    monkeypatch.setattr(os, "sysconf", lambda name: 4096 if name == "SC_PAGE_SIZE" else 1)  # 4 KiB of memory
    assert ckpt.larger_than_memory()
    ckpt.uncached = True
    h = ckpt.shards[ckpt.weight_map["s0.t1"]]
    start, end = h["s0.t1"]["data_offsets"]
    assert ckpt.get("s0.t1").equal(tensors["s0.t1"])
    assert dropped == [(h.start + start, end - start, os.POSIX_FADV_DONTNEED)]
