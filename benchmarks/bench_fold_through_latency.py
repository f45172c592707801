"""Latency of the partial fold (fold-through): the model `normconv fold` writes against the unfolded one, eager torch
and onnxruntime CPU, side by side in one run.

Models: CREPE's layout (zero pad -> conv -> relu -> BatchNorm -> max pool, six blocks, then permute + reshape ->
linear) at torchcrepe's "tiny" widths (capacity 4: 128, 16, 16, 16, 32, 64 channels, 1024-sample frames), with zero
padding (the shifts stay as per-channel adds) and with replicate padding (every BatchNorm absorbed); and the small
CREPE-like model the tests train for a few seconds. Variants, interleaved round by round (median of rounds):
  unfolded   the model as given (BatchNorm after each relu: neither torch nor onnxruntime folds it)
  fold       `normconv.fold` (fold-through: scale into the conv, shift into the next layer or a ChannelAffine add)
  no BN      every BatchNorm replaced by the identity: the floor a fold can reach (not the same function)

    python benchmarks/bench_fold_through_latency.py [--rounds 7] [--out benchmarks/results/fold_through.md]
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import sys
import tempfile
import time
import warnings
from pathlib import Path

import torch
import torch.nn as nn

warnings.filterwarnings("ignore")
torch.set_num_threads(max(1, min(2, os.cpu_count() or 1)))
torch.set_flush_denormal(True)
sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))

import bn_styles as B  # noqa: E402
import normconv  # noqa: E402


def crepe_tiny(pad_mode: str) -> nn.Module:
    """torchcrepe's Crepe('tiny') layout: kernels (512, 64 x5), strides (4, 1 x5), pads (254/254, 31/32)."""

    class CrepeTiny(nn.Module):
        def __init__(self):
            super().__init__()
            ch = [1, 128, 16, 16, 16, 32, 64]
            k = [512, 64, 64, 64, 64, 64]
            self.convs = nn.ModuleList(nn.Conv2d(ch[i], ch[i + 1], (k[i], 1), stride=(4 if i == 0 else 1, 1))
                                       for i in range(6))
            self.bns = nn.ModuleList(nn.BatchNorm2d(c, eps=0.0010000000474974513, momentum=0.0) for c in ch[1:])
            self.classifier = nn.Linear(64 * 4, 360)

        def forward(self, x):
            x = x[:, None, :, None]
            for i, (conv, bn) in enumerate(zip(self.convs, self.bns)):
                pad = (0, 0, 254, 254) if i == 0 else (0, 0, 31, 32)
                x = torch.nn.functional.pad(x, pad, mode=pad_mode)
                x = torch.nn.functional.max_pool2d(bn(torch.relu(conv(x))), (2, 1), (2, 1))
            x = x.permute(0, 2, 1, 3).reshape(-1, self.classifier.in_features)
            return torch.sigmoid(self.classifier(x))

    torch.manual_seed(0)
    model = B.randomize(CrepeTiny()).eval()
    with torch.no_grad():  # trained BatchNorms mostly scale up (positive gamma): the max pool then passes the rest
        for bn in model.bns:
            bn.weight.abs_()
    return model


def no_bn(model: nn.Module) -> nn.Module:
    import copy

    m = copy.deepcopy(model)
    for name, mod in list(m.named_modules()):
        if isinstance(mod, nn.modules.batchnorm._BatchNorm):
            parent, _, attr = name.rpartition(".")
            setattr(m.get_submodule(parent) if parent else m, attr, nn.Identity())
    return m


def ort_session(model: nn.Module, x: torch.Tensor, path: str):
    import onnxruntime as ort

    torch.onnx.export(model, (x,), path, dynamo=True, external_data=False, verbose=False)
    opts = ort.SessionOptions()
    opts.intra_op_num_threads = torch.get_num_threads()
    sess = ort.InferenceSession(path, opts, providers=["CPUExecutionProvider"])
    name = sess.get_inputs()[0].name
    import onnx

    ops = [n.op_type for n in onnx.load(path).graph.node]
    return (lambda: sess.run(None, {name: x.numpy()})), ops


def timed(fns: dict, rounds: int, reps: int) -> dict[str, float]:
    """Median over rounds of the mean of ``reps`` calls, the variants interleaved within each round."""
    for fn in fns.values():
        fn()
    times: dict[str, list[float]] = {k: [] for k in fns}
    for _ in range(rounds):
        for k, fn in fns.items():
            t0 = time.perf_counter()
            for _ in range(reps):
                fn()
            times[k].append((time.perf_counter() - t0) / reps)
    return {k: statistics.median(v) * 1e3 for k, v in times.items()}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--out", default="benchmarks/results/fold_through.md")
    args = ap.parse_args()
    cases = [
        ("CREPE tiny, zero pad (64,1024)", crepe_tiny("constant"), torch.randn(64, 1024), 3),
        ("CREPE tiny, replicate pad (64,1024)", crepe_tiny("replicate"), torch.randn(64, 1024), 3),
        ("trained CREPE-like, zero pad (256,64)", B.trained_crepe("constant"), B.toy_pitch(256, seed=2)[0], 20),
        ("trained CREPE-like, reflect pad (256,64)", B.trained_crepe("reflect"), B.toy_pitch(256, seed=2)[0], 20),
    ]
    load = os.getloadavg()[0]
    lines = ["## fold-through (partial fold): latency of the folded model against the unfolded one", "",
             f"Command: `python benchmarks/bench_fold_through_latency.py`  ",
             f"Machine: {platform.machine()}, {os.cpu_count()} CPUs, torch {torch.__version__}, "
             f"{torch.get_num_threads()} threads, load average {load:.1f} at start; median of {args.rounds} "
             f"interleaved rounds, ratio = time / unfolded time", "",
             "| model | backend | unfolded ms | fold | no BN (floor) | fold vs floor | BatchNormalization ops: unfolded -> fold | fold: what it did | max abs err |",
             "|---|---|---|---|---|---|---|---|---|"]
    with tempfile.TemporaryDirectory() as tmp:
        for label, model, x, reps in cases:
            folded, report = normconv.fold(model, x[:4])
            err = float((folded(x) - model(x)).abs().max())
            floor = no_bn(model)
            did = ", ".join(f"{sum(s.code == c for s in report.sites)} {c}" for c in
                            dict.fromkeys(str(s.code) for s in report.sites if s.applied))
            with torch.no_grad():
                eager = timed({"unfolded": lambda: model(x), "fold": lambda: folded(x), "floor": lambda: floor(x)},
                              args.rounds, reps)
            sessions = {k: ort_session(m, x, f"{tmp}/{k}.onnx") for k, m in
                        (("unfolded", model), ("fold", folded), ("floor", floor))}
            ort = timed({k: v[0] for k, v in sessions.items()}, args.rounds, reps)
            bn_ops = {k: v[1].count("BatchNormalization") for k, v in sessions.items()}
            for backend, t in (("eager torch", eager), ("onnxruntime CPU", ort)):
                lines.append(f"| {label} | {backend} | {t['unfolded']:.3f} | {t['fold'] / t['unfolded']:.3f}x | "
                             f"{t['floor'] / t['unfolded']:.3f}x | {t['fold'] / t['floor']:.3f} | "
                             f"{bn_ops['unfolded']} -> {bn_ops['fold']} | {did} | {err:.2g} |")
            print(lines[-2], lines[-1], sep="\n", flush=True)
    text = "\n".join(lines) + "\n"
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(text)
    print(text)


if __name__ == "__main__":
    main()
