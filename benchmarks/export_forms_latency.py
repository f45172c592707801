"""Which export form is fastest in onnxruntime: the data behind `normconv export`'s default.

Every variant of the same model, timed side by side in one process on onnxruntime CPU (one intra-op thread,
idle threads not spinning, ORT_ENABLE_ALL), interleaved and rotated rounds, median:
  normconv --target onnx at opset 20 (RMSNorm as the function-bodied normconv.RMSNorm) and at 23 (RMSNormalization),
  normconv --target ort at opset 20 (SimplifiedLayerNormalization),
  plain torch.onnx.export at opset 20 (torch's default) and 23 (its best for RMSNorm).
Ratios are variant time / the fastest plain export's time (< 1: faster than plain export at its best opset).

    python benchmarks/export_forms_latency.py --rounds 5 --out benchmarks/results/export_defaults.md
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import warnings
from pathlib import Path

import numpy as np
import torch

from export_latency_vs_plain import NormStack
from results_table import emit_table

warnings.filterwarnings("ignore")

VARIANTS = (("normconv onnx@20", "onnx", 20), ("normconv onnx@23", "onnx", 23), ("normconv ort@20", "ort", 20),
            ("plain @20", None, 20), ("plain @23", None, 23))


def one_thread_session(path: str):
    import onnxruntime as ort

    opts = ort.SessionOptions()
    opts.intra_op_num_threads = 1
    opts.inter_op_num_threads = 1
    opts.add_session_config_entry("session.intra_op.allow_spinning", "0")
    opts.log_severity_level = 3
    return ort.InferenceSession(path, opts, providers=["CPUExecutionProvider"])


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--out", default=None)
    a = ap.parse_args()

    import onnx_ir as ir

    import normconv
    from normconv.models import get
    from normconv.onnx.export import torch_export
    from normconv.onnx.validate import feeds, latency_ms
    from normconv.verify import Inputs

    torch.manual_seed(0)
    x = torch.randn(8, a.seq, 768)
    cases = [(f"8x RMSNorm (8,{a.seq},768)", NormStack("rmsnorm").eval(), Inputs((x,))),
             (f"8x LayerNorm (8,{a.seq},768)", NormStack("layernorm").eval(), Inputs((x,)))]
    for name in ("llama", "gpt"):
        z = get(name)
        cases.append((f"zoo:{name}", z.build().eval(), Inputs(tuple(z.example_inputs()))))

    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for name, model, inputs in cases:
            sessions, feed = {}, {}
            for label, target, opset in VARIANTS:
                path = Path(tmp) / (label.replace(" ", "_").replace("@", "_") + ".onnx")
                if target is None:
                    ir.save(torch_export(model, inputs, opset, normconv_ops=False, dynamic=False).model, str(path))
                else:
                    normconv.export(model, inputs, path, target, opset, baseline=False, repeats=0)
                sessions[label] = one_thread_session(str(path))
                feed[label] = feeds(sessions[label], model, inputs)
            one = latency_ms(sessions["plain @20"], feed["plain @20"], 3)
            n = max(10, int(300 / max(one, 1e-3)))
            times: dict[str, list[float]] = {k: [] for k in sessions}
            keys = list(sessions)
            for i in range(a.rounds):  # interleaved and rotated: background load hits every variant alike
                for k in keys[i % len(keys):] + keys[:i % len(keys)]:
                    times[k].append(latency_ms(sessions[k], feed[k], n))
            ms = {k: float(np.median(v)) for k, v in times.items()}
            best_plain = min(ms["plain @20"], ms["plain @23"])
            rows.append((name, ms, best_plain))
            print(name, {k: round(v, 3) for k, v in ms.items()}, file=sys.stderr)

    lines = ["# Export form vs onnxruntime CPU latency (the default's evidence)", "",
             f"Command: `python benchmarks/export_forms_latency.py {' '.join(sys.argv[1:])}`. onnxruntime CPU, one "
             f"intra-op thread, ORT_ENABLE_ALL, median of {a.rounds} interleaved rotated rounds of >= 0.3 s each; "
             "cell: ms (time / fastest plain export). 2-core machine, shared.", "",
             "| model | " + " | ".join(k for k, _, _ in VARIANTS) + " |", "|---|" + "---|" * len(VARIANTS)]
    for name, ms, best in rows:
        lines.append(f"| {name} | " + " | ".join(f"{ms[k]:.3f} ({ms[k] / best:.2f}x)" for k, _, _ in VARIANTS) + " |")
    emit_table(lines, a.out)


if __name__ == "__main__":
    main()
