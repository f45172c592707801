"""``verify.guard.one_snapshot``: the guarded forwards of one model share one snapshot, and each still starts from
the state it holds and has its changes undone; a guard nested in another of the same model, or after a forward
that grew the module tree, takes a snapshot of its own. The door takes three snapshots where it took five."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn

import normconv
from normconv.verify import guard as guard_mod
from normconv.verify import run, Inputs
from normconv.verify.guard import forward_guard, one_snapshot


class Leaky(nn.Module):
    """Each forward leaves something behind: a counter, a filled cache, a changed buffer, a re-bound attribute."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.register_buffer("calls", torch.zeros(()))
        self.cache: dict = {}
        self.scale = 1.0
        self.flags_seen: list = []

    def forward(self, x):
        self.flags_seen.append(self.training)
        out = self.lin(x) * self.scale + self.calls + len(self.cache)  # what a leaked state would change
        self.calls.add_(1)
        self.cache[len(self.cache)] = x.shape
        self.scale = 2.0
        return out


@pytest.fixture
def snapshots(monkeypatch):
    made = []
    real = guard_mod._Snapshot

    class Counted(real):
        def __init__(self, model):
            made.append(model)
            super().__init__(model)

    monkeypatch.setattr(guard_mod, "_Snapshot", Counted)
    return made


def test_shared_forwards_each_start_clean(snapshots):
    torch.manual_seed(0)
    model = Leaky().train()
    x = torch.randn(2, 4)
    alone = [run(model, Inputs((x,))) for _ in range(3)]
    assert len(snapshots) == 3
    with one_snapshot(model):
        shared = [run(model, Inputs((x,))) for _ in range(3)]
    assert len(snapshots) == 4  # one for the three
    for a, b in zip(alone, shared):  # every forward saw calls == 0, an empty cache, scale 1
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    assert model.calls.item() == 0 and model.cache == {} and model.scale == 1.0 and model.training
    assert model.flags_seen == []  # appended to inside each forward, put back after it


def test_a_nested_guard_takes_its_own_snapshot_and_keeps_the_outer_one_in_eval(snapshots):
    model = Leaky().train()
    with one_snapshot(model):
        with forward_guard(model):
            assert not model.training
            with forward_guard(model):  # nested: the outer one is running
                model(torch.randn(1, 4))
            assert not model.training  # the inner guard did not put the outer's training flag back
            model.scale = 5.0
        assert model.training and model.scale == 1.0
    assert len(snapshots) == 2


def test_a_forward_that_adds_a_submodule_gets_a_fresh_snapshot(snapshots):
    class Grows(nn.Module):
        def forward(self, x):
            if not hasattr(self, "extra"):
                self.add_module("extra", nn.Dropout(0.5))  # training mode, as a new module is
            return self.extra(x)

    model = Grows().eval()
    x = torch.ones(1, 1000)
    with one_snapshot(model):
        with forward_guard(model):
            model(x)
        # _modules is torch's own state, left alone: the tree grew, so this guard snapshots it and puts the new
        # module in eval mode as every guard does
        with forward_guard(model):
            out = model(x)
    assert torch.equal(out, x)  # dropout off
    assert len(snapshots) == 2  # the shared one, then one of its own


def test_the_door_takes_three_snapshots(snapshots):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4), nn.ReLU()).eval()
    with torch.no_grad():
        model[1].running_mean.normal_()
    new, report = normconv.fold(model, torch.randn(2, 3, 8, 8))
    assert report.passed and len(report.validation) == 2
    # the original (example and second shape), the capture's copy, the rewrite (example and second shape)
    assert len(snapshots) == 3
