"""An RMSNorm written inside a bigger module (Mamba2's gated norm: the module also gates and regroups, so torch
keeps it as written) is matched in the exported ONNX graph and becomes the target's one op; a decomposed chain
with another reader inside is left as it is; --no-canonicalize leaves hand-written norms as written."""

from __future__ import annotations

import onnx_ir as ir
import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import normconv
from normconv.verify import Inputs

DECOMPOSED = {"ReduceMean", "Pow", "Sqrt", "Reciprocal"}


class GatedRMSNorm(nn.Module):
    """transformers' MambaRMSNormGated, as written there (grouped RMSNorm of x * silu(gate), then the weight)."""

    def __init__(self, hidden, group, eps=1e-6):
        super().__init__()
        self.weight, self.eps, self.group = nn.Parameter(1 + 0.3 * torch.randn(hidden)), eps, group

    def forward(self, x, gate):
        x = x.to(torch.float32) * F.silu(gate.to(torch.float32))
        *prefix, last = x.shape
        g = x.view(*prefix, last // self.group, self.group)
        g = g * torch.rsqrt(g.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * g.view(*prefix, last)


class Mixer(nn.Module):
    def __init__(self, d=16):
        super().__init__()
        self.inp, self.out, self.norm = nn.Linear(d, 2 * d), nn.Linear(d, d), GatedRMSNorm(d, 8)

    def forward(self, hidden_states):
        x, gate = self.inp(hidden_states).chunk(2, dim=-1)
        return self.out(self.norm(x, gate))


class LeakyMixer(nn.Module):
    """An inline RMSNorm whose mean square is also read outside it: the chain is not the norm's alone."""

    def __init__(self, d=16):
        super().__init__()
        self.inp, self.out = nn.Linear(d, d), nn.Linear(d, d)

    def forward(self, hidden_states):
        x = self.inp(hidden_states)
        ms = x.pow(2).mean(-1, keepdim=True)
        return self.out(x * torch.rsqrt(ms + 1e-6)) + ms


def _ops(path):
    counts: dict[str, int] = {}
    for n in ir.load(str(path)).graph:
        key = n.op_type if n.domain in ("", "ai.onnx") else f"{n.domain}.{n.op_type}"
        counts[key] = counts.get(key, 0) + 1
    return counts


def _inputs():
    torch.manual_seed(1)
    return Inputs((), {"hidden_states": torch.randn(2, 5, 16)})


@pytest.mark.parametrize("target,opset,op", [("ort", 20, "SimplifiedLayerNormalization"),
                                             ("onnx", 23, "RMSNormalization"), ("onnx", 20, "normconv.RMSNorm")])
def test_inline_rmsnorm_becomes_one_op(tmp_path, target, opset, op):
    torch.manual_seed(0)
    model = Mixer().eval()
    sites = normconv.inspect(model, _inputs()).to_json()["sites"]
    assert [s["kind"] for s in sites] == ["rmsnorm"]
    plan = next(p for p in sites[0]["plan"] if p["pass"] == "export")
    assert plan["applied"] and "matched in the exported ONNX graph" in plan["reason"]
    report = normconv.export(model, _inputs(), tmp_path / "m.onnx", target=target, opset=opset)
    assert report.passed and report.extra["inline_fused"] == 1 and report.extra["fused_matches_sites"]
    ops = _ops(tmp_path / "m.onnx")
    assert ops.get(op) == 1 and not DECOMPOSED & set(ops)
    assert any(v["label"].startswith("onnxruntime") for v in report.to_json()["validation"])


def test_a_chain_read_elsewhere_is_left_decomposed(tmp_path):
    torch.manual_seed(0)
    model = LeakyMixer().eval()
    sites = normconv.inspect(model, _inputs()).to_json()["sites"]
    plan = next(p for p in sites[0]["plan"] if p["pass"] == "export")
    assert not plan["applied"] and "primitive ops" in plan["reason"]
    report = normconv.export(model, _inputs(), tmp_path / "m.onnx")
    assert report.passed and report.extra["inline_fused"] == 0
    assert {"ReduceMean", "Sqrt", "Reciprocal"} <= set(_ops(tmp_path / "m.onnx"))


def test_no_canonicalize_leaves_the_inline_norm_as_written(tmp_path):
    torch.manual_seed(0)
    report = normconv.export(Mixer().eval(), _inputs(), tmp_path / "m.onnx", canonicalize=False)
    assert report.passed and report.extra["inline_fused"] == 0
    assert {"ReduceMean", "Sqrt"} <= set(_ops(tmp_path / "m.onnx"))


class TupleLayerNorm(nn.Module):
    """I-BERT's IntLayerNorm outside quant mode: a LayerNorm written out, taking (x, scaling_factor) and returning
    (y, None), so torch keeps it as written."""

    def __init__(self, d, eps):
        super().__init__()
        self.weight, self.bias, self.eps = nn.Parameter(1 + 0.3 * torch.randn(d)), nn.Parameter(torch.randn(d)), eps

    def forward(self, x, scaling_factor=None):
        mean = x.mean(axis=2, keepdim=True)
        y = x - mean
        var = torch.mean(y ** 2, axis=2, keepdim=True)
        return y / torch.sqrt(self.eps + var) * self.weight + self.bias, None


class TupleLayerNormBlock(nn.Module):
    def __init__(self, eps, d=16):
        super().__init__()
        self.fc, self.norm, self.head = nn.Linear(d, d), TupleLayerNorm(d, eps), nn.Linear(d, 4)

    def forward(self, hidden_states):
        y, _ = self.norm(self.fc(hidden_states), None)
        return self.head(y)


@pytest.mark.parametrize("eps", [0.0, 1e-5])
def test_inline_layernorm_becomes_one_layernormalization(tmp_path, eps):
    torch.manual_seed(0)
    model = TupleLayerNormBlock(eps).eval()
    report = normconv.export(model, _inputs(), tmp_path / "m.onnx")
    assert report.passed and report.extra["inline_fused"] == 1 and report.extra["fused_matches_sites"]
    ops = _ops(tmp_path / "m.onnx")
    assert ops.get("LayerNormalization") == 1 and not DECOMPOSED & set(ops) and "Sub" not in ops


class MultiHeadLayerNorm(nn.Module):
    """transformers' xLSTMMultiHeadLayerNorm, as written there: per head, x - mean(x) scaled by the inverse root of
    torch.var(x) (its own mean again; exported as a keepdims=0 mean put back by a Reshape), float32 casts around
    it, then the heads joined and one weight over all of them."""

    def __init__(self, heads, head_dim, inverse="rsqrt", eps=1e-6):
        super().__init__()
        self.heads, self.inverse, self.eps = heads, inverse, eps
        self.weight = nn.Parameter(1 + 0.3 * torch.randn(heads * head_dim))

    def forward(self, x):
        b, s, _, _ = x.shape
        dtype = x.dtype
        x = x.float()
        centered = x - x.mean(dim=-1, keepdim=True)
        var = x.var(dim=-1, keepdim=True, unbiased=False) + self.eps
        y = centered * torch.rsqrt(var) if self.inverse == "rsqrt" else centered / torch.sqrt(var)
        return y.to(dtype).reshape(b, s, -1) * self.weight


class HeadsBlock(nn.Module):
    def __init__(self, inverse, d=16, heads=4):
        super().__init__()
        self.heads = heads
        self.fc, self.norm, self.out = nn.Linear(d, d), MultiHeadLayerNorm(heads, d // heads, inverse), nn.Linear(d, d)

    def forward(self, hidden_states):
        b, s, d = hidden_states.shape
        return self.out(self.norm(self.fc(hidden_states).view(b, s, self.heads, d // self.heads)))


@pytest.mark.parametrize("inverse", ["rsqrt", "div"])
def test_per_head_layernorm_with_var_of_x_becomes_one_op(tmp_path, inverse):
    torch.manual_seed(0)
    model = HeadsBlock(inverse).eval()
    # dynamic (the default): torch's exporter leaves the head size symbolic, (d // heads), though d is 16 at the
    # input: the norm is not fused (its normalized size is unknown) and the report says so; validated all the same
    dynamic = normconv.export(model, _inputs(), tmp_path / "dyn.onnx")
    assert dynamic.passed and not dynamic.extra["fused_matches_sites"]
    assert any("differ from norm sites" in n for n in dynamic.notes)
    report = normconv.export(model, _inputs(), tmp_path / "m.onnx", static=True)
    assert report.passed and report.extra["inline_fused"] == 1 and report.extra["fused_matches_sites"]
    site = [s for s in report.sites if s.pass_name == "export"]
    assert len(site) == 1 and site[0].applied and "matched in the exported ONNX graph" in site[0].reason
    ops = _ops(tmp_path / "m.onnx")
    assert ops.get("LayerNormalization") == 1 and not DECOMPOSED & set(ops) and "Sub" not in ops
