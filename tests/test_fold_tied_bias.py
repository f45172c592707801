"""A conv whose bias is tied to another conv's (``c2.bias = c.bias``): folding its BatchNorm would change the other
conv, so fold refuses the site, and the reason names the tensor shared. It said 'c shares its weight with c2'."""

from __future__ import annotations

import torch
import torch.nn as nn

import normconv


class TiedBias(nn.Module):
    def __init__(self):
        super().__init__()
        self.c, self.c2, self.bn = nn.Conv2d(4, 4, 1), nn.Conv2d(4, 4, 1), nn.BatchNorm2d(4)
        self.c2.bias = self.c.bias
        with torch.no_grad():
            self.bn.running_mean.normal_()
            self.bn.running_var.uniform_(0.5, 2.0)

    def forward(self, x):
        return self.bn(self.c(x)) + self.c2(x)


def test_a_tied_conv_bias_is_named_as_the_bias():
    torch.manual_seed(0)
    model = TiedBias().eval()
    new, report = normconv.fold(model, (torch.randn(2, 4, 8, 8),))
    (site,) = [s for s in report.sites if s.target == "bn"]
    assert not site.applied
    assert "c shares its bias with c2" in site.reason and "shares its weight" not in site.reason
    with torch.no_grad():
        for shape in ((3, 4, 5, 7), (1, 4, 9, 6)):
            x = torch.randn(shape)
            torch.testing.assert_close(new(x), model(x), atol=1e-5, rtol=1e-5)
