"""Hand-written norms vs the native modules ``normconv canonicalize`` puts in their place.

For each hand-written spelling (zoo classes: the tutorial LayerNorm / BatchNorm, HF LlamaRMSNorm / T5LayerNorm /
GemmaRMSNorm) on a transformer-sized input: eager CPU time of the original module and of its canonicalized
replacement, measured side by side in one run (median of interleaved repeats), and the ONNX node count of each
(dynamo exporter, opset 23: one LayerNormalization / RMSNormalization / BatchNormalization after).

    python benchmarks/handwritten_vs_native_latency.py [--repeats 30] [--out benchmarks/results/canonicalize.md]
"""

from __future__ import annotations

import argparse
import platform
import statistics
import sys
import time
import warnings

import torch
import torch.nn as nn

from results_table import emit_table
from normconv.models.handwritten import BatchNorm, GemmaRMSNorm, LayerNorm, LlamaRMSNorm, T5LayerNorm
from normconv.api import canonicalize
from normconv.verify import Inputs

warnings.filterwarnings("ignore")


class Holder(nn.Module):
    """A parent for the norm (a module-form site needs one)."""

    def __init__(self, norm):
        super().__init__()
        self.norm = norm

    def forward(self, x):
        return self.norm(x)


def cases(hidden: int):
    g = torch.Generator().manual_seed(0)
    seq = torch.randn(32, 512, hidden, generator=g)
    img = torch.randn(32, 64, 56, 56, generator=g)
    bn = BatchNorm(64, num_dims=4)
    with torch.no_grad():
        bn.moving_mean.normal_(0, 1, generator=g)
        bn.moving_var.uniform_(0.5, 2, generator=g)
    return [
        ("tutorial LayerNorm (x.var, / sqrt)", LayerNorm(hidden), seq),
        ("LlamaRMSNorm (fp32 upcast)", LlamaRMSNorm(hidden), seq),
        ("T5LayerNorm", T5LayerNorm(hidden), seq),
        ("GemmaRMSNorm (1 + w)", GemmaRMSNorm(hidden), seq),
        ("tutorial BatchNorm (moving stats), NCHW", bn, img),
    ]


def timed(fn, x) -> float:
    with torch.no_grad():
        t0 = time.perf_counter()
        fn(x)
        return time.perf_counter() - t0


def onnx_nodes(model, x) -> int | str:
    """Node count of the model exported alone (a small slice of the input: the count does not depend on it)."""
    small = x[:1, :8] if x.dim() == 3 else x[:1]
    try:
        with torch.no_grad():
            prog = torch.onnx.export(model, (small,), dynamo=True, opset_version=23, verbose=False)
        return len(prog.model_proto.graph.node)
    except Exception as exc:  # reported in the table, not hidden
        return f"export failed: {type(exc).__name__}"


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--repeats", type=int, default=30)
    ap.add_argument("--hidden", type=int, default=768)
    ap.add_argument("--out", default=None)
    a = ap.parse_args()
    rows = []
    for label, norm, x in cases(a.hidden):
        original = Holder(norm).eval()
        new, report = canonicalize(original, Inputs((x[:2, :16] if x.dim() == 3 else x[:2],)))
        assert report.validation[0].passed, label
        native = type(new.norm).__name__
        t_old, t_new = [], []
        timed(original, x), timed(new, x)  # warm-up
        for _ in range(a.repeats):  # interleaved: both see the same machine state
            t_old.append(timed(original, x))
            t_new.append(timed(new, x))
        mo, mn = statistics.median(t_old) * 1e3, statistics.median(t_new) * 1e3
        rows.append((label, native, mo, mn, mo / mn, onnx_nodes(original, x), onnx_nodes(new, x)))
        print(f"{label}: {mo:.2f} ms -> {native} {mn:.2f} ms ({mo / mn:.2f}x)", file=sys.stderr)
    lines = [
        "# canonicalize: hand-written norms vs their native replacements",
        "",
        f"Command: `python benchmarks/handwritten_vs_native_latency.py --repeats {a.repeats} --hidden {a.hidden}`  ",
        f"Machine: {platform.processor() or platform.machine()}, {torch.get_num_threads()} threads, "
        f"torch {torch.__version__}. Inputs: (32, 512, {a.hidden}) fp32 for the token norms, (32, 64, 56, 56) fp32 "
        f"for BatchNorm. Eager CPU, no grad, median of {a.repeats} interleaved runs. ONNX: dynamo exporter, "
        f"opset 23, node count of the exported norm alone.",
        "",
        "| hand-written norm | replaced by | original ms | native ms | speed-up | ONNX nodes before | after |",
        "|---|---|---|---|---|---|---|",
    ]
    for label, native, mo, mn, r, no, nn_ in rows:
        lines.append(f"| {label} | {native} | {mo:.2f} | {mn:.2f} | {r:.2f}x | {no} | {nn_} |")
    emit_table(lines, a.out)


if __name__ == "__main__":
    main()
