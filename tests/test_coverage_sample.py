"""A fixed, diverse sample of the coverage sweep (benchmarks/coverage_transformers.py): tiny configs built the sweep's way, the
verdicts checked the sweep's way, outside normconv.

- inspect: every norm module a forward hook sees is a site, and no module site is one no hook saw;
- exact rewrites (fold / swap / canonicalize): the result matches the original on inputs of a second shape;
- export: the ONNX in onnxruntime matches torch.

One or two commands per type keep the whole file to a few minutes on CPU (22 types).
"""

from __future__ import annotations

import importlib.util
import sys
from functools import lru_cache
from pathlib import Path

import pytest
import torch

import normconv

_PATH = Path(__file__).resolve().parents[1] / "benchmarks" / "coverage_transformers.py"


@lru_cache(maxsize=None)
def sweep():
    """benchmarks/coverage_transformers.py as a module (named so it cannot shadow the `coverage` package)."""
    spec = importlib.util.spec_from_file_location("normconv_coverage_sweep", _PATH)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod
    spec.loader.exec_module(mod)
    return mod


@lru_cache(maxsize=None)
def _maps():
    return sweep().mappings()


def tiny(mtype: str):
    """(model, inputs, second-shape inputs), the way the sweep builds them (depth-only shrink where it needs it)."""
    sw = sweep()
    gentle = mtype in GENTLE
    model, _, _ = sw.build(mtype, _maps(), gentle)
    x1 = sw.example_inputs(model, sw.BATCH, sw.SEQ, 0, 1024 if gentle else 64)
    x2 = sw.example_inputs(model, sw.BATCH2, sw.SEQ2, 1, 1024 if gentle else 64)
    assert x1 is not None and x2 is not None
    x1, x2, _, _ = sw.runnable_inputs(model, x1, x2)  # the spelling of the inputs the model takes, as in the sweep
    return model, x1, x2


# types whose tiny config does not run: the sweep falls back to shrinking depth only
GENTLE = {"levit"}

# model type -> the commands checked on it (the sweep runs all of them on every type)
SAMPLE = {
    "bert": ("inspect", "canonicalize"),
    "gpt2": ("inspect", "swap"),
    "llama": ("inspect", "export"),
    "t5": ("inspect",),
    "vit": ("swap",),
    "resnet": ("inspect", "fold"),
    "wav2vec2": ("inspect",),
    "opt": ("swap",),
    "mistral": ("inspect",),
    "convnext": ("inspect", "canonicalize"),
    "dinov2": ("swap",),  # layer scale folded into its writers
    "falcon": ("swap",),  # in-place add_ on the stream, x @ W.T linears
    "olmo": ("swap",),  # a functional LayerNorm module made native, then swapped
    "bloom": ("swap",),  # a LayerNorm writes the stream
    "levit": ("fold",),  # BatchNorm after convs and linears
    "roberta-prelayernorm": ("inspect",),  # "Norm" in the architecture's name is not a norm module
    "sew-d": ("inspect",),  # a LayerNorm on the relative position embeddings: a norm of a parameter, listed apart
    "vit_mae": ("swap",),  # random masking: the kept patches gathered into the stream, the same draws in each check
    "videomae": ("inspect",),  # a clip (B, T, C, H, W): the sweep's second spelling of pixel_values
    "paligemma": ("swap",),  # a VLM: one image token per image feature, as normconv makes them for a folder
    "qwen2_vl": ("canonicalize",),  # no whole graph (data-dependent image merge): rewritten by parts
    "gemma4_text": ("inspect",),  # per-layer config overrides keyed by layer index, shrunk with the layers
}


def check_inspect(model, x1):
    sw = sweep()
    calls, _ = sw.norm_hooks(model, x1)
    assert calls, "the sample should have norm modules"
    report = normconv.inspect(model, x1).to_json()
    sites = report["sites"]
    owners = sw.site_calls(sites)
    on_params = {w["target"] for w in report["extra"]["weight_standardizations"]}
    # a norm of a parameter no layer takes as its weight claims no fold into a conv
    assert all("no layer reads it as its weight" in w["reason"] and "conv" not in w["reason"]
               for w in report["extra"]["weight_standardizations"] if not w["consumer"])
    missed = sorted(n for n in calls if n not in owners and n not in on_params)
    false = sorted(s.get("owner") or s.get("target") for s in sites
                   if s.get("source") == "module" and (s.get("owner") or s.get("target")) not in calls)
    assert not missed, f"norm modules inspect did not report: {missed}"
    assert not false, f"module sites no hook saw: {false}"
    for name, n in calls.items():
        assert owners[name] == n or name in on_params, f"{name}: {owners[name]} site calls, {n} hooked calls"


def check_rewrite(command, model, x1, x2):
    sw = sweep()
    fn = {"fold": normconv.fold, "swap": normconv.swap, "canonicalize": normconv.canonicalize}[command]
    new, report = fn(model, x1)
    assert report.passed
    ok, err = sw.close(sw.forward(model, x2), sw.forward(new, x2))
    assert ok, f"{command}: second shape differs (max abs {err:.3g})"
    if command in ("fold", "swap"):
        assert any(getattr(s, "applied", False) for s in report.sites), f"{command} applied nowhere"


def check_export(model, x1, tmp_path):
    sw = sweep()
    sites = normconv.inspect(model, x1).to_json()["sites"]
    per_opset = sw.export_verdicts(model, x1, sw.forward(model, x1), sites, lambda fn: fn())
    assert set(per_opset) == {17, 20, 23}
    assert all(v[0] == "ok" for v in per_opset.values()), per_opset
    assert all(f"fused {len(sites)} of {len(sites)} norm sites" in v[1] for v in per_opset.values()), per_opset


@pytest.mark.parametrize("mtype", sorted(SAMPLE))
def test_coverage_sample(mtype, tmp_path):
    pytest.importorskip("transformers")
    model, x1, x2 = tiny(mtype)
    for command in SAMPLE[mtype]:
        if command == "inspect":
            check_inspect(model, x1)
        elif command == "export":
            check_export(model, x1, tmp_path)
        else:
            check_rewrite(command, model, x1, x2)


class _QR(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.ln = torch.nn.LayerNorm(8)

    def forward(self, x):  # plain torch.onnx.export has no ONNX function for aten.linalg_qr either
        return torch.linalg.qr(self.ln(x))[0]


class _InlineNorm(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.proj = torch.nn.Linear(8, 8)

    def forward(self, x):  # an RMSNorm written inline whose mean square is read outside it too: exported unfused
        h = self.proj(x)
        ms = h.pow(2).mean(-1, keepdim=True)
        return h * torch.rsqrt(ms + 1e-6) + x + ms


def test_export_verdict_excuses_only_what_plain_export_fails_too():
    sw = sweep()
    x = {"x": torch.randn(2, 3, 8)}
    per_opset = sw.export_verdicts(_QR().eval(), x, sw.forward(_QR().eval(), x), None, lambda fn: fn())
    assert all(v[0] == "n/a" and "plain torch.onnx.export fails too" in v[1] and "aten.linalg_qr" in v[1]
               for v in per_opset.values()), per_opset
    assert sw.export_verdict(per_opset)[0] == "n/a"
    model = _InlineNorm().eval()
    sites = normconv.inspect(model, x).to_json()["sites"]
    assert len(sites) == 1
    per_opset = sw.export_verdicts(model, x, sw.forward(model, x), sites, lambda fn: fn())
    assert all(v == ("failed", "fused 0 of 1 norm sites") for v in per_opset.values()), per_opset
    assert sw.export_verdict({17: ("ok", "a"), 20: ("n/a", "b"), 23: per_opset[23]}) == \
        ("failed", "opset 23: fused 0 of 1 norm sites (ok at 17)")


def test_fused_count_takes_dead_calls_per_call(tmp_path):
    """A module with one live and one dead call (PegasusX's shared final_layer_norm): one fused op is wanted."""
    import torch.nn as nn

    class SharedNormOneCallDead(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc, self.ln, self.other = nn.Linear(16, 16), nn.LayerNorm(16), nn.LayerNorm(16)

        def forward(self, x):
            dropped = self.ln(x + 1.0)  # noqa: F841 - computed, never read
            return self.other(self.ln(self.fc(x)))

    torch.manual_seed(0)
    model, x = SharedNormOneCallDead().eval(), torch.randn(2, 5, 16)
    path = str(tmp_path / "m.onnx")
    normconv.export(model, (x,), path, opset=17)
    sites = normconv.inspect(model, (x,)).to_json()["sites"]
    ok, why = sweep().fused_vs_sites(path, sites)
    assert ok and why.startswith("fused 2 of 2"), why


def test_a_norm_of_a_parameter_is_a_site_and_exports_as_its_norm_op(tmp_path):
    """SEW-D's and DeBERTa-v2's LayerNorm on their relative position embeddings: a norm that runs on every forward,
    of a table no layer takes as its weight, so a site (placed on-parameter; the sweep's hooks count it), not a
    weight standardization; exported as a LayerNormalization on a constant, counted once."""
    import torch.nn as nn

    class NormedTable(nn.Module):
        def __init__(self):
            super().__init__()
            self.table, self.table_norm = nn.Parameter(torch.randn(16, 16)), nn.LayerNorm(16)
            self.ln = nn.LayerNorm(16)

        def forward(self, x):
            return self.ln(x) @ self.table_norm(self.table)

    torch.manual_seed(0)
    model, x = NormedTable().eval(), torch.randn(2, 5, 16)
    path = str(tmp_path / "m.onnx")
    normconv.export(model, (x,), path, opset=17)
    report = normconv.inspect(model, (x,)).to_json()
    assert report["extra"]["weight_standardizations"] == []
    assert [(s["target"], s["placement"]) for s in report["sites"]] == [("ln", "input"), ("table_norm", "on-parameter")]
    ok, why = sweep().fused_vs_sites(path, report["sites"])
    assert ok and why == "fused 2 of 2 norm sites", why
    ok, why = sweep().fused_vs_sites(path, report["sites"][:1])
    assert not ok  # one more norm op than the sites listed is not a pass
