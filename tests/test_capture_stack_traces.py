"""torch.export's per-node Python stacks: a capture records none unless asked (the analysis reads none of them, and
recording them is a seventh of a GPT-2 capture); an ONNX export, which reuses its capture, asks, so its nodes keep
their source lines; torch.fx's setting is restored after, whatever the capture did."""

from __future__ import annotations

import onnx
import pytest
import torch
import torch.fx as fx
import torch.nn as nn

from normconv.errors import NormconvError
from normconv.graph.capture import capture
from normconv.verify import Inputs


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.norm, self.fc = nn.LayerNorm(8), nn.Linear(8, 8)

    def forward(self, x):
        return self.fc(self.norm(x)) + x


def _traced(cap) -> list[str]:
    return [n.meta.get("stack_trace") or "" for n in cap.gm.graph.nodes if n.op == "call_function"]


def test_a_capture_records_no_stack_unless_asked():
    inputs = Inputs((torch.randn(2, 3, 8),))
    plain = capture(Block(), inputs, "torch.export")
    kept = capture(Block(), inputs, "torch.export", stack_traces=True)
    assert _traced(plain) and not any(_traced(plain))
    assert all("self.norm(x)" in t or "self.fc(" in t for t in _traced(kept) if "layer_norm" in t or "linear" in t)
    assert any("test_capture_stack_traces.py" in t for t in _traced(kept))
    assert fx.config.do_not_emit_stack_traces is False


def test_the_setting_is_restored_when_the_capture_fails():
    class Broken(nn.Module):
        def forward(self, x):
            raise RuntimeError("no graph here")

    with pytest.raises(NormconvError):
        capture(Broken(), Inputs((torch.randn(2, 8),)), "torch.export")
    assert fx.config.do_not_emit_stack_traces is False


def test_an_exported_onnx_file_keeps_its_nodes_source_lines(tmp_path):
    from normconv.api import export

    out = tmp_path / "b.onnx"
    # keyword inputs: captured by torch.export, whose program the static export reuses
    export(Block(), {"x": torch.randn(2, 3, 8)}, str(out), static=True)
    props = [{p.key: p.value for p in n.metadata_props} for n in onnx.load(str(out)).graph.node]
    traces = [p.get("pkg.torch.onnx.stack_trace", "") for p in props]
    assert any("test_capture_stack_traces.py" in t for t in traces)


def test_a_capture_writes_its_graph_code_once_at_most(monkeypatch):
    """torch.export builds and rebuilds GraphModules on the way to one program; each wrote its Python code when
    made (6 code generations for a tiny block, as for GPT-2). Made lazily, the code is written when first run."""
    made = []
    python_code = fx.Graph.python_code
    monkeypatch.setattr(fx.Graph, "python_code", lambda self, *a, **k: made.append(1) or python_code(self, *a, **k))
    cap = capture(Block(), Inputs((torch.randn(2, 3, 8),)), "torch.export")
    assert len(made) <= 1
    x = torch.randn(2, 3, 8)  # the program still computes what the block does, on fresh values
    torch.testing.assert_close(cap.exported.module()(x), cap.model(x))
