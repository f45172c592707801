"""ONNX in: normconv against onnxslim, onnxoptimizer (fuse_bn_into_conv) and onnxruntime's transformers optimizer on
the same real .onnx files (PaddleOCR det / rec / cls from rapidocr-onnxruntime, magika's jax2tf classifier,
silero-vad's torch export), all measured side by side in one run.

Per tool and file: BatchNormalization left, LayerNorm-family fused ops (LayerNormalization,
SimplifiedLayerNormalization, com.microsoft ones), parity (max abs error vs IN at two input sizes, ORT CPU, graph
optimizations disabled), and ORT CPU latency of OUT / IN, optimizations disabled and default (median of interleaved
rounds, one intra-op thread).

  python benchmarks/onnx_in.py --files DIR_WITH_ONNX_FILES --out benchmarks/results/onnx_in.md
  python benchmarks/onnx_in.py --all --files .../site-packages/onnx/backend/test/data/light --out ...
      (--all: every .onnx under --files, e.g. the ONNX model zoo's light files the onnx package ships)
"""

from __future__ import annotations

import argparse
import collections
import statistics
import tempfile
import time
from pathlib import Path

import onnx

FILES = ["ch_ppocr_mobile_v2.0_cls_infer.onnx", "ch_PP-OCRv4_det_infer.onnx", "ch_PP-OCRv4_rec_infer.onnx",
         "model.onnx", "silero_vad_op18_ifless.onnx"]
NORM_OPS = ("LayerNormalization", "SimplifiedLayerNormalization", "SkipLayerNormalization",
            "SkipSimplifiedLayerNormalization", "RMSNormalization")


def ops(path) -> collections.Counter:
    return collections.Counter(n.op_type for n in onnx.load(str(path)).graph.node)


def normconv_tool(src, dst, atol):
    from normconv.onnx import onnx_in

    onnx_in.run(str(src), "export", str(dst), target="onnx", atol=atol)


def slim(src, dst, atol):
    import onnxslim

    onnx.save(onnxslim.slim(onnx.load(str(src))), str(dst))


def optimizer(src, dst, atol):
    import onnxoptimizer

    onnx.save(onnxoptimizer.optimize(onnx.load(str(src)), ["fuse_bn_into_conv"]), str(dst))


def ort_transformers(src, dst, atol):
    from onnxruntime.transformers.optimizer import optimize_model

    optimize_model(str(src), model_type="bert", opt_level=1, use_gpu=False).save_model_to_file(str(dst))


TOOLS = {"normconv": normconv_tool, "onnxslim": slim, "onnxoptimizer": optimizer, "ort-transformers": ort_transformers}


def timed(sess, feed, rounds):
    for _ in range(2):
        sess.run(None, feed)
    t0, n = time.perf_counter(), 0
    while n < 5 or time.perf_counter() - t0 < 0.2:
        sess.run(None, feed)
        n += 1
    return (time.perf_counter() - t0) / n * 1e3


def session(path, level):
    import onnxruntime as ort

    o = ort.SessionOptions()
    o.intra_op_num_threads = 1
    o.add_session_config_entry("session.intra_op.allow_spinning", "0")
    o.graph_optimization_level = (ort.GraphOptimizationLevel.ORT_DISABLE_ALL if level == "disabled"
                                  else ort.GraphOptimizationLevel.ORT_ENABLE_ALL)
    o.log_severity_level = 3
    return ort.InferenceSession(str(path), o, providers=["CPUExecutionProvider"])


def main() -> None:
    from normconv.onnx import onnx_in, parity

    ap = argparse.ArgumentParser()
    ap.add_argument("--files", required=True)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--out", default=None)
    ap.add_argument("--all", action="store_true", help="every .onnx file under --files, not the wheels' five")
    args = ap.parse_args()
    found = {p.name: p for p in Path(args.files).rglob("*.onnx")}
    rows = []
    tmp = Path(tempfile.mkdtemp())
    for name in (sorted(found) if args.all else FILES):
        src = found[name]
        atol = 1e-2 if name == "model.onnx" else None  # magika: E[x²] − E[x]² in float32 (see README)
        specs = parity.specs(str(src), onnx_in.to_ir(onnx_in.load(str(src)).proto), None)
        plan = parity.plan_sizes(str(src), specs)
        feed = parity.feeds(specs, plan.sizes[-1], 0)
        base = ops(src)
        outs = {}
        for tool, fn in TOOLS.items():
            dst = tmp / f"{tool}-{name}"
            try:
                fn(src, dst, atol)
                outs[tool] = dst
            except Exception as exc:  # noqa: BLE001 - a tool failing on a file is a result
                outs[tool] = f"failed: {type(exc).__name__}: {str(exc).splitlines()[0][:80] if str(exc) else ''}"
        lat = {(t, lvl): [] for t in ["IN", *outs] for lvl in ("disabled", "default")}
        sess = {}
        for t, p in [("IN", src), *outs.items()]:
            if isinstance(p, Path):
                for lvl in ("disabled", "default"):
                    try:
                        sess[t, lvl] = session(p, lvl)
                    except Exception:  # noqa: BLE001 - onnxruntime cannot load what the tool wrote
                        pass
        for r in range(args.rounds):  # interleaved, rotated
            keys = list(sess)
            keys = keys[r % len(keys):] + keys[:r % len(keys)]
            for k in keys:
                lat[k].append(timed(sess[k], feed, 1))
        for tool, p in outs.items():
            if not isinstance(p, Path):
                rows.append([name, tool, p, "", "", "", "", ""])
                continue
            o = ops(p)
            try:
                errs = [v.max_abs_error for v in parity.compare_files(str(src), str(p), plan, 1.0, 1.0,
                                                                       levels=("disabled",))]
                err = f"{max(errs):.2g}" + ("" if len(plan.sizes) > 1 else " (1 size)")
            except Exception as exc:  # noqa: BLE001 - e.g. fails at the second size
                err = f"fails: {type(exc).__name__}"
            ratio = {lvl: (statistics.median(lat[tool, lvl]) / statistics.median(lat["IN", lvl])
                           if lat.get((tool, lvl)) else float("nan")) for lvl in ("disabled", "default")}
            rows.append([name, tool, f"{base['BatchNormalization']} -> {o['BatchNormalization']}",
                         str(sum(o[k] for k in NORM_OPS) + sum(v for k, v in o.items() if "LayerNorm" in k
                                                               and k not in NORM_OPS)),
                         err, f"{statistics.median(lat['IN', 'default']):.3f}",
                         f"{ratio['disabled']:.2f}x", f"{ratio['default']:.2f}x"])
    head = ["file", "tool", "BN in -> out", "fused norm ops", "max abs err vs IN", "IN ms (default)",
            "OUT/IN disabled", "OUT/IN default"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)] + ["| " + " | ".join(r) + " |" for r in rows]
    text = "\n".join(lines)
    print(text)
    if args.out:
        Path(args.out).write_text(text + "\n")


if __name__ == "__main__":
    main()
