"""The cost of safety in a half export: onnxruntime CPU latency of `normconv export --dtype float16` with
`--keep-fp32 auto` (norm sites without headroom in float32 between Casts) against `none` (every norm in float16)
and `all` (every norm in float32), side by side in one process.

Each model is exported three times (normconv.export, one per mode, validated against the float32 model where the
mode passes), then the three sessions are timed interleaved and rotated (one intra-op thread, ORT_ENABLE_ALL),
median of the rounds. Ratio = time / the `none` export's time. The table also says which sites auto kept in float32.

    python benchmarks/half_export_latency.py --rounds 7 --out benchmarks/results/halfprec.md
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import warnings
from pathlib import Path

import numpy as np
import torch

from export_forms_latency import one_thread_session
from results_table import emit_table

warnings.filterwarnings("ignore")

MODES = ("none", "auto", "all")


def hf_gpt2():
    """A small randomly initialised Hugging Face GPT-2 (4 layers, width 256) on (4, 128) token ids."""
    from transformers import GPT2Config, GPT2LMHeadModel

    from normconv.verify import Inputs

    torch.manual_seed(0)
    cfg = GPT2Config(vocab_size=1000, n_embd=256, n_layer=4, n_head=4, n_positions=256, use_cache=False,
                     bos_token_id=0, eos_token_id=0)
    ids = torch.randint(0, 1000, (4, 128), generator=torch.Generator().manual_seed(0))
    return GPT2LMHeadModel(cfg).eval(), Inputs((), {"input_ids": ids, "attention_mask": torch.ones_like(ids)})


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--out", default=None)
    a = ap.parse_args()

    import normconv
    from normconv.errors import VerificationError
    from normconv.models import get
    from normconv.onnx.validate import feeds, latency_ms
    from normconv.verify import Inputs

    # (label, zoo name, export kwargs): transformers (all norms have headroom: auto == none) and the zoo's
    # no-upcast stack left decomposed (--no-canonicalize: auto keeps its three norms in float32)
    cases = [("zoo:gpt", "gpt", {}), ("zoo:llama", "llama", {}),
             ("zoo:fp16_overflow --no-canonicalize", "fp16_overflow", {"canonicalize": False}),
             ("HF GPT-2 4x256, ids (4,128)", "hf_gpt2", {})]
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for label, name, kw in cases:
            if name == "hf_gpt2":
                model, inputs = hf_gpt2()
            else:
                z = get(name)
                model, inputs = z.build().eval(), Inputs(tuple(z.example_inputs()))
            sessions, feed, kept, err = {}, {}, {}, {}
            for mode in MODES:
                path = Path(tmp) / f"{name}_{mode}.onnx"
                loose = {}
                try:
                    report = normconv.export(model, inputs, path, dtype=torch.float16, keep_fp32=mode, repeats=0, **kw)
                except VerificationError:  # none on the overflowing model: written with a loose tolerance to time it
                    loose = {"atol": 1e3, "rtol": 1e3}
                    report = normconv.export(model, inputs, path, dtype=torch.float16, keep_fp32=mode, repeats=0,
                                             **kw, **loose)
                kept[mode] = report.extra["half_precision"]["float32_sites"]
                err[mode] = max(r["max_abs_error"] for r in report.extra["ort"]) if report.extra.get("ort") else None
                sessions[mode] = one_thread_session(str(path))
                feed[mode] = feeds(sessions[mode], model, inputs.to(torch.float16))
            one = latency_ms(sessions["none"], feed["none"], 3)
            n = max(10, int(300 / max(one, 1e-3)))
            times: dict[str, list[float]] = {k: [] for k in MODES}
            for i in range(a.rounds):  # interleaved and rotated: background load hits every mode alike
                for k in MODES[i % 3:] + MODES[:i % 3]:
                    times[k].append(latency_ms(sessions[k], feed[k], n))
            ms = {k: float(np.median(v)) for k, v in times.items()}
            rows.append((label, ms, kept, err))
            print(label, {k: round(v, 4) for k, v in ms.items()}, kept, err, file=sys.stderr)

    lines = ["# fp16 export: --keep-fp32 auto vs none vs all (onnxruntime CPU)", "",
             f"Command: `python benchmarks/half_export_latency.py {' '.join(sys.argv[1:])}`. onnxruntime CPU, one intra-op "
             f"thread, ORT_ENABLE_ALL, median of {a.rounds} interleaved rotated rounds of >= 0.3 s each; cell: ms "
             "(time / none). ORT err: max abs error of the export against the float32 model. 2-core machine, shared.",
             "", "| model | none | auto | all | float32 sites (auto / all) | ORT err none / auto / all |",
             "|---|---|---|---|---|---|"]
    for label, ms, kept, err in rows:
        lines.append(f"| {label} | " + " | ".join(f"{ms[k]:.3f} ({ms[k] / ms['none']:.2f}x)" for k in MODES) +
                     f" | {len(kept['auto'])} / {len(kept['all'])} | " +
                     " / ".join("-" if err[k] is None else f"{err[k]:.3g}" for k in MODES) + " |")
    emit_table(lines, a.out)


if __name__ == "__main__":
    main()
