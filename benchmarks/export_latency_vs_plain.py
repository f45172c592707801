"""onnxruntime CPU latency: normconv export vs plain torch.onnx.export (default settings), side by side.

Both files run at onnxruntime's default optimization level (ORT_ENABLE_ALL) on the same inputs in one process.
Models: the zoo transformers, HF-sized GPT-2 / Llama configs (12 layers, hidden 768, small vocab so export
stays quick), and norm-only models (a stack of 8 norms on (B, L, 768)) that isolate the norm-op time.

    python benchmarks/export_latency_vs_plain.py --seq 128 --repeats 20 --out benchmarks/results/export.md
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
import warnings
from pathlib import Path

import numpy as np
import torch
import torch.nn as nn

from results_table import emit_table
warnings.filterwarnings("ignore")


class NormStack(nn.Module):
    """8 residual add + norm steps: what a transformer's norms cost, without the matmuls."""

    def __init__(self, kind: str, d: int = 768, n: int = 8):
        super().__init__()
        make = (lambda: nn.RMSNorm(d, eps=1e-6)) if kind == "rmsnorm" else (lambda: nn.LayerNorm(d))
        self.norms = nn.ModuleList(make() for _ in range(n))

    def forward(self, x):
        h = x
        for norm in self.norms:
            h = h + norm(h)
        return h


def hf_models(seq: int):
    from transformers import GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    ids = torch.randint(0, 1000, (1, seq))
    gpt2 = GPT2LMHeadModel(GPT2Config(vocab_size=1000, n_embd=768, n_layer=12, n_head=12, n_positions=max(seq, 128),
                                      use_cache=False)).eval()
    llama = LlamaForCausalLM(LlamaConfig(vocab_size=1000, hidden_size=768, num_hidden_layers=12, num_attention_heads=12,
                                         num_key_value_heads=12, intermediate_size=3072, use_cache=False)).eval()
    return [(f"HF GPT-2 12x768 seq {seq}", gpt2, {"input_ids": ids}),
            (f"HF Llama 12x768 seq {seq}", llama, {"input_ids": ids})]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--seq", type=int, nargs="+", default=[128])
    ap.add_argument("--repeats", type=int, default=20, help="minimum runs per round")
    ap.add_argument("--rounds", type=int, default=5, help="interleaved rounds; the median is reported")
    ap.add_argument("--target", default="ort")
    ap.add_argument("--opset", type=int, default=None, help="default: normconv's default")
    ap.add_argument("--skip-hf", action="store_true")
    ap.add_argument("--out", default=None)
    a = ap.parse_args()

    from normconv.api import export as export_onnx
    from normconv.onnx.export import DEFAULT_OPSET, torch_export
    from normconv.models import ZOO
    from normconv.onnx.validate import feeds, latency_ms, session
    from normconv.verify import Inputs
    import onnx
    import onnx_ir as ir

    a.opset = DEFAULT_OPSET if a.opset is None else a.opset
    cases = [(f"zoo:{n}", ZOO[n].build().eval(), Inputs(tuple(ZOO[n].example_inputs())))
             for n in ("bert", "gpt", "llama", "seq2seq")]
    for seq in a.seq:
        x = torch.randn(8, seq, 768)
        cases += [(f"norm-only 8x RMSNorm (8,{seq},768)", NormStack("rmsnorm"), Inputs((x,))),
                  (f"norm-only 8x LayerNorm (8,{seq},768)", NormStack("layernorm"), Inputs((x,)))]
        if not a.skip_hf:
            cases += [(name, m, Inputs((), kw)) for name, m, kw in hf_models(seq)]

    try:  # the tool users reach for after a plain export; optional (pip install onnxslim)
        import onnxslim
    except ImportError:
        onnxslim = None
        print("onnxslim not installed: its column is left out", file=sys.stderr)

    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for name, model, inputs in cases:
            t0 = time.perf_counter()
            files = {"normconv": Path(tmp) / "normconv.onnx", "plain": Path(tmp) / "plain.onnx",
                     "skip": Path(tmp) / "normconv_skip.onnx"}
            report = export_onnx(model, inputs, files["normconv"], a.target, a.opset, baseline=False, repeats=0)
            skip_report = export_onnx(model, inputs, files["skip"], a.target, a.opset, baseline=False, repeats=0,
                                      skip_fusion=True)
            plain = torch_export(model, inputs, 20, normconv_ops=False, dynamic=False)  # torch's default opset
            ir.save(plain.model, str(files["plain"]))
            if onnxslim is not None:
                files["slim"] = Path(tmp) / "plain_slim.onnx"
                onnx.save(onnxslim.slim(str(files["plain"])), str(files["slim"]))
            # idle sessions' threads spin by default: sessions interleaved on 2 cores would time the spinning
            sessions = {k: session(str(f), "CPUExecutionProvider", "default", spin=False) for k, f in files.items()}
            feed = {k: feeds(sess, model, inputs) for k, sess in sessions.items()}
            # each round runs >= 0.2 s per variant: sub-millisecond models need hundreds of runs for a stable median
            one = latency_ms(sessions["plain"], feed["plain"], 3)
            n = max(a.repeats, int(200 / max(one, 1e-3)))
            times: dict[str, list[float]] = {k: [] for k in sessions}
            keys = list(sessions)
            for i in range(a.rounds):  # interleaved so background load hits all alike; rotated so no variant
                for k in keys[i % len(keys):] + keys[:i % len(keys)]:  # always runs first (or right after another)
                    times[k].append(latency_ms(sessions[k], feed[k], n))
            ms = {k: float(np.median(v)) for k, v in times.items()}
            rows.append(dict(name=name, fused=sum(report.extra["fused_norm_ops"].values()),
                             sites=sum(report.extra["norm_sites"].values()), skip_fused=skip_report.extra["skip_fused"],
                             err=max(r["max_abs_error"] for r in report.extra["ort"]), ms=ms))
            print(f"{name}: plain {ms['plain']:.3f} ms, normconv {ms['normconv']:.3f} ms, speedup "
                  f"{ms['plain'] / ms['normconv']:.2f}x ({time.perf_counter() - t0:.0f}s)", file=sys.stderr)

    slim = onnxslim is not None
    lines = ["# normconv export: onnxruntime CPU latency vs plain torch.onnx.export", "",
             f"Command: `python benchmarks/export_latency_vs_plain.py {' '.join(sys.argv[1:])}`", "",
             f"normconv: `--target {a.target} --opset {a.opset}`; plain: `torch.onnx.export(model, dynamo=True)` "
             "defaults (opset 20)" + (f"; plain + onnxslim {onnxslim.__version__}: `onnxslim.slim` on the plain file"
                                      if slim else "") +
             ". All at ORT_ENABLE_ALL on CPUExecutionProvider, same inputs, idle threads not "
             f"spinning, median of {a.rounds} "
             f"interleaved rounds of at least {a.repeats} runs and 0.2 s, this machine (2 CPU cores). "
             "Ratios are time / normconv time (> 1: normconv is faster).", "",
             "| model | fused norm ops | norm sites | normconv ms | plain ms | plain / normconv | "
             + ("plain + onnxslim ms | slim / normconv | " if slim else "")
             + "skip-fused (--skip-fusion) | --skip-fusion / normconv | max abs err vs torch |",
             "|---|---|---|---|---|---|" + ("---|---|" if slim else "") + "---|---|---|"]
    for r in rows:
        ms = r["ms"]
        cells = [r["name"], r["fused"], r["sites"], f"{ms['normconv']:.3f}", f"{ms['plain']:.3f}",
                 f"{ms['plain'] / ms['normconv']:.2f}x"]
        if slim:
            cells += [f"{ms['slim']:.3f}", f"{ms['slim'] / ms['normconv']:.2f}x"]
        cells += [r["skip_fused"], f"{ms['skip'] / ms['normconv']:.2f}x", f"{r['err']:.2e}"]
        lines.append("| " + " | ".join(str(c) for c in cells) + " |")
    emit_table(lines, a.out)


if __name__ == "__main__":
    main()
