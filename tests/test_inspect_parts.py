"""inspect on a model no method captures whole: each submodule's graph alone, and what no graph holds named."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
import torch.nn as nn

import normconv


class HandRMSNorm(nn.Module):
    def __init__(self, dim: int):
        super().__init__()
        self.weight = nn.Parameter(torch.rand(dim) + 0.5)

    def forward(self, x):
        return self.weight * x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6)


class Block(nn.Module):
    def __init__(self, dim: int):
        super().__init__()
        self.norm = nn.LayerNorm(dim)
        self.mlp = nn.Linear(dim, dim)

    def forward(self, x):
        return x + self.mlp(self.norm(x))


class NumpyInForward(nn.Module):
    """A forward that leaves torch (numpy on the activations): neither symbolic_trace nor torch.export captures it,
    each submodule captures alone. The norm written inline in the forward itself is in no part's graph."""

    def __init__(self, dim: int = 8):
        super().__init__()
        self.proj = nn.Linear(4, dim)
        self.blocks = nn.ModuleList([Block(dim), Block(dim)])
        self.final = HandRMSNorm(dim)

    def forward(self, x):
        h = self.proj(x)
        h = h / float(np.abs(h.detach().numpy()).max())
        for block in self.blocks:
            h = block(h)
        h = self.final(h)
        return h - h.mean(-1, keepdim=True)  # not a norm; the point: code here is not in any part


def _model():
    torch.manual_seed(0)
    return NumpyInForward().eval()


def test_each_submodule_is_inspected_alone_when_the_whole_model_cannot_be():
    model = _model()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    report = normconv.inspect(model, torch.randn(2, 5, 4)).to_json()
    sites = {s["target"]: s for s in report["sites"]}
    assert list(sites) == ["blocks.0.norm", "blocks.1.norm", "final"]  # in the order the forward calls them
    assert sites["final"]["kind"] == "rmsnorm" and sites["final"]["module_type"] == "HandRMSNorm"
    assert sites["final"]["affine"]["weight"] == "final.weight"
    assert sites["blocks.0.norm"]["placement"] == "pre-norm"  # inside its part's graph the residual is seen
    assert sites["final"]["placement"] == "unknown"  # its input comes from outside its part
    ex = report["extra"]
    assert ex["capture"].startswith("parts (4 submodules captured alone")
    assert "the model (its own code between its submodules)" in ex["not_inspected"]
    # deepnorm and export need the whole graph; fold, canonicalize and swap plan on each part's own graph
    plan = {(t, p["pass"]): p for t, s in sites.items() for p in s["plan"]}
    for t in sites:
        for p in ("deepnorm", "export"):
            assert not plan[t, p]["applied"] and "whole model" in plan[t, p]["reason"]
    assert plan["final", "canonicalize"]["applied"]  # the hand-written RMSNorm, proved within its part
    assert not plan["blocks.0.norm", "swap"]["applied"] and "model input" in plan["blocks.0.norm", "swap"]["reason"]
    # the user's model is left as it was: weights, and no hook left behind
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    assert not any(m._forward_pre_hooks for m in model.modules())


def test_a_module_called_twice_counts_its_calls():
    class Twice(nn.Module):
        def __init__(self):
            super().__init__()
            self.norm = HandRMSNorm(8)

        def forward(self, x):
            x = x * float(x.detach().numpy().std())
            return self.norm(self.norm(x))

    report = normconv.inspect(Twice().eval(), torch.randn(2, 8)).to_json()
    assert [(s["target"], s["calls"]) for s in report["sites"]] == [("norm", 2)]


def test_no_part_captures_is_the_capture_error():
    class AllNumpy(nn.Module):  # no submodule to fall back on
        def forward(self, x):
            return torch.from_numpy(x.detach().numpy() * 2)

    with pytest.raises(normconv.NormconvError, match="cannot capture a graph of AllNumpy"):
        normconv.inspect(AllNumpy(), torch.randn(2, 3))


def test_cli_inspect_by_parts_names_what_it_did_not_see(cli, tmp_path):
    path = tmp_path / "numpy_model.pt"
    torch.save(_model(), path)
    code, out, err = cli("inspect", path, "--trust-pickle", "--input-shape", "x:2,5,4")
    assert code == 0, err
    text = " ".join(out.split())  # the console wraps long lines
    assert "graph by parts (4 submodules captured alone: the whole model cannot be)" in text
    assert "not inspected: the model (its own code between its submodules)" in text
    code, out, _ = cli("inspect", path, "--trust-pickle", "--input-shape", "x:2,5,4", "--json")
    assert code == 0 and len(json.loads(out)["sites"]) == 3
    # swap runs by parts, where each block's stream is its input: refused in one line, nothing written
    dest = tmp_path / "swapped.pt"
    code, _, err = cli("swap", path, "--trust-pickle", "--input-shape", "x:2,5,4", "-o", dest)
    assert code == 2 and err.startswith("error: in blocks.0 (captured alone: the whole model cannot be)")
    assert len(err.strip().splitlines()) == 1 and not dest.exists()
    # rotation needs the whole graph: the capture error, in one line
    code, _, err = cli("rotate", path, "--trust-pickle", "--input-shape", "x:2,5,4", "-o", dest)
    assert code == 2 and "cannot capture a graph of NumpyInForward" in err and not dest.exists()


def test_inputs_the_model_rejects_are_said_in_one_line():
    with pytest.raises(normconv.NormconvError, match=r"the model rejected its example inputs \(\(2, 5, 3\):float32\)"):
        normconv.inspect(_model(), torch.randn(2, 5, 3))


def test_a_part_whose_inputs_cannot_be_copied_is_split_instead():
    import threading

    class TakesALock(nn.Module):
        def __init__(self):
            super().__init__()
            self.norm = nn.LayerNorm(8)

        def forward(self, x, lock):
            with lock:
                return self.norm(x)

    class Outer(nn.Module):
        def __init__(self):
            super().__init__()
            self.inner = TakesALock()

        def forward(self, x):
            x = x * float(x.detach().numpy().std())
            return self.inner(x, threading.Lock())

    report = normconv.inspect(Outer().eval(), torch.randn(2, 8)).to_json()
    assert [s["target"] for s in report["sites"]] == ["inner.norm"]
