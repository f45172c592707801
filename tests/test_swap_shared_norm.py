"""One norm module called at several sites (DINOv3's backbone norms every stage with its one final LayerNorm): the
module is replaced once, so its bias takes one form at every call. Where one call's output has no linear to take the
bias (the model's output), the bias stays an add after the RMSNorm at every call and no call folds it into a reader
(before: the replacement followed the first call, and the other lost its bias or had it twice: exit 1)."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn

import normconv


class _NormTwice(nn.Module):
    """Pre-LN blocks; ``norm`` reads the stream after each block: once into a linear head, once as an output."""

    def __init__(self, d: int = 16, head_first: bool = True):
        super().__init__()
        self.inp = nn.Linear(8, d)
        self.ln1, self.ln2, self.norm = nn.LayerNorm(d), nn.LayerNorm(d), nn.LayerNorm(d)
        self.mlp1, self.mlp2 = nn.Linear(d, d), nn.Linear(d, d)
        self.head = nn.Linear(d, 4)
        self.head_first = head_first
        g = torch.Generator().manual_seed(0)
        with torch.no_grad():
            for ln in (self.ln1, self.ln2, self.norm):  # trained-looking: a bias that matters
                ln.weight.copy_(1 + 0.3 * torch.randn(d, generator=g))
                ln.bias.copy_(0.5 * torch.randn(d, generator=g))

    def forward(self, x):
        h = self.inp(x)
        h = h + self.mlp1(self.ln1(h))
        early = self.norm(h)
        h = h + self.mlp2(self.ln2(h))
        late = self.norm(h)
        if self.head_first:
            return self.head(early), late
        return late, self.head(self.norm(h) * 2)


@pytest.mark.parametrize("head_first", [True, False])
def test_a_norm_called_twice_keeps_its_bias_at_every_call(head_first):
    model = _NormTwice(head_first=head_first).eval()
    x = torch.randn(2, 5, 8)
    swapped, report = normconv.swap(model, (x,), to="rmsnorm")
    norm_rows = [s for s in report.sites if s.target == "norm"]
    assert len(norm_rows) >= 2 and all(s.applied and s.code.value == "exact-bias-kept" for s in norm_rows)
    assert not any(isinstance(m, nn.LayerNorm) for m in swapped.modules())
    assert torch.equal(swapped.head.bias, model.head.bias)  # no call folded the bias into the head
    y = torch.randn(3, 7, 8)  # a fresh shape
    with torch.no_grad():
        for got, want in zip(swapped(y), model(y)):
            torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
