"""Export as users run it, on every model type asked for: the tiny model (the class of ``--mapping``, by default its
causal LM, with trained-looking norms)
saved with ``save_pretrained``, then ``normconv export FOLDER -o OUT.onnx --json`` as a process. Each row keeps the
exit code, the dynamic dimensions the file kept (or why one was pinned to the example's size) and the fused norm ops.

Why: the default file is dynamic in batch and sequence (issue 30), and a dimension that fails its check at a second
size is pinned with a reason instead of failing the export, so a regression there shows as a pinned row, not an
error (a rotary model's batch was pinned so: torch's fused RotaryEmbedding-23 ran at batch 1 only).

    python benchmarks/coverage_export_dims.py --types llama,mistral,qwen2 [--out benchmarks/results/coverage_export_dims.jsonl]
    python benchmarks/coverage_export_dims.py --mapping MODEL_FOR_IMAGE_CLASSIFICATION --types vit,resnet,convnext
    python benchmarks/coverage_export_dims.py --report benchmarks/results/coverage_export_dims.md
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))


def run_type(mtype: str, timeout: int, mapping: str = "MODEL_FOR_CAUSAL_LM") -> dict:
    from coverage_folders import trained_looking
    from coverage_transformers import build, mappings

    maps = mappings()
    maps = {mtype: [m for m in maps.get(mtype, []) if m[0] == mapping] or maps.get(mtype, [])}
    try:
        model, _, cname = build(mtype, maps)
    except Exception as exc:  # noqa: BLE001 - the sweep records every reason
        return {"type": mtype, "verdict": "skipped", "why": f"{type(exc).__name__}: {exc}"[:300]}
    trained_looking(model)
    with tempfile.TemporaryDirectory() as tmp:
        model.save_pretrained(Path(tmp) / "in")
        t0 = time.time()
        args = ["normconv", "export", str(Path(tmp) / "in"), "-o", str(Path(tmp) / "out.onnx"), "--json"]
        try:
            r = subprocess.run(args, capture_output=True, text=True, timeout=timeout)
            rc, stdout, stderr = r.returncode, r.stdout, r.stderr
        except subprocess.TimeoutExpired:
            rc, stdout, stderr = -9, "", f"timeout {timeout} s"
    row = {"type": mtype, "class": cname, "rc": rc, "s": round(time.time() - t0, 1)}
    try:
        extra = json.loads(stdout).get("extra", {})
        row["dims"] = [(d["name"], d.get("pinned") or "") for d in extra.get("dynamic_dims", [])]
        row["fused"] = extra.get("fused_norm_ops")
    except json.JSONDecodeError:
        row["why"] = (stderr.strip().splitlines() or [""])[-1][:400]
    row["verdict"] = "skipped" if rc == 2 and "rejected its example inputs" in row.get("why", "") else \
        "ok" if rc == 0 and not any(p for _, p in row.get("dims", [])) else "pinned" if rc == 0 else "failed"
    return row


def report(rows: list[dict]) -> str:
    from collections import Counter

    rows = list({(r["type"], r.get("class")): r for r in rows}.values())
    counts = Counter(r["verdict"] for r in rows)
    lines = ["# normconv export on causal LMs (benchmarks/coverage_export_dims.py)", "",
             "`normconv export FOLDER -o OUT.onnx` as a process on each type's tiny causal LM (module docstring). "
             "ok: exit 0 with every dynamic dimension kept (each checked in onnxruntime at a second size); pinned: "
             "exit 0 with a dimension pinned to the example's size; skipped: the tiny config does not build or run "
             "in transformers itself.", "",
             f"ok {counts['ok']}, pinned {counts['pinned']}, failed {counts['failed']}, skipped {counts['skipped']}",
             "", "| type | verdict | s | dynamic dimensions | fused norm ops | why |", "|---|---|---|---|---|---|"]
    for r in sorted(rows, key=lambda r: (r["type"], r.get("class") or "")):
        dims = ", ".join(n + (" (pinned)" if p else "") for n, p in r.get("dims", []))
        why = "; ".join(p for _, p in r.get("dims", []) if p) or r.get("why", "")
        lines.append(f"| {r['type']} ({r.get('class', '')}) | {r['verdict']} | {r.get('s', '')} | {dims} | {r.get('fused') or ''} | "
                     f"{why.replace('|', '/')[:200]} |")
    return "\n".join(lines) + "\n"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--types", default="llama,mistral,qwen2,gemma,phi,gpt2,gpt_neox,mixtral")
    ap.add_argument("--mapping", default="MODEL_FOR_CAUSAL_LM", help="the auto mapping whose class is built "
                                                                      "(MODEL_FOR_IMAGE_CLASSIFICATION, ...)")
    ap.add_argument("--timeout", type=int, default=240)
    ap.add_argument("--out", default=str(HERE / "results" / "coverage_export_dims.jsonl"))
    ap.add_argument("--report", default=None, help="write the markdown report of --out's rows here and stop")
    args = ap.parse_args()
    if args.report:
        Path(args.report).write_text(report([json.loads(ln) for ln in open(args.out) if ln.strip()]))
        return
    with open(args.out, "a") as f:
        for t in [t for t in args.types.split(",") if t]:
            row = run_type(t, args.timeout, args.mapping)
            f.write(json.dumps(row) + "\n")
            f.flush()
            print(json.dumps(row), flush=True)


if __name__ == "__main__":
    main()
