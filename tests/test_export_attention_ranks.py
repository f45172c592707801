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


class SharedKV(nn.Module):
    """Multi-query attention as timm's MobileNetV5 writes it: q with 4 heads, one key / value head that broadcasts
    (no ``enable_gqa``). torch.onnx's opset-23 SDPA asserts "q_num_heads = kv_num_heads"; normconv's translation
    builds it with onnxscript's SDPA, whose MatMul broadcasts the shared head."""

    def __init__(self):
        super().__init__()
        self.norm, self.q, self.kv, self.proj = nn.LayerNorm(16), nn.Linear(16, 16), nn.Linear(16, 8), nn.Linear(16, 16)

    def forward(self, x):  # (B, L, 16)
        b, n, _ = x.shape
        y = self.norm(x)
        q = self.q(y).reshape(b, n, 4, 4).transpose(1, 2)
        k, v = self.kv(y).reshape(b, n, 2, 1, 4).unbind(2)
        o = F.scaled_dot_product_attention(q, k.transpose(1, 2), v.transpose(1, 2))
        return x + self.proj(o.transpose(1, 2).reshape(b, n, 16))


def test_a_shared_key_value_head_exports_where_torch_onnx_refuses_it(tmp_path):
    import onnxruntime as ort

    torch.manual_seed(0)
    model = SharedKV().eval()
    x = torch.randn(2, 12, 16)
    with pytest.raises(Exception, match="step 3/3"):  # the plain exporter's conversion fails on it
        torch.onnx.export(model, (x,), dynamo=True, opset_version=23, verbose=False)
    out = tmp_path / "mqa.onnx"
    report = normconv.export(model, (x,), out)
    assert report.passed
    session = ort.InferenceSession(str(out))
    for shape in ((2, 12, 16), (1, 7, 16)):
        other = torch.randn(shape)
        (got,) = session.run(None, {session.get_inputs()[0].name: other.numpy()})
        with torch.no_grad():
            np.testing.assert_allclose(got, model(other).numpy(), atol=1e-5, rtol=1e-4)
