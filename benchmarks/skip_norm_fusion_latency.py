"""onnxruntime CPU: is residual add + norm faster fused (com.microsoft Skip*LayerNormalization) or not?

Three measurements per shape, side by side in one run (fp32, 2 intra-op threads, ORT_ENABLE_ALL):
  1. Add + LayerNormalization (sum also a graph output, so onnxruntime cannot fuse it)  vs  SkipLayerNormalization
  2. Add + SimplifiedLayerNormalization                                                  vs  SkipSimplifiedLayerNormalization
  3. Add + LayerNormalization with only y as output: onnxruntime's own SkipLayerNormFusion on vs disabled

Why `normconv export --target ort` leaves residual add + norm unfused unless --skip-fusion asks.
Run: python benchmarks/skip_norm_fusion_latency.py --out benchmarks/results/skip_norm.md
"""

from __future__ import annotations

import argparse

import numpy as np
import onnxruntime as ort

from onnx import TensorProto, helper

from results_table import emit_table
from normconv.onnx.validate import latency_ms

SHAPES = ([1, 128, 768], [8, 128, 768], [4, 512, 768], [1, 128, 4096])


def build(kind: str, shape: list[int], expose_sum: bool = True) -> bytes:
    """A one-step model: y = norm(x + s) (and sum = x + s as an output when expose_sum)."""
    d = shape[-1]
    rng = np.random.default_rng(0)
    gamma = helper.make_tensor("gamma", TensorProto.FLOAT, [d], rng.random(d, dtype=np.float32))
    beta = helper.make_tensor("beta", TensorProto.FLOAT, [d], rng.random(d, dtype=np.float32))
    rms = kind.endswith("rms")
    norm_inputs = ["gamma"] if rms else ["gamma", "beta"]
    if kind.startswith("skip"):
        op = "SkipSimplifiedLayerNormalization" if rms else "SkipLayerNormalization"
        nodes = [helper.make_node(op, ["x", "s", *norm_inputs], ["y", "", "", "sum" if expose_sum else ""],
                                  domain="com.microsoft", epsilon=1e-5)]
    else:
        op = "SimplifiedLayerNormalization" if rms else "LayerNormalization"
        nodes = [helper.make_node("Add", ["x", "s"], ["sum"]),
                 helper.make_node(op, ["sum", *norm_inputs], ["y"], axis=-1, epsilon=1e-5)]
    outputs = [helper.make_tensor_value_info("y", TensorProto.FLOAT, shape)]
    if expose_sum:
        outputs.append(helper.make_tensor_value_info("sum", TensorProto.FLOAT, shape))
    inputs = [helper.make_tensor_value_info(n, TensorProto.FLOAT, shape) for n in ("x", "s")]
    graph = helper.make_graph(nodes, "step", inputs, outputs, [gamma] if rms else [gamma, beta])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18), helper.make_opsetid("com.microsoft", 1)],
                              ir_version=10)
    return model.SerializeToString()


def median_ms(model: bytes, feed: dict, repeats: int, disabled: list[str] | None = None) -> float:
    opts = ort.SessionOptions()
    opts.intra_op_num_threads = 2
    opts.log_severity_level = 3
    sess = ort.InferenceSession(model, opts, providers=["CPUExecutionProvider"], disabled_optimizers=disabled or [])
    return latency_ms(sess, feed, repeats, warmup=3)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--repeats", type=int, default=50)
    ap.add_argument("--out", default=None)
    a = ap.parse_args()
    lines = ["# onnxruntime CPU: residual add + norm, fused or not", "",
             f"Command: `python benchmarks/skip_norm_fusion_latency.py --repeats {a.repeats}`; onnxruntime {ort.__version__}, "
             "fp32, 2 threads, median ms. Ratio > 1: the fused op is slower.", "",
             "| shape | Add+LN | SkipLN | SkipLN / Add+LN | Add+RMS | SkipRMS | SkipRMS / Add+RMS | "
             "y-only Add+LN, ORT fusion on | fusion disabled | on / disabled |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for shape in SHAPES:
        rng = np.random.default_rng(1)
        feed = {"x": rng.standard_normal(shape, dtype=np.float32), "s": rng.standard_normal(shape, dtype=np.float32)}
        t = {k: median_ms(build(k, shape), feed, a.repeats) for k in ("add_ln", "skip_ln", "add_rms", "skip_rms")}
        own_on = median_ms(build("add_ln", shape, expose_sum=False), feed, a.repeats)
        own_off = median_ms(build("add_ln", shape, expose_sum=False), feed, a.repeats, ["SkipLayerNormFusion"])
        lines.append(f"| {tuple(shape)} | {t['add_ln']:.3f} | {t['skip_ln']:.3f} | {t['skip_ln'] / t['add_ln']:.2f} | "
                     f"{t['add_rms']:.3f} | {t['skip_rms']:.3f} | {t['skip_rms'] / t['add_rms']:.2f} | "
                     f"{own_on:.3f} | {own_off:.3f} | {own_on / own_off:.2f} |")
    emit_table(lines, a.out)


if __name__ == "__main__":
    main()
