"""A fixed, diverse sample of the coverage sweep (benchmarks/coverage.py): tiny configs built the sweep's way, the
verdicts checked the sweep's way, outside normconv.

- inspect: every norm module a forward hook sees is a site, and no module site is one no hook saw;
- exact rewrites (fold / swap / canonicalize): the result matches the original on inputs of a second shape;
- export: the ONNX in onnxruntime matches torch.

One or two commands per type keep the whole file to about two minutes on CPU (15 types).
"""

from __future__ import annotations

import importlib.util
import sys
from functools import lru_cache
from pathlib import Path

import pytest
import torch

import normconv

_PATH = Path(__file__).resolve().parents[1] / "benchmarks" / "coverage.py"


@lru_cache(maxsize=None)
def sweep():
    """benchmarks/coverage.py as a module (named so it cannot shadow the `coverage` package)."""
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
}


def check_inspect(model, x1):
    sw = sweep()
    calls, _ = sw.norm_hooks(model, x1)
    assert calls, "the sample should have norm modules"
    sites = normconv.inspect(model, x1).to_json()["sites"]
    owners = sw.site_calls(sites)
    missed = sorted(n for n in calls if n not in owners)
    false = sorted(s.get("owner") or s.get("target") for s in sites
                   if s.get("source") == "module" and (s.get("owner") or s.get("target")) not in calls)
    assert not missed, f"norm modules inspect did not report: {missed}"
    assert not false, f"module sites no hook saw: {false}"
    for name, n in calls.items():
        assert owners[name] == n, f"{name}: {owners[name]} site calls, {n} hooked calls"


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
    import onnxruntime as ort

    sw = sweep()
    path = tmp_path / "m.onnx"
    normconv.export(model, x1, str(path), opset=sw.OPSET, baseline=False, repeats=1)
    sess = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    feeds = {}
    for i in sess.get_inputs():
        feeds[i.name] = x1[i.name].numpy() if i.name in x1 else torch.ones_like(x1["input_ids"]).numpy()
    outs = sess.run(None, feeds)
    ref = sw.forward(model, x1)
    n = min(len(outs), len(ref))
    ok, err = sw.close(ref[:n], [torch.from_numpy(o) for o in outs[:n]], atol=1e-3, rtol=1e-3)
    assert ok, f"onnxruntime differs from torch (max abs {err:.3g})"


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
