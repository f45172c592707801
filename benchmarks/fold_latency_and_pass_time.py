"""Benchmark `normconv fold`: inference time and pass time, side by side in one run.

1. Inference, eager torch and onnxruntime CPU: unfolded model vs normconv fold vs the same architecture with
   no BN at all (BN -> Identity: the physical limit of folding) vs torch.fx.experimental.optimization.fuse.
2. A BN with no foldable neighbour: torch's eval BatchNorm kernel vs a per-channel scale and shift
   (x * s + t, and torch.addcmul): decides whether the fold pass rewrites such a BN (it does not).
3. Pass running time vs model size (chains of 10 -> 3000 conv-BN-ReLU blocks; ``--ladder`` runs only this): the fold
   pass alone, ``normconv.fold`` end to end (with its verification), fuse alone, and fuse + one eager forward.

    python benchmarks/fold_latency_and_pass_time.py [--quick] [--ladder] [--threads N] [--out benchmarks/results/fold.md]

Timings interleave the variants round by round and report medians, so ratios are comparable within a run.
"""

from __future__ import annotations

import argparse
import copy
import gc
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
# deep random chains drive activations into denormals, which make CPU convs 100x slower and swamp every timing
torch.set_flush_denormal(True)

from normconv.graph.capture import capture  # noqa: E402
from normconv.models import get  # noqa: E402
from normconv.models.cnn import BasicBlock, Decoder  # noqa: E402
from normconv.api import fold  # noqa: E402
from normconv.passes.fold_batchnorm import FOLD  # noqa: E402
from normconv.clone import clone_sharing_tensors  # noqa: E402
from normconv.verify import Inputs  # noqa: E402


# -- models -------------------------------------------------------------------------------------------------


def _randomize(model: nn.Module) -> nn.Module:
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for m in model.modules():
            if isinstance(m, nn.modules.batchnorm._BatchNorm):
                m.running_mean.copy_(torch.randn(m.num_features, generator=g))
                m.running_var.copy_(torch.rand(m.num_features, generator=g) + 0.5)
    return model.eval()


class WideResNet(nn.Module):
    """ResNet-18-like trunk at 64..128 channels: the kind of model folding is for."""

    def __init__(self):
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(3, 64, 3, padding=1, bias=False), nn.BatchNorm2d(64), nn.ReLU())
        self.blocks = nn.Sequential(BasicBlock(64, 64), BasicBlock(64, 64), BasicBlock(64, 128, 2),
                                    BasicBlock(128, 128))
        self.head = nn.Linear(128, 10)

    def forward(self, x):
        return self.head(self.blocks(self.stem(x)).mean((2, 3)))


class WideMLP(nn.Module):
    def __init__(self, width: int = 512):
        super().__init__()
        layers = []
        for _ in range(4):
            layers += [nn.Linear(width, width), nn.BatchNorm1d(width), nn.ReLU()]
        self.body = nn.Sequential(*layers)

    def forward(self, x):
        return self.body(x)


class Chain(nn.Module):
    """n blocks of conv3x3 -> BN -> ReLU at 8 channels (pass-time scaling)."""

    def __init__(self, n: int, c: int = 8):
        super().__init__()
        self.body = nn.Sequential(*[nn.Sequential(nn.Conv2d(c, c, 3, padding=1, bias=False), nn.BatchNorm2d(c),
                                                  nn.ReLU()) for _ in range(n)])

    def forward(self, x):
        return self.body(x)


def inference_models(quick: bool):
    z = get("resnet")
    yield "zoo:resnet (2,3,32,32)", z.build().eval(), z.example_inputs()
    yield "wide resnet (8,3,56,56)" if not quick else "wide resnet (2,3,32,32)", _randomize(WideResNet()), \
        (torch.randn(8, 3, 56, 56) if not quick else torch.randn(2, 3, 32, 32),)
    yield "mobilenet (8,3,64,64)" if not quick else "zoo:mobilenet", get("mobilenet").build().eval(), \
        (torch.randn(8, 3, 64, 64),) if not quick else get("mobilenet").example_inputs()
    yield "deconv, grouped ConvTranspose (8,8,16,16)", _randomize(Decoder()), (torch.randn(8, 8, 16, 16),)
    yield "MLP 4x(Linear 512 + BN1d) (64,512)", _randomize(WideMLP()), (torch.randn(64, 512),)


def without_bn(model: nn.Module) -> nn.Module:
    """The same architecture with every BN removed: what a folded model cannot beat."""
    model = copy.deepcopy(model)
    for name, m in list(model.named_modules()):
        if isinstance(m, nn.modules.batchnorm._BatchNorm):
            parent, _, leaf = name.rpartition(".")
            setattr(model.get_submodule(parent) if parent else model, leaf, nn.Identity())
    return model


def torch_fuse(model: nn.Module) -> nn.Module | None:
    from torch.fx.experimental.optimization import fuse

    try:
        return fuse(model)
    except Exception:
        return None


# -- timing -------------------------------------------------------------------------------------------------


def interleaved(fns: dict[str, callable], rounds: int, inner: int) -> dict[str, float]:
    """Median seconds per call of each fn, measured round by round (each round runs every fn ``inner`` times)."""
    for f in fns.values():
        f()
        f()
    samples: dict[str, list[float]] = {k: [] for k in fns}
    for _ in range(rounds):
        for k, f in fns.items():
            t0 = time.perf_counter()
            for _ in range(inner):
                f()
            samples[k].append((time.perf_counter() - t0) / inner)
    return {k: statistics.median(v) for k, v in samples.items()}


def ort_session(model: nn.Module, args: tuple, folder: str, name: str):
    import onnxruntime as ort

    path = os.path.join(folder, f"{name}.onnx")
    with torch.no_grad():
        torch.onnx.export(model, args, path, dynamo=False, opset_version=17, do_constant_folding=True)
    opts = ort.SessionOptions()
    opts.intra_op_num_threads = torch.get_num_threads()
    # idle sessions' threads spin by default: interleaving four sessions on 2 cores would time the spinning
    opts.add_session_config_entry("session.intra_op.allow_spinning", "0")
    sess = ort.InferenceSession(path, opts, providers=["CPUExecutionProvider"])
    feed = {sess.get_inputs()[0].name: args[0].numpy()}
    return lambda: sess.run(None, feed)


def bench_inference(quick: bool, lines: list[str]) -> None:
    rounds, inner = (5, 3) if quick else (15, 10)
    lines += ["## Inference time (median of interleaved rounds; ratio = time / unfolded time)", "",
              "| model | backend | unfolded ms | normconv fold | no BN (limit) | torch fx fuse | fold vs no-BN |",
              "|---|---|---|---|---|---|---|"]
    for title, model, args in inference_models(quick):
        folded, report = fold(model, args)
        variants = {"unfolded": model, "fold": folded, "nobn": without_bn(model), "fuse": torch_fuse(model)}
        fuse_err = None
        if variants["fuse"] is not None:
            with torch.no_grad():
                fuse_err = float((variants["fuse"](*args) - model(*args)).abs().max())
        with torch.no_grad():
            eager = interleaved({k: (lambda m=m: m(*args)) for k, m in variants.items() if m is not None},
                                rounds, inner)
        _row(lines, title, "eager torch", eager, fuse_err)
        with tempfile.TemporaryDirectory() as folder:
            try:
                sessions = {k: ort_session(m, args, folder, k) for k, m in variants.items() if m is not None}
                _row(lines, title, "onnxruntime CPU", interleaved(sessions, rounds, inner), None)
            except Exception as exc:  # report, keep going
                lines.append(f"| {title} | onnxruntime CPU | export failed: {type(exc).__name__} | | | | |")
        v = report.validation[0]
        lines.append(f"| | | fold: {sum(s.applied for s in report.sites)} BN folded, max abs err "
                     f"{v.max_abs_error:.2g}" + (f"; fuse max abs err {fuse_err:.2g}" if fuse_err is not None
                                                 else "; fuse failed") + " | | | | |")
        print(lines[-1], file=sys.stderr)
    lines.append("")


def _row(lines, title, backend, t, fuse_err):
    base = t["unfolded"]
    fuse = f"{t['fuse'] / base:.2f}x" if "fuse" in t else "failed"
    lines.append(f"| {title} | {backend} | {base * 1e3:.3f} | {t['fold'] / base:.2f}x | {t['nobn'] / base:.2f}x | "
                 f"{fuse} | {t['fold'] / t['nobn']:.3f} |")
    print(lines[-1], file=sys.stderr)


def bench_lone_bn(quick: bool, lines: list[str]) -> None:
    rounds, inner = (5, 5) if quick else (15, 20)
    lines += ["## A BN with no foldable neighbour: keep the BN, or rewrite it as a scale and shift?", "",
              "| input | BN eval ms | x*s+t | addcmul(t, x, s) |", "|---|---|---|---|"]
    shapes = [(8, 64, 56, 56), (32, 256, 14, 14), (2, 16, 32, 32), (64, 512)]
    for shape in shapes[:3] if quick else shapes:
        c = shape[1]
        bn = _randomize(nn.BatchNorm2d(c) if len(shape) == 4 else nn.BatchNorm1d(c))
        s = torch.randn(c).view(1, c, *([1] * (len(shape) - 2)))
        t = torch.randn(c).view_as(s)
        x = torch.randn(shape)
        with torch.no_grad():
            r = interleaved({"bn": lambda: bn(x), "mul": lambda: x * s + t, "addcmul": lambda: torch.addcmul(t, x, s)},
                            rounds, inner)
        lines.append(f"| {shape} | {r['bn'] * 1e3:.3f} | {r['mul'] / r['bn']:.2f}x | {r['addcmul'] / r['bn']:.2f}x |")
        print(lines[-1], file=sys.stderr)
    lines.append("")


LADDER = (10, 30, 100, 300, 1000, 3000)


def bench_pass_time(quick: bool, lines: list[str]) -> None:
    """The ladder: per-block time of normconv's fold against torch.fx.experimental.optimization.fuse, interleaved."""
    from torch.fx.experimental.optimization import fuse

    sizes = LADDER[:3] if quick else LADDER
    lines += ["## Pass running time vs model size (conv3x3-BN-ReLU blocks, 8 channels, input (1,8,8,8))", "",
              "Per block, in ms (CPU time of the process / blocks; torch at "
              f"{torch.get_num_threads()} thread(s)), each size's variants interleaved round by round, best round "
              "kept. "
              "pass = the fold pass on a given capture (analysis + fold); fold = the documented "
              "`normconv.fold(model, x)` end to end (copy of the module tree, capture with its trust check, pass, "
              "verification against the original at the example shape and at a second shape: "
              f"{FOLD_FORWARDS} model forwards in all, counted below); fuse = "
              "`torch.fx.experimental.optimization.fuse(model)` (deep copy, trace, fuse; checks nothing); "
              "fuse + check = fuse and one eager forward of the fused model (the least a check costs); frozen = "
              "the same with what is alive frozen for the cyclic collector first (`gc.freeze()`, as normconv.fold "
              "does at each phase): fuse's full collections walk the whole heap, a cost that grows with the model.",
              "", "| blocks | rounds | pass | fold | fuse | fuse + check | frozen | fold / (fuse + check) | "
              "fold / frozen | pass / fuse | fold forwards |", "|---|---|---|---|---|---|---|---|---|---|---|"]
    for n in sizes:
        model = _randomize(Chain(n))
        x = torch.randn(1, 8, 8, 8)
        inputs = Inputs((x,))
        rounds = 3 if n <= 300 else 2

        def pass_only() -> float:
            m = clone_sharing_tensors(model)
            cap = capture(m, inputs)
            t0 = time.process_time()
            FOLD(m, cap)
            return time.process_time() - t0

        def fuse_check() -> None:
            fused = fuse(model)
            with torch.no_grad():
                fused(x)

        def fuse_check_frozen() -> None:  # what is alive left out of the collector's scans, as normconv.fold does
            gc.freeze()
            try:
                fuse_check()
            finally:
                gc.unfreeze()

        variants = {"pass": pass_only, "fold": lambda: _time(lambda: fold(model, x)),
                    "fuse": lambda: _time(lambda: fuse(model)), "fuse + check": lambda: _time(fuse_check),
                    "frozen": lambda: _time(fuse_check_frozen)}
        best = {k: float("inf") for k in variants}
        for _ in range(rounds):
            for k, f in variants.items():
                best[k] = min(best[k], f())
        result = []
        forwards = _count_forwards(lambda: result.append(fold(model, x))) / n
        folded, report = result[0]
        assert sum(isinstance(m, nn.BatchNorm2d) for m in folded.modules()) == 0 and report.validation
        per = {k: v / n * 1e3 for k, v in best.items()}
        lines.append(f"| {n} | {rounds} | {per['pass']:.3f} | {per['fold']:.3f} | {per['fuse']:.3f} | "
                     f"{per['fuse + check']:.3f} | {per['frozen']:.3f} | {best['fold'] / best['fuse + check']:.2f}x | "
                     f"{best['fold'] / best['frozen']:.2f}x | {best['pass'] / best['fuse']:.2f}x | {forwards:g} |")
        print(lines[-1], file=sys.stderr)
    lines.append("")


FOLD_FORWARDS = "five"  # original at two shapes, the traced graph once (shapes + trust check), the result at two


def _count_forwards(fn) -> int:
    """How many Conv2d forwards ``fn`` runs (per block: how many times it runs the model)."""
    calls = [0]
    original = nn.Conv2d._conv_forward

    def counting(self, *args):
        calls[0] += 1
        return original(self, *args)

    nn.Conv2d._conv_forward = counting
    try:
        fn()
    finally:
        nn.Conv2d._conv_forward = original
    return calls[0]


def _time(fn) -> float:
    """CPU seconds of ``fn`` (this process): on a shared machine wall time also counts other people's jobs."""
    t0 = time.process_time()
    fn()
    return time.process_time() - t0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="small sizes and few rounds (proves the script runs)")
    ap.add_argument("--ladder", action="store_true", help="only the pass-time ladder (10 -> 3000 blocks) vs fuse")
    ap.add_argument("--threads", type=int, default=None, help="torch threads (default: up to 2)")
    ap.add_argument("--out", default=None, help="default benchmarks/results/fold.md (fold_ladder.md with --ladder)")
    a = ap.parse_args()
    if a.threads:
        torch.set_num_threads(a.threads)
    a.out = a.out or str(Path(__file__).parent / "results" / ("fold_ladder.md" if a.ladder else "fold.md"))
    cmd = "python benchmarks/fold_latency_and_pass_time.py" + (" --quick" if a.quick else "") + (" --ladder" if a.ladder else "") + \
        (f" --threads {a.threads}" if a.threads else "")
    lines = ["# normconv fold: benchmark", "",
             f"Command: `{cmd}`  ", f"Machine: {platform.machine()}, {os.cpu_count()} CPUs, torch "
             f"{torch.__version__}, {torch.get_num_threads()} threads, flush-denormal on, "
             f"load average {os.getloadavg()[0]:.1f} at start" + (" (QUICK run: few rounds, noisy)" if a.quick else ""),
             ""]
    if not a.ladder:
        bench_inference(a.quick, lines)
        bench_lone_bn(a.quick, lines)
    bench_pass_time(a.quick, lines)
    lines += ["## Reading", ""] + ([] if a.ladder else [
              "- fold vs no-BN is the target ratio (<= 1.02 means folding reached the physical limit). In ORT the "
              "unfolded model is already folded by the exporter / ORT's Conv+BN fusion, so ORT ratios near 1.0 are "
              "expected for conv models; folding matters there for ConvTranspose+BN and Linear+BN1d.",
              "- A lone BN stays a BatchNorm: torch's eval BN kernel is one pass over the data, and x*s+t / addcmul "
              "are not faster on large inputs (ratios > 1 above); the pass therefore leaves it alone."]) + [
              "- pass is the fold itself; fold adds normconv's copy, capture and verification: the model runs "
              "once as a traced graph (shapes, and the trust check against the original's output), and original "
              "and result each run at the example shape and a second shape. fuse does none of it.", ""]
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text("\n".join(lines) + "\n")
    print(f"wrote {a.out}", file=sys.stderr)


if __name__ == "__main__":
    main()
