"""Benchmark: normconv's RMSNorm vs nn.LayerNorm vs nn.RMSNorm (eager CPU), and the swapped zoo gpt vs the
original (eager CPU and onnxruntime CPU). Timings are interleaved (round-robin) and the median is reported.

    python benchmarks/rmsnorm_vs_layernorm_latency.py [--repeats 30] [--out benchmarks/results/swap.md]
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import sys
import tempfile
import time

import torch
import torch.nn as nn

from results_table import emit_table
from normconv.nn.rmsnorm import make_rmsnorm

SHAPES = [(32, 512, 768), (8, 128, 768), (4, 2048, 4096)]


def interleaved(fns: dict, repeats: int) -> dict[str, float]:
    """Median seconds per call of each fn, calling them round-robin so machine noise hits all alike."""
    times = {k: [] for k in fns}
    for f in fns.values():
        f()  # warm-up
    for _ in range(repeats):
        for k, f in fns.items():
            t = time.perf_counter()
            f()
            times[k].append(time.perf_counter() - t)
    return {k: statistics.median(v) for k, v in times.items()}


def bench_norms(repeats: int) -> list[str]:
    rows = ["| input | nn.LayerNorm ms | nn.RMSNorm ms | normconv RMSNorm ms | normconv / LayerNorm | "
            "normconv / nn.RMSNorm | max abs diff vs nn.RMSNorm |", "|---|---|---|---|---|---|---|"]
    torch.manual_seed(0)
    for shape in SHAPES:
        d = shape[-1]
        x = torch.randn(shape)
        ln, rms = nn.LayerNorm(d), nn.RMSNorm(d, eps=1e-5)
        with torch.no_grad():
            rms.weight.copy_(torch.randn(d))
        ours = make_rmsnorm((d,), 1e-5, rms.weight.detach())
        with torch.no_grad():
            diff = float((ours(x) - rms(x)).abs().max())
            t = interleaved({"ln": lambda: ln(x), "rms": lambda: rms(x), "ours": lambda: ours(x)},
                            repeats if shape[0] * shape[1] * d < 20_000_000 else max(5, repeats // 3))
        rows.append(f"| {tuple(shape)} fp32 | {t['ln'] * 1e3:.2f} | {t['rms'] * 1e3:.2f} | {t['ours'] * 1e3:.2f} | "
                    f"{t['ours'] / t['ln']:.2f}x | {t['ours'] / t['rms']:.2f}x | {diff:.1e} |")
    return rows


def _gpt(hidden: int, layers: int):
    from normconv.models.transformer import GPT

    torch.manual_seed(0)
    model = GPT(vocab=1000, hidden=hidden, heads=8, layers=layers, max_positions=256).eval()
    with torch.no_grad():
        for m in model.modules():
            if isinstance(m, nn.LayerNorm):
                m.weight.add_(0.2 * torch.randn_like(m.weight))
                m.bias.add_(0.2 * torch.randn_like(m.bias))
    return model


def bench_models(repeats: int) -> list[str]:
    import onnxruntime as ort

    from normconv.api import swap
    from normconv.verify import Inputs

    rows = ["| model | input | eager original ms | eager swapped ms | swapped / original | "
            "ORT original ms | ORT swapped ms | swapped / original | max abs err (torch) |",
            "|---|---|---|---|---|---|---|---|---|"]
    for hidden, layers, batch, seq in [(256, 4, 8, 128), (768, 2, 4, 256)]:
        model = _gpt(hidden, layers)
        ids = torch.randint(0, 1000, (batch, seq))
        swapped, report = swap(model, Inputs((ids,)))
        err = report.extra["drift"]["max_abs_error"]
        with torch.no_grad():
            t = interleaved({"a": lambda: model(ids), "b": lambda: swapped(ids)}, repeats)
        sessions = {}
        with tempfile.TemporaryDirectory() as tmp:
            for key, m in (("a", model), ("b", swapped)):
                path = os.path.join(tmp, f"{key}.onnx")
                torch.onnx.export(m, (ids,), path, dynamo=True, opset_version=23, external_data=False,
                                  verbose=False)
                opts = ort.SessionOptions()
                opts.intra_op_num_threads = torch.get_num_threads()
                sessions[key] = ort.InferenceSession(path, opts, providers=["CPUExecutionProvider"])
            feed = {sessions["a"].get_inputs()[0].name: ids.numpy()}
            o = interleaved({k: (lambda s=s: s.run(None, feed)) for k, s in sessions.items()}, repeats)
        rows.append(f"| gpt hidden {hidden}, {layers} layers | ({batch},{seq}) | {t['a'] * 1e3:.2f} | "
                    f"{t['b'] * 1e3:.2f} | {t['b'] / t['a']:.2f}x | {o['a'] * 1e3:.2f} | {o['b'] * 1e3:.2f} | "
                    f"{o['b'] / o['a']:.2f}x | {err:.1e} |")
    return rows


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--repeats", type=int, default=30)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    cmd = "python " + " ".join(sys.argv)
    lines = ["# swap benchmark", "", f"Command: `{cmd}`", "",
             f"torch {torch.__version__}, {platform.processor() or platform.machine()}, "
             f"{torch.get_num_threads()} threads; medians of {args.repeats} interleaved runs.", "",
             "## RMSNorm implementations (eager CPU, fp32, inference)", ""]
    lines += bench_norms(args.repeats)
    lines += ["", "## Swapped model vs original (zoo GPT architecture, LayerNorm -> RMSNorm, exact)", ""]
    lines += bench_models(max(5, args.repeats // 2))
    emit_table(lines, args.out)


if __name__ == "__main__":
    main()
