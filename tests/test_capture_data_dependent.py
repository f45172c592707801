"""A model whose forward branches on tensor values (FSMT's `if not padding_mask.any()`, EoMT) has no symbolic
torch.export graph: normconv captures it with torch.export.draft_export (branches taken as on the example inputs),
says so, analyzes and rewrites it (verified on the model itself), and never exports that specialized graph."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn

import normconv
from normconv.errors import NormconvError
from normconv.verify import Inputs


class PaddingBranch(nn.Module):
    """ids -> Embedding -> Linear -> (pad rows zeroed if any id is the pad id) -> LayerNorm -> head: the branch reads
    the ids' values."""

    def __init__(self):
        super().__init__()
        self.emb, self.fc, self.norm, self.head = nn.Embedding(16, 8), nn.Linear(8, 8), nn.LayerNorm(8), nn.Linear(8, 3)
        with torch.no_grad():
            self.norm.weight.normal_(1.0, 0.3)
            self.norm.bias.normal_()

    def forward(self, input_ids):
        h = self.fc(self.emb(input_ids))
        if (input_ids == 0).any():  # a Python branch on values: torch.export cannot guard on it
            h = h * (input_ids != 0).unsqueeze(-1)
        return self.head(self.norm(h))


def _inputs(seed=0, shape=(2, 5)):
    g = torch.Generator().manual_seed(seed)
    return Inputs((), {"input_ids": torch.randint(1, 16, shape, generator=g)})


def test_inspect_captures_with_draft_export_and_says_so():
    torch.manual_seed(0)
    with pytest.raises(Exception, match="data-dependent"):  # the premise: plain torch.export fails here
        torch.export.export(PaddingBranch(), (), _inputs().kwargs, strict=False)
    report = normconv.inspect(PaddingBranch(), _inputs()).to_json()
    assert [(s["kind"], s["target"]) for s in report["sites"]] == [("layernorm", "norm")]
    assert "draft_export" in report["extra"]["capture_failures"]["torch.export"]


def test_rewrite_of_a_draft_captured_model_is_verified_on_the_model():
    torch.manual_seed(0)
    model = PaddingBranch().eval()
    # the branch is in the model's own forward and the swap centers fc: unproven for the other branch (issue 27),
    # so it takes --accept-specialized, and the report says so
    with pytest.raises(NormconvError, match="specialized a branch on tensor values"):
        normconv.swap(model, _inputs())
    new, report = normconv.swap(model, _inputs(), accept_specialized=True)  # a Linear writes, a Linear reads: exact
    assert report.passed and isinstance(new.norm, nn.RMSNorm)
    assert report.extra["specialized"] and any("--accept-specialized" in n for n in report.notes)
    x2 = {"input_ids": torch.tensor([[0, 3, 5, 0], [1, 2, 0, 9]])}  # pad ids: the other branch
    with torch.no_grad():
        assert torch.allclose(new(**x2), model(**x2), atol=1e-5)


def test_export_never_uses_the_specialized_graph(tmp_path):
    torch.manual_seed(0)
    with pytest.raises(NormconvError):
        normconv.export(PaddingBranch().eval(), _inputs(), str(tmp_path / "m.onnx"))
    assert not list(tmp_path.iterdir())


class MaskedRows(nn.Module):
    """Higgs Audio V2: a norm applied to the rows a boolean mask selects (a size torch.export knows as u0)."""

    def __init__(self):
        super().__init__()
        self.fc, self.norm = nn.Linear(8, 8), nn.LayerNorm(8)

    def forward(self, hidden_states, mask):
        h = self.fc(hidden_states)
        return h.masked_scatter(mask.unsqueeze(-1), self.norm(h[mask]))


def test_a_norm_on_a_value_dependent_size_is_found():
    torch.manual_seed(0)
    inputs = Inputs((), {"hidden_states": torch.randn(2, 5, 8), "mask": torch.rand(2, 5) > 0.5})
    report = normconv.inspect(MaskedRows().eval(), inputs).to_json()
    assert [(s["target"], s["kind"], s["normalized_shape"]) for s in report["sites"]] == [("norm", "layernorm", [8])]


def test_a_draft_graph_that_is_not_the_eager_computation_is_refused():
    # draft_export may take a data-dependent branch otherwise than eager (LightGlue: its no-keypoint early return,
    # so no norm is in the graph); the capture checks the graph against the eager output on the example inputs
    from normconv.graph.capture import _check_draft

    torch.manual_seed(0)
    model, other = PaddingBranch().eval(), PaddingBranch().eval()  # the same code, other weights
    inputs = Inputs((), {"input_ids": torch.tensor([[0, 3, 4, 5, 6], [7, 8, 0, 9, 1]])})
    ep = torch.export.draft_export(other, (), inputs.kwargs, strict=False)
    _check_draft(other, ep, inputs)  # its own graph: the eager output
    with pytest.raises(NormconvError, match="draft_export's graph is not the model's computation on these inputs"):
        _check_draft(model, ep, inputs)


def test_a_pt2_that_torch_export_cannot_make_is_refused_before_the_work(tmp_path):
    """A .pt2 is torch.export of the whole rewritten model: where torch.export cannot take the model whole (a
    branch on values), the command refuses as soon as the capture shows it, naming the .pt that works, and runs
    no pass (issue 31: a detector's fold spent minutes before failing at the write)."""
    from normconv.api import _loaded
    from normconv.engine.door import rewrite
    from normconv.errors import Code
    from normconv.options import Options
    from normconv.passes import swap_norm

    torch.manual_seed(0)
    model = PaddingBranch().eval()
    ran = []

    class Spy(swap_norm.SwapPass):
        def __call__(self, model, cap):
            ran.append(1)
            return super().__call__(model, cap)

    out = tmp_path / "m.pt2"
    with pytest.raises(NormconvError) as err:
        rewrite(_loaded(model, _inputs()), [Spy()], Options(output=str(out), accept_specialized=True),
                command="swap")
    assert err.value.code is Code.REFUSED and "-o m.pt" in err.value.message and "torch.export" in err.value.message
    assert not ran and not list(tmp_path.iterdir())
    report, _ = rewrite(_loaded(model, _inputs()), [Spy()],
                        Options(output=str(tmp_path / "m.pt"), accept_specialized=True), command="swap")
    assert report.passed and (tmp_path / "m.pt").is_file()  # the format that works still writes


def test_a_model_no_method_captures_raises_capture_error_with_each_method_s_reason():
    # the error carries each method's own failure as data (a .pt2 names torch.export's), not as an ad hoc attribute
    from normconv.errors import CaptureError, Code
    from normconv.graph.capture import capture

    class Opaque(nn.Module):
        def __init__(self):
            super().__init__()
            self.norm = nn.LayerNorm(4)

        def forward(self, x):
            if float(x.sum()) > 0:  # a Python branch on a value: no symbolic trace, no export
                x = x.tolist()
                return self.norm(torch.tensor(x))
            return self.norm(x)

    with pytest.raises(CaptureError) as info:
        capture(Opaque(), Inputs((torch.ones(2, 4),)))
    err = info.value
    assert err.code is Code.CANNOT_CAPTURE and isinstance(err, NormconvError)
    assert "torch.export" in err.attempts and all(isinstance(v, str) and v for v in err.attempts.values())
