"""A dynamic dimension is checked at two more sizes, the first one size up: a stride-2 conv (kernel 3, padding 1)
maps 63 to 64's own sizes (32, 16, 8), so the one check at 63 proved nothing for a strided net, and an ONNX file that
claimed any height (timm's MobileViT: sizes rounded up to a patch, then reshaped) failed in onnxruntime at 65, 48, 80
(exit 0, "checked at 64, 63"). Now such a dimension is pinned, said, and the file runs at every size it declares."""

from __future__ import annotations

import json
import math

import numpy as np
import onnx
import onnxruntime as ort
import torch
import torch.nn as nn
import torch.nn.functional as F

import normconv
from normconv.io.dims import candidates


class PatchMix(nn.Module):
    """MobileViT's unfold / fold around a linear (timm's code): the size rounded up to the patch with math.ceil and
    interpolated only where it is not a multiple."""

    def __init__(self, c: int = 8, p: int = 2):
        super().__init__()
        self.p, self.proj = p, nn.Linear(c, c)

    def forward(self, x):
        B, C, H, W = x.shape
        p = self.p
        new_h, new_w = math.ceil(H / p) * p, math.ceil(W / p) * p
        nh, nw = new_h // p, new_w // p
        resize = new_h != H or new_w != W
        if resize:
            x = F.interpolate(x, size=(new_h, new_w), mode="bilinear", align_corners=False)
        x = x.reshape(B * C * nh, p, nw, p).transpose(1, 2).reshape(B, C, nh * nw, p * p).transpose(1, 3)
        x = self.proj(x.reshape(B * p * p, nh * nw, C))
        x = x.contiguous().view(B, p * p, nh * nw, -1).transpose(1, 3).reshape(B * C * nh, nw, p, p)
        x = x.transpose(1, 2).reshape(B, C, nh * p, nw * p)
        return F.interpolate(x, size=(H, W), mode="bilinear", align_corners=False) if resize else x


class StridedPatchNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(3, 8, 3, 2, 1), nn.BatchNorm2d(8), nn.ReLU(),
                                  nn.Conv2d(8, 8, 3, 2, 1), nn.ReLU(), nn.Conv2d(8, 8, 3, 2, 1))
        self.mix, self.head = PatchMix(), nn.Conv2d(8, 4, 1)

    def forward(self, x):
        return self.head(self.mix(self.stem(x)))


def _net(cls=StridedPatchNet):
    torch.manual_seed(0)
    m = cls().eval()
    with torch.no_grad():
        for bn in (x for x in m.modules() if isinstance(x, nn.BatchNorm2d)):
            bn.running_mean.uniform_(-1, 1)
            bn.running_var.uniform_(0.5, 2)
    return m


def test_the_probes_move_a_size_by_one_up_first_then_by_half():
    assert candidates(64) == [[65, 63, 128, 32], [96, 32, 128]]
    assert candidates(2) == [[3, 1, 4], [1, 4]]
    assert candidates(1) == [[2], []]


def test_a_height_that_holds_for_some_strides_only_is_pinned_and_the_file_runs_at_what_it_declares(tmp_path):
    m = _net()
    path = tmp_path / "m.onnx"
    report = normconv.export(m, (torch.randn(1, 3, 64, 64),), str(path))
    dims = {d["name"]: d for d in json.loads(json.dumps(report.extra["dynamic_dims"], default=str))}
    assert "65" in dims["height"]["pinned"] and "65" in dims["width"]["pinned"]
    assert dims["height"]["code"] == "pinned-by-check"
    assert any(n.startswith("dimension height (x[2]) pinned to the example's 64") for n in report.notes)
    declared = [d.dim_param or d.dim_value for d in onnx.load(str(path)).graph.input[0].type.tensor_type.shape.dim]
    assert declared[1:] == [3, 64, 64] and isinstance(declared[0], str)
    sess = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    for batch in (1, 3):
        x = torch.randn(batch, 3, 64, 64)
        with torch.no_grad():
            ref = m(x).numpy()
        got = sess.run(None, {sess.get_inputs()[0].name: x.numpy()})[0]
        np.testing.assert_allclose(got, ref, atol=1e-5 * np.abs(ref).max(), rtol=0)


class StridedNet(nn.Module):  # no patch: every height works
    def __init__(self):
        super().__init__()
        self.body = nn.Sequential(nn.Conv2d(3, 8, 3, 2, 1), nn.BatchNorm2d(8), nn.ReLU(), nn.Conv2d(8, 4, 3, 2, 1))

    def forward(self, x):
        return self.body(x)


def test_a_height_every_size_takes_stays_free_checked_at_two_more_sizes(tmp_path):
    m = _net(StridedNet)
    path = tmp_path / "s.onnx"
    report = normconv.export(m, (torch.randn(1, 3, 64, 64),), str(path))
    dims = {d["name"]: d for d in report.extra["dynamic_dims"]}
    assert dims["height"]["checked"] == [64, 65, 96] and "pinned" not in dims["height"]
    sess = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    for h in (33, 48, 81):
        x = torch.randn(2, 3, h, h)
        with torch.no_grad():
            ref = m(x).numpy()
        got = sess.run(None, {sess.get_inputs()[0].name: x.numpy()})[0]
        np.testing.assert_allclose(got, ref, atol=1e-5 * np.abs(ref).max(), rtol=0)


class GridPosNet(nn.Module):
    """A stride-2 stem then a learned positional tensor of the example's grid (timm's LeViT: attention biases fixed
    to the resolution): the model runs at 63 and 64 (both give a 32 grid) and at no size that changes the grid."""

    def __init__(self):
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(3, 8, 3, 2, 1), nn.BatchNorm2d(8), nn.ReLU())
        self.pos, self.head = nn.Parameter(torch.randn(1, 8, 32, 32)), nn.Conv2d(8, 4, 1)

    def forward(self, x):
        return self.head(self.stem(x) + self.pos)


def test_a_height_checked_only_one_below_on_the_same_grid_is_pinned_not_declared_free(tmp_path):
    # before: 65 failed in the original, 63 (the same 32 grid) passed, the second probe found no size the model
    # takes, and height / width were declared free (min 1, max None, checked [64, 63]); onnxruntime failed at 96, 48
    m = _net(GridPosNet)
    path = tmp_path / "g.onnx"
    report = normconv.export(m, (torch.randn(1, 3, 64, 64),), str(path), baseline=False)
    dims = {d["name"]: d for d in report.extra["dynamic_dims"]}
    for name in ("height", "width"):
        assert dims[name]["code"] == "pinned-by-check" and dims[name]["checked"] == [64, 63]
        assert "nothing proves it free" in dims[name]["pinned"]
    assert "pinned" not in dims["batch"]
    assert any(n.startswith("dimension height (x[2]) pinned to the example's 64") for n in report.notes)
    sess = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    declared = sess.get_inputs()[0].shape
    assert declared[1:] == [3, 64, 64] and isinstance(declared[0], str)
    x = torch.randn(2, 3, 64, 64)
    with torch.no_grad():
        ref = m(x).numpy()
    got = sess.run(None, {sess.get_inputs()[0].name: x.numpy()})[0]
    np.testing.assert_allclose(got, ref, atol=1e-5 * np.abs(ref).max(), rtol=0)


def test_only_a_size_off_the_example_grid_proves_a_dimension_free():
    from normconv.io.dims import grid_moving

    assert not grid_moving(64, 63) and not grid_moving(64, 65)  # stride 2, kernel 3, padding 1: 63 -> 32; pool: 65
    assert grid_moving(64, 96) and grid_moving(64, 32) and grid_moving(1, 2) and grid_moving(2, 1)
