"""Attention on 3-D or 5-D tensors (timm's Hiera, NesT, Twins, SAM: ``F.scaled_dot_product_attention`` on
(B, L, E) or (B, H1, H2, L, E)): torch.onnx's SDPA takes 4-D q, k, v only and the whole export failed ("only 4D
query, key, and value are supported"). normconv's translation reshapes to 4-D around the same SDPA and back; the file
runs in onnxruntime and matches torch on a fresh input with another sequence length."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import normconv


class Attention(nn.Module):
    def __init__(self, rank: int, mask: bool | str = False):
        super().__init__()
        self.rank, self.mask = rank, mask
        self.norm, self.qkv, self.proj = nn.LayerNorm(8), nn.Linear(8, 24), nn.Linear(8, 8)

    def forward(self, x):  # x: (B, L, 8), L a multiple of 4
        q, k, v = self.qkv(self.norm(x)).chunk(3, -1)
        if self.rank == 4:
            q, k, v = (t.reshape(t.shape[0], -1, 2, 4).transpose(1, 2) for t in (q, k, v))
        elif self.rank == 5:
            q, k, v = (t.reshape(t.shape[0], 2, -1, 4, 4).transpose(2, 3) for t in (q, k, v))
        mask = torch.ones(q.shape[-2], k.shape[-2], dtype=torch.bool).tril() if self.mask else None
        if self.mask == "bias":  # a float bias with q's rank (SAM's relative positions: (B, L, S) beside 3-D q)
            mask = (q[..., :1] - k[..., :1].transpose(-2, -1)).tanh()
        o = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        return self.proj(o.transpose(-3, -2).reshape(x.shape) if self.rank == 5 else
                         o.transpose(1, 2).reshape(x.shape) if self.rank == 4 else o)


@pytest.mark.parametrize("rank, mask", [(3, False), (3, True), (3, "bias"), (4, False), (5, False), (5, "bias")])
def test_attention_of_any_rank_exports_and_runs(tmp_path, rank, mask):
    import onnxruntime as ort

    torch.manual_seed(0)
    model = Attention(rank, mask).eval()
    out = tmp_path / "a.onnx"
    report = normconv.export(model, (torch.randn(2, 16, 8),), out)
    assert report.passed and out.exists()
    assert sum(n.op_type == "LayerNormalization" for n in onnx.load(str(out)).graph.node) == 1
    session = ort.InferenceSession(str(out))
    for shape in ((2, 16, 8), (3, 24, 8)):  # the sequence dimension is dynamic
        x = torch.randn(shape)
        (got,) = session.run(None, {session.get_inputs()[0].name: x.numpy()})
        with torch.no_grad():
            np.testing.assert_allclose(got, model(x).numpy(), atol=1e-5, rtol=1e-4)
