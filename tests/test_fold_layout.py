"""fold through layout ops that keep the channel axis (issue 12): LeViT's Linear -> flatten(0, 1) -> BatchNorm1d
-> reshape back, and Linear on (N, L, C) -> transpose(1, 2) -> BatchNorm1d -> transpose back; a reshape that
mixes the channel axis stays refused."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn

from fold_helpers import applied, bn_modules, checked_fold, randomize_bn, skipped


class LinearNorm(nn.Module):
    """timm LeViT's LinearNorm, verbatim: the BN sees (N*L, C)."""

    def __init__(self, i, o):
        super().__init__()
        self.linear, self.bn = nn.Linear(i, o, bias=False), nn.BatchNorm1d(o)

    def forward(self, x):
        x = self.linear(x)
        return self.bn(x.flatten(0, 1)).reshape_as(x)


class TransposedNorm(nn.Module):
    """Linear on (N, L, C), BN on (N, C, L), back to (N, L, C)."""

    def __init__(self, i, o):
        super().__init__()
        self.linear, self.bn = nn.Linear(i, o), nn.BatchNorm1d(o)

    def forward(self, x):
        return self.bn(self.linear(x).transpose(1, 2)).transpose(1, 2)


class PermutedNorm(TransposedNorm):
    def forward(self, x):
        return self.bn(self.linear(x).permute(0, 2, 1).contiguous()).permute(0, 2, 1)


class MixingNorm(TransposedNorm):
    """(N, L, C) -> reshape to (N, C, L) (not a transpose): BN channel j sees a mix of features and positions."""

    def __init__(self, i, o):
        super().__init__(i, o)

    def forward(self, x):
        n, l, _ = x.shape
        return self.bn(self.linear(x).reshape(n, -1, l)).reshape(n, l, -1)


def net(block):
    torch.manual_seed(0)
    return randomize_bn(nn.Sequential(block(8, 16), nn.GELU(), block(16, 16)))


@pytest.mark.parametrize("method", ["symbolic_trace", "torch.export"])
@pytest.mark.parametrize("block", [LinearNorm, TransposedNorm, PermutedNorm])
def test_channel_keeping_layouts_fold_exactly(block, method):
    model = net(block)
    x = torch.randn(2, 5, 8)
    folded, report = checked_fold(model, (x,), method=method)
    assert set(applied(report)) == {"0.bn", "2.bn"}, report.sites
    assert not skipped(report) and bn_modules(folded) == 0
    assert all("0.linear" in r or "2.linear" in r for r in applied(report).values())
    # the fold is weights-only: a second batch size and sequence length agree too
    for shape in [(3, 7, 8), (1, 1, 8)]:
        x2 = torch.randn(*shape)
        with torch.no_grad():
            err = (folded(x2) - model(x2)).abs().max().item()
        assert err < 1e-4, (shape, err)
    # the user's model keeps its BN and weights
    assert bn_modules(model) == 2 and model[0].linear.weight is not folded[0].linear.weight


def test_reshape_that_mixes_the_channel_axis_is_refused():
    model = net(MixingNorm)
    x = torch.randn(2, 5, 8)
    folded, report = checked_fold(model, (x,))
    assert not applied(report) and bn_modules(folded) == 2
    why = skipped(report)
    assert len(why) == 2 and all("mixes the channel axis" in r for r in why.values()), why
    # and it is indeed not a per-channel scale of the linear: folding it anyway would be wrong
    lin, bn = model[0].linear, model[0].bn
    s = bn.weight / torch.sqrt(bn.running_var + bn.eps)
    wrong = nn.Linear(8, 16)
    with torch.no_grad():
        wrong.weight.copy_(lin.weight * s[:, None])
        wrong.bias.copy_((lin.bias - bn.running_mean) * s + bn.bias)
        assert (wrong(x) - model[0](x)).abs().max() > 0.1


def test_channels_that_end_on_another_dim_are_refused():
    class Twice(TransposedNorm):
        def forward(self, x):  # transposed there and back: BN would normalize the L positions, not C
            return self.bn(self.linear(x).transpose(1, 2).transpose(1, 2))

    class Before(TransposedNorm):
        def forward(self, x):  # features moved to dim 1 after the linear: foldable (a positive control)
            return self.bn(self.linear(x.transpose(1, 2)).transpose(1, 2))

    torch.manual_seed(0)
    x = torch.randn(2, 16, 16)  # L == C: the shapes alone would let BN through
    folded, report = checked_fold(randomize_bn(nn.Sequential(Twice(16, 16))), (x,))
    assert not applied(report) and bn_modules(folded) == 1
    assert "arrive on dim 2" in skipped(report)["0.bn"]
    folded, report = checked_fold(randomize_bn(nn.Sequential(Before(16, 16))), (x,))
    assert applied(report) == {"0.bn": "fold into 0.linear (backward)"} and bn_modules(folded) == 0
