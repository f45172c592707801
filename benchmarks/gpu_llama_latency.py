"""CUDA whole-model latency: a Llama-style model (hidden 2048, 16 layers, seq 512, fp16) exported by normconv and by
plain torch.onnx.export, run in onnxruntime's CUDA provider with the same session options.

The model is Hugging Face's LlamaForCausalLM from a config (random weights, seed 0): 32 heads, 4 KV heads,
intermediate 5632, vocab 32000 (TinyLlama's shapes at 16 layers), no KV cache, input_ids (1, 512).
Exports run in parallel processes; then each file is timed in turn in one process:
input and logits bound on the GPU (IOBinding), 10 warm-up runs, median and p90 of the timed runs.
torch eager fp16 on CUDA is timed too, as the reference point users have today.
Run: python benchmarks/gpu_llama_latency.py --dir /tmp/llama --out results/gpu_llama.md
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import statistics
import time
from pathlib import Path

SEQ = 512
VARIANTS = {
    "normconv --target ort (default, opset 20)": ("normconv", "ort", 20, False),
    "normconv --device cuda (Skip*Norm fusion, opset 20)": ("normconv", "ort", 20, True),
    "normconv --target ort, opset 23": ("normconv", "ort", 23, False),
    "normconv --target onnx, opset 23 (RMSNormalization)": ("normconv", "onnx", 23, False),
    "plain torch.onnx.export, its default opset": ("plain", None, None, False),
    "plain torch.onnx.export, opset 23": ("plain", None, 23, False),
}


def build(layers: int = 16, hidden: int = 2048):
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=32000, hidden_size=hidden, num_hidden_layers=layers, num_attention_heads=32,
                      num_key_value_heads=4, intermediate_size=5632, max_position_embeddings=2048, use_cache=False)
    model = LlamaForCausalLM(cfg).eval()
    ids = torch.randint(0, 32000, (1, SEQ), generator=torch.Generator().manual_seed(0))
    return model, ids


def export_one(args) -> dict:
    label, path, layers, hidden = args
    import torch

    kind, target, opset, skip = VARIANTS[label]
    torch.set_num_threads(4)
    model, ids = build(layers, hidden)
    t0 = time.perf_counter()
    rec = {"variant": label, "path": path}
    try:
        if kind == "normconv":
            import normconv
            from normconv.verify import Inputs

            report = normconv.export(model, Inputs((), {"input_ids": ids}), path, target, opset,
                                     validate=("cuda",), repeats=0, skip_fusion=skip, dtype=torch.float16)
            rec["ort"] = report.extra.get("ort")
            rec["fused"] = report.extra.get("fused_norm_ops")
        else:
            kw = {} if opset is None else {"opset_version": opset}
            prog = torch.onnx.export(model.half(), (), kwargs={"input_ids": ids}, dynamo=True, verbose=False, **kw)
            prog.save(path)
        import onnx

        m = onnx.load(path, load_external_data=False)
        rec["opset"] = next(o.version for o in m.opset_import if o.domain in ("", "ai.onnx"))
        ops: dict[str, int] = {}
        for n in m.graph.node:
            ops[n.op_type] = ops.get(n.op_type, 0) + 1
        rec["ops"] = ops
        rec["nodes"] = len(m.graph.node)
    except Exception as exc:
        rec["error"] = f"{type(exc).__name__}: {str(exc)[:400]}"
    rec["export_s"] = round(time.perf_counter() - t0, 1)
    print(json.dumps({k: v for k, v in rec.items() if k != "ort"}), flush=True)
    return rec


def time_onnx(path: str, ids, runs: int) -> dict:
    import numpy as np
    import onnxruntime as ort
    import torch

    opts = ort.SessionOptions()  # the same options for every file: onnxruntime's defaults (ORT_ENABLE_ALL)
    opts.log_severity_level = 3
    sess = ort.InferenceSession(path, opts, providers=["CUDAExecutionProvider"])
    io = sess.io_binding()
    feed = {"input_ids": ids, "attention_mask": torch.ones_like(ids)}
    kept = []
    for i in sess.get_inputs():
        t = feed[i.name].cuda().contiguous()
        kept.append(t)
        io.bind_input(i.name, "cuda", 0, np.int64, list(t.shape), t.data_ptr())
    for o in sess.get_outputs():
        io.bind_output(o.name, "cuda")
    for _ in range(10):
        sess.run_with_iobinding(io)
    times = []
    for _ in range(runs):
        t0 = time.perf_counter()
        sess.run_with_iobinding(io)
        times.append(time.perf_counter() - t0)
    logits = torch.from_numpy(io.copy_outputs_to_cpu()[0].astype("float32"))
    return {"median_ms": statistics.median(times) * 1e3, "p90_ms": sorted(times)[int(0.9 * runs)] * 1e3,
            "logits": logits}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dir", type=Path, default=Path("/tmp/llama"))
    ap.add_argument("--out", type=Path, default=Path("gpu_llama.md"))
    ap.add_argument("--layers", type=int, default=16)
    ap.add_argument("--hidden", type=int, default=2048)
    ap.add_argument("--runs", type=int, default=50)
    ap.add_argument("--jobs", type=int, default=6)
    a = ap.parse_args()
    a.dir.mkdir(parents=True, exist_ok=True)
    jobs = [(label, str(a.dir / f"v{i}.onnx"), a.layers, a.hidden) for i, label in enumerate(VARIANTS)]
    t0 = time.perf_counter()
    with mp.get_context("spawn").Pool(min(a.jobs, len(jobs))) as pool:
        recs = pool.map(export_one, jobs)
    export_wall = time.perf_counter() - t0

    import torch

    model, ids = build(a.layers, a.hidden)
    with torch.no_grad():
        ref = model(input_ids=ids).logits.float()  # float32 on CPU: what every export is compared with
        m16 = model.half().cuda()
        g = ids.cuda()
        for _ in range(5):
            m16(input_ids=g)
        torch.cuda.synchronize()
        times = []
        for _ in range(a.runs):
            t = time.perf_counter()
            m16(input_ids=g)
            torch.cuda.synchronize()
            times.append(time.perf_counter() - t)
        eager = statistics.median(times) * 1e3
        eager_err = float((m16(input_ids=g).logits.float().cpu() - ref).abs().max())
    del m16
    torch.cuda.empty_cache()
    rows = [f"Device: {torch.cuda.get_device_name()}; onnxruntime CUDA provider, default session options; "
            f"LlamaForCausalLM hidden {a.hidden}, {a.layers} layers, input_ids (1, {SEQ}), fp16. Exports ran in "
            f"parallel ({export_wall:.0f} s wall).", "",
            "| variant | opset | nodes | norm ops | median ms | p90 ms | vs plain default | max abs logit err vs fp32 "
            "| export s |", "|---|---|---|---|---|---|---|---|---|"]
    results = {}
    for rec in recs:
        if "error" in rec:
            continue
        try:
            r = time_onnx(rec["path"], ids, a.runs)
            rec.update(median_ms=r["median_ms"], p90_ms=r["p90_ms"],
                       max_abs_error=float((r["logits"] - ref).abs().max()))
        except Exception as exc:
            rec["error"] = f"{type(exc).__name__}: {str(exc)[:400]}"
        results[rec["variant"]] = rec
    base = results.get("plain torch.onnx.export, its default opset", {}).get("median_ms")
    norm_names = ("LayerNormalization", "SimplifiedLayerNormalization", "SkipSimplifiedLayerNormalization",
                  "RMSNormalization", "ReduceMean", "Pow", "Sqrt", "Reciprocal")
    for rec in recs:
        if "error" in rec:
            rows.append(f"| {rec['variant']} | | | error: {rec['error'][:200]} | | | | | {rec['export_s']} |")
            continue
        norms = ", ".join(f"{k} {v}" for k, v in rec["ops"].items() if k in norm_names)
        rel = f"{base / rec['median_ms']:.2f}x" if base else "-"
        rows.append(f"| {rec['variant']} | {rec['opset']} | {rec['nodes']} | {norms} | {rec['median_ms']:.2f} | "
                    f"{rec['p90_ms']:.2f} | {rel} | {rec['max_abs_error']:.3g} | {rec['export_s']} |")
    rows.append(f"| torch eager fp16 (CUDA) | | | | {eager:.2f} | | {base / eager:.2f}x | {eager_err:.3g} | |"
                if base else f"| torch eager fp16 (CUDA) | | | | {eager:.2f} | | - | {eager_err:.3g} | |")
    a.out.write_text("\n".join(rows) + "\n")
    a.out.with_suffix(".json").write_text(json.dumps(recs, indent=1, default=str))
    print(a.out.read_text())


if __name__ == "__main__":
    main()
