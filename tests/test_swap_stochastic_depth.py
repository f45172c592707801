"""torchvision's stochastic depth on a residual branch (MViT, MaxViT, Swin): ``torchvision.ops.stochastic_depth`` is
``torch.fx.wrap``'ed, so symbolic_trace keeps the call in the graph. In eval it returns its input, and the stream's
writer is the linear behind it: an exact swap, as through dropout. In training it is a random mask, never a writer
that can be centered. The function is declared here as torchvision declares it (same module name, same wrap), so the
suite needs no torchvision."""

from __future__ import annotations

import pytest
import torch
import torch.fx
import torch.nn as nn

import normconv


def stochastic_depth(input, p: float, mode: str, training: bool = True):  # torchvision/ops/stochastic_depth.py
    if p < 0.0 or p > 1.0:
        raise ValueError(f"drop probability has to be between 0 and 1, but got {p}")
    if not training or p == 0.0:
        return input
    size = [input.shape[0]] + [1] * (input.ndim - 1) if mode == "row" else [1] * input.ndim
    noise = torch.empty(size, dtype=input.dtype, device=input.device).bernoulli_(1.0 - p)
    return input * noise.div_(1.0 - p) if p < 1.0 else input * noise


stochastic_depth.__module__ = "torchvision.ops.stochastic_depth"
torch.fx.wrap("stochastic_depth")


class StochasticDepth(nn.Module):
    def __init__(self, p: float) -> None:
        super().__init__()
        self.p = p

    def forward(self, x):
        return stochastic_depth(x, self.p, "row", self.training)


class Block(nn.Module):
    def __init__(self, d: int, p: float) -> None:
        super().__init__()
        self.norm1, self.norm2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.attn, self.mlp = nn.Linear(d, d), nn.Sequential(nn.Linear(d, 2 * d), nn.GELU(), nn.Linear(2 * d, d))
        self.stochastic_depth = StochasticDepth(p)

    def forward(self, x):
        x = x + self.stochastic_depth(self.attn(self.norm1(x)))
        return x + self.stochastic_depth(self.mlp(self.norm2(x)))


class Net(nn.Module):
    def __init__(self, d: int = 16, p: float = 0.2) -> None:
        super().__init__()
        self.embed = nn.Linear(8, d)
        self.blocks = nn.Sequential(Block(d, p), Block(d, p))
        self.norm, self.head = nn.LayerNorm(d), nn.Linear(d, 3)

    def forward(self, x):
        return self.head(self.norm(self.blocks(self.embed(x))))


def _net():
    torch.manual_seed(0)
    net = Net().eval()
    with torch.no_grad():
        for name, p in net.named_parameters():
            if "norm" in name:
                p.add_(0.5 * torch.randn_like(p))
    return net


def test_the_graph_keeps_the_call():
    """What makes the class: symbolic_trace records stochastic_depth as one call, not its body."""
    graph = torch.fx.symbolic_trace(_net()).graph
    assert sum(n.op == "call_function" and n.target.__name__ == "stochastic_depth" for n in graph.nodes) == 4


def test_stochastic_depth_in_eval_is_no_writer_of_the_stream():
    net = _net()
    x = torch.randn(2, 5, 8)
    new, report = normconv.swap(net, x)
    assert report.passed and report.extra["swapped"] == 5
    assert sum(isinstance(m, nn.RMSNorm) for m in new.modules()) == 5
    other = torch.randn(3, 7, 8)
    with torch.no_grad():
        torch.testing.assert_close(new(other), net(other), atol=1e-5, rtol=1e-4)


@pytest.mark.parametrize("training, p, op", [(False, 0.2, "identity"), (True, 0.0, "identity"), (True, 0.2, None)])
def test_in_training_it_is_a_random_mask_not_an_identity(training, p, op):
    """Only eval (or p 0) makes the call its input itself: in training it multiplies by a random mask."""
    from normconv.match import op_of

    net = Net(p=p).train(training)
    calls = [n for n in torch.fx.symbolic_trace(net).graph.nodes
             if n.op == "call_function" and n.target.__name__ == "stochastic_depth"]
    assert len(calls) == 4 and {op_of(n) for n in calls} == {op}
