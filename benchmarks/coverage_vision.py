"""Vision coverage: torchvision and timm image models (random weights) through normconv's public API.

    python benchmarks/coverage_vision.py --src tv --size 64 resnet50,mobilenet_v3_small,...
    python benchmarks/coverage_vision.py --src timm --size 224 vit_tiny_patch16_224,...
    python benchmarks/coverage_vision.py --report-only

Neither library is a dependency of normconv: install them to run this (torchvision's PyPI wheel is CUDA-linked;
on a CPU-only machine install it with --no-deps, its models are Python). Each model is checked outside the passes,
as in benchmarks/coverage_transformers.py: the rewritten model against the original on a second batch size, the ONNX in
onnxruntime against torch, fused norm ops against inspect's sites, inspect's sites against forward hooks on the norm
modules. Zero-initialized parameters (heads, layer scales) are drawn at random (a check on zeros compares nothing),
and BatchNorm statistics are random so that folding changes the weights. One JSON line per model goes to
results/coverage_vision.jsonl; results/coverage_vision.md is the table.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import re
import signal
import sys
import tempfile
import time
import warnings
from collections import Counter
from pathlib import Path

HERE = Path(__file__).resolve().parent
CACHE = HERE / "results" / "coverage_vision.jsonl"
OUT_MD = HERE / "results" / "coverage_vision.md"
COMMANDS = ("inspect", "fold", "swap", "canonicalize", "export")


def _sweep():
    """benchmarks/coverage_transformers.py (its comparison and fused-op counting), loaded under a name that shadows nothing."""
    spec = importlib.util.spec_from_file_location("normconv_coverage_sweep", HERE / "coverage_transformers.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod
    spec.loader.exec_module(mod)
    return mod


def _alarm(*_):
    raise TimeoutError("timed out")


def _limited(fn, seconds):
    signal.signal(signal.SIGALRM, _alarm)
    signal.alarm(seconds)
    try:
        return fn()
    finally:
        signal.alarm(0)


def _first(e: BaseException) -> str:
    text = str(e).strip().splitlines()
    return f"{type(e).__name__}: {text[0][:300] if text else ''}"


def build(src: str, name: str):
    import torch

    if src == "tv":
        import torchvision

        model = torchvision.models.get_model(name, weights=None)
    else:
        import timm

        model = timm.create_model(name, pretrained=False)
    model.eval()
    torch.manual_seed(0)
    with torch.no_grad():
        for p in model.parameters():  # zero-initialized heads / layer scales: a check on zeros compares nothing
            if p.dim() >= 1 and not p.count_nonzero():
                p.normal_(0, 0.02)
        for m in model.modules():
            if isinstance(m, torch.nn.modules.batchnorm._BatchNorm) and m.running_var is not None:
                m.running_mean.normal_(0, 0.1)
                m.running_var.uniform_(0.5, 2.0)
            if isinstance(m, (torch.nn.modules.batchnorm._BatchNorm, torch.nn.LayerNorm, torch.nn.GroupNorm)) \
                    and getattr(m, "weight", None) is not None:
                m.weight.normal_(1, 0.2)
                m.bias.normal_(0, 0.1)
    return model


def _is_norm(m) -> bool:
    """torch's norm classes and their subclasses, or a class named like a norm (LayerNorm2d), not a block that only
    mentions one (Conv2dNormActivation, NormFreeBlock)."""
    import torch.nn as nn

    kinds = (nn.modules.batchnorm._NormBase, nn.LayerNorm, nn.GroupNorm, nn.RMSNorm)
    return isinstance(m, kinds) or re.search(r"Norm(\dd)?$", type(m).__name__) is not None


def norm_calls(model, x) -> Counter:
    import torch

    calls: Counter = Counter()
    # innermost only: timm's ConvNorm / LinearNorm wrap a BatchNorm, which is the norm call
    handles = [m.register_forward_hook(lambda mod, i, o, n=name: calls.update([n]))
               for name, m in model.named_modules()
               if _is_norm(m) and not any(_is_norm(c) for c in m.modules() if c is not m)]
    try:
        with torch.no_grad():
            model(x)
    finally:
        for h in handles:
            h.remove()
    return calls


def run_one(src: str, name: str, size: int, timeout: int) -> dict:
    import torch

    import normconv

    cv = _sweep()
    model = build(src, name)
    x1, x2 = torch.randn(1, 3, size, size), torch.randn(2, 3, size, size)
    rec: dict = {"src": src, "name": name, "size": size, "params": sum(p.numel() for p in model.parameters())}
    with torch.no_grad():
        ref2 = cv.flat_tensors(model(x2))
    calls = norm_calls(model, x1)
    res: dict = {}
    sites = None
    try:
        rep = _limited(lambda: normconv.inspect(model, x1), timeout).to_json()
        sites = rep["sites"]
        owners = cv.site_calls(sites)
        missed = sorted(n for n in calls if n not in owners)
        rec.update(sites=len(sites), hook_calls=sum(calls.values()), missed=missed[:5])
        res["inspect"] = ("failed", f"{len(missed)} missed (e.g. {missed[0]})") if missed else \
            ("ok", f"{len(sites)} sites")
    except Exception as e:  # noqa: BLE001 - every reason is recorded
        res["inspect"] = ("refused" if isinstance(e, normconv.NormconvError) else "failed", _first(e))

    def rewrite(fn):
        try:
            new, r = _limited(fn, timeout)
            with torch.no_grad():
                ok, err = cv.close(ref2, cv.flat_tensors(new(x2)))
            applied = sum(1 for s in r.sites if s.applied)
            return ("ok", f"{applied} applied") if ok else ("failed", f"second shape differs ({err:.3g})")
        except normconv.NormconvError as e:  # VerificationError included: the command caught it itself
            return "refused", _first(e)
        except Exception as e:  # noqa: BLE001
            return "failed", _first(e)

    res["fold"] = rewrite(lambda: normconv.fold(model, x1))
    res["swap"] = rewrite(lambda: normconv.swap(model, x1))
    res["canonicalize"] = rewrite(lambda: normconv.canonicalize(model, x1))
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "m.onnx")
        try:
            _limited(lambda: normconv.export(model, x1, path, opset=17, baseline=False, repeats=1), 2 * timeout)
            import onnxruntime as ort

            sess = ort.InferenceSession(path, providers=["CPUExecutionProvider"])
            got = sess.run(None, {sess.get_inputs()[0].name: x1.numpy()})
            with torch.no_grad():
                ok, err = cv.close(cv.flat_tensors(model(x1)), [torch.from_numpy(v) for v in got][:1],
                                   atol=1e-3, rtol=1e-3)
            fused_ok, fused = cv.fused_vs_sites(path, sites)
            res["export"] = ("ok", f"onnxruntime within {err:.3g}, {fused}") if ok and fused_ok else \
                ("failed", fused if not fused_ok else f"onnxruntime differs ({err:.3g})")
        except normconv.NormconvError as e:
            res["export"] = "refused", _first(e)
        except Exception as e:  # noqa: BLE001
            res["export"] = "failed", _first(e)
    rec["results"] = res
    return rec


def write_md(recs: list[dict]) -> None:
    totals = {c: Counter(r["results"][c][0] for r in recs if "results" in r) for c in COMMANDS}
    lines = ["# Vision coverage: torchvision and timm models through normconv", "",
             "`benchmarks/coverage_vision.py` (random weights; see its docstring). Verdicts: ok, refused (a "
             "one-line reason, nothing written), failed.", "",
             "| command | " + " | ".join(["ok", "refused", "failed"]) + " |", "|---|---|---|---|"]
    for c in COMMANDS:
        lines.append(f"| {c} | " + " | ".join(str(totals[c][k]) for k in ("ok", "refused", "failed")) + " |")
    lines += ["", "| library | model | image | " + " | ".join(COMMANDS) + " |", "|---|---|---|" + "---|" * len(COMMANDS)]
    for r in recs:
        if "results" not in r:
            lines.append(f"| {r['src']} | {r['name']} | | build failed: {r.get('error', '')[:80]} |")
            continue
        cells = []
        for c in COMMANDS:
            v, why = r["results"][c]
            cells.append(v if v == "ok" else f"{v}: {why[:110].replace('|', '/')}")
        lines.append(f"| {r['src']} | {r['name']} | {r['size']} | " + " | ".join(cells) + " |")
    OUT_MD.write_text("\n".join(lines) + "\n")


def load() -> list[dict]:
    recs: dict = {}
    if CACHE.exists():
        for line in CACHE.read_text().splitlines():
            r = json.loads(line)
            recs[(r["src"], r["name"])] = r
    return list(recs.values())


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("models", nargs="?", default="", help="comma-separated model names")
    ap.add_argument("--src", choices=("tv", "timm"), default="tv")
    ap.add_argument("--size", type=int, default=64, help="image size")
    ap.add_argument("--timeout", type=int, default=300, help="seconds per command")
    ap.add_argument("--report-only", action="store_true")
    args = ap.parse_args(argv)
    warnings.filterwarnings("ignore")
    if not args.report_only:
        CACHE.parent.mkdir(parents=True, exist_ok=True)
        for name in filter(None, args.models.split(",")):
            t = time.time()
            try:
                rec = run_one(args.src, name, args.size, args.timeout)
            except Exception as e:  # noqa: BLE001 - a model that does not build is recorded
                rec = {"src": args.src, "name": name, "size": args.size, "error": _first(e)}
            rec["seconds"] = round(time.time() - t, 1)
            with CACHE.open("a") as f:
                f.write(json.dumps(rec, default=str) + "\n")
            print(name, {c: v[0] for c, v in rec.get("results", {}).items()} or rec.get("error"), flush=True)
    write_md(load())
    return 0


if __name__ == "__main__":
    sys.exit(main())
