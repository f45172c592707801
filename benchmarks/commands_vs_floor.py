"""Benchmark: each normconv command against its floor, side by side, as whole processes (issue 32).

Every case is a pair run in turn, A then B (the next round B then A, so a drift of the machine's speed hits both
alike): A the normconv command, B its floor; the result is the ratio A/B pair by pair, best and median over the
rounds, with the machine's load average at each pair. Wall time, CPU time and peak RSS come from the operating
system's accounting of each finished child (``os.wait4``).

    floor (zoo)     python: import torch, build the zoo model, one forward, torch.save (the least a tool that
                    loads, runs and writes a model costs)
    version         normconv --version            against python -c "import torch"
    fold            normconv fold zoo:resnet -o   against the zoo floor of resnet
    inspect         normconv inspect zoo:resnet   against the zoo floor of resnet
    swap            normconv swap zoo:gpt --to rmsnorm -o   against the zoo floor of gpt
    export          normconv export zoo:resnet -o r.onnx    against the zoo floor of resnet
    export vs plain the same, against build + plain torch.onnx.export(dynamo=True) of the same model
    --hf 124m       swap / fold on a GPT-2 124M folder (random weights, GPT2Config, save_pretrained) against
                    from_pretrained + save_pretrained; export against load + plain torch.onnx.export + save
    --before COMMIT each normconv case also run by COMMIT's code (git archive), paired with the same floor

    python benchmarks/commands_vs_floor.py [--rounds 5] [--only fold,swap] [--hf 124m] [--before COMMIT]
                                           [--out benchmarks/results/commands_vs_floor.md]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from real_sizes_vs_floor import FLOOR as HF_FLOOR, PLAIN_EXPORT, ROOT, before_tree, build, measure  # noqa: E402

PY = sys.executable

ZOO_FLOOR = """
import sys, torch
from normconv.models import ZOO
z = ZOO[sys.argv[1]]
m = z.build()
with torch.no_grad():
    m(*z.example_inputs())
torch.save(m, sys.argv[2])
"""

ZOO_PLAIN_EXPORT = """
import sys, torch
from normconv.models import ZOO
z = ZOO[sys.argv[1]]
m = z.build()
torch.onnx.export(m, tuple(z.example_inputs()), sys.argv[2], dynamo=True, verbose=False)
"""


def cases(work: Path, hf: dict[str, Path]) -> dict[str, tuple[list[str], list[str]]]:
    """name -> (normconv command, its floor)."""
    nc = [PY, "-m", "normconv.cli"]

    def zoo_floor(name: str) -> list[str]:
        return [PY, "-c", ZOO_FLOOR, name, str(work / f"floor-{name}.pt")]

    out = {
        "version": (nc + ["--version"], [PY, "-c", "import torch"]),
        "fold zoo:resnet": (nc + ["fold", "zoo:resnet", "-o", str(work / "fold.pt")], zoo_floor("resnet")),
        "inspect zoo:resnet": (nc + ["inspect", "zoo:resnet"], zoo_floor("resnet")),
        "swap zoo:gpt": (nc + ["swap", "zoo:gpt", "--to", "rmsnorm", "-o", str(work / "swap.pt")], zoo_floor("gpt")),
        "export zoo:resnet": (nc + ["export", "zoo:resnet", "-o", str(work / "r.onnx")], zoo_floor("resnet")),
        # export against what a user runs without normconv: build + plain torch.onnx.export (no validation)
        "export vs plain zoo:resnet": (nc + ["export", "zoo:resnet", "-o", str(work / "r2.onnx")],
                                       [PY, "-c", ZOO_PLAIN_EXPORT, "resnet", str(work / "plain.onnx")]),
    }
    for size, folder in hf.items():
        floor = [PY, "-c", HF_FLOOR, str(folder), str(work / "floor")]
        out[f"swap {size}"] = (nc + ["swap", str(folder), "--to", "rmsnorm", "-o", str(work / "s.pt")], floor)
        out[f"fold {size}"] = (nc + ["fold", str(folder), "-o", str(work / "f.pt")], floor)
        out[f"export {size}"] = (nc + ["export", str(folder), "-o", str(work / "e.onnx")],
                                 [PY, "-c", PLAIN_EXPORT, str(folder), str(work / "plain.onnx")])
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--only", default=None, help="comma-separated case names (prefixes: fold, swap, ...)")
    ap.add_argument("--hf", default="", help="GPT-2 sizes to add (124m, 355m)")
    ap.add_argument("--before", default=None, help="a commit: its normconv too, paired with the same floor")
    ap.add_argument("--cache", default=os.path.join(tempfile.gettempdir(), "normconv_bench_scale"))
    ap.add_argument("--out", default=str(ROOT / "benchmarks/results/commands_vs_floor.md"))
    args = ap.parse_args()
    cache = Path(args.cache)
    cache.mkdir(parents=True, exist_ok=True)
    hf = {size: build(size, cache) for size in filter(None, args.hf.split(","))}
    before = before_tree(args.before, cache) if args.before else None
    with tempfile.TemporaryDirectory(dir=str(cache)) as w:
        work = Path(w)
        todo = cases(work, hf)
        if args.only:
            todo = {k: v for k, v in todo.items() if any(k.startswith(p) for p in args.only.split(","))}
        if before is not None:  # the older code: PYTHONPATH=its tree (measure() reads the prefix)
            todo = {**{k: v for k, v in todo.items()},
                    **{f"{k} (before)": ([f"PYTHONPATH={before}"] + a, b) for k, (a, b) in todo.items()}}
        runs: dict[str, list[dict]] = {k: [] for k in todo}
        loads = [os.getloadavg()[0]]
        for r in range(args.rounds):
            for name, (a, b) in todo.items():
                order = (("a", a), ("b", b)) if r % 2 == 0 else (("b", b), ("a", a))
                got = {}
                for side, cmd in order:
                    got[side] = measure(cmd, work)
                load = os.getloadavg()[0]
                loads.append(load)
                pair = {"a": got["a"], "b": got["b"], "load": load,
                        "wall": got["a"]["wall_s"] / got["b"]["wall_s"], "rss": got["a"]["rss"] / got["b"]["rss"]}
                runs[name].append(pair)
                print(f"[round {r + 1}] {name}: {got['a']['wall_s']:.2f} s / floor {got['b']['wall_s']:.2f} s = "
                      f"{pair['wall']:.2f}x, RSS {pair['rss']:.2f}x, rc {got['a']['rc']}/{got['b']['rc']}, "
                      f"load {load:.1f}", flush=True)
                if got["a"]["rc"] != 0:
                    print("   " + got["a"]["tail"].strip().replace("\n", "\n   "), flush=True)
    rows = []
    for name, pairs in runs.items():
        wall = [p["wall"] for p in pairs]
        rss = [p["rss"] for p in pairs]
        a = statistics.median(p["a"]["wall_s"] for p in pairs)
        b = statistics.median(p["b"]["wall_s"] for p in pairs)
        rows.append(f"| {name} | {max(p['a']['rc'] for p in pairs)} | {min(wall):.2f}x | {statistics.median(wall):.2f}x "
                    f"| {statistics.median(rss):.2f}x | {a:.2f} | {b:.2f} | "
                    f"{min(p['load'] for p in pairs):.1f}-{max(p['load'] for p in pairs):.1f} |")
    head = [f"# commands_vs_floor", "",
            f"`{' '.join([Path(PY).name] + sys.argv)}` — {time.strftime('%Y-%m-%d %H:%M')}, {platform.machine()}, "
            f"{os.cpu_count()} cores (shared), 1-min load average {min(loads):.1f}-{max(loads):.1f}; "
            f"{args.rounds} rounds, each case a pair of fresh processes run in turn (A B, then B A); ratios pair by "
            f"pair.", "",
            "| case | rc | time / floor, best | median | peak RSS / floor, median | median s | floor median s | "
            "load |",
            "|---|---|---|---|---|---|---|---|"]
    text = "\n".join(head + rows) + "\n"
    print(text)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(text)
    out.with_suffix(".json").write_text(json.dumps(runs, indent=1, default=str))


if __name__ == "__main__":
    main()
