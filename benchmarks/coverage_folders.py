"""Folder in, folder out, with trained-looking norms: every transformers model type (tiny, as the class of an auto
mapping: its causal LM, its image classifier) saved with ``save_pretrained``, then ``normconv swap / canonicalize /
fold FOLDER -o OUT`` (and ``inspect``) run as a user runs them (the CLI, a process each), the written folder loaded
with ``from_pretrained`` and compared here.

Why: random initialization leaves every LayerNorm bias 0 and every BatchNorm at its identity statistics, which is
where the hardest cases of a folder written back are absent (a final norm's bias next to a head without one, a
model rewritten in place past the rounding budget). Every norm-like module's weight is drawn as 1 + 0.3 N(0, 1), its
bias as 0.3 N(0, 1), BatchNorm statistics away from (0, 1), as trained weights leave them.

    python benchmarks/coverage_folders.py --types gpt2,gpt_neox,opt --dtype float32
    python benchmarks/coverage_folders.py --mapping MODEL_FOR_CAUSAL_LM --commands swap,canonicalize
    python benchmarks/coverage_folders.py --mapping MODEL_FOR_IMAGE_CLASSIFICATION --commands fold,canonicalize,swap

Verdicts per (type, command): ok (exit 0, the folder loads and matches the source within 1e-3 of the output's
scale in float32, 5e-2 in half), refused (exit 2, one line), failed (exit 1 or anything else: the line is kept).
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


def trained_looking(model, seed: int = 0):
    import torch

    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for m in model.modules():
            if "norm" not in type(m).__name__.lower():
                continue
            w, b = getattr(m, "weight", None), getattr(m, "bias", None)
            if isinstance(w, torch.nn.Parameter) and w.is_floating_point():
                w.copy_(1 + 0.3 * torch.randn(w.shape, generator=g))
            if isinstance(b, torch.nn.Parameter) and b.is_floating_point():
                b.copy_(0.3 * torch.randn(b.shape, generator=g))
            if isinstance(m, torch.nn.modules.batchnorm._BatchNorm) and m.running_mean is not None:
                m.running_mean.copy_(0.2 * torch.randn(m.running_mean.shape, generator=g))
                m.running_var.copy_(torch.rand(m.running_var.shape, generator=g) + 0.5)
    return model


def _outputs(folder: Path, cls_name: str, kw: dict):
    import torch
    import transformers

    m = getattr(transformers, cls_name).from_pretrained(str(folder)).eval()
    with torch.no_grad():
        out = m(**kw)
    out = out if isinstance(out, torch.Tensor) else out[0]  # the first output; a backbone's is a tuple of maps
    leaves = [t for t in torch.utils._pytree.tree_leaves(out) if isinstance(t, torch.Tensor)]
    return torch.cat([t.float().reshape(-1) for t in leaves])


def run_type(mtype: str, maps, commands: list[str], dtype: str, mapping: str | None, timeout: int) -> list[dict]:
    import torch
    from coverage_transformers import build, example_inputs

    if mapping:  # the class of that mapping (a causal LM: its head; an image classifier: its classifier)
        maps = {mtype: [m for m in maps[mtype] if m[0] == mapping] or maps[mtype]}
    try:
        model, _, cname = build(mtype, maps)
    except Exception as exc:  # noqa: BLE001 - the sweep records every reason
        return [{"type": mtype, "command": "build", "verdict": "skipped", "why": f"{type(exc).__name__}: {exc}"[:300]}]
    trained_looking(model)
    if dtype != "float32":
        model = model.to(getattr(torch, dtype))
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        src = Path(tmp) / "in"
        try:
            model.save_pretrained(src)
            kw = example_inputs(model, 1, 7, seed=3)
            try:  # the sweep's own inputs; where the model rejects them (a clip, a history), normconv's
                with torch.no_grad():
                    model(**kw)
            except Exception:  # noqa: BLE001
                from normconv.io.hf_inputs import hf_example_inputs

                made = hf_example_inputs(model, 1, 7)
                kw = made.kwargs if made is not None else kw
            if dtype != "float32":
                kw = {k: v.to(model.dtype) if v.is_floating_point() else v for k, v in kw.items()}
            ref = _outputs(src, cname, kw)
        except Exception as exc:  # noqa: BLE001
            return [{"type": mtype, "command": "save", "verdict": "skipped",
                     "why": f"{type(exc).__name__}: {exc}"[:300]}]
        for command in commands:
            out = Path(tmp) / f"out_{command}"
            args = ["normconv", command, str(src)] + ([] if command == "inspect" else ["-o", str(out)]) + \
                (["--to", "rmsnorm"] if command == "swap" else [])
            t0 = time.time()
            try:
                r = subprocess.run(args, capture_output=True, text=True, timeout=timeout)
                rc, err = r.returncode, [ln for ln in r.stderr.splitlines() if ln.strip()]
            except subprocess.TimeoutExpired:
                rc, err = -9, [f"timeout {timeout} s"]
            row = {"type": mtype, "class": cname, "command": command, "rc": rc, "s": round(time.time() - t0, 1)}
            last = next((ln for ln in reversed(err) if ln.startswith("error")), err[-1] if err else "")
            if rc == 0 and command == "inspect":  # writes nothing: exit 0 with its table is the verdict
                row.update(verdict="ok")
            elif rc == 0:
                try:
                    got = _outputs(out, cname, kw)
                    scale = float(ref.float().abs().max())
                    e = float((got.float() - ref.float()).abs().max()) / max(scale, 1e-30)
                    bound = 1e-3 if dtype == "float32" else 5e-2
                    row.update(verdict="ok" if e <= bound else "failed", error_of_scale=e)
                    if e > bound:
                        row["why"] = f"written folder differs: {e:.3g} of the output's scale"
                except Exception as exc:  # noqa: BLE001
                    row.update(verdict="failed", why=f"loading the written folder: {type(exc).__name__}: {exc}"[:300])
            else:
                row.update(verdict="refused" if rc == 2 and last.startswith("error") and "Traceback" not in r.stderr
                           else "failed", why=last[:400])
            rows.append(row)
    return rows


def report(rows: list[dict]) -> str:
    """The results as markdown: counts per (dtype, command, verdict), then every row not ok with its line (a
    (type, class, command, dtype) run again: its last row)."""
    from collections import Counter

    rows = list({(r["type"], r.get("class"), r["command"], r.get("dtype")): r for r in rows}.values())

    lines = ["# Folder in, folder out (benchmarks/coverage_folders.py)", "",
             "Every row: `normconv COMMAND FOLDER -o OUT` as a process, the written folder loaded with from_pretrained "
             "and compared here with the source folder's outputs (module docstring). `skipped`: the tiny config "
             "does not build or run in transformers itself.", "",
             "| dtype | command | ok | refused | failed | skipped (build / run) |", "|---|---|---|---|---|---|"]
    counts = Counter((r.get("dtype"), r["command"], r["verdict"]) for r in rows)
    skipped = Counter(r.get("dtype") for r in rows if r["verdict"] == "skipped")
    for dtype in sorted({r.get("dtype") for r in rows}):
        for command in sorted({r["command"] for r in rows if r["verdict"] != "skipped" and r.get("dtype") == dtype}):
            lines.append(f"| {dtype} | {command} | {counts[(dtype, command, 'ok')]} | "
                         f"{counts[(dtype, command, 'refused')]} | {counts[(dtype, command, 'failed')]} | "
                         f"{skipped[dtype]} |")
    lines += ["", "| dtype | type | command | verdict | why |", "|---|---|---|---|---|"]
    for r in rows:
        if r["verdict"] in ("refused", "failed"):
            why = str(r.get("why", "")).replace("|", "/")[:220]
            lines.append(f"| {r.get('dtype')} | {r['type']} | {r['command']} | {r['verdict']} | {why} |")
    return "\n".join(lines) + "\n"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--types", default="", help="comma-separated model types (default: all, or --mapping's)")
    ap.add_argument("--mapping", default=None, help="only the types in this auto mapping (MODEL_FOR_CAUSAL_LM, "
                                                    "MODEL_FOR_IMAGE_CLASSIFICATION), built as its class")
    ap.add_argument("--commands", default="swap,canonicalize,fold")
    ap.add_argument("--dtype", default="float32", choices=["float32", "float16", "bfloat16"])
    ap.add_argument("--timeout", type=int, default=180)
    ap.add_argument("--out", default=str(HERE / "results" / "coverage_folders.jsonl"))
    ap.add_argument("--report", default=None, help="write the markdown report of --out's rows here and stop")
    args = ap.parse_args()
    if args.report:
        rows = [json.loads(ln) for ln in open(args.out) if ln.strip()]
        Path(args.report).write_text(report(rows))
        return
    from coverage_transformers import mappings

    maps = mappings()
    types = [t for t in args.types.split(",") if t] or sorted(
        t for t in maps if not args.mapping or any(m[0] == args.mapping for m in maps[t]))
    commands = [c for c in args.commands.split(",") if c]
    with open(args.out, "a") as f:
        for t in types:
            for row in run_type(t, maps, commands, args.dtype, args.mapping, args.timeout):
                row["dtype"] = args.dtype
                f.write(json.dumps(row) + "\n")
                f.flush()
                print(json.dumps(row), flush=True)


if __name__ == "__main__":
    main()
