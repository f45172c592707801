"""torchvision's compiled ops in pure torch, for the vision sweep on a CPU-only torch (not part of normconv).

torchvision's PyPI wheels are CUDA builds: on torch's CPU wheel their ``_C.so`` does not load (it links
``libtorch_cuda.so`` / ``libc10_cuda.so``), torchvision then skips defining ``torchvision::nms`` / ``roi_align``
and its import fails where it registers their fake kernels (``operator torchvision::nms does not exist``).

``install()``, called before ``import torchvision``, lets torchvision's own loader "load" ``_C.so`` by defining
the ops' schemas here instead, each with a CPU kernel in plain torch: ``nms`` (greedy, as torchvision's C++:
scores sorted descending, a box is dropped when its IoU with a kept box exceeds the threshold) and ``roi_align``
(bilinear samples by ``grid_sample``). torchvision then registers its meta / fake / autograd kernels on
them as usual, so ``torch.export`` traces through them. The ops no torchvision.models model calls in inference
(ps_roi_*, roi_pool, deform_conv2d, the quantized and rotated ones) are defined with a kernel that raises.
"""

from __future__ import annotations

import os

import numpy as np
import torch

SCHEMAS = {
    "nms": "nms(Tensor dets, Tensor scores, float iou_threshold) -> Tensor",
    "qnms": "qnms(Tensor dets, Tensor scores, float iou_threshold) -> Tensor",
    "roi_align": "roi_align(Tensor input, Tensor rois, float spatial_scale, SymInt pooled_height, "
                 "SymInt pooled_width, int sampling_ratio, bool aligned) -> Tensor",
    "_roi_align_backward": "_roi_align_backward(Tensor grad, Tensor rois, float spatial_scale, SymInt pooled_height, "
                           "SymInt pooled_width, SymInt batch_size, SymInt channels, SymInt height, SymInt width, "
                           "int sampling_ratio, bool aligned) -> Tensor",
    "qroi_align": "qroi_align(Tensor input, Tensor rois, float input_scale, int input_zero_point, float rois_scale, "
                  "int rois_zero_point, float spatial_scale, SymInt pooled_height, SymInt pooled_width, "
                  "int sampling_ratio, bool aligned) -> Tensor",
    "ps_roi_align": "ps_roi_align(Tensor input, Tensor rois, float spatial_scale, SymInt pooled_height, "
                    "SymInt pooled_width, int sampling_ratio) -> (Tensor, Tensor)",
    "_ps_roi_align_backward": "_ps_roi_align_backward(Tensor grad, Tensor rois, Tensor channel_mapping, "
                              "float spatial_scale, SymInt pooled_height, SymInt pooled_width, int sampling_ratio, "
                              "SymInt batch_size, SymInt channels, SymInt height, SymInt width) -> Tensor",
    "roi_pool": "roi_pool(Tensor input, Tensor rois, float spatial_scale, SymInt pooled_height, "
                "SymInt pooled_width) -> (Tensor, Tensor)",
    "_roi_pool_backward": "_roi_pool_backward(Tensor grad, Tensor rois, Tensor argmax, float spatial_scale, "
                          "SymInt pooled_height, SymInt pooled_width, SymInt batch_size, SymInt channels, "
                          "SymInt height, SymInt width) -> Tensor",
    "ps_roi_pool": "ps_roi_pool(Tensor input, Tensor rois, float spatial_scale, SymInt pooled_height, "
                   "SymInt pooled_width) -> (Tensor, Tensor)",
    "_ps_roi_pool_backward": "_ps_roi_pool_backward(Tensor grad, Tensor rois, Tensor channel_mapping, "
                             "float spatial_scale, SymInt pooled_height, SymInt pooled_width, SymInt batch_size, "
                             "SymInt channels, SymInt height, SymInt width) -> Tensor",
    "deform_conv2d": "deform_conv2d(Tensor input, Tensor weight, Tensor offset, Tensor mask, Tensor bias, "
                     "SymInt stride_h, SymInt stride_w, SymInt pad_h, SymInt pad_w, SymInt dilation_h, "
                     "SymInt dilation_w, SymInt groups, SymInt offset_groups, bool use_mask) -> Tensor",
    "_deform_conv2d_backward": "_deform_conv2d_backward(Tensor grad, Tensor input, Tensor weight, Tensor offset, "
                               "Tensor mask, Tensor bias, SymInt stride_h, SymInt stride_w, SymInt pad_h, "
                               "SymInt pad_w, SymInt dilation_h, SymInt dilation_w, SymInt groups, "
                               "SymInt offset_groups, bool use_mask) -> (Tensor, Tensor, Tensor, Tensor, Tensor)",
    "box_iou_rotated": "box_iou_rotated(Tensor boxes1, Tensor boxes2) -> Tensor",
    "_cuda_version": "_cuda_version() -> int",
}

_LIB: list = []  # the Library objects must live as long as the process


def nms(dets: torch.Tensor, scores: torch.Tensor, iou_threshold: float) -> torch.Tensor:
    """torchvision's CPU nms: indices of the kept boxes, by decreasing score."""
    if dets.numel() == 0:
        return torch.empty(0, dtype=torch.long, device=dets.device)
    order = scores.sort(0, descending=True).indices
    boxes = dets[order]
    x1, y1, x2, y2 = boxes.unbind(1)
    area = (x2 - x1) * (y2 - y1)
    w = (torch.min(x2[:, None], x2[None]) - torch.max(x1[:, None], x1[None])).clamp_min(0)
    h = (torch.min(y2[:, None], y2[None]) - torch.max(y1[:, None], y1[None])).clamp_min(0)
    inter = w * h
    over = (inter / (area[:, None] + area[None] - inter) > iou_threshold).cpu().numpy()
    dropped = np.zeros(len(order), dtype=bool)
    keep = []
    for i in range(len(order)):
        if not dropped[i]:
            keep.append(i)
            dropped |= over[i]  # boxes before i are kept or dropped already: marking them changes nothing
    return order[torch.tensor(keep, dtype=torch.long, device=dets.device)]


def roi_align(input, rois, spatial_scale, pooled_height, pooled_width, sampling_ratio, aligned):
    """torchvision's roi_align (the average of sampling_ratio^2 bilinear samples per bin; samples beyond one pixel
    outside the image count 0, samples within it are clamped to the border pixels), by ``grid_sample`` per image.
    An adaptive sampling ratio (<= 0) goes to torchvision's own pure-torch version, run eagerly (slow: inductor's
    compiled one took 8 s a call on Faster R-CNN; no torchvision.models model asks for it)."""
    if sampling_ratio <= 0:
        from torchvision.ops.roi_align import _roi_align

        return _roi_align.__wrapped__(input, rois, spatial_scale, pooled_height, pooled_width, sampling_ratio,
                                      aligned)
    n, c, height, width = input.shape
    k, s = rois.shape[0], sampling_ratio
    out = input.new_zeros(k, c, pooled_height, pooled_width)
    if k == 0:
        return out
    offset = 0.5 if aligned else 0.0
    start_w, start_h, end_w, end_h = (rois[:, i] * spatial_scale - offset for i in (1, 2, 3, 4))
    roi_w, roi_h = end_w - start_w, end_h - start_h
    if not aligned:
        roi_w, roi_h = roi_w.clamp_min(1.0), roi_h.clamp_min(1.0)
    grid_y = (torch.arange(pooled_height, dtype=input.dtype, device=input.device)[:, None]
              + (torch.arange(s, dtype=input.dtype, device=input.device)[None] + 0.5) / s).reshape(-1)  # [PH*S]
    grid_x = (torch.arange(pooled_width, dtype=input.dtype, device=input.device)[:, None]
              + (torch.arange(s, dtype=input.dtype, device=input.device)[None] + 0.5) / s).reshape(-1)  # [PW*S]
    y = start_h[:, None] + grid_y[None] * (roi_h / pooled_height)[:, None]  # [K, PH*S]
    x = start_w[:, None] + grid_x[None] * (roi_w / pooled_width)[:, None]  # [K, PW*S]
    inside = ((y >= -1.0) & (y <= height))[:, :, None] & ((x >= -1.0) & (x <= width))[:, None, :]  # [K, PHS, PWS]
    yn = y.clamp(0, height - 1) / max(height - 1, 1) * 2 - 1
    xn = x.clamp(0, width - 1) / max(width - 1, 1) * 2 - 1
    grid = torch.stack(torch.broadcast_tensors(xn[:, None, :], yn[:, :, None]), -1)  # [K, PHS, PWS, 2] as (x, y)
    batch = rois[:, 0].long()
    for b in range(n):
        pick = (batch == b).nonzero().flatten()
        if not len(pick):
            continue
        g = grid[pick].reshape(1, len(pick) * pooled_height * s, pooled_width * s, 2)
        v = torch.nn.functional.grid_sample(input[b:b + 1], g, mode="bilinear", padding_mode="border",
                                            align_corners=True)  # [1, C, K_b*PH*S, PW*S]
        v = v.reshape(c, len(pick), pooled_height * s, pooled_width * s).transpose(0, 1)
        out[pick] = torch.nn.functional.avg_pool2d(v * inside[pick][:, None].to(v.dtype), s)  # each bin's mean
    return out


def _missing(name: str):
    def kernel(*args, **kwargs):
        raise NotImplementedError(f"torchvision::{name} has no kernel in the sweep's pure-torch shim "
                                  f"(benchmarks/tv_ops.py)")
    return kernel


def _define() -> None:
    lib = torch.library.Library("torchvision", "DEF")
    impl = torch.library.Library("torchvision", "IMPL", "CPU")
    anywhere = torch.library.Library("torchvision", "IMPL", "CompositeExplicitAutograd")  # an op without tensors
    _LIB.extend([lib, impl, anywhere])
    kernels = {"nms": nms, "roi_align": roi_align}
    for name, schema in SCHEMAS.items():
        lib.define(schema)
        if name == "_cuda_version":  # torchvision asks at import which CUDA its ops were built for: none
            anywhere.impl(name, lambda: -1)
        else:
            impl.impl(name, kernels.get(name, _missing(name)))


def install() -> None:
    """Make ``import torchvision`` define its ops here when its compiled ``_C.so`` cannot load. Idempotent; a
    no-op where the compiled ops load (a torchvision built for this torch)."""
    if _LIB or hasattr(torch.ops.torchvision, "nms") and _defined("nms"):
        return
    real = torch.ops.load_library

    def load_library(path):
        if os.path.basename(str(path)) == "_C.so" and os.path.basename(os.path.dirname(str(path))) == "torchvision":
            try:
                return real(path)
            except OSError:
                _define()
                return None
        return real(path)

    torch.ops.load_library = load_library


def _defined(name: str) -> bool:
    try:
        getattr(torch.ops.torchvision, name).default
        return True
    except (AttributeError, RuntimeError):
        return False
