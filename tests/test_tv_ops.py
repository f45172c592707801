"""The vision sweep's plain-torch torchvision ops (benchmarks/tv_ops.py) against the definitions of torchvision's C++
kernels, written out here one element at a time (no torchvision needed)."""

from __future__ import annotations

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
import tv_ops  # noqa: E402


def _iou(a, b) -> float:
    w = max(0.0, min(a[2], b[2]) - max(a[0], b[0]))
    h = max(0.0, min(a[3], b[3]) - max(a[1], b[1]))
    inter = w * h
    return inter / ((a[2] - a[0]) * (a[3] - a[1]) + (b[2] - b[0]) * (b[3] - b[1]) - inter)


def test_nms_keeps_what_greedy_nms_keeps():
    g = torch.Generator().manual_seed(0)
    boxes = torch.rand(60, 2, generator=g) * 20
    boxes = torch.cat([boxes, boxes + 1 + torch.rand(60, 2, generator=g) * 10], 1)
    scores = torch.rand(60, generator=g)
    order = scores.argsort(descending=True).tolist()
    keep: list[int] = []
    for i in order:
        if all(_iou(boxes[i].tolist(), boxes[j].tolist()) <= 0.4 for j in keep):
            keep.append(i)
    assert tv_ops.nms(boxes, scores, 0.4).tolist() == keep
    assert tv_ops.nms(boxes[:0], scores[:0], 0.4).numel() == 0


def _bilinear(img, y: float, x: float) -> float:
    h, w = img.shape
    if y < -1.0 or y > h or x < -1.0 or x > w:
        return 0.0
    y, x = max(y, 0.0), max(x, 0.0)
    y0, x0 = int(y), int(x)
    if y0 >= h - 1:
        y0 = y1 = h - 1
        y = float(y0)
    else:
        y1 = y0 + 1
    if x0 >= w - 1:
        x0 = x1 = w - 1
        x = float(x0)
    else:
        x1 = x0 + 1
    ly, lx = y - y0, x - x0
    return ((1 - ly) * (1 - lx) * img[y0, x0] + (1 - ly) * lx * img[y0, x1] + ly * (1 - lx) * img[y1, x0]
            + ly * lx * img[y1, x1])


def _roi_align(x, rois, scale, ph, pw, s, aligned):
    out = torch.zeros(len(rois), x.shape[1], ph, pw, dtype=torch.float64)
    off = 0.5 if aligned else 0.0
    for k, (b, x1, y1, x2, y2) in enumerate(rois.tolist()):
        sw, sh = x1 * scale - off, y1 * scale - off
        rw, rh = x2 * scale - off - sw, y2 * scale - off - sh
        if not aligned:
            rw, rh = max(rw, 1.0), max(rh, 1.0)
        for c in range(x.shape[1]):
            img = x[int(b), c].double()
            for i in range(ph):
                for j in range(pw):
                    out[k, c, i, j] = sum(_bilinear(img, sh + i * rh / ph + (iy + 0.5) * rh / ph / s,
                                                    sw + j * rw / pw + (ix + 0.5) * rw / pw / s)
                                          for iy in range(s) for ix in range(s)) / (s * s)
    return out


def test_roi_align_samples_as_torchvisions_kernel():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(2, 2, 12, 15, generator=g)
    corners = torch.rand(8, 2, generator=g) * torch.tensor([15.0, 12.0])
    rois = torch.cat([torch.randint(0, 2, (8, 1), generator=g).float(), corners,
                      corners + torch.rand(8, 2, generator=g) * 9 - 1], 1)  # some past the border, some inverted
    for aligned in (False, True):
        for scale in (1.0, 0.5):
            got = tv_ops.roi_align(x, rois, scale, 3, 4, 2, aligned)
            assert torch.allclose(got.double(), _roi_align(x, rois, scale, 3, 4, 2, aligned), atol=1e-5)
