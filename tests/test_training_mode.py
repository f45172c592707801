"""The training path (engine/training.py): a rewrite that keeps the model trainable (canonicalize, swap) is run in
training mode too, against the original on the same random draws. Where it computes otherwise there, the report
says the rewrite is exact in eval mode only (code ``eval-only``, a drift check with the measured error) and the
result is left in eval mode; canonicalize keeps a hand-written norm whose native module would train otherwise (a
frozen BatchNorm). Judged here by running the results in training mode, outside normconv."""

from __future__ import annotations

import copy

import torch
import torch.nn as nn
import torch.nn.functional as F

import normconv


def _train_out(model, x, seed=0):
    model.train()
    torch.manual_seed(seed)
    with torch.no_grad():
        return model(x)


class FrozenBN(nn.Module):  # torchvision.ops.FrozenBatchNorm2d's forward: statistics and affine are buffers
    def __init__(self, c, eps=1e-5):
        super().__init__()
        for k, v in (("weight", torch.randn(c)), ("bias", torch.randn(c)), ("running_mean", torch.randn(c)),
                     ("running_var", torch.rand(c) + .5)):
            self.register_buffer(k, v)
        self.eps = eps

    def forward(self, x):
        scale = self.weight.reshape(1, -1, 1, 1) * (self.running_var.reshape(1, -1, 1, 1) + self.eps).rsqrt()
        return x * scale + (self.bias.reshape(1, -1, 1, 1) - self.running_mean.reshape(1, -1, 1, 1) * scale)


class TutorialLN(nn.Module):  # the seeds' LayerNorm: trains as nn.LayerNorm does
    def __init__(self, d, eps=1e-5):
        super().__init__()
        self.gamma, self.beta, self.eps = nn.Parameter(torch.randn(d)), nn.Parameter(torch.randn(d)), eps

    def forward(self, x):
        mean = x.mean(-1, keepdim=True)
        var = ((x - mean) ** 2).mean(-1, keepdim=True)
        return self.gamma * (x - mean) / torch.sqrt(var + self.eps) + self.beta


class Backbone(nn.Module):
    def __init__(self):
        super().__init__()
        self.c, self.n, self.o = nn.Conv2d(4, 8, 3, padding=1), FrozenBN(8), nn.Conv2d(8, 2, 1)

    def forward(self, x):
        return self.o(torch.relu(self.n(self.c(x))))


def test_a_frozen_batchnorm_is_kept_where_a_live_one_would_train_otherwise():
    torch.manual_seed(0)
    model, x = Backbone().eval(), torch.randn(2, 4, 8, 8)
    new, report = normconv.canonicalize(model, x)
    site = next(s for s in report.sites if s.target == "n")
    assert not site.applied and site.code == "differs-in-training", site
    assert isinstance(new.n, FrozenBN)  # was nn.BatchNorm2d: 1.27 of the output's scale off in training mode
    assert torch.allclose(_train_out(new, x), _train_out(model, x))
    assert report.extra["training_mode"]["code"] == "same"


class InlineDrop(nn.Module):  # a Llama-style RMSNorm written inline, then F.dropout(training=self.training)
    def __init__(self, d=16):
        super().__init__()
        self.w, self.l1, self.l2 = nn.Parameter(torch.rand(d) + .5), nn.Linear(d, d), nn.Linear(d, d)

    def forward(self, x):
        h = self.l1(x)
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + 1e-6) * self.w
        return self.l2(F.dropout(h, 0.5, training=self.training))


def test_a_traced_graph_that_fixed_self_training_is_said_eval_only_and_left_in_eval_mode():
    torch.manual_seed(0)
    model, x = InlineDrop().train(), torch.randn(2, 6, 16)  # saved mid-training
    new, report = normconv.canonicalize(model, x)
    assert any(s.applied for s in report.sites)
    tm = report.extra["training_mode"]
    assert tm["code"] == "eval-only" and tm["max_abs_error"] > 0.1, tm
    drift = [v for v in report.validation if v.drift]
    assert len(drift) == 1 and drift[0].label.startswith("training mode") and report.passed
    assert any(n.startswith("exact in eval mode only") for n in report.notes)
    assert not any(m.training for m in new.modules())  # was written in training mode, 0.91 of the scale off
    model.eval()
    for shape in ((2, 6, 16), (3, 5, 16)):  # in the mode it is written in, the proof holds at any shape
        y = torch.randn(shape)
        with torch.no_grad():
            assert torch.allclose(new(y), model(y), atol=1e-5)


class PreLN(nn.Module):
    def __init__(self, p, d=16, depth=2):
        super().__init__()
        self.emb = nn.Embedding(11, d)
        self.ln = nn.ModuleList(nn.LayerNorm(d) for _ in range(depth))
        self.mlp = nn.ModuleList(nn.Linear(d, d) for _ in range(depth))
        self.drop = nn.Dropout(p)
        self.ln_f, self.head = nn.LayerNorm(d), nn.Linear(d, 11)

    def forward(self, ids):
        x = self.emb(ids)
        for ln, mlp in zip(self.ln, self.mlp):
            x = x + self.drop(mlp(ln(x)))
        return self.head(self.ln_f(x))


def test_swap_with_dropout_on_the_stream_is_exact_in_eval_mode_only_and_says_so():
    torch.manual_seed(0)
    ids = torch.randint(0, 11, (2, 7))
    model = PreLN(0.1).eval()
    new, report = normconv.swap(model, ids, "rmsnorm")
    assert sum(s.applied for s in report.sites) == 3  # every norm swapped exactly (in eval mode)
    assert report.extra["training_mode"]["code"] == "eval-only"
    assert not any(m.training for m in new.modules())  # left in eval mode, the mode the proof covers
    diff = (_train_out(new, ids) - _train_out(model, ids)).abs().max()
    assert diff > 1e-3  # dropout(C W x) is not zero-mean: the claim really is eval-only
    assert abs(float(diff) - report.extra["training_mode"]["max_abs_error"]) < 1e-5  # the same draws, measured
    quiet = PreLN(0.0).eval()  # no dropout: the proof holds in both modes, nothing said
    new, report = normconv.swap(quiet, ids, "rmsnorm")
    assert report.extra["training_mode"]["code"] == "same" and not any("eval mode only" in n for n in report.notes)
    assert torch.allclose(_train_out(new, ids), _train_out(quiet, ids), atol=1e-5)


class BNNet(nn.Module):
    def __init__(self, norm):
        super().__init__()
        self.c, self.n, self.o = nn.Conv2d(3, 8, 3, padding=1), norm(8), nn.Conv2d(8, 2, 1)
        if isinstance(self.n, nn.modules.batchnorm._BatchNorm):
            with torch.no_grad():
                self.n.running_mean.normal_(0, .5), self.n.running_var.uniform_(.5, 2)
                self.n.weight.normal_(1, .3), self.n.bias.normal_(0, .1)

    def forward(self, x):
        return self.o(torch.relu(self.n(self.c(x))))


def test_batchnorm_swaps_are_checked_in_training_mode_and_say_how_it_differs():
    """swap to a BatchNorm target said exact with no word on training mode, while e.g. a frozen BatchNorm made
    nn.BatchNorm2d trains on batch statistics (0.96 of the scale off in training mode). Each swap is now run in
    training mode too: the same there (SyncBatchNorm -> BatchNorm) or said eval-only with its cause."""
    torch.manual_seed(0)
    x = torch.randn(2, 3, 8, 8)
    cases = [(FrozenBN, "batchnorm", "eval-only", ["batch-statistics"], "never does"),
             (nn.BatchNorm2d, "frozen-batchnorm", "eval-only", ["frozen-statistics"], "never updates them"),
             (nn.BatchNorm2d, "affine", "eval-only", ["fixed-affine"], "eval-mode BatchNorm"),
             (nn.BatchNorm2d, "groupnorm", "approximate", ["sample-statistics"], "group statistics"),
             (nn.SyncBatchNorm, "batchnorm", "same", None, None)]
    for norm, to, code, causes, said in cases:
        model = BNNet(norm).eval()
        new, report = normconv.swap(model, x, to=to)
        tm = report.extra["training_mode"]
        assert tm["code"] == code and tm.get("causes") == causes, (to, tm)
        # copies: a BatchNorm's training-mode forward updates its running statistics
        ref, got = _train_out(copy.deepcopy(model), x), _train_out(copy.deepcopy(new), x)
        differs = float((got - ref).abs().max())
        if code == "same":
            assert differs < 1e-6 and not any("training mode" in n for n in report.notes)
            continue
        assert differs > 1e-2 * float(ref.abs().max()) and abs(differs - tm["max_abs_error"]) < 1e-5
        assert any(said in n and "training mode" in n for n in report.notes), report.notes
        if code == "eval-only":
            model.eval(), new.eval()
            for shape in ((1, 3, 8, 8), (3, 3, 12, 10)):  # exact in eval mode, at two shapes
                y = torch.randn(shape)
                with torch.no_grad():
                    assert torch.allclose(new(y), model(y), atol=1e-5)
