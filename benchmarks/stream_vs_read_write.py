"""Benchmark: ``normconv swap --stream`` (and ``fold --stream``) against the floor of reading and writing the same
bytes, on a ladder of pre-LN checkpoints with random weights saved sharded (GPT-2 124M fp32, OPT-style 1.3B to 13B
bf16) and of BatchNorm CNNs (ResNet-50 / ResNet-152 shapes, fp32, for fold).

Each rung's checkpoint is generated shard by shard (the model is never built with real weights: its names and
shapes come from the config on the meta device), so the generator itself needs no more than one shard of memory.
Then, side by side in the same run, each as its own process (peak RSS from ``os.wait4``):
  floor    every tensor read with safetensors.safe_open and written back, a tensor at a time, into shards of the
           same names (normconv.stream.checkpoint.ShardWriter): the I/O any streaming rewrite has to do
  floor + fsync  the same, each shard fsynced before it is closed
  floor-pread  (``--pread``) with normconv's reader (a positioned read per tensor into its own buffer, no mapping)
  normconv ``python -m normconv.cli swap IN --to rmsnorm --stream -o OUT`` (``fold IN --stream -o OUT`` for the CNN
           rungs): plan on meta, then one pass in block order (each block read once, rewritten, run through the
           original and the rewritten model at two shapes, written), then the written shards read back by checksum
  before   with ``--before COMMIT``: the same command run by COMMIT's code (git archive, real_sizes_vs_floor's
           before_tree), right before this code's run, on the same checkpoint
The folders are deleted after each rung.

    python benchmarks/stream_vs_read_write.py [--rungs 124m,1.3b] [--root DIR] [--out benchmarks/results/stream.md]
                                              [--before COMMIT] [--rounds 3] [--pread]

Every case runs ``--rounds`` times, interleaved with the others, ``sync`` before each; the table gives the best and
the median wall time, the best run's peak RSS, and the ratios to the floor with and without an fsync of what it
wrote (normconv's output is fsynced before it is renamed into place: the floor without one can end before its
bytes are on the disk; 7.5 to 20.7 s for the same 13.3 GB on this machine).
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

import torch

# name -> (transformers class, config kwargs, dtype)
RUNGS = {
    "124m": ("GPT2LMHeadModel", "GPT2Config", dict(n_embd=768, n_layer=12, n_head=12), torch.float32),
    "1.3b": ("OPTForCausalLM", "OPTConfig", dict(hidden_size=2048, num_hidden_layers=24, ffn_dim=8192,
                                                 num_attention_heads=32, word_embed_proj_dim=2048), torch.bfloat16),
    "2.7b": ("OPTForCausalLM", "OPTConfig", dict(hidden_size=2560, num_hidden_layers=32, ffn_dim=10240,
                                                 num_attention_heads=32, word_embed_proj_dim=2560), torch.bfloat16),
    "6.7b": ("OPTForCausalLM", "OPTConfig", dict(hidden_size=4096, num_hidden_layers=32, ffn_dim=16384,
                                                 num_attention_heads=32, word_embed_proj_dim=4096), torch.bfloat16),
    # larger than this machine's RAM (23 GB): OPT-13B's shape, 25.7 GB of bf16 on disk
    "13b": ("OPTForCausalLM", "OPTConfig", dict(hidden_size=5120, num_hidden_layers=40, ffn_dim=20480,
                                                num_attention_heads=40, word_embed_proj_dim=5120), torch.bfloat16),
    # BatchNorm CNNs for fold --stream: ResNet-50 and ResNet-152's shapes (bottleneck blocks)
    "resnet50": ("ResNetForImageClassification", "ResNetConfig",
                 dict(embedding_size=64, hidden_sizes=[256, 512, 1024, 2048], depths=[3, 4, 6, 3],
                      layer_type="bottleneck", num_labels=1000), torch.float32),
    "resnet152": ("ResNetForImageClassification", "ResNetConfig",
                  dict(embedding_size=64, hidden_sizes=[256, 512, 1024, 2048], depths=[3, 8, 36, 3],
                       layer_type="bottleneck", num_labels=1000), torch.float32),
}
COMMAND = {"resnet50": "fold", "resnet152": "fold"}  # the streamed command each rung runs (default: swap)
_TEXT_ONLY = dict(vocab_size=50272, max_position_embeddings=2048, use_cache=False)
SHARD_BYTES = 1 << 30  # 1 GiB shards


def make_checkpoint(rung: str, folder: Path) -> tuple[int, int]:
    """A sharded safetensors folder with random weights for ``rung``; returns (parameters, bytes)."""
    import transformers

    from normconv.stream.checkpoint import INDEX, ShardWriter

    cls_name, cfg_name, kwargs, dtype = RUNGS[rung]
    config = getattr(transformers, cfg_name)(**({} if rung in COMMAND else _TEXT_ONLY), **kwargs)
    config.architectures = [cls_name]
    config.dtype = str(dtype).removeprefix("torch.")
    with torch.device("meta"):
        model = getattr(transformers, cls_name)(config)
    seen, entries = set(), []
    for name, t in model.named_parameters():  # tied weights once (as save_pretrained writes them)
        if id(t) not in seen:
            seen.add(id(t))
            entries.append((name, dtype, tuple(t.shape)))
    for name, t in model.named_buffers():  # BatchNorm statistics (and its int64 counter)
        if name.rsplit(".", 1)[-1] in ("running_mean", "running_var", "num_batches_tracked"):
            entries.append((name, dtype if t.is_floating_point() else t.dtype, tuple(t.shape)))
    folder.mkdir(parents=True)
    config.save_pretrained(folder)
    shards, cur, size = [], [], 0
    for e in entries:
        nbytes = torch.Size(e[2]).numel() * dtype.itemsize
        if cur and size + nbytes > SHARD_BYTES:
            shards.append(cur)
            cur, size = [], 0
        cur.append(e)
        size += nbytes
    shards.append(cur)
    g = torch.Generator().manual_seed(0)
    weight_map, total = {}, 0
    for i, shard in enumerate(shards):
        fname = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        w = ShardWriter(folder / fname, shard, {"format": "pt"})
        for name, dt, shape in shard:
            if name.endswith("num_batches_tracked"):
                t = torch.zeros(shape, dtype=dt)
            elif name.endswith("running_var"):
                t = 0.5 + 1.5 * torch.rand(shape, generator=g)  # positive variances
            elif name.endswith("running_mean"):
                t = 0.1 * torch.randn(shape, generator=g)
            elif name.endswith("norm.weight") or ".ln_" in name and name.endswith(".weight") or \
                    "layer_norm.weight" in name or "normalization.weight" in name:
                t = 1 + 0.1 * torch.randn(shape, generator=g)  # norm gains around 1
            else:
                t = 0.02 * torch.randn(shape, generator=g)  # weights, biases, norm biases: all nonzero
            w.write(name, t.to(dt))
            weight_map[name] = fname
            total += t.numel() * dt.itemsize
            del t
        w.check()
        w.f.close()
    (folder / INDEX).write_text(json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=2))
    return sum(torch.Size(e[2]).numel() for e in entries), total


FLOOR = r"""
import os, sys, json
from pathlib import Path
from safetensors import safe_open
from normconv.stream.checkpoint import ShardWriter, Checkpoint, _DTYPES
src, out = Path(sys.argv[1]), Path(sys.argv[2])
out.mkdir()
ckpt = Checkpoint(src)
for shard, header in ckpt.shards.items():
    names = ckpt.names(shard)
    w = ShardWriter(out / shard, [(n, _DTYPES[header[n]["dtype"]], tuple(header[n]["shape"])) for n in names],
                    header.get("__metadata__"))
    if sys.argv[3] == "safe_open":
        with safe_open(str(src / shard), framework="pt") as f:
            for n in names:
                w.write(n, f.get_tensor(n))
    else:
        for n in names:
            w.write(n, ckpt.get(n))
    w.check()
    if sys.argv[4:] == ["fsync"]:  # the bytes on disk, as normconv's output is before it is renamed into place
        os.fsync(w.f.fileno())
    w.f.close()
"""


def measure(cmd: list[str], path: Path | None = None) -> tuple[float, float, int]:
    """(wall seconds, peak RSS GB, exit code) of one process (``path``: the normconv tree it imports, first)."""
    t = time.perf_counter()
    env = {**os.environ, "PYTHONWARNINGS": "ignore"}
    if path is not None:
        env["PYTHONPATH"] = str(path)
    # run from the temp folder: ``python -m`` puts the working directory first on sys.path (a checkout's normconv
    # would shadow ``path``)
    p = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env, cwd=tempfile.gettempdir())
    _, status, usage = os.wait4(p.pid, 0)
    wall = time.perf_counter() - t
    out, err = p.stdout.read(), p.stderr.read()
    code = os.waitstatus_to_exitcode(status)
    if code != 0:
        sys.stderr.write(err.decode()[-2000:])
    p.stdout.close()
    p.stderr.close()
    return wall, usage.ru_maxrss / 1e6, code


def _load() -> str:
    return "/".join(f"{x:.2f}" for x in os.getloadavg())


def _stats(runs: list[tuple[float, float, int]]) -> tuple[float, float, float, int]:
    """(best wall, median wall, peak RSS of the best run, worst exit code) of a case's rounds."""
    walls = sorted(r[0] for r in runs)
    best = min(runs, key=lambda r: r[0])
    return walls[0], walls[len(walls) // 2], best[1], max((r[2] for r in runs), key=abs)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rungs", default="124m,1.3b,2.7b")
    ap.add_argument("--root", default=None, help="folder for the checkpoints (default: a temp folder)")
    ap.add_argument("--out", default="benchmarks/results/stream.md")
    ap.add_argument("--before", default=None, help="a commit: its normconv too, run just before this code's")
    ap.add_argument("--rounds", type=int, default=3, help="each case this many times, interleaved (best, median)")
    ap.add_argument("--pread", action="store_true", help="also the floor with normconv's own reader")
    args = ap.parse_args()
    root = Path(args.root or tempfile.mkdtemp(prefix="normconv-bench-stream-")).resolve()
    before = None
    if args.before:
        sys.path.insert(0, str(Path(__file__).resolve().parent))
        from real_sizes_vs_floor import before_tree

        before = before_tree(args.before, root)
    rows = ["| model | params | dtype | on disk | case | best | median | peak RSS (best run) | time / floor (best, "
            "median) | time / floor + fsync (best, median) | RSS / floor |", "|---|---|---|---|---|---|---|---|---|---|---|"]
    details = []
    for rung in args.rungs.split(","):
        folder = root / rung
        t = time.perf_counter()
        params, nbytes = make_checkpoint(rung, folder)
        made = time.perf_counter() - t
        command = COMMAND.get(rung, "swap")
        out = root / f"{rung}-out"
        nc_cmd = ([sys.executable, "-m", "normconv.cli", command, str(folder)]
                  + (["--to", "rmsnorm"] if command == "swap" else []) + ["--stream", "-o", str(out), "--json"])
        floor = [sys.executable, "-c", FLOOR, str(folder), str(out)]
        cases = {"floor: safe_open + write": (floor + ["safe_open"], None),
                 "floor: safe_open + write + fsync": (floor + ["safe_open", "fsync"], None)}
        if args.pread:
            cases["floor: pread + write"] = (floor + ["pread"], None)
        if before is not None:
            cases[f"normconv before ({args.before})"] = (nc_cmd, before)
        cases["normconv --stream"] = (nc_cmd, None)
        runs: dict[str, list] = {c: [] for c in cases}
        loads = [_load()]
        for _ in range(args.rounds):  # the cases interleaved, so a slow spell of the machine hits all of them
            for case, (cmd, path) in cases.items():
                os.sync()  # no case meets the dirty pages of the one before
                w, m, code = measure(cmd, path)
                ok = code == 0 and out.exists()
                shutil.rmtree(out, ignore_errors=True)
                runs[case].append((w, m, code if ok or code else -1))
        loads.append(_load())
        shutil.rmtree(folder, ignore_errors=True)
        dtype = str(RUNGS[rung][3]).removeprefix("torch.")
        f_best, f_med, f_rss, _ = _stats(runs["floor: safe_open + write"])
        s_best, s_med, _, _ = _stats(runs["floor: safe_open + write + fsync"])
        for case, got in runs.items():
            best, med, rss, code = _stats(got)
            rows.append(f"| {rung} ({RUNGS[rung][0]}, {command}) | {params / 1e9:.2f} B | {dtype} | "
                        f"{nbytes / 1e9:.2f} GB | {case}{'' if code == 0 else f' (exit {code})'} | {best:.1f} s | "
                        f"{med:.1f} s | {rss:.2f} GB | {best / f_best:.2f}x, {med / f_med:.2f}x | "
                        f"{best / s_best:.2f}x, {med / s_med:.2f}x | {rss / f_rss:.2f}x |")
            print(rows[-1], flush=True)
        details.append(f"{rung}: generated in {made:.1f} s; {args.rounds} rounds; load average (1/5/15 min) "
                       f"{loads[0]} before, {loads[1]} after; every run's (wall s, RSS GB, exit): "
                       + "; ".join(f"{c}: " + ", ".join(f"({w:.1f}, {m:.2f}, {e})" for w, m, e in r)
                                   for c, r in runs.items()))
        Path(args.out).write_text("\n".join(rows + [""] + details) + "\n")  # each rung as soon as it is measured
    text = "\n".join([f"machine: {platform.machine()}, {os.cpu_count()} cores, torch {torch.__version__}", ""]
                     + rows + [""] + details) + "\n"
    Path(args.out).write_text(text)
    print(text)


if __name__ == "__main__":
    main()
