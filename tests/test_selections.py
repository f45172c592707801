"""Outputs after a discrete selection (top-k, a threshold, argmax): a flip by rounding is judged on the tensors before
it, with the original's selections replayed in the rewritten model; a real error still shows, before the selection
or after it (a head that runs on the selected regions)."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn

import normconv
from normconv.passes import fold_batchnorm
from normconv.selections import Recorder
from normconv.verify import Inputs, compare, run, untraced, with_selections

CLASSES, K = 5, 6


class Detector(nn.Module):
    """After torchvision's SSD head and postprocess, in small: a conv+BN backbone, per-position class scores and
    box offsets (conv1x1+BN heads), the top-k (position, class) scores over the image, the boxes and a region head
    (linear+BN, as Faster R-CNN's box head runs on the selected regions) at the selected positions. Classes 0 and 1
    have identical weights: their scores tie everywhere, and the order top-k gives them is decided by rounding."""

    def __init__(self):
        super().__init__()
        self.backbone = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU(),
                                      nn.Conv2d(8, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU())
        self.cls = nn.Sequential(nn.Conv2d(8, CLASSES, 1), nn.BatchNorm2d(CLASSES))
        self.box = nn.Sequential(nn.Conv2d(8, 4, 1), nn.BatchNorm2d(4))
        self.region = nn.Sequential(nn.Linear(8, 7), nn.BatchNorm1d(7))

    def forward(self, x):
        f = self.backbone(x)
        scores = self.cls(f).flatten(2)  # (B, C, HW)
        b, c, hw = scores.shape
        top, idx = scores.transpose(1, 2).reshape(b, hw * c).topk(K)
        labels, pos = idx % c, idx // c
        boxes = self.box(f).flatten(2).gather(2, pos[:, None].expand(b, 4, K)).transpose(1, 2)
        feats = f.flatten(2).gather(2, pos[:, None].expand(b, 8, K)).transpose(1, 2)  # (B, K, 8)
        regions = self.region(feats.reshape(b * K, 8)).reshape(b, K, 7)
        return {"boxes": boxes, "scores": top, "labels": labels, "regions": regions}


def detector():
    torch.manual_seed(0)
    model = Detector()
    with torch.no_grad():
        for m in model.modules():
            if isinstance(m, nn.modules.batchnorm._BatchNorm):
                m.running_mean.normal_(0, 0.1)
                m.running_var.uniform_(0.5, 2.0)
                m.weight.normal_(1, 0.2)
                m.bias.normal_(0, 0.1)
        head, bn = model.cls
        for p in (head.weight, head.bias, bn.weight, bn.bias, bn.running_mean, bn.running_var):
            p[1] = p[0]  # class 1 = class 0
        bn.bias[:2] += 3.0  # and they lead: the top-k holds both, tied
    return model.eval(), (torch.randn(2, 3, 6, 6, generator=torch.Generator().manual_seed(1)),)


def _tied_order(model, x) -> int:
    """The class top-k puts first among the tied pair, in the original."""
    with torch.no_grad():
        return int(model(*x)["labels"][0, 0])


def plant(monkeypatch, rows: int, channel: int | None, relative: float) -> None:
    """A wrong fold of the layer with ``rows`` outputs: its BatchNorm scale times (1 + relative) (one channel, or
    all where ``channel`` is None)."""
    real = fold_batchnorm.fold_backward

    def wrong(layer, s, t):
        if layer.weight.shape[0] == rows:
            s = s.clone()
            if channel is None:
                s *= 1 + relative
            else:
                s[channel] *= 1 + relative
        real(layer, s, t)

    monkeypatch.setattr(fold_batchnorm, "fold_backward", wrong)


def test_the_recorder_replays_selections_and_gathers_top_k_values():
    x = torch.tensor([[1.0, 3.0, 2.0, 3.0 + 1e-6]])

    def f(v):
        values, idx = v.topk(2)
        return values, idx, (v > 2.5).nonzero(), v.argmax(-1)

    with Recorder() as rec:
        ref = f(x)
    assert [p.op for p in rec.trace.picks] == ["aten.topk", "aten.gt", "aten.argmax"]
    swapped = x.clone()
    swapped[0, 1] += 2e-6  # position 1 now leads: every selection flips its order
    with Recorder(rec.trace) as again:
        got = f(swapped)
    assert again.trace.flipped == [0, 2] and again.trace.lost is None  # gt's mask is the same: not a flip
    assert torch.equal(got[1], ref[1]) and torch.equal(got[3], ref[3])  # the original's indices
    assert torch.equal(got[0], swapped[0, ref[1][0]][None])  # values: its own input at those indices
    assert [torch.equal(a, b) for a, b in zip(again.trace.picks[0].inputs, (swapped,))] == [True]


def test_a_flip_by_rounding_is_judged_before_the_selection(monkeypatch):
    model, x = detector()
    first = _tied_order(model, x)
    real = fold_batchnorm.fold_backward

    def lifted(layer, s, t):  # the other class of the tie gains 1e-6 of its score everywhere: rounding-sized
        if layer.weight.shape[0] == CLASSES:  # (its bias, not its scale: a scale moves a negative term down)
            t = t.clone()
            t[1 - first] += 1e-6 * t[1 - first].abs()
        real(layer, s, t)

    monkeypatch.setattr(fold_batchnorm, "fold_backward", lifted)
    folded, report = normconv.fold(model, x)
    with torch.no_grad():
        ref, got = model(*x), folded(*x)
    assert not torch.equal(ref["labels"], got["labels"]), "the selection flipped"
    assert not compare(ref, got).passed, "compared as they are, the outputs differ by whole elements"
    v = report.validation[0]
    assert report.passed and "discrete selections differed" in v.label and "aten.topk" in v.label
    assert all(o.note for o in v.outputs) and v.outputs[-1].name.startswith("inputs of")


@pytest.mark.parametrize("rows,channel", [(CLASSES, None), (4, None), (7, None)],
                         ids=["scores before the selection", "boxes", "region head after the selection"])
def test_a_real_error_is_refused_with_or_without_a_flip(monkeypatch, rows, channel):
    model, x = detector()
    first = _tied_order(model, x)
    real = fold_batchnorm.fold_backward

    def wrong(layer, s, t):  # a rounding-sized flip of the tie, and a wrong fold of 1e-3 in one head
        s = s.clone()
        if layer.weight.shape[0] == CLASSES:
            s[1 - first] *= 1 + 1e-6
        if layer.weight.shape[0] == rows:
            s *= 1 + 1e-3
        real(layer, s, t)

    monkeypatch.setattr(fold_batchnorm, "fold_backward", wrong)
    with pytest.raises(normconv.VerificationError, match="of the output's scale"):
        normconv.fold(model, x)


def test_the_cli_refuses_a_wrong_fold_after_a_selection(cli, tmp_path, monkeypatch):
    plant(monkeypatch, 7, None, 1e-3)
    out = tmp_path / "det.pt"
    code, _, stderr = cli("fold", "test_selections:detector", "-o", out)
    assert code == 1 and "nothing written" in stderr and not out.exists()


def test_only_outputs_with_a_discrete_tensor_are_traced():
    model, x = detector()
    inputs = Inputs(x)
    out = run(model, inputs)
    traced = with_selections(model, inputs, out)
    assert untraced(traced) is not out and len(traced.trace.picks) >= 1
    plain = nn.Sequential(nn.Conv2d(3, 4, 1)).eval()
    y = run(plain, inputs)
    assert with_selections(plain, inputs, y) is y


class LazyScale(nn.Module):
    """A scale computed once, from shapes, on the first forward and cached (torchvision's MultiScaleRoIAlign:
    ``float(torch.tensor(s).log2().round())``), then a top-k: a fresh model and a copy that already ran make
    different op sequences, one scalar ``round`` apart."""

    def __init__(self):
        super().__init__()
        self.scale = None

    def forward(self, x):
        if self.scale is None:
            self.scale = 2 ** float(torch.tensor(x.shape[-1] / 3.0).log2().round())
        values, idx = (x * self.scale).topk(2)
        return values, idx, (x > 0.5).sum()


@pytest.mark.parametrize("fresh_first", [True, False])
def test_a_scalar_selection_made_once_does_not_lose_the_replay(fresh_first):
    x = torch.tensor([[1.0, 3.0, 2.0, 3.0 + 1e-6]])
    swapped = x.clone()
    swapped[0, 1] += 2e-6  # the top-k's order flips
    fresh, warm = LazyScale(), LazyScale()
    warm(x)
    first, second = (fresh, warm) if fresh_first else (warm, fresh)
    with Recorder() as rec:
        ref = first(x)
    with Recorder(rec.trace) as again:
        got = second(swapped)
    assert again.trace.lost is None  # the round the other forward did not make is passed over, on either side
    pairs = again.trace.pairs(rec.trace)
    assert [(a.op, b.op) for _, a, b in pairs] == [("aten.topk", "aten.topk"), ("aten.gt", "aten.gt")]
    assert [k for k, _, _ in pairs] == ([1, 2] if fresh_first else [0, 1])  # the original's own indices
    assert torch.equal(got[1], ref[1])  # the top-k after it is still replayed


def test_a_selection_of_another_op_still_loses_the_replay():
    x = torch.tensor([[1.0, 3.0, 2.0]])
    with Recorder() as rec:
        x.topk(2), x.argmax(-1)
    with Recorder(rec.trace) as again:
        x.argmax(-1), x.topk(2)
    assert again.trace.lost == 0 and again.trace.pairs(rec.trace) == []
