"""Which export form is fastest in onnxruntime: the data behind `normconv export`'s default.

Every variant of the same model, timed side by side in one process on onnxruntime CPU (one intra-op thread,
idle threads not spinning, ORT_ENABLE_ALL), interleaved and rotated rounds, median:
  the new default: --target onnx --opset 23, dynamic dimensions (RMSNormalization, standard ops only),
  today's (former) default: --target ort --opset 20, static shapes (SimplifiedLayerNormalization),
  each target at each opset (onnx@20: RMSNorm as the model-local function normconv.RMSNorm),
  plain torch.onnx.export at opset 20 (torch's default) and 23 (its best for RMSNorm).
Cells: ms (time / the former default's time; < 1: faster than the former default).

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

VARIANTS = (("new default onnx@23 dynamic", "onnx", 23, False), ("former default ort@20 static", "ort", 20, True),
            ("onnx@20 dynamic", "onnx", 20, False), ("ort@20 dynamic", "ort", 20, False),
            ("ort@23 dynamic", "ort", 23, False), ("onnx@23 static", "onnx", 23, True),
            ("plain @20", None, 20, True), ("plain @23", None, 23, True))
FORMER = "former default ort@20 static"


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
            for label, target, opset, static in VARIANTS:
                path = Path(tmp) / (label.replace(" ", "_").replace("@", "_") + ".onnx")
                if target is None:
                    ir.save(torch_export(model, inputs, opset, normconv_ops=False, dynamic=False).model, str(path))
                else:
                    normconv.export(model, inputs, path, target, opset, static=static, baseline=False, repeats=0)
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
            rows.append((name, ms, ms[FORMER]))
            print(name, {k: round(v, 3) for k, v in ms.items()}, file=sys.stderr)

    lines = ["# Export form vs onnxruntime CPU latency (the default's evidence)", "",
             f"Command: `python benchmarks/export_forms_latency.py {' '.join(sys.argv[1:])}`. onnxruntime CPU, one "
             f"intra-op thread, ORT_ENABLE_ALL, median of {a.rounds} interleaved rotated rounds of >= 0.3 s each; "
             "cell: ms (time / the former default's, ort@20 static). 2-core machine, shared.", "",
             "| model | " + " | ".join(v[0] for v in VARIANTS) + " |", "|---|" + "---|" * len(VARIANTS)]
    for name, ms, best in rows:
        lines.append(f"| {name} | " + " | ".join(f"{ms[v[0]]:.3f} ({ms[v[0]] / best:.2f}x)" for v in VARIANTS) + " |")
    emit_table(lines, a.out)


if __name__ == "__main__":
    main()
