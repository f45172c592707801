"""A model no method captures whole (its own forward leaves torch; a VLM's data-dependent merge of image features
does the same to torch.export) is rewritten by parts: fold, canonicalize and swap run on each submodule captured alone, the whole
rewritten model is verified against the original, and the report says what was done by parts. Passes whose proof
needs the whole graph (rotate, deepnorm) still refuse, naming the capture failure."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn as nn

import normconv
from normconv.errors import NormconvError

from fold_helpers import randomize_bn


class HandLayerNorm(nn.Module):
    """A LayerNorm as users write it."""

    def __init__(self, d: int, eps: float = 1e-5):
        super().__init__()
        self.weight, self.bias, self.eps = nn.Parameter(torch.rand(d) + 0.5), nn.Parameter(torch.randn(d)), eps

    def forward(self, x):
        mu = x.mean(-1, keepdim=True)
        var = ((x - mu) ** 2).mean(-1, keepdim=True)
        return (x - mu) / torch.sqrt(var + self.eps) * self.weight + self.bias


class PreLNStack(nn.Module):
    """A pre-LN stack whose stream starts at its own embedding (exact to swap within it)."""

    def __init__(self, vocab: int = 50, d: int = 16):
        super().__init__()
        self.embed = nn.Embedding(vocab, d)
        self.ln1, self.fc1 = nn.LayerNorm(d), nn.Linear(d, d)
        self.ln_f, self.head = nn.LayerNorm(d), nn.Linear(d, 4)

    def forward(self, ids):
        h = self.embed(ids)
        h = h + self.fc1(self.ln1(h))
        return self.head(self.ln_f(h))


class Branchy(nn.Module):
    """conv -> BN -> hand-written LN over the channels, and a pre-LN stack; the top forward computes with numpy."""

    def __init__(self):
        super().__init__()
        self.vision = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU())
        self.norm = HandLayerNorm(8)
        self.text = PreLNStack()

    def forward(self, image, ids):
        v = self.norm(self.vision(image).mean((2, 3)))
        t = self.text(ids)
        scale = float(np.abs(v.detach().numpy()).max())  # numpy: neither symbolic_trace nor torch.export takes it
        return t + v[:, :4].unsqueeze(1) / scale


def branchy():
    torch.manual_seed(0)
    model = Branchy()
    randomize_bn(model)
    g = torch.Generator().manual_seed(1)
    return model.eval(), (torch.randn(2, 3, 8, 8, generator=g), torch.randint(0, 50, (2, 7), generator=g))


def _state(model):
    return {k: v.clone() for k, v in model.state_dict().items()}


def _note(report):
    return next(n for n in report.notes if "rewritten by parts" in n)


def test_fold_by_parts_folds_the_bn_and_verifies_the_whole_model():
    model, x = branchy()
    before = _state(model)
    folded, report = normconv.fold(model, x)
    assert report.passed and report.validation[0].max_abs_error < 1e-5
    assert not any(isinstance(m, nn.BatchNorm2d) for m in folded.modules())
    assert [s.target for s in report.sites if s.applied] == ["vision.1"]  # named as in the whole model
    assert "vision" in _note(report) and "the model" in _note(report)  # what ran alone, and what did not
    with torch.no_grad():
        other = (torch.randn(3, 3, 8, 8), torch.randint(0, 50, (3, 5)))
        torch.testing.assert_close(folded(*other), model(*other), atol=1e-5, rtol=1e-4)
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())  # the user's model untouched


def test_the_whole_model_is_tried_once_however_many_passes_modify_it(monkeypatch):
    """fold runs several passes, each modifying the model; the whole model's capture failed before the first, and
    is not tried again before the next (a detector's failed draft_export costs minutes each time)."""
    from normconv.engine import run as engine_run

    tried = []
    real = engine_run.capture

    def counted(model, *args, **kwargs):
        tried.append(type(model).__name__)
        return real(model, *args, **kwargs)

    monkeypatch.setattr(engine_run, "capture", counted)
    model, x = branchy()
    model.vision.append(nn.Conv2d(8, 8, 1))  # a second fold-able pair: conv -> BN -> ReLU -> conv
    folded, report = normconv.fold(model, x, eval_mode=True)
    assert report.passed and len(report.validation) >= 1
    assert tried.count("Branchy") == 1, tried


class NumpyBlock(nn.Module):
    """A submodule that does not capture alone either (numpy in its own forward); its children do."""

    def __init__(self):
        super().__init__()
        self.body = nn.Sequential(nn.Conv2d(8, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU(), nn.Conv2d(8, 8, 1))

    def forward(self, x):
        y = self.body(x)
        return y / float(np.abs(y.detach().numpy()).max())


@pytest.fixture
def part_captures(monkeypatch):
    """The class name of every submodule captured alone (``graph.parts``), in order."""
    from normconv.graph import parts as graph_parts

    tried = []
    real = graph_parts.capture

    def counted(model, *args, **kwargs):
        tried.append(type(model).__name__)
        return real(model, *args, **kwargs)

    monkeypatch.setattr(graph_parts, "capture", counted)
    return tried


def test_a_part_that_failed_is_tried_once_however_many_passes_run(part_captures):
    """By parts, each pass captures the parts again; a submodule whose capture failed for the first pass is split
    at once for the next (a detector's RoIHeads: a failed draft_export each time), and the rewrite is the same."""
    model, x = branchy()
    model.vision.append(NumpyBlock())
    randomize_bn(model)
    tried = part_captures
    folded, report = normconv.fold(model, x, eval_mode=True)
    assert report.passed and tried.count("NumpyBlock") == 1, tried
    assert tried.count("Sequential") > 1  # the parts that captured are captured again after a pass changed them
    # vision (now holding the numpy block) is split too: its BN captured alone has no layer to fold into
    assert [(s.target, s.applied) for s in report.sites if s.pass_name == "fold"] == [
        ("vision.1", False), ("vision.3.body.1", True)]
    assert [n for n, m in folded.named_modules() if isinstance(m, nn.BatchNorm2d)] == ["vision.1"]
    with torch.no_grad():
        other = (torch.randn(3, 3, 8, 8), torch.randint(0, 50, (3, 5)))
        torch.testing.assert_close(folded(*other), model(*other), atol=1e-5, rtol=1e-4)


def test_parts_are_captured_once_while_the_passes_change_nothing(part_captures):
    """fold's first passes (weight standardization, fold through an activation) find nothing in Branchy: the parts'
    captures serve the fold pass too, as one whole capture serves every pass that leaves the model unchanged (a
    detector's parts took 15-17 s a pass); the rewrite is the same and is verified."""
    model, x = branchy()
    tried = part_captures
    folded, report = normconv.fold(model, x, eval_mode=True)
    assert report.passed and [s.target for s in report.sites if s.applied] == ["vision.1"]
    assert sorted(tried) == ["HandLayerNorm", "PreLNStack", "Sequential"], tried  # each part once, for 3 passes
    with torch.no_grad():
        other = (torch.randn(3, 3, 8, 8), torch.randint(0, 50, (3, 5)))
        torch.testing.assert_close(folded(*other), model(*other), atol=1e-5, rtol=1e-4)


def test_canonicalize_by_parts_makes_the_handwritten_norm_native():
    model, x = branchy()
    new, report = normconv.canonicalize(model, x)
    assert report.passed and isinstance(new.norm, nn.LayerNorm)
    site = next(s for s in report.sites if s.applied)
    assert site.target == "norm" and "the whole module (HandLayerNorm" in site.reason  # the part was the norm
    assert isinstance(model.norm, HandLayerNorm)


def test_swap_by_parts_swaps_the_stream_a_part_holds_whole():
    model, x = branchy()
    before = _state(model)
    new, report = normconv.swap(model, x, partial=True)
    # the embedding and linears are centered in the copy: the user's tensors keep their values
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    assert not any("_normconv_owned_ids" in m.__dict__ for m in new.modules())  # no bookkeeping left in the result
    assert report.passed and report.validation[0].max_abs_error < 1e-5
    assert isinstance(new.text.ln1, nn.RMSNorm) and isinstance(new.text.ln_f, nn.RMSNorm)
    assert report.extra["swapped"] == 2
    assert {"text.ln1", "text.ln_f"} <= {s.target for s in report.sites if s.applied}


def test_swap_by_parts_refuses_a_stream_entering_the_part():
    """The hand LN (canonicalized to a LayerNorm) reads a value its part takes as an input: its writers are
    outside every graph, so an exact swap refuses, naming the part."""
    model, x = branchy()
    with pytest.raises(NormconvError, match=r"^in norm \(captured alone: the whole model cannot be\): swap: .* "
                                             r"the module itself: the stream starts at the model input"):
        normconv.swap(model, x)


@pytest.mark.parametrize("command", ["rotate", "deepnorm"])
def test_whole_graph_passes_still_refuse(command):
    model, x = branchy()
    with pytest.raises(NormconvError, match="^cannot capture a graph of Branchy"):  # not "the swap refused"
        getattr(normconv, command)(model, x)


def test_cli_fold_by_parts(cli, tmp_path):
    out = tmp_path / "folded.pt"
    code, stdout, stderr = cli("fold", "test_rewrite_by_parts:branchy", "-o", str(out), "--json")
    assert code == 0, stderr
    assert "rewritten by parts" in stdout and out.exists()


def test_cli_pt2_of_a_model_export_cannot_take_is_one_line(cli, tmp_path):
    out = tmp_path / "folded.pt2"
    code, _, err = cli("fold", "test_rewrite_by_parts:branchy", "-o", str(out))
    assert code == 2 and len(err.strip().splitlines()) == 1  # no graph dump from the failed torch.export
    assert err.startswith(f"error: cannot write {out}") and "write -o folded.pt (torch.load) instead" in err
    assert not out.exists() and not list(tmp_path.iterdir())  # nothing written, no temp file left


def test_a_pt2_of_a_model_rewritten_by_parts_is_refused_before_the_work_with_torch_export_s_reason(tmp_path):
    """A .pt2 is torch.export of the whole model: the whole does not capture, so the command refuses right after
    the capture (no part captured, no pass run), with torch.export's own failure, naming the .pt that works."""
    from normconv.api import _loaded
    from normconv.engine.door import rewrite
    from normconv.errors import Code
    from normconv.options import Options
    from normconv.passes.fold_batchnorm import FoldBatchNorm

    model, x = branchy()
    ran = []

    class Spy(FoldBatchNorm):
        def __call__(self, m, cap):
            ran.append(1)
            return super().__call__(m, cap)

    with pytest.raises(NormconvError) as err:
        rewrite(_loaded(model, x), [Spy()], Options(output=str(tmp_path / "m.pt2")), command="fold")
    msg = err.value.message
    assert err.value.code is Code.REFUSED and "-o m.pt " in msg and "torch.export cannot take Branchy whole" in msg
    assert "symbolic_trace" not in msg  # torch.export's reason, not the first method's
    assert not ran and not list(tmp_path.iterdir())
    report, _ = rewrite(_loaded(model, x), [Spy()], Options(output=str(tmp_path / "m.pt")), command="fold")
    assert report.passed and ran and (tmp_path / "m.pt").is_file()


def test_a_pass_that_broke_the_model_is_named_not_the_users_inputs():
    """By parts, each pass records the submodules' inputs with one eager forward of the model as rewritten so far.
    Where an earlier pass left a model that fails, that forward named the user's example inputs ('the model
    rejected its example inputs', a user error, exit 2); it names the pass (a normconv bug, exit 3)."""
    from normconv.engine.run import apply_passes
    from normconv.passes import fold_batchnorm
    from normconv.passes.base import Check, Pass, replace_module
    from normconv.report import PassResult
    from normconv.verify import Inputs

    class Broken(nn.Module):
        def forward(self, x):
            raise ValueError("broken by the pass")

    class Breaker(Pass):
        name, check, by_parts = "breaker", Check.EXACT, True

        def plan(self, cap, norms):
            return []

        def __call__(self, model, cap):
            found = "1" in dict(model.named_children()) and isinstance(model.get_submodule("1"), nn.BatchNorm2d)
            if found:
                replace_module(model, "1", Broken())
            return PassResult(model, found, ())

    model, x = branchy()
    with pytest.raises(RuntimeError, match="as breaker rewrote it fails on its example inputs"):
        apply_passes(model, Inputs(x), [Breaker(), fold_batchnorm.FOLD], by_parts=True)
