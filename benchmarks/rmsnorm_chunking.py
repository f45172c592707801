"""Can row-chunking close normconv RMSNorm's gap to nn.LayerNorm on large inputs? (eager CPU, fp32, no grad)

normconv's RMSNorm makes three passes over memory (fused sum of squares, x * inv, * weight); LayerNorm's fused
kernel keeps each row in cache. Processing rows in cache-sized chunks would make passes 2 and 3 hit cache,
at the price of one Python-level loop step (four ops) per chunk. This measures it, side by side.

    python benchmarks/rmsnorm_chunking.py --repeats 15 --out benchmarks/results/rmsnorm_chunking.md
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

import torch
import torch.nn as nn

from results_table import emit_table
from normconv.nn.rmsnorm import rms_norm_cpu

CHUNK_KIB = (256, 1024, 4096)


def chunked(x: torch.Tensor, weight: torch.Tensor, eps: float, rows: int) -> torch.Tensor:
    """rms_norm_cpu over blocks of ``rows`` rows, written into one preallocated output."""
    n = x.shape[-1]
    x2 = x.reshape(-1, n)
    out = torch.empty_like(x2)
    for i in range(0, x2.shape[0], rows):
        xc, oc = x2[i:i + rows], out[i:i + rows]
        inv = torch.linalg.vector_norm(xc, 2, -1, keepdim=True).square_().div_(n).add_(eps).rsqrt_()
        torch.mul(xc, inv, out=oc).mul_(weight)
    return out.view_as(x)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--repeats", type=int, default=15)
    ap.add_argument("--out", default=None)
    a = ap.parse_args()
    torch.manual_seed(0)
    head = "| input | nn.LayerNorm ms | normconv RMSNorm | " + " | ".join(f"chunks of {k} KiB" for k in CHUNK_KIB) + " |"
    lines = ["# RMSNorm: does row-chunking help?", "",
             f"Command: `python benchmarks/rmsnorm_chunking.py {' '.join(sys.argv[1:])}`", "",
             f"torch {torch.__version__}, {torch.get_num_threads()} threads; median of {a.repeats} interleaved runs; "
             "ratios are time / nn.LayerNorm time.", "", head, "|---|---|---|" + "---|" * len(CHUNK_KIB)]
    with torch.no_grad():
        for shape in [(4, 2048, 4096), (32, 512, 768), (8, 128, 768)]:
            x, d = torch.randn(shape), shape[-1]
            ln, w = nn.LayerNorm(d), torch.randn(d)
            fns = {"ln": lambda: ln(x), "normconv": lambda: rms_norm_cpu(x, (d,), w, 1e-6)}
            for kib in CHUNK_KIB:
                fns[kib] = lambda r=max(1, kib * 1024 // (4 * d)): chunked(x, w, 1e-6, r)
            ref = fns["normconv"]()
            assert all(torch.equal(fns[k](), ref) for k in CHUNK_KIB)  # same ops per row: bitwise equal
            t = {k: [] for k in fns}
            for _ in range(a.repeats):
                for k, f in fns.items():
                    t0 = time.perf_counter()
                    f()
                    t[k].append(time.perf_counter() - t0)
            med = {k: statistics.median(v) * 1e3 for k, v in t.items()}
            cells = [f"{med[k] / med['ln']:.2f}x" for k in ["normconv", *CHUNK_KIB]]
            lines.append(f"| {shape} | {med['ln']:.2f} | " + " | ".join(cells) + " |")
            print(lines[-1], file=sys.stderr)
    emit_table(lines, a.out)


if __name__ == "__main__":
    main()
