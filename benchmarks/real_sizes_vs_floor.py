"""Benchmark: normconv on real model sizes against the floor, in wall time and peak RSS (issue 13).

GPT-2 models are built from ``GPT2Config`` with random weights (no download) and saved as Hugging Face folders
(safetensors). Every measurement is a fresh subprocess (``os.wait4`` gives that child's own peak RSS), started
after ``os.sync()``; the cases run interleaved, round after round, and each keeps its best of ``--rounds``, so
machine noise hits all alike:

    floor          load the folder with from_pretrained, save_pretrained it (the bytes in, the bytes out)
    floor + fsync  the same, then its files fsynced (normconv fsyncs before its rename; save_pretrained does not)
    swap           normconv swap FOLDER --to rmsnorm -o out.pt
    fold           normconv fold FOLDER -o out.pt          (GPT-2 has no BatchNorm: capture + verify + save)
    canonicalize   normconv canonicalize FOLDER -o out.pt  (GPT-2's norms are native: capture + verify + save)
    deepnorm       normconv deepnorm FOLDER --rescale -o out.pt (GPT-2 is pre-LN: refused, timed anyway)
    plain-export   load + torch.onnx.export (dynamo, opset 20, the same inputs, static) + save: --static's floor
    plain-export-dynamic   the same with batch and sequence dynamic (Dim.AUTO), opset 23: export's floor
    export         normconv export FOLDER -o out.onnx           (dynamic batch and sequence, opset 23: the default)
    export --static   normconv export FOLDER --static -o out.onnx

    python benchmarks/real_sizes_vs_floor.py [--sizes 124m,355m] [--rounds 2] [--out benchmarks/results/scale.md]
                                     [--before COMMIT]   (each normconv case also as COMMIT's code, interleaved)
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PY = sys.executable
SIZES = {  # GPT-2 family configs (n_embd, n_layer, n_head)
    "124m": dict(n_embd=768, n_layer=12, n_head=12),
    "355m": dict(n_embd=1024, n_layer=24, n_head=16),
    "774m": dict(n_embd=1280, n_layer=36, n_head=20),
}

FLOOR = """
import sys, torch, transformers
m = transformers.GPT2LMHeadModel.from_pretrained(sys.argv[1], local_files_only=True)
m.save_pretrained(sys.argv[2], safe_serialization=True)
"""

DURABLE_FLOOR = FLOOR + """
import os
for name in os.listdir(sys.argv[2]):  # what normconv's writers do before their rename: the bytes on the device
    fd = os.open(os.path.join(sys.argv[2], name), os.O_RDONLY)
    os.fsync(fd)
    os.close(fd)
fd = os.open(sys.argv[2], os.O_RDONLY)
os.fsync(fd)
os.close(fd)
"""

PLAIN_EXPORT = """
import sys, torch, transformers
m = transformers.GPT2LMHeadModel.from_pretrained(sys.argv[1], local_files_only=True, use_cache=False).eval()
g = torch.Generator().manual_seed(0)
ids = torch.randint(0, m.config.vocab_size, (2, 16), generator=g)  # normconv's HF example inputs
with torch.no_grad():
    p = torch.onnx.export(m, (), kwargs=dict(input_ids=ids, attention_mask=torch.ones_like(ids)), dynamo=True,
                          opset_version=20, external_data=False, verbose=False)
p.save(sys.argv[2])
"""

# what `normconv export` writes by default: batch and sequence dynamic, at normconv's default opset
PLAIN_EXPORT_DYNAMIC = PLAIN_EXPORT.replace(
    "opset_version=20,", "opset_version=23, dynamic_shapes={'input_ids': {0: torch.export.Dim.AUTO, "
    "1: torch.export.Dim.AUTO}, 'attention_mask': {0: torch.export.Dim.AUTO, 1: torch.export.Dim.AUTO}},")
assert PLAIN_EXPORT_DYNAMIC != PLAIN_EXPORT
# each export case's floor: the plain export of the same kind of file
EXPORT_FLOORS = {"export": "plain-export-dynamic", "export --static": "plain-export", "plain-export": "plain-export",
                 "plain-export-dynamic": "plain-export-dynamic"}


def build(size: str, cache: Path) -> Path:
    """The GPT-2 folder of ``size`` with random weights (seed 0), built once into ``cache``."""
    folder = cache / f"gpt2-{size}"
    if (folder / "config.json").exists():
        return folder
    import torch
    import transformers

    torch.manual_seed(0)
    model = transformers.GPT2LMHeadModel(transformers.GPT2Config(**SIZES[size]))
    tmp = cache / f".gpt2-{size}.tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    model.save_pretrained(tmp, safe_serialization=True)
    tmp.rename(folder)
    return folder


def before_tree(commit: str, cache: Path) -> Path:
    """normconv as of ``commit`` (git archive), importable from its root with PYTHONPATH alone: the package maps
    normconv.passes / normconv.models to top-level folders, so link them into place as the editable install does."""
    root = cache / f"normconv-{commit}"
    if not (root / "normconv" / "passes").exists():
        shutil.rmtree(root, ignore_errors=True)
        root.mkdir(parents=True)
        archive = subprocess.run(["git", "-C", str(ROOT), "archive", commit], check=True, capture_output=True).stdout
        subprocess.run(["tar", "-x", "-C", str(root)], input=archive, check=True)
        for sub in ("passes", "models"):
            (root / "normconv" / sub).symlink_to(root / sub, target_is_directory=True)
    return root


def commands(folder: Path, work: Path, only: set[str] | None, extra: list[str],
             before: Path | None = None) -> dict[str, list[str]]:
    nc = [PY, "-m", "normconv.cli"]
    cmds = {
        "floor": [PY, "-c", FLOOR, str(folder), str(work / "floor")],
        "floor + fsync": [PY, "-c", DURABLE_FLOOR, str(folder), str(work / "floor")],
        "swap": nc + ["swap", str(folder), "--to", "rmsnorm", "-o", str(work / "swap.pt")] + extra,
        "fold": nc + ["fold", str(folder), "-o", str(work / "fold.pt")] + extra,
        "canonicalize": nc + ["canonicalize", str(folder), "-o", str(work / "canon.pt")] + extra,
        "deepnorm": nc + ["deepnorm", str(folder), "--rescale", "-o", str(work / "deepnorm.pt")] + extra,
        "plain-export": [PY, "-c", PLAIN_EXPORT, str(folder), str(work / "plain.onnx")],
        "plain-export-dynamic": [PY, "-c", PLAIN_EXPORT_DYNAMIC, str(folder), str(work / "plain.onnx")],
        "export": nc + ["export", str(folder), "-o", str(work / "out.onnx")] + extra,
        "export --static": nc + ["export", str(folder), "--static", "-o", str(work / "out.onnx")] + extra,
    }
    cmds = {k: v for k, v in cmds.items() if only is None or k in only}
    if before is not None:  # the same normconv commands run by the older code, interleaved with these
        cmds = {**cmds, **{f"{k} (before)": [f"PYTHONPATH={before}"] + v for k, v in cmds.items()
                           if v[:3] == nc}}
    return cmds


def measure(cmd: list[str], work: Path, env: dict[str, str] | None = None) -> dict:
    """Wall seconds and the child's own peak RSS (bytes) of one subprocess run; ``start``, the wall clock when it was
    spawned; ``env``: variables added to its environment."""
    for p in work.iterdir():  # every run writes into an empty folder
        shutil.rmtree(p) if p.is_dir() else p.unlink()
    path = cmd[0].removeprefix("PYTHONPATH=") if cmd[0].startswith("PYTHONPATH=") else str(ROOT)
    cmd = cmd[1:] if cmd[0].startswith("PYTHONPATH=") else cmd
    env = dict(os.environ, HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", PYTHONPATH=path, **(env or {}))
    # no dirty pages of the case before: each case's writes meet an empty write-back queue (torch.save of GPT-2
    # 355M, 1.4 GB, took 0.5 s in one process and 3.0 s in the next, the same code, as the page cache stood)
    os.sync()
    start, t0 = time.time(), time.perf_counter()
    proc = subprocess.Popen(cmd, cwd=str(work), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=env)
    out = proc.stdout.read()
    _, status, usage = os.wait4(proc.pid, 0)
    wall = time.perf_counter() - t0
    proc.returncode = os.waitstatus_to_exitcode(status)
    rss = usage.ru_maxrss * (1 if sys.platform == "darwin" else 1024)
    return {"wall_s": wall, "rss": rss, "rc": proc.returncode, "tail": out.decode(errors="replace")[-600:],
            "start": start}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--sizes", default="124m")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--only", default=None, help="comma-separated case names (the floors and plain-export are kept)")
    ap.add_argument("--extra", default="", help="extra flags for every normconv command")
    ap.add_argument("--cache", default=os.path.join(tempfile.gettempdir(), "normconv_bench_scale"))
    ap.add_argument("--out", default=str(ROOT / "benchmarks/results/scale.md"))
    ap.add_argument("--label", default="")
    ap.add_argument("--before", default=None, help="a commit: also run its normconv, interleaved (before / after)")
    args = ap.parse_args()
    cache = Path(args.cache)
    cache.mkdir(parents=True, exist_ok=True)
    only = None if args.only is None else set(args.only.split(",")) | {"floor", "floor + fsync", "plain-export",
                                                                         "plain-export-dynamic"}
    rows, raw = [], {}
    for size in args.sizes.split(","):
        folder = build(size, cache)
        weight_bytes = sum(f.stat().st_size for f in folder.glob("*.safetensors"))
        with tempfile.TemporaryDirectory(dir=str(cache)) as w:
            work = Path(w)
            cmds = commands(folder, work, only, args.extra.split(),
                            before_tree(args.before, cache) if args.before else None)
            runs: dict[str, list[dict]] = {k: [] for k in cmds}
            for r in range(args.rounds):  # interleaved: every case once per round
                for name, cmd in cmds.items():
                    res = measure(cmd, work)
                    runs[name].append(res)
                    print(f"[{size} round {r + 1}] {name}: {res['wall_s']:.1f} s, {res['rss'] / 2**30:.2f} GiB, "
                          f"rc {res['rc']}", flush=True)
                    if res["rc"] != 0:
                        print("   " + res["tail"].strip().replace("\n", "\n   "), flush=True)
        best = {k: {"wall_s": min(x["wall_s"] for x in v), "rss": min(x["rss"] for x in v),
                    "rc": max(x["rc"] for x in v)} for k, v in runs.items()}
        raw[size] = {"weights_bytes": weight_bytes, "runs": runs, "best": best}
        for name, b in best.items():
            case = name.removesuffix(" (before)")
            export = case in EXPORT_FLOORS
            floor = best[EXPORT_FLOORS[case] if export else "floor"]
            durable = "" if export else f"{b['wall_s'] / best['floor + fsync']['wall_s']:.2f}x"
            rows.append(f"| {size} | {name} | {b['rc']} | {b['wall_s']:.1f} | {b['rss'] / 2**30:.2f} | "
                        f"{b['wall_s'] / floor['wall_s']:.2f}x | {durable} | {b['rss'] / floor['rss']:.2f}x |")
    load = os.getloadavg()
    head = [f"# real_sizes_vs_floor {args.label}".rstrip(), "",
            f"`{' '.join([Path(PY).name] + sys.argv)}` — {time.strftime('%Y-%m-%d %H:%M')}, {platform.machine()}, "
            f"{os.cpu_count()} cores (shared), load average {load[0]:.1f} / {load[1]:.1f} / {load[2]:.1f}; "
            f"best of {args.rounds} interleaved rounds, each a fresh subprocess; ratios against `floor` "
            f"(from_pretrained + save_pretrained) or, for an export, the plain export of the same kind of file "
            f"(`export` against `plain-export-dynamic`, `export --static` against `plain-export`: load + "
            f"torch.onnx.export + save); "
            f"`floor + fsync`: the same with its files fsynced, as normconv's writers do before their rename.", "",
            "| model | case | rc | wall s | peak RSS GiB | time / floor | time / (floor + fsync) | RSS / floor |",
            "|---|---|---|---|---|---|---|---|"]
    text = "\n".join(head + rows) + "\n"
    print(text)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(text)
    out.with_suffix(".json").write_text(json.dumps(raw, indent=1))


if __name__ == "__main__":
    main()
