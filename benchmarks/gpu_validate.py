"""`normconv export --validate cpu,cuda` over every zoo model and the tiny Hugging Face models the tests use.

Matrix: model x opset (17, 20, 23) x target (onnx, ort) x dtype (float32, float16), --device cuda (so --target ort
fuses residual add + norm into Skip*LayerNormalization); each cell is one call of the
Python API (what the CLI runs), validated on onnxruntime CPU and CUDA at both optimization levels. A cell is

  ok        written, every provider within tolerance
  failed    export or validation refused it; the record keeps which provider, which level and the error
  skipped   the CUDA provider was not available (then nothing here says anything about CUDA)

Needs onnxruntime-gpu and a GPU. Workers run in parallel (one torch thread each).
Run: python benchmarks/gpu_validate.py --jobs 12 --out results/gpu_validate.jsonl --md results/gpu_validate.md
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import sys
import tempfile
import time
import traceback
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
OPSETS = (17, 20, 23)
TARGETS = ("onnx", "ort")
DTYPES = ("float32", "float16")


def models() -> list[str]:
    sys.path.insert(0, str(ROOT))
    from normconv.models import ZOO
    from tests import hf_tiny

    return [f"zoo:{n}" for n in ZOO] + [f"hf:{n}" for n in dir(hf_tiny) if n.startswith("tiny_")]


def build(name: str):
    from normconv.verify import Inputs

    kind, _, rest = name.partition(":")
    if kind == "zoo":
        from normconv.models import ZOO

        z = ZOO[rest]
        return z.build().eval(), Inputs(tuple(z.example_inputs()))
    from tests import hf_tiny

    return getattr(hf_tiny, rest)()


def cell(args: tuple[str, int, str, str]) -> dict:
    name, opset, target, dtype = args
    import torch

    import normconv
    from normconv.errors import NormconvError, VerificationError

    torch.set_num_threads(1)
    rec = {"model": name, "opset": opset, "target": target, "dtype": dtype}
    t0 = time.perf_counter()
    try:
        model, inputs = build(name)
        with tempfile.TemporaryDirectory() as tmp:
            report = normconv.export(model, inputs, str(Path(tmp) / "m.onnx"), target, opset,
                                     validate=("cpu", "cuda"), repeats=3, device="cuda",
                                     dtype=None if dtype == "float32" else getattr(torch, dtype))
        rec["status"] = "ok"
    except VerificationError as exc:
        report = exc.report
        rec["status"], rec["error"] = "failed", str(exc)
    except NormconvError as exc:
        report = None
        rec["status"], rec["error"] = "failed", str(exc)
    except Exception as exc:  # a crash is a finding too
        report = None
        rec["status"], rec["error"] = "crashed", f"{type(exc).__name__}: {exc}"
        rec["traceback"] = traceback.format_exc()[-2000:]
    rec["seconds"] = round(time.perf_counter() - t0, 2)
    if report is not None:
        rec["ort"] = report.extra.get("ort", [])
        rec["notes"] = [n for n in report.notes if "not validated" in n]
        rec["fused"] = report.extra.get("fused_norm_ops")
        if rec["status"] == "ok" and not any(r["provider"] == "cuda" for r in rec["ort"]):
            rec["status"] = "skipped"
    return rec


def summary(records: list[dict]) -> str:
    lines = ["| model | cells | ok | failed | worst CUDA max abs error (fp32 / fp16) | CUDA latency ms, fp16 ort op20 |",
             "|---|---|---|---|---|---|"]
    by_model: dict[str, list[dict]] = {}
    for r in records:
        by_model.setdefault(r["model"], []).append(r)
    for name, rs in by_model.items():
        def worst(dt):
            errs = [o["max_abs_error"] for r in rs if r["dtype"] == dt for o in r.get("ort", [])
                    if o["provider"] == "cuda" and o["max_abs_error"] is not None]
            return f"{max(errs):.2g}" if errs else "-"
        lat = [o["latency_ms"] for r in rs if (r["dtype"], r["target"], r["opset"]) == ("float16", "ort", 20)
               for o in r.get("ort", []) if o["provider"] == "cuda" and o.get("latency_ms")]
        ok = sum(r["status"] == "ok" for r in rs)
        lines.append(f"| {name} | {len(rs)} | {ok} | {len(rs) - ok} | {worst('float32')} / {worst('float16')} | "
                     f"{lat[0]:.3f} |" if lat else
                     f"| {name} | {len(rs)} | {ok} | {len(rs) - ok} | {worst('float32')} / {worst('float16')} | - |")
    bad = [r for r in records if r["status"] != "ok"]
    if bad:
        lines += ["", "Not ok:", ""]
        lines += [f"- {r['model']} opset {r['opset']} {r['target']} {r['dtype']}: {r['status']}: "
                  f"{r.get('error', '')[:300]}" for r in bad]
    return "\n".join(lines) + "\n"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--jobs", type=int, default=4)
    ap.add_argument("--only", default="", help="comma separated model names (zoo:gpt, hf:tiny_llama)")
    ap.add_argument("--out", default="gpu_validate.jsonl")
    ap.add_argument("--md", default="gpu_validate.md")
    a = ap.parse_args()
    names = [n for n in models() if not a.only or n in a.only.split(",")]
    cells = [(n, o, t, d) for n in names for d in DTYPES for t in TARGETS for o in OPSETS]
    records = []
    t0 = time.perf_counter()
    with mp.get_context("spawn").Pool(a.jobs, maxtasksperchild=8) as pool, open(a.out, "w") as f:
        for rec in pool.imap_unordered(cell, cells):
            records.append(rec)
            f.write(json.dumps(rec) + "\n")
            f.flush()
            print(f"{len(records)}/{len(cells)} {rec['model']} {rec['opset']} {rec['target']} {rec['dtype']}: "
                  f"{rec['status']} ({rec['seconds']} s) {rec.get('error', '')[:160]}", flush=True)
    records.sort(key=lambda r: (r["model"], r["dtype"], r["target"], r["opset"]))
    text = summary(records)
    Path(a.md).write_text(f"{len(cells)} cells in {time.perf_counter() - t0:.0f} s\n\n" + text)
    print(text)


if __name__ == "__main__":
    main()
