"""Check: export of a model whose weights pass protobuf's 2 GB limit (issue 13).

A pre-LN embedding model (Embedding(V, 1024) -> 2 x [LN -> Linear -> GELU -> Linear, residual] -> LN) with
V chosen so the fp32 weights are ``--gb`` GB, random weights. ``normconv.export`` must write ``m.onnx`` plus the
``m.onnx.data`` sidecar, validate it in onnxruntime itself, and the result must load from disk in onnxruntime
(external data resolved next to the file) and match torch; every LayerNorm is one fused op. Wall time and peak
RSS of the export (this process: ``resource.getrusage``) are reported next to the weight bytes.

    python benchmarks/export_past_2gb.py [--gb 2.2] [--out benchmarks/results/big_export.md]
"""

from __future__ import annotations

import argparse
import os
import resource
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

import torch
import torch.nn as nn

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))
from results_table import emit_table  # noqa: E402

D = 1024


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.ln, self.up, self.down = nn.LayerNorm(D), nn.Linear(D, 4 * D), nn.Linear(4 * D, D)

    def forward(self, x):
        return x + self.down(torch.nn.functional.gelu(self.up(self.ln(x))))


class BigEmbeddingLM(nn.Module):
    def __init__(self, vocab: int):
        super().__init__()
        self.emb = nn.Embedding(vocab, D)
        self.blocks = nn.Sequential(Block(), Block())
        self.ln_f = nn.LayerNorm(D)

    def forward(self, ids):
        return self.ln_f(self.blocks(self.emb(ids)))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--gb", type=float, default=2.2, help="fp32 weight size in GB (10^9 bytes)")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()

    import onnx
    import onnxruntime as ort

    import normconv
    from normconv.verify import Inputs

    per_block = 2 * (D * 4 * D) + 4 * D + D + 2 * D
    vocab = int((args.gb * 1e9 / 4 - 2 * per_block - 2 * D) / D)
    torch.manual_seed(0)
    model = BigEmbeddingLM(vocab).eval()
    weight_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    ids = torch.randint(0, vocab, (2, 16))
    with tempfile.TemporaryDirectory(dir=os.environ.get("TMPDIR")) as tmp:
        path = Path(tmp) / "m.onnx"
        t0 = time.perf_counter()
        report = normconv.export(model, Inputs((ids,)), str(path), repeats=1)
        seconds = time.perf_counter() - t0
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
        files = {f.name: f.stat().st_size for f in Path(tmp).iterdir()}
        graph = onnx.load(str(path), load_external_data=False)
        ops = Counter(n.op_type for n in graph.graph.node)
        sess = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
        ids2 = torch.randint(0, vocab, (2, 16), generator=torch.Generator().manual_seed(1))
        got = torch.from_numpy(sess.run(None, {sess.get_inputs()[0].name: ids2.numpy()})[0])
        with torch.no_grad():
            ref = model(ids2)
        err = (got - ref).abs().max().item()
    lines = [
        "| weights (fp32) | m.onnx | m.onnx.data | LayerNormalization | export wall | peak RSS | RSS / weights | "
        "ORT from disk vs torch (max abs) | report |",
        "|---|---|---|---|---|---|---|---|---|",
        f"| {weight_bytes / 1e9:.2f} GB | {files.get('m.onnx', 0) / 1e6:.2f} MB | "
        f"{files.get('m.onnx.data', 0) / 1e9:.2f} GB | {ops.get('LayerNormalization', 0)} of 3 | {seconds:.1f} s | "
        f"{peak / 1e9:.2f} GB | {peak / weight_bytes:.2f}x | {err:.2g} | external_data="
        f"{report.extra.get('external_data')}, passed={report.passed} |",
    ]
    emit_table(lines, args.out)
    if not (files.get("m.onnx.data") and ops.get("LayerNormalization") == 3 and err < 1e-3 and report.passed):
        sys.exit(1)


if __name__ == "__main__":
    main()
