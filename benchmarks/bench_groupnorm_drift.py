"""Drift of `swap --to groupnorm` (and instancenorm) on a trained model, before and after a short fine-tune, and what
`recalibrate` does for a BatchNorm model whose input moved: a toy pitch task (noisy sinusoids, 12 frequency classes),
the small CREPE-like model the tests train (conv -> relu -> BatchNorm -> max pool, x3), all measured in one run.

  drift        against the trained BatchNorm model on held-out inputs: max abs error of the outputs, cosine, argmax
               agreement, and task accuracy
  fine-tune    the converted model trained on the task labels for --steps Adam steps (lr 1e-3, batch 64)
  distill      the converted model trained to reproduce the BatchNorm model's outputs (MSE) for --steps steps
  recalibrate  the BatchNorm model on inputs with another gain and offset, before and after `normconv recalibrate`
               on 256 of them (cumulative-average statistics: 4 batches of 64)

    python benchmarks/bench_groupnorm_drift.py [--steps 60] [--out benchmarks/results/groupnorm_drift.md]
"""

from __future__ import annotations

import argparse
import copy
import os
import platform
import sys
import time
import warnings
from pathlib import Path

import torch
import torch.nn.functional as F

warnings.filterwarnings("ignore")
torch.set_num_threads(max(1, min(2, os.cpu_count() or 1)))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))

import bn_styles as B  # noqa: E402
import normconv  # noqa: E402


def drift(model, reference, x, y) -> dict[str, float]:
    with torch.no_grad():
        a, b = model(x), reference(x)
    return {"max_abs": float((a - b).abs().max()), "cosine": float(F.cosine_similarity(a.flatten(), b.flatten(), 0)),
            "agree": float((a.argmax(-1) == b.argmax(-1)).float().mean()), "acc": B.accuracy(model, x, y)}


def train(model, steps: int, x, y, teacher=None) -> None:
    """Adam, lr 1e-3, batch 64: on the labels, or on the teacher's outputs (distillation)."""
    model.train()
    opt = torch.optim.Adam([p for p in model.parameters() if p.requires_grad], lr=1e-3)
    g = torch.Generator().manual_seed(1)
    for _ in range(steps):
        i = torch.randint(0, len(x), (64,), generator=g)
        out = model(x[i])
        if teacher is None:
            loss = F.binary_cross_entropy(out, F.one_hot(y[i], 12).float())
        else:
            with torch.no_grad():
                target = teacher(x[i])
            loss = F.mse_loss(out, target)
        opt.zero_grad()
        loss.backward()
        opt.step()
    model.eval()


def row(label: str, d: dict[str, float], ref_acc: float) -> str:
    return (f"| {label} | {d['max_abs']:.3g} | {d['cosine']:.4f} | {d['agree']:.3f} | {d['acc']:.3f} "
            f"({d['acc'] - ref_acc:+.3f}) |")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--out", default="benchmarks/results/groupnorm_drift.md")
    args = ap.parse_args()
    t0 = time.time()
    model = B.trained_crepe("constant")
    x_train, y_train = B.toy_pitch(2048, seed=0)
    x, y = B.toy_pitch(1024, seed=7)  # held out
    ref_acc = B.accuracy(model, x, y)
    lines = ["## BatchNorm -> GroupNorm / InstanceNorm: drift before and after a short fine-tune; recalibrate", "",
             "Command: `python benchmarks/bench_groupnorm_drift.py`  ",
             f"Machine: {platform.machine()}, {os.cpu_count()} CPUs, torch {torch.__version__}; the small CREPE-like "
             f"model of the tests, trained 60 steps on the toy pitch task (held-out accuracy {ref_acc:.3f}); drift "
             f"measured on 1024 held-out inputs against that BatchNorm model; fine-tune / distill: {args.steps} "
             f"Adam steps (lr 1e-3, batch 64)", "",
             "| model | max abs drift | cosine | argmax agreement | accuracy (vs BN) |", "|---|---|---|---|---|",
             row("BatchNorm model (reference)", drift(model, model, x, y), ref_acc)]
    for to in ("groupnorm", "groupnorm:2", "instancenorm"):
        converted, report = normconv.swap(model, x[:4], to=to)
        groups = sorted({m.num_groups for m in converted.modules() if isinstance(m, torch.nn.GroupNorm)})
        what = f"{to} (G = {', '.join(map(str, groups))})" if groups else to
        lines.append(row(f"`--to {what}`", drift(converted, model, x, y), ref_acc))
        tuned = copy.deepcopy(converted)
        train(tuned, args.steps, x_train, y_train)
        lines.append(row(f"`--to {to}` + fine-tune on labels", drift(tuned, model, x, y), ref_acc))
        distilled = copy.deepcopy(converted)
        train(distilled, args.steps, x_train, y_train, teacher=model)
        lines.append(row(f"`--to {to}` + distill from the BN model", drift(distilled, model, x, y), ref_acc))
        print("\n".join(lines[-3:]), flush=True)
    # recalibrate: the input moved (gain 3, offset 0.5): the running statistics no longer describe it
    shift = lambda v: v * 3.0 + 0.5  # noqa: E731
    xs = shift(x)
    lines += ["", "| BatchNorm model on inputs x * 3 + 0.5 | accuracy |", "|---|---|",
              f"| as trained (statistics of the old inputs) | {B.accuracy(model, xs, y):.3f} |"]
    recal, report = normconv.recalibrate(model, shift(x_train[:256]), batch_size=64)
    lines.append(f"| after `normconv recalibrate` on 256 moved inputs (4 batches) | {B.accuracy(recal, xs, y):.3f} |")
    changes = report.extra["changes"]
    lines.append("")
    lines.append("recalibrate's report, per site: " + "; ".join(
        f"{k}: mean moved {v['max_mean_shift']:.2f} old std, var x{v['min_var_ratio']:.2f}-{v['max_var_ratio']:.2f}"
        for k, v in changes.items()) + f"; every other tensor bit-identical ({report.extra['unchanged_tensors']} "
        f"checked); the recalibrated model equals the original given the new statistics "
        f"(max abs {report.validation[-1].max_abs_error:.2g})")
    lines.append(f"\n(total {time.time() - t0:.0f} s)")
    text = "\n".join(lines) + "\n"
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(text)
    print(text)


if __name__ == "__main__":
    main()
