"""Every rewritten model writes as a .pt (issue 31): normconv's own forwards and traces leave no state behind on
the model (caches keyed by a tracer's Proxy, hooks a library installs on its first call), and a model that cannot
pickle is refused before the work, in one line naming the attribute and the formats that work."""

from __future__ import annotations

import io

import pytest
import torch

import normconv
from normconv.io.pickled import unpicklable

from fixtures.deploy_models import OwnTracer, inline_norm_scaled
from fixtures.vision_models import cached_bias_attention

FACTORY = "tests.fixtures.vision_models:cached_bias_attention"


def test_a_cache_filled_during_capture_is_not_left_on_the_rewrite(cli, tmp_path):
    model, inputs = cached_bias_attention()
    folded, report = normconv.fold(model, inputs)
    assert sum(s.applied for s in report.sites) == 1
    attn_cache = folded.attention_bias_cache
    assert all(isinstance(k, str) and not k.startswith("Proxy") for k in attn_cache)
    assert unpicklable(folded) is None
    torch.save(folded, io.BytesIO())
    # the user's model is as it was given: its cache empty (normconv's forwards filled nothing)
    assert model.attention_bias_cache == {}
    code, out, err = cli("fold", FACTORY, "-o", tmp_path / "fold.pt")
    assert code == 0, err
    loaded = torch.load(tmp_path / "fold.pt", weights_only=False)
    torch.testing.assert_close(loaded(*inputs), model(*inputs), atol=1e-5, rtol=1e-5)


def test_hooks_a_library_installs_on_the_first_forward_are_not_left_behind(cli, tmp_path):
    """transformers installs its output-capturing hooks (local closures, unpicklable) on a model's first call."""
    pytest.importorskip("transformers")
    from tests.hf_tiny import tiny_segformer

    model, inputs = tiny_segformer()
    folded, report = normconv.fold(model, inputs)
    assert any(s.applied for s in report.sites)  # the decode head's BatchNorm
    assert unpicklable(model) is None and unpicklable(folded) is None
    torch.save(folded, io.BytesIO())
    code, out, err = cli("fold", "tests.hf_tiny:tiny_segformer", "-o", tmp_path / "seg.pt")
    assert code == 0, err
    loaded = torch.load(tmp_path / "seg.pt", weights_only=False)
    torch.testing.assert_close(loaded(*inputs.args).logits, model(*inputs.args).logits, atol=1e-4, rtol=1e-4)


class _Unpicklable(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = torch.nn.Conv2d(3, 4, 3)
        self.bn = torch.nn.BatchNorm2d(4)
        self.conv.register_forward_hook(lambda m, a, out: None)  # a lambda: pickle cannot take it

    def forward(self, x):
        return self.bn(self.conv(x))


def unpicklable_net():
    return _Unpicklable().eval(), (torch.randn(1, 3, 8, 8),)


def test_a_model_that_does_not_pickle_is_refused_before_the_work(cli, tmp_path, monkeypatch):
    import normconv.engine.door as door

    def no_work(*a, **k):
        raise AssertionError("the passes ran before the refusal")

    monkeypatch.setattr(door, "apply_passes", no_work)
    code, out, err = cli("fold", "tests.test_outputs_pickle:unpicklable_net", "-o", tmp_path / "m.pt")
    assert code == 2
    line = err.strip()
    assert len(line.splitlines()) == 1
    assert "conv._forward_hooks" in line and "m.pt2" in line and "m.safetensors" in line
    assert not (tmp_path / "m.pt").exists()
    monkeypatch.undo()
    code, out, err = cli("fold", "tests.test_outputs_pickle:unpicklable_net", "-o", tmp_path / "m.pt2")
    assert code == 0, err


class _StatsInAList(torch.nn.Module):
    """BatchNorm statistics held in a Python list: symbolic_trace lifts them as ``_tensor_constant0/1`` onto the
    traced root (the user's model), and the graph module keeps its own reference."""

    def __init__(self):
        super().__init__()
        self.conv = torch.nn.Conv2d(3, 4, 3)
        self.stats = [torch.randn(4), torch.rand(4) + 0.5]
        self.g, self.b = torch.nn.Parameter(torch.rand(4) + 0.5), torch.nn.Parameter(torch.randn(4))

    def forward(self, x):
        return torch.nn.functional.batch_norm(self.conv(x), self.stats[0], self.stats[1], self.g, self.b, False, 0.1,
                                              1e-5)


def test_constants_a_trace_lifts_are_read_from_the_graph_and_not_left_on_the_model():
    torch.manual_seed(0)
    model, x = _StatsInAList().eval(), torch.randn(1, 3, 8, 8)
    folded, report = normconv.fold(model, (x,), method="symbolic_trace")
    assert [(s.target, s.applied) for s in report.sites] == [("batch_norm", True)]
    assert not [k for k in vars(model) if k.startswith("_tensor_constant")]
    torch.testing.assert_close(folded(x), model(x), atol=1e-5, rtol=1e-5)


_FRESH_LOAD = r"""
import sys
sys.modules["normconv"] = None
import torch
m = torch.load(sys.argv[1], weights_only=False)
x = torch.randn(2, 4, 16)
y = m(x)
m.scale.fill_(3.0)  # the buffer is still read by the code (not frozen into a constant on reload)
print(type(m).__name__, torch.allclose(m(x), y * 1.5))
torch.save(m, sys.argv[1] + ".again")  # and it saves again
"""


def test_a_graph_module_pt_loads_with_torch_alone(cli, tmp_path):
    """A canonicalized inline norm makes the output a GraphModule: its pickle names no normconv class (the tracer
    that traced it is written as torch's), and it loads in a fresh interpreter where normconv cannot be imported."""
    import pickletools
    import subprocess
    import sys
    import zipfile

    out = tmp_path / "inl.pt"
    code, _, err = cli("canonicalize", "tests.fixtures.deploy_models:inline_norm_scaled", "-o", out)
    assert code == 0, err
    data = zipfile.ZipFile(out).read(next(n for n in zipfile.ZipFile(out).namelist() if n.endswith("data.pkl")))
    names = [arg for op, arg, _ in pickletools.genops(data) if op.name == "GLOBAL"]
    assert not [n for n in names if n.startswith("normconv")], names
    r = subprocess.run([sys.executable, "-I", "-c", _FRESH_LOAD, str(out)], capture_output=True, text=True,
                       cwd=str(tmp_path), timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    assert r.stdout.split() == ["GraphModule", "True"]
    # what the report's load note says torch.load imports agrees: torch alone for normconv's tracer, while a
    # GraphModule traced by a tracer class of the user's own names the package holding it
    from normconv.io.pickled import load_needs

    model, inputs = inline_norm_scaled()
    canon, _ = normconv.canonicalize(model, inputs)
    assert isinstance(canon, torch.fx.GraphModule) and load_needs(canon) == []
    own = torch.fx.GraphModule(model, OwnTracer().trace(model))
    assert load_needs(own) == ["fixtures"]
