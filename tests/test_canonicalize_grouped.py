"""Hand-written GroupNorm and InstanceNorm over a regrouped view (``graph.grouped``), as users write them:
x.view(N, G, -1) standardized over its last axis, viewed back, then a per-channel affine (Wu & He's own code).
canonicalize makes them nn.GroupNorm(G, C) / nn.InstanceNorm2d(C), which take any size as the user's view does;
before, they became LayerNorm(L) pinned to the example's size and failed the proof at the second shape (exit 1)."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
import torch
import torch.nn as nn

from normconv.api import canonicalize, inspect
from normconv.verify import Inputs, compare, run


class GroupNormByView(nn.Module):
    """Figure 3 of the GroupNorm paper in torch (biased variance, as nn.GroupNorm computes), or InstanceNorm when
    ``groups`` is None (one group per channel), the view written as ``how`` says."""

    def __init__(self, c: int, groups: int | None, how: str = "view", eps: float = 1e-5, affine: bool = True):
        super().__init__()
        self.groups, self.how, self.eps = groups, how, eps
        self.weight = nn.Parameter(torch.randn(1, c, 1, 1)) if affine else None
        self.bias = nn.Parameter(torch.randn(1, c, 1, 1)) if affine else None

    def forward(self, x):
        n, c, h, w = x.size()
        g = self.groups or c
        if self.how == "view":
            z = x.view(n, g, -1)
        elif self.how == "rows":  # samples and groups folded into rows
            z = x.reshape(n * g, -1)
        else:  # "flatten": one group per channel
            z = x.flatten(2)
        mean = z.mean(-1, keepdim=True)
        var = z.var(-1, keepdim=True, unbiased=self.how == "unbiased")
        z = (z - mean) / (var + self.eps).sqrt()
        z = z.view(n, c, h, w)
        return z * self.weight + self.bias if self.weight is not None else z


class Net(nn.Module):
    def __init__(self, norm: nn.Module):
        super().__init__()
        self.c1, self.norm, self.c2 = nn.Conv2d(3, 8, 3, padding=1), norm, nn.Conv2d(8, 4, 3, padding=1)

    def forward(self, x):
        return self.c2(torch.relu(self.norm(self.c1(x))))


def _fresh(model, new, shapes):
    for i, s in enumerate(shapes):
        x = torch.randn(s, generator=torch.Generator().manual_seed(i))
        ref = run(model, Inputs((x,)))
        assert float(ref.abs().max()) > 0.1 and compare(ref, run(new, Inputs((x,)))).passed, s


@pytest.mark.parametrize("groups, how, native", [(4, "view", nn.GroupNorm), (2, "rows", nn.GroupNorm),
                                                 (None, "view", nn.InstanceNorm2d),
                                                 (None, "flatten", nn.InstanceNorm2d),
                                                 (None, "rows", nn.InstanceNorm2d)])
@pytest.mark.parametrize("affine", [True, False])
def test_grouped_view_becomes_the_native_norm_of_any_size(groups, how, native, affine):
    torch.manual_seed(0)
    model = Net(GroupNormByView(8, groups, how, affine=affine)).eval()
    new, report = canonicalize(model, torch.randn(2, 3, 12, 12))
    assert report.passed and [s.applied for s in report.sites] == [True]
    assert type(new.norm) is native, type(new.norm)  # the module itself replaced, sizes read by x.size() included
    if native is nn.GroupNorm:
        assert (new.norm.num_groups, new.norm.num_channels) == (groups, 8)
    assert new.norm.affine is affine
    _fresh(model, new, [(1, 3, 20, 9), (3, 3, 5, 16), (2, 3, 12, 12)])  # sizes the example never had


def test_unbiased_variance_is_no_native_norm_and_stays():
    """x.var() unbiased (the paper's code in torch as written) computes no native norm: left as it is."""
    model = Net(GroupNormByView(8, 4, "unbiased")).eval()
    sites = inspect(model, torch.randn(2, 3, 8, 8)).sites
    assert not any(s["kind"] in ("groupnorm", "layernorm") for s in sites), sites


def test_inspect_names_the_kind_and_groups():
    sites = inspect(Net(GroupNormByView(8, 4)).eval(), torch.randn(2, 3, 8, 8)).sites
    (site,) = [s for s in sites if s["source"] == "handwritten"]
    assert site["kind"] == "groupnorm" and site["num_groups"] == 4 and site["num_features"] == 8


class TokenRowsNorm(nn.Module):
    """A hand-written LayerNorm applied to tokens flattened into rows, (B, S, H) -> (B * S, H) and back: a norm over
    the last axis, a LayerNorm, never a GroupNorm(S, S) that would pin the sequence length."""

    def __init__(self, h: int = 16):
        super().__init__()
        self.w, self.b, self.out = nn.Parameter(torch.randn(h)), nn.Parameter(torch.randn(h)), nn.Linear(h, h)

    def forward(self, x):
        b, s, h = x.shape
        z = x.reshape(-1, h)
        mu = z.mean(-1, keepdim=True)
        z = (z - mu) / torch.sqrt(((z - mu) ** 2).mean(-1, keepdim=True) + 1e-5)
        return self.out(z.view(b, s, h) * self.w + self.b)


def test_tokens_flattened_to_rows_stay_a_layernorm_free_in_length():
    torch.manual_seed(0)
    model = TokenRowsNorm().eval()
    new, report = canonicalize(model, torch.randn(2, 7, 16))
    assert report.passed and any(isinstance(m, nn.LayerNorm) for m in new.modules())
    assert not any(isinstance(m, nn.GroupNorm) for m in new.modules())
    _fresh(model, new, [(1, 11, 16), (3, 4, 16)])


class OverCHW(nn.Module):
    """A hand-written LayerNorm over (C, H, W) of a conv's output, its affine per channel, per element, or none."""

    def __init__(self, affine: str, c: int = 8, side: int = 12):
        super().__init__()
        self.conv, self.affine = nn.Conv2d(3, c, 3, padding=1), affine
        shape = (c, 1, 1) if affine == "channel" else (c, side, side)
        if affine != "none":
            self.w, self.b = nn.Parameter(torch.randn(shape)), nn.Parameter(torch.randn(shape))

    def forward(self, x):
        y = self.conv(x)
        mu = y.mean((1, 2, 3), keepdim=True)
        z = (y - mu) / torch.sqrt(((y - mu) ** 2).mean((1, 2, 3), keepdim=True) + 1e-5)
        return z * self.w + self.b if self.affine != "none" else z


@pytest.mark.parametrize("affine", ["none", "channel", "element"])
def test_norm_over_every_dim_but_the_batch(affine):
    """No affine or one per channel: GroupNorm(1, C) (PoolFormer's GroupNorm1), any image size; an affine per
    element pins the sizes itself: LayerNorm((C, H, W)), exact at the size the weights fix."""
    torch.manual_seed(0)
    model = OverCHW(affine).eval()
    new, report = canonicalize(model, torch.randn(2, 3, 12, 12))
    assert report.passed
    norms = [m for m in new.modules() if isinstance(m, (nn.GroupNorm, nn.LayerNorm))]
    if affine == "element":
        assert [type(m) for m in norms] == [nn.LayerNorm] and norms[0].normalized_shape == (8, 12, 12)
        _fresh(model, new, [(1, 3, 12, 12), (3, 3, 12, 12)])
    else:
        assert [type(m) for m in norms] == [nn.GroupNorm] and norms[0].num_groups == 1
        _fresh(model, new, [(1, 3, 20, 9), (3, 3, 5, 16)])


def grouped_net() -> nn.Module:
    """The CLI's model spec (tests.test_canonicalize_grouped:grouped_net)."""
    torch.manual_seed(0)
    return Net(GroupNormByView(8, 4)).eval()


def test_export_one_fused_op_dynamic_sizes(cli, tmp_path):
    """The CLI end to end: one GroupNormalization in the file, onnxruntime equal to torch at a size the example
    never had (the file keeps batch and image sides dynamic)."""
    import onnxruntime as ort

    out = tmp_path / "gn.onnx"
    code, _, err = cli("export", "tests.test_canonicalize_grouped:grouped_net", "-i", "2,3,16,16", "-o", out)
    assert code == 0, err
    ops = [n.op_type for n in onnx.load(str(out)).graph.node]
    assert ops.count("GroupNormalization") == 1 and "ReduceMean" not in ops, ops
    x = torch.randn(3, 3, 20, 12)
    sess = ort.InferenceSession(str(out), providers=["CPUExecutionProvider"])
    (got,) = sess.run(None, {sess.get_inputs()[0].name: x.numpy()})
    np.testing.assert_allclose(got, grouped_net()(x).detach().numpy(), rtol=1e-4, atol=1e-4)
