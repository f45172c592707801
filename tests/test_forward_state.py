"""normconv's own forwards leave no state behind, on the user's model or on the rewrite: a forward that re-binds an
attribute for the shape it sees (Swin's window), fills a cache dict (LeViT's attention biases by device), appends to
a list or adds an attribute finds each put back after every check forward (``verify.forward_guard``), at the
example shape and at the second shape alike; the rewrite still pickles and loads."""

from __future__ import annotations

import io

import pytest
import torch
import torch.nn as nn

import normconv


class Stateful(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv, self.bn = nn.Conv2d(3, 4, 3, padding=1), nn.BatchNorm2d(4)
        self.window = 7
        self.cache: dict = {}
        self.seen: list = []
        with torch.no_grad():
            self.bn.running_mean.normal_()
            self.bn.running_var.uniform_(0.5, 2.0)

    def forward(self, x):
        self.window = min(self.window, x.shape[-1])  # re-bound for the shape it sees
        self.cache[str(tuple(x.shape))] = lambda: None  # a cache of something that does not pickle
        self.seen.append(x.shape[0])
        self.last_shape = tuple(x.shape)  # an attribute added by the forward
        return torch.relu(self.bn(self.conv(x)))[..., : self.window]


def _state(m):
    return {k: (v if not isinstance(v, (dict, list)) else (type(v), len(v))) for k, v in m.__dict__.items()
            if k not in ("_parameters", "_buffers", "_modules")}


@pytest.mark.parametrize("command", ["fold", "canonicalize"])
def test_check_forwards_leave_no_state(command):
    torch.manual_seed(0)
    model = Stateful().eval()
    before = _state(model)
    x = torch.randn(2, 3, 16, 16)
    new, report = getattr(normconv, command)(model, x)
    assert report.passed
    assert _state(model) == before  # the user's model: as it was, after the example and the second shape
    assert "last_shape" not in new.__dict__ and new.cache == {} and new.seen == [] and new.window == 7
    buf = io.BytesIO()
    torch.save(new, buf)  # no closure left in its cache: it pickles
    for shape in ((1, 3, 5, 5), (3, 3, 9, 12)):  # and computes the original's outputs at fresh shapes
        y = torch.randn(shape)
        torch.testing.assert_close(new(y), model(y), atol=1e-5, rtol=1e-5)
