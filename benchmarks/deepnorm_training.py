"""DeepNorm in miniature: a deep, narrow post-LN transformer trained three ways from the same seed and learning rate.

  post-LN   the zoo's post-LN encoder layers (x = LN(x + f(x))), PyTorch default init
  deepnorm  the same model after ``normconv.passes.deepnorm.deepnorm`` (LN(alpha x + f(x)), beta Xavier init)
  pre-LN    the same weights arranged pre-LN (x = x + f(LN(x))) with a final LN

Task: reverse a random token sequence (encoder-only, per-position cross-entropy). Adam, constant learning rate,
no warm-up (the setting in which the paper reports post-LN instability). Writes the loss curves to
benchmarks/results/deepnorm_loss.png and the table to benchmarks/results/deepnorm.md.

    python benchmarks/deepnorm_training.py [--layers 32] [--steps 500] [--lr 1e-3] [--stem deepnorm]
"""

from __future__ import annotations

import argparse
import math
import os
import sys
import time
from pathlib import Path

import torch
import torch.nn as nn
import torch.nn.functional as F

from normconv.models.transformer import BertEncoder, PostLNEncoderLayer
from normconv.api import deepnorm
from normconv.verify import Inputs

RESULTS = Path(__file__).parent / "results"


class PreLNEncoderLayer(PostLNEncoderLayer):
    """The same sublayers arranged pre-LN: x = x + attn(attn_norm(x)); x = x + ffn(ffn_norm(x))."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.attn_norm(x))
        return x + self.ffn(self.ffn_norm(x))


class Reverser(nn.Module):
    """Token + position embeddings, a stack of encoder layers, a linear head over the vocabulary."""

    def __init__(self, vocab: int, hidden: int, heads: int, layers: int, ffn: int, pre_ln: bool = False):
        super().__init__()
        self.encoder = BertEncoder(vocab=vocab, hidden=hidden, heads=heads, layers=layers, ffn=ffn, eps=1e-5)
        if pre_ln:
            self.encoder.layers = nn.ModuleList(PreLNEncoderLayer(hidden, heads, ffn, 1e-5) for _ in range(layers))
            self.final_norm = nn.LayerNorm(hidden)
        else:
            self.final_norm = nn.Identity()
        self.head = nn.Linear(hidden, vocab)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.head(self.final_norm(self.encoder(ids)))


def batch(g: torch.Generator, n: int, seq: int, vocab: int) -> tuple[torch.Tensor, torch.Tensor]:
    x = torch.randint(0, vocab, (n, seq), generator=g)
    return x, x.flip(1)


def train(model: nn.Module, args, label: str) -> dict:
    torch.manual_seed(args.seed + 1)  # dropout-free model; the seed fixes nothing else, kept for clarity
    g = torch.Generator().manual_seed(args.seed + 2)  # the same batches for every variant
    opt = torch.optim.Adam(model.parameters(), lr=args.lr)
    model.train()
    losses, grad_norms = [], []
    t0 = time.perf_counter()
    for step in range(args.steps):
        x, y = batch(g, args.batch, args.seq, args.vocab)
        loss = F.cross_entropy(model(x).flatten(0, 1), y.flatten())
        opt.zero_grad(set_to_none=True)
        loss.backward()
        gn = torch.nn.utils.clip_grad_norm_(model.parameters(), float("inf"))  # measure only, no clipping
        grad_norms.append(float(gn))
        losses.append(loss.item())
        if not math.isfinite(losses[-1]):
            break
        opt.step()
    secs = time.perf_counter() - t0
    tail = losses[-20:]
    final = sum(tail) / len(tail)
    chance = math.log(args.vocab)
    if not all(math.isfinite(v) for v in losses):
        verdict = "diverged (non-finite loss)"
    elif final > 0.9 * chance:
        verdict = "did not train (loss stays near chance)"
    elif final > max(min(losses) * 3, 0.5):
        verdict = "unstable (loss rose again)"
    else:
        verdict = "converged" if final < 0.1 * chance else "training (not yet converged)"
    print(f"{label:9s} final loss {final:.4f}  min {min(losses):.4f}  max grad norm {max(grad_norms):.3g}  "
          f"{verdict}  ({secs:.1f}s)", flush=True)
    escape = next((i for i, v in enumerate(losses) if v < 1.0), None)  # left the near-chance plateau
    return {"label": label, "losses": losses, "final": final, "escape": escape, "min": min(losses), "verdict": verdict, "secs": secs,
            "max_grad": max(grad_norms), "first_grad": grad_norms[0]}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--layers", type=int, default=32)
    p.add_argument("--hidden", type=int, default=32)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--ffn", type=int, default=64)
    p.add_argument("--vocab", type=int, default=16)
    p.add_argument("--seq", type=int, default=12)
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--steps", type=int, default=500)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=1)  # 2 threads on a loaded 2-core box is 5x slower
    p.add_argument("--no-plot", action="store_true")
    p.add_argument("--stem", default="deepnorm", help="results/STEM.md and results/STEM_loss.png")
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    dims = dict(vocab=args.vocab, hidden=args.hidden, heads=args.heads, layers=args.layers, ffn=args.ffn)

    torch.manual_seed(args.seed)
    post = Reverser(**dims)
    state = post.state_dict()
    x, _ = batch(torch.Generator().manual_seed(99), 2, args.seq, args.vocab)
    t0 = time.perf_counter()
    deep, report = deepnorm(post, Inputs((x,)), seed=args.seed)
    dn_secs = time.perf_counter() - t0
    stack = report.extra["stacks"]["encoder"]
    applied = sum(s.applied for s in report.sites)
    print(f"deepnorm: {applied} sublayers, N={stack['layers']} alpha={stack['alpha']:.4f} beta={stack['beta']:.4f} "
          f"reference check max abs err {report.validation[0].max_abs_error:.2g} ({dn_secs:.1f}s)", flush=True)
    pre = Reverser(**dims, pre_ln=True)
    missing = pre.load_state_dict(state, strict=False)
    assert not missing.unexpected_keys and all(k.startswith("final_norm") for k in missing.missing_keys)

    runs = [train(post, args, "post-LN"), train(deep, args, "deepnorm"), train(pre, args, "pre-LN")]
    write(args, runs, stack, applied, report)


def write(args, runs, stack, applied, report) -> None:
    RESULTS.mkdir(exist_ok=True)
    png = RESULTS / f"{args.stem}_loss.png"
    if not args.no_plot:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, ax = plt.subplots(figsize=(7, 4))
        for r in runs:
            ax.plot([v if math.isfinite(v) else float("nan") for v in r["losses"]], label=f"{r['label']} ({r['verdict']})")
        ax.axhline(math.log(args.vocab), color="gray", ls=":", lw=1, label="chance (ln V)")
        ax.set_xlabel("step")
        ax.set_ylabel("cross-entropy")
        ax.set_yscale("log")
        ax.set_title(f"{args.layers} layers x 2 sublayers, d={args.hidden}, Adam lr={args.lr:g}, no warm-up")
        ax.legend(fontsize=8)
        fig.tight_layout()
        fig.savefig(png, dpi=110)
    cmd = "python " + " ".join(["benchmarks/deepnorm_training.py", *sys.argv[1:]])
    lines = [
        "# deepnorm: training a deep post-LN transformer three ways",
        "",
        f"Command: `{cmd}` (torch {torch.__version__}, CPU, {args.threads} threads, load average {os.getloadavg()[0]:.1f} at the end).",
        "",
        f"Model: {args.layers} post-LN encoder layers x 2 sublayers = {2 * args.layers} sublayers, hidden {args.hidden}, "
        f"{args.heads} heads, FFN {args.ffn}; task: reverse a random sequence of {args.seq} tokens over a vocabulary "
        f"of {args.vocab} (chance loss ln {args.vocab} = {math.log(args.vocab):.3f}). Adam, lr {args.lr:g} constant, "
        f"no warm-up, batch {args.batch}, {args.steps} steps, the same seed, initial weights and batches for every "
        f"variant (DeepNorm re-initializes FFN/v/out with Xavier gain beta and q/k with gain 1, as the paper does).",
        "",
        f"normconv deepnorm found {applied} post-LN sublayers, counted N = {stack['layers']} "
        f"({stack['counted_from']}), alpha = (2N)^(1/4) = {stack['alpha']:.4f}, beta = (8N)^(-1/4) = "
        f"{stack['beta']:.4f}; its reference check (rewritten model vs literal LN(alpha*x + f(x))) max abs error "
        f"{report.validation[0].max_abs_error:.2g}.",
        "",
        "| variant | final loss (mean of last 20 steps) | min loss | first step with loss < 1 | grad norm step 0 "
        "| max grad norm | outcome | train time |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in runs:
        lines.append(f"| {r['label']} | {r['final']:.4f} | {r['min']:.4f} | {r['escape']} | {r['first_grad']:.3g} "
                     f"| {r['max_grad']:.3g} "
                     f"| {r['verdict']} | {r['secs']:.0f} s |")
    lines += ["", f"Loss curves: `{png.name}` (log scale).", ""]
    (RESULTS / f"{args.stem}.md").write_text("\n".join(lines))
    print(f"wrote {RESULTS / (args.stem + '.md')}" + ("" if args.no_plot else f" and {png}"))


if __name__ == "__main__":
    main()
