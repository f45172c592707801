"""Where each command's time goes: every command run as its own process with ``$NORMCONV_PHASE_LOG`` set
(``normconv.quiet.phase`` appends each phase mark: the wall clock and the resident set), seconds per phase.

    python benchmarks/phase_profile.py [--sizes 124m] [--out benchmarks/results/phase_profile.md]

"start" is the process's spawn to its first mark (the interpreter, torch and the command's imports); each phase
runs from its first mark to the next phase's first mark (marks of the same phase in a row, a block i/N or a shape
of 2, are one phase); the last phase runs to the process's exit (the report, and the exit itself). Each process
is run as benchmarks/real_sizes_vs_floor.py runs its cases (``measure``: after a sync, peak RSS the child's own).
Small zoo models, then the GPT-2 folders of ``--sizes`` (built as that benchmark builds them, random weights, seed 0).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(Path(__file__).resolve().parent))
from real_sizes_vs_floor import build, measure  # noqa: E402

ZOO = [["inspect", "zoo:resnet"], ["fold", "zoo:resnet", "-o", "{out}/f.pt"],
       ["canonicalize", "zoo:tutorial_ln", "-o", "{out}/c.pt"], ["swap", "zoo:gpt", "--to", "rmsnorm", "-o", "{out}/s.pt"],
       ["rotate", "zoo:llama", "-o", "{out}/r.pt"], ["deepnorm", "zoo:bert", "-o", "{out}/d.pt"],
       ["export", "zoo:resnet", "-o", "{out}/r.onnx"]]
FOLDER = [["inspect", "{dir}"], ["fold", "{dir}", "-o", "{out}/g.pt"], ["canonicalize", "{dir}", "-o", "{out}/c.pt"],
          ["swap", "{dir}", "--to", "rmsnorm", "-o", "{out}/s.pt"], ["export", "{dir}", "-o", "{out}/g.onnx"]]


def profile(args: list[str], work: Path, log: Path) -> dict:
    """One command as a process (``measure``, as every floor benchmark runs one): its phases (name, seconds), wall
    seconds, peak RSS, exit code."""
    log.unlink(missing_ok=True)
    r = measure([sys.executable, "-m", "normconv.cli", "--quiet", *args], work, {"NORMCONV_PHASE_LOG": str(log)})
    end = r["start"] + r["wall_s"]
    marks = [json.loads(line) for line in log.read_text().splitlines()] if log.exists() else []
    phases: list[list] = [["start", (marks[0]["t"] if marks else end) - r["start"]]]
    for i, m in enumerate(marks):
        stop = marks[i + 1]["t"] if i + 1 < len(marks) else end
        if phases[-1][0] == m["phase"] and i > 0:
            phases[-1][1] += stop - m["t"]
        else:
            phases.append([m["phase"], stop - m["t"]])
    return {"phases": phases, "wall": r["wall_s"], "rss": r["rss"], "rc": r["rc"]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sizes", default="124m", help="GPT-2 folder sizes (comma-separated; empty for zoo only)")
    ap.add_argument("--cache", default=os.path.join(tempfile.gettempdir(), "normconv_bench_scale"))
    ap.add_argument("--out", default=str(ROOT / "benchmarks/results/phase_profile.md"))
    a = ap.parse_args()

    cases = [(" ".join(c), c) for c in ZOO]
    for size in [s for s in a.sizes.split(",") if s]:
        folder = build(size, Path(a.cache))
        cases += [(" ".join(c).replace("{dir}", f"GPT-2 {size} folder"), [x.replace("{dir}", str(folder)) for x in c])
                  for c in FOLDER]
    load = os.getloadavg()
    lines = ["# phase_profile", "",
             f"`python benchmarks/phase_profile.py --sizes {a.sizes}` — {time.strftime('%Y-%m-%d %H:%M')}, "
             f"{platform.machine()}, {os.cpu_count()} cores, load average {load[0]:.1f} / {load[1]:.1f} / "
             f"{load[2]:.1f} at start; one run each, seconds per phase (module docstring).", "",
             "| command | rc | wall s | peak RSS GiB | phases (s) |", "|---|---|---|---|---|"]
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp) / "out"  # emptied before each command (``measure``): the log lives beside it
        work.mkdir()
        for label, args in cases:
            r = profile([x.replace("{out}", str(work)) for x in args], work, Path(tmp) / "phases.jsonl")
            shown = label.replace("{out}/", "")
            spent = ", ".join(f"{name} {s:.2f}" for name, s in r["phases"])
            lines.append(f"| `{shown}` | {r['rc']} | {r['wall']:.2f} | {r['rss'] / 2**30:.2f} | {spent} |")
            print(lines[-1], file=sys.stderr)
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text("\n".join(lines) + "\n")
    print(f"wrote {a.out}", file=sys.stderr)


if __name__ == "__main__":
    main()
