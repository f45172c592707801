"""Weights mapped from their file (``normconv.clone``): a weight mapped from its safetensors file is found as such (and
nothing else is), its pages are let go without any holder seeing a change, and ``owned`` on a model the command line
may write in place copies it instead of writing the mapping (each page a copy-on-write fault), keeping ties and
leaving one copy resident."""

from __future__ import annotations

import sys

import pytest
import torch
import torch.nn as nn
from safetensors.torch import load_file, save_file

from normconv.clone import clone_sharing_tensors, owned
from normconv.clone import from_file, let_go

linux = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="/proc/self/pagemap and madvise are Linux's")


def _mapped(tmp_path, **tensors) -> dict[str, torch.Tensor]:
    """Tensors as ``load_file`` maps them from a safetensors file, every page read once (present)."""
    save_file(tensors, str(tmp_path / "w.safetensors"))
    loaded = load_file(str(tmp_path / "w.safetensors"))
    for t in loaded.values():
        float(t.float().sum())  # the pages are mapped in by a read, as a load's check forward does
    return loaded


def _resident_file_kb() -> int:
    for line in open("/proc/self/status"):
        if line.startswith("RssFile:"):
            return int(line.split()[1])
    raise AssertionError("no RssFile line")


@linux
def test_a_mapped_weight_is_found_and_nothing_else(tmp_path):
    w = torch.randn(1024, 1024)  # 4 MiB
    t = _mapped(tmp_path, w=w, small=torch.randn(64, 64))
    assert from_file(t["w"])
    assert not from_file(w)  # anonymous memory
    assert not from_file(t["small"])  # under 1 MiB: not worth the checks
    assert not from_file(t["w"].t())  # not contiguous
    assert not from_file(t["w"].to("meta"))
    t["w"][512, 0] = 1.0  # one page written: copied by the process, no longer the file's
    assert not from_file(t["w"])


@linux
def test_letting_go_changes_no_value_and_frees_the_pages(tmp_path):
    w = torch.randn(4096, 1024)  # 16 MiB
    t = _mapped(tmp_path, w=w)["w"]
    before = _resident_file_kb()
    assert let_go(t)
    assert _resident_file_kb() <= before - 15 * 1024
    assert torch.equal(t, w)  # read again: mapped from the file, the same bytes


@linux
def test_owned_copies_a_mapped_weight_in_a_writable_model_and_keeps_ties(tmp_path):
    t = _mapped(tmp_path, emb=torch.randn(2048, 512), proj=torch.randn(2048, 512))
    model = nn.Module()
    model.emb, model.head, model.proj = nn.Embedding(2048, 512), nn.Linear(512, 2048, bias=False), \
        nn.Linear(512, 2048, bias=False)
    model.emb.weight = model.head.weight = nn.Parameter(t["emb"])  # tied, as GPT-2's embedding and head
    model.proj.weight = nn.Parameter(t["proj"])
    originals = {k: v.clone() for k, v in t.items()}
    work = clone_sharing_tensors(model, writable=True)
    w = owned(work, work.emb.weight)
    assert w is not model.emb.weight and work.head.weight is w  # a copy, the tie kept
    assert owned(work, w) is w  # the copy is anonymous memory: written in place from now on
    with torch.no_grad():
        w.mul_(2)
    assert torch.equal(w, originals["emb"] * 2)
    assert torch.equal(model.emb.weight, originals["emb"])  # the old tensor reads the file's bytes again
    # a weight in anonymous memory stays the writable model's own: written in place, not copied
    anon = nn.Linear(512, 2048, bias=False)
    work2 = clone_sharing_tensors(anon, writable=True)
    assert owned(work2, work2.weight) is anon.weight


def test_owned_still_copies_for_a_model_nobody_gave_away(tmp_path):
    t = _mapped(tmp_path, proj=torch.randn(2048, 512))
    model = nn.Linear(512, 2048, bias=False)
    model.weight = nn.Parameter(t["proj"])
    work = clone_sharing_tensors(model)
    w = owned(work, work.weight)
    with torch.no_grad():
        w.zero_()
    assert w is not model.weight and torch.equal(model.weight, t["proj"]) and bool(model.weight.abs().sum() > 0)


@pytest.mark.parametrize("mapped", [True, False])
def test_asking_again_with_the_tensor_held_before_gets_the_same_copy(tmp_path, mapped):
    """A pass that held on to a tensor and asks ``owned`` for it a second time writes the copy the first call made:
    never the user's tensor (a model the API was given) nor a file-mapped tensor no longer in the model."""
    weight = _mapped(tmp_path, w=torch.randn(2048, 512))["w"] if mapped else torch.randn(2048, 512)
    model = nn.Linear(512, 2048, bias=False)
    model.weight = nn.Parameter(weight)
    original = weight.clone()
    for writable in ((True, False) if mapped else (False,)):
        work = clone_sharing_tensors(model, writable=writable)
        held = work.weight  # the tensor the pass holds
        first = owned(work, held)
        with torch.no_grad():
            first.mul_(2)
        second = owned(work, held)
        with torch.no_grad():
            second.add_(1)
        assert second is first and work.weight is first
        assert torch.equal(work.weight, original * 2 + 1)
        assert torch.equal(model.weight, original)  # the model it was copied from reads its own values
