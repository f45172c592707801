"""Issue 27, class 1: value-dependent control flow never yields a silent exact claim. A capture that decided a Python
branch on a tensor's value (torch.export.draft_export's guards, or a concrete tensor's value read while
symbolic_trace ran) saw one path: the rewrite is proven for the other branches (no rewritten module is reachable from
the branch's code, and every module the rewrite did not change computes what it did), or refused with exit 2 naming
the guard and --accept-specialized; the report always says when a capture specialized a branch."""

from __future__ import annotations

import json
import sys
import textwrap

import pytest
import torch
import torch.nn as nn

import normconv
from normconv.errors import Code, NormconvError
from tests.trust_helpers import one_line_error


def _bn(c: int) -> nn.BatchNorm2d:
    bn = nn.BatchNorm2d(c)
    with torch.no_grad():
        bn.running_mean.uniform_(-1, 1)
        bn.running_var.uniform_(0.5, 2)
        bn.weight.uniform_(0.5, 2)
        bn.bias.uniform_(-1, 1)
    return bn.eval()


_ISSUE = '''
import torch
import torch.nn as nn


class Branchy(nn.Module):
    """The issue's model: BN on one branch, the conv alone on the other."""

    def __init__(self):
        super().__init__()
        self.conv, self.bn = nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4)
        with torch.no_grad():
            self.bn.running_mean.uniform_(-1, 1)
            self.bn.running_var.uniform_(0.5, 2)
            self.bn.bias.uniform_(-1, 1)

    def forward(self, x):
        if x.sum() > 0:
            return self.bn(self.conv(x))
        return self.conv(x) * 2


def make():
    torch.manual_seed(0)
    return Branchy().eval(), (torch.randn(2, 3, 8, 8).abs(),)
'''


@pytest.fixture
def issue_model(tmp_path, monkeypatch):
    (tmp_path / "branchy27.py").write_text(textwrap.dedent(_ISSUE))
    monkeypatch.chdir(tmp_path)
    yield tmp_path
    sys.modules.pop("branchy27", None)


def test_the_issue_s_fold_is_refused_naming_the_guard_and_the_flag(cli, issue_model):
    out = issue_model / "out.pt"
    one_line_error(cli, "fold", "branchy27:make", "-o", out, match=("if x.sum() > 0", "--accept-specialized",
                                                                   "specialized a branch"))
    assert not out.exists()


def test_accepting_the_specialization_says_so_and_is_what_it_says(cli, issue_model):
    out = issue_model / "out.pt"
    rc, stdout, err = cli("fold", "branchy27:make", "-o", out, "--accept-specialized", "--json")
    assert rc == 0, err
    report = json.loads(stdout)
    assert report["extra"]["specialized"][0]["where"].startswith("branchy27.py:")
    assert any("--accept-specialized" in n for n in report["notes"])
    # what was accepted: on the other branch the written model is not the original (why the default refuses)
    import branchy27

    model, _ = branchy27.make()
    folded = torch.load(out, weights_only=False)
    x = -torch.randn(2, 3, 8, 8).abs()
    with torch.no_grad():
        assert (folded(x) - model(x)).abs().max() > 1e-2


class Flagged(nn.Module):
    """A branch on a plain tensor attribute (not a buffer): symbolic_trace reads its value and bakes the branch in."""

    def __init__(self):
        super().__init__()
        self.conv, self.bn = nn.Conv2d(3, 4, 3), _bn(4)
        self.use_bn = torch.tensor(True)

    def forward(self, x):
        if self.use_bn:
            return self.bn(self.conv(x))
        return self.conv(x) * 2


def test_a_branch_symbolic_trace_baked_in_is_refused_too():
    torch.manual_seed(0)
    model = Flagged().eval()
    x = torch.randn(2, 3, 8, 8)
    with pytest.raises(NormconvError) as exc:
        normconv.fold(model, x, method="symbolic_trace")
    assert exc.value.code is Code.REFUSED and "--accept-specialized" in str(exc.value)
    new, report = normconv.fold(model, x, method="symbolic_trace", accept_specialized=True)
    assert report.extra["specialized"][0]["owner"] == ""


class Gate(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Conv2d(3, 3, 1)

    def forward(self, x):
        if x.mean() > 0:  # a branch on values, in a module the fold does not touch
            return self.fc(x)
        return x * 2


class GateThenFold(nn.Module):
    def __init__(self):
        super().__init__()
        self.gate, self.conv, self.bn = Gate(), nn.Conv2d(3, 4, 3), _bn(4)

    def forward(self, x):
        return self.bn(self.conv(self.gate(x)))


def test_a_fold_away_from_the_branch_is_proven_for_both_branches():
    torch.manual_seed(0)
    model = GateThenFold().eval()
    x = torch.randn(2, 3, 8, 8).abs() + 0.1
    new, report = normconv.fold(model, x)
    assert report.passed and report.extra["specialized"][0]["owner"] == "gate"
    assert any("proven for the other branches" in n for n in report.notes)
    other = -x  # takes the branch the capture did not see
    with torch.no_grad():
        torch.testing.assert_close(new(other), model(other), atol=1e-4, rtol=1e-4)


class HandLN(nn.Module):
    """A tutorial LayerNorm written by hand (canonicalize replaces it by nn.LayerNorm)."""

    def __init__(self, d):
        super().__init__()
        self.weight, self.bias = nn.Parameter(torch.rand(d) + 0.5), nn.Parameter(torch.randn(d))

    def forward(self, x):
        mu = x.mean(-1, keepdim=True)
        var = ((x - mu) ** 2).mean(-1, keepdim=True)
        return (x - mu) / torch.sqrt(var + 1e-5) * self.weight + self.bias


class Skip(nn.Module):
    """A sublayer switched by a plain tensor attribute: symbolic_trace bakes the branch its value takes."""

    def __init__(self, d):
        super().__init__()
        self.ln, self.fc = nn.LayerNorm(d), nn.Linear(d, d)
        self.enabled = torch.tensor(True)

    def forward(self, h):
        if self.enabled:
            return h + self.fc(self.ln(h))
        return h * 2


class PreLN(nn.Module):
    def __init__(self, d=8):
        super().__init__()
        self.emb, self.block, self.norm, self.head = nn.Linear(4, d), Skip(d), HandLN(d), nn.Linear(d, 3)

    def forward(self, x):
        return self.head(self.norm(self.block(self.emb(x))))


def test_canonicalize_away_from_the_branch_is_proven():
    torch.manual_seed(0)
    model = PreLN().eval()
    x = torch.randn(2, 5, 4)
    new, report = normconv.canonicalize(model, x)
    assert isinstance(new.norm, nn.LayerNorm) and report.passed
    assert report.extra["specialized"][0]["owner"] == "block"
    assert any("proven for the other branches" in n for n in report.notes)
    new.block.enabled = model.block.enabled = torch.tensor(False)  # the branch the capture did not take
    with torch.no_grad():
        torch.testing.assert_close(new(x), model(x), atol=1e-4, rtol=1e-4)


def test_a_swap_that_changes_what_the_branch_reads_is_refused():
    torch.manual_seed(0)
    model = PreLN().eval()
    model.norm = nn.LayerNorm(8)
    with torch.no_grad():
        model.norm.bias.normal_()
    x = torch.randn(2, 5, 4)
    with pytest.raises(NormconvError, match="specialized a branch.*if self.enabled") as exc:
        normconv.swap(model, x)
    assert exc.value.code is Code.REFUSED


def test_inspect_says_the_capture_specialized(cli, issue_model):
    rc, stdout, err = cli("inspect", "branchy27:make", "--json")
    assert rc == 0, err
    report = json.loads(stdout)
    assert report["extra"]["specialized"] and "if x.sum() > 0" in report["extra"]["specialized"][0]["where"]
    assert any("specialized a branch" in n for n in report["notes"])


class Shift(nn.Module):
    """No parameters; on the branch not taken it adds a constant to the stream (no longer zero-mean)."""

    def __init__(self):
        super().__init__()
        self.enabled = torch.tensor(True)

    def forward(self, h):
        if self.enabled:
            return h
        return h + 1.0


class Block(nn.Module):
    def __init__(self, d):
        super().__init__()
        self.ln, self.fc = nn.LayerNorm(d), nn.Linear(d, d)

    def forward(self, h):
        return h + self.fc(self.ln(h))


class ShiftedPreLN(nn.Module):
    def __init__(self, d=8):
        super().__init__()
        self.emb, self.shift, self.block, self.norm, self.head = nn.Linear(4, d), Shift(), Block(d), nn.LayerNorm(d), \
            nn.Linear(d, 3)
        with torch.no_grad():
            self.norm.bias.normal_()

    def forward(self, x):
        return self.head(self.norm(self.block(self.shift(self.emb(x)))))


def test_a_branch_that_reads_what_the_rewrite_changed_is_refused():
    """The guard's module is not rewritten, but the swap centers the stream it reads: not a local rewrite."""
    torch.manual_seed(0)
    model = ShiftedPreLN().eval()
    x = torch.randn(2, 5, 4)
    with pytest.raises(NormconvError, match="not local") as exc:
        normconv.swap(model, x)
    assert exc.value.code is Code.REFUSED
    new, report = normconv.swap(model, x, accept_specialized=True)  # accepted: right on the branch it saw only
    new.shift.enabled = model.shift.enabled = torch.tensor(False)
    with torch.no_grad():
        assert (new(x) - model(x)).abs().max() > 1e-3


class Pick(nn.Module):
    """An argmax between two channels that are equal in exact arithmetic (a detector's top-k over near-equal
    scores): float32 rounding decides each tie, and the fold rounds differently from the original."""

    def forward(self, x):
        return torch.stack([x[:, 0], x[:, 1]]).argmax(0).float() * 100 + x[:, 2]


class GateFoldPick(nn.Module):
    def __init__(self):
        super().__init__()
        self.gate, self.conv, self.bn, self.pick = Gate(), nn.Conv2d(3, 3, 3), _bn(3), Pick()
        with torch.no_grad():  # channel 1 = channel 0 in exact arithmetic: twice the conv, half the BN scale
            self.conv.weight[1] = 2 * self.conv.weight[0]
            self.conv.bias[1] = 2 * self.conv.bias[0]
            bn = self.bn
            bn.running_mean[1] = 2 * bn.running_mean[0]
            bn.running_var[1] = 4 * bn.running_var[0] + 3 * bn.eps
            bn.weight[1], bn.bias[1] = bn.weight[0], bn.bias[0]

    def forward(self, x):
        return self.pick(self.bn(self.conv(self.gate(x))))


def test_a_selection_flipped_by_rounding_downstream_is_no_change_of_the_rewrite():
    """The locality proof runs the rewrite with the original's selections, as the door's check does: an argmax
    that rounding flips after the fold is not taken for a module computing other values."""
    torch.manual_seed(0)
    model = GateFoldPick().eval()
    x = torch.randn(2, 3, 16, 16).abs() + 0.1
    new, report = normconv.fold(model, x)
    assert report.passed and report.extra["specialized"][0]["owner"] == "gate"
    assert any("proven for the other branches" in n for n in report.notes), report.notes
    assert not isinstance(new.bn, nn.BatchNorm2d)
