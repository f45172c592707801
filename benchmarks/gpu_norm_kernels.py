"""CUDA: kernel time of each norm form normconv emits, against the decomposed form and the GPU's bandwidth limit.

Two steps (the ONNX files are small, so they are built where normconv's torch is and run where the GPU is):

  --build DIR   export one-norm models with normconv (and plain torch.onnx.export for the decomposed forms), fp32
                and fp16, dynamic batch and sequence, hidden 4096
  --run DIR     on a CUDA machine: each file in onnxruntime's CUDA provider at (8, 2048, 4096), inputs and outputs
                bound on the GPU (IOBinding); and torch eager / torch.compile of the same norms

What is timed, per form:
  kernel us   sum of the GPU kernel durations per run, from CUPTI (torch.profiler records every CUDA kernel of the
              process, onnxruntime's included), memcpy excluded; median over runs
  ort prof us onnxruntime's own profiler: the sum of the Node events of one run (on CUDA these time the host side of
              each kernel's launch, not the kernel)
  wall us     one session.run_with_iobinding (launch + kernels + sync), median
Achieved bandwidth = bytes that must move (read x [and the residual], write y [and the sum]; weights are 8 KB)
divided by the kernel time; the floor is a device-to-device copy of the same bytes, measured in the same run,
and H100 SXM's nominal 3.35 TB/s.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch
import torch.nn as nn

HIDDEN = 4096
SHAPE = (8, 2048, HIDDEN)
PEAK_TBS = 3.35  # H100 SXM HBM3, nominal


class HandRMSNorm(nn.Module):
    """What Hugging Face's LlamaRMSNorm computes (float32 statistics, cast back): plain export decomposes it."""

    def __init__(self, d: int, eps: float = 1e-6):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(d) + 0.1 * torch.randn(d))
        self.eps = eps

    def forward(self, x):
        dt = x.dtype
        h = x.to(torch.float32)
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * h.to(dt)


class HandLayerNorm(nn.Module):
    def __init__(self, d: int, eps: float = 1e-5):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(d) + 0.1 * torch.randn(d))
        self.bias = nn.Parameter(0.1 * torch.randn(d))
        self.eps = eps

    def forward(self, x):
        mu = x.mean(-1, keepdim=True)
        var = (x - mu).pow(2).mean(-1, keepdim=True)
        return self.weight * (x - mu) / torch.sqrt(var + self.eps) + self.bias


class Norm(nn.Module):
    def __init__(self, norm: nn.Module):
        super().__init__()
        self.norm = norm

    def forward(self, x):
        return self.norm(x)


class SkipNorm(nn.Module):
    """A residual step as transformers write it: h = x + r; returns norm(h) and h (the stream goes on)."""

    def __init__(self, norm: nn.Module):
        super().__init__()
        self.norm = norm

    def forward(self, x, r):
        h = x + r
        return self.norm(h), h


def _ln():
    torch.manual_seed(0)
    m = nn.LayerNorm(HIDDEN)
    with torch.no_grad():
        m.weight.add_(0.1 * torch.randn(HIDDEN))
        m.bias.add_(0.1 * torch.randn(HIDDEN))
    return m


def _rms():
    torch.manual_seed(0)
    m = nn.RMSNorm(HIDDEN, eps=1e-6)
    with torch.no_grad():
        m.weight.add_(0.1 * torch.randn(HIDDEN))
    return m


# name -> (module, skip?, how it is exported: ("normconv", target, opset, skip_fusion) or ("plain", opset))
FORMS = {
    "LayerNormalization (normconv, op17)": (_ln, False, ("normconv", "ort", 17, False)),
    "SimplifiedLayerNormalization (normconv ort, op20)": (_rms, False, ("normconv", "ort", 20, False)),
    "RMSNormalization (normconv onnx, op23)": (_rms, False, ("normconv", "onnx", 23, False)),
    "normconv.RMSNorm function, inlined (normconv onnx, op20)": (_rms, False, ("normconv", "onnx", 20, False)),
    "Add + SimplifiedLayerNormalization (normconv ort, op20)": (_rms, True, ("normconv", "ort", 20, False)),
    "SkipSimplifiedLayerNormalization (normconv ort --skip-fusion)": (_rms, True, ("normconv", "ort", 20, True)),
    "Add + LayerNormalization (normconv ort, op20)": (_ln, True, ("normconv", "ort", 20, False)),
    "SkipLayerNormalization (normconv ort --skip-fusion)": (_ln, True, ("normconv", "ort", 20, True)),
    "decomposed: HF-style RMSNorm, plain export op20": (lambda: HandRMSNorm(HIDDEN), False, ("plain", 20)),
    "decomposed: nn.RMSNorm, plain export op20": (_rms, False, ("plain", 20)),
    "nn.RMSNorm, plain export op23": (_rms, False, ("plain", 23)),
    "decomposed: hand-written LayerNorm, plain export op20": (lambda: HandLayerNorm(HIDDEN), False, ("plain", 20)),
}


def slug(name: str, dtype: str) -> str:
    keep = "".join(c if c.isalnum() else "_" for c in name).strip("_")
    return f"{keep}__{dtype}.onnx"


def build(out: Path) -> None:
    import normconv
    from normconv.verify import Inputs

    out.mkdir(parents=True, exist_ok=True)
    index = {}
    for name, (make, skip, how) in FORMS.items():
        for dtype in ("float32", "float16"):
            torch.manual_seed(1)
            norm = make().eval()
            model = (SkipNorm(norm) if skip else Norm(norm)).eval()
            x = torch.randn(2, 16, HIDDEN)
            inputs = (x, torch.randn(2, 16, HIDDEN)) if skip else (x,)
            path = out / slug(name, dtype)
            half = dtype == "float16"
            if how[0] == "normconv":
                _, target, opset, skip_fusion = how
                normconv.export(model, Inputs(inputs), str(path), target, opset, dynamic=True, repeats=0,
                                skip_fusion=skip_fusion, dtype=torch.float16 if half else None)
            else:
                m = model.half() if half else model
                args = tuple(t.half() for t in inputs) if half else inputs
                dims = {"x": {0: "batch", 1: "sequence"}} | ({"r": {0: "batch", 1: "sequence"}} if skip else {})
                prog = torch.onnx.export(m, args, dynamo=True, opset_version=how[1], dynamic_shapes=dims,
                                         verbose=False)
                prog.save(str(path))
            import onnx

            ops = [n.op_type for n in onnx.load(str(path)).graph.node]
            index[path.name] = {"form": name, "dtype": dtype, "skip": skip, "ops": ops}
            print(path.name, ops, flush=True)
    (out / "index.json").write_text(json.dumps(index, indent=1))


def _cuda_kernel_us(fn, runs: int) -> tuple[float, list[str]]:
    """Median per-run sum of CUDA kernel durations (memcpy/memset excluded) from torch.profiler (CUPTI)."""
    from torch.profiler import ProfilerActivity, profile

    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(runs):
            fn()
            torch.cuda.synchronize()
    events = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    kernels = [e for e in events if "memcpy" not in e.name.lower() and "memset" not in e.name.lower()]
    total = sum(e.device_time for e in kernels) if kernels else 0.0  # us
    names = sorted({e.name[:80] for e in kernels})
    return total / runs, names


def _events_us(fn, runs: int) -> float:
    """CUDA-event time of back-to-back calls, per call (launches overlap kernels: the device-side cost)."""
    for _ in range(5):
        fn()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(runs):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) * 1e3 / runs


def run_torch(dtype: torch.dtype, runs: int, floor_only: bool = False) -> list[dict]:
    from normconv.nn.rmsnorm import RMSNorm as NcRMSNorm

    x = torch.randn(SHAPE, device="cuda", dtype=dtype)
    r = torch.randn(SHAPE, device="cuda", dtype=dtype)
    nbytes = x.numel() * x.element_size()
    rows = []
    copy = torch.empty_like(x)
    floor = _events_us(lambda: copy.copy_(x), runs)
    rows.append({"form": "device-to-device copy (the floor)", "bytes": 2 * nbytes, "events_us": floor})
    mods = {} if floor_only else {
        "nn.LayerNorm": _ln(),
        "nn.RMSNorm": _rms(),
        "normconv.nn.RMSNorm": NcRMSNorm(HIDDEN, eps=1e-6),
        "HF-style RMSNorm (float32 statistics)": HandRMSNorm(HIDDEN),
        "hand-written LayerNorm": HandLayerNorm(HIDDEN),
    }
    for name, m in mods.items():
        m = m.to("cuda", dtype).eval()
        for compiled in (False, True):
            f = torch.compile(m) if compiled else m
            label = f"torch.compile({name})" if compiled else f"{name} eager"
            try:
                with torch.no_grad():
                    f(x)
                    ev = _events_us(lambda: f(x), runs)
                    k, names = _cuda_kernel_us(lambda: f(x), 20)
                rows.append({"form": label, "bytes": 2 * nbytes, "events_us": ev, "kernel_us": k, "kernels": names})
            except Exception as exc:  # compile can fail on a machine without a compiler; record it
                rows.append({"form": label, "error": f"{type(exc).__name__}: {str(exc)[:200]}"})
    for name, m in ({} if floor_only else {"x + r, nn.RMSNorm": _rms(), "x + r, nn.LayerNorm": _ln()}).items():
        m = m.to("cuda", dtype).eval()
        for compiled in (False, True):
            sk = SkipNorm(m)
            f = torch.compile(sk) if compiled else sk
            label = f"torch.compile({name})" if compiled else f"{name} eager"
            with torch.no_grad():
                f(x, r)
                ev = _events_us(lambda: f(x, r), runs)
                k, names = _cuda_kernel_us(lambda: f(x, r), 20)
            rows.append({"form": label, "bytes": 4 * nbytes, "events_us": ev, "kernel_us": k, "kernels": names})
    for row in rows:
        row["dtype"] = str(dtype).replace("torch.", "")
        row["floor_us"] = floor * row.get("bytes", 2 * nbytes) / (2 * nbytes)
    return rows


def run_ort(folder: Path, runs: int) -> list[dict]:
    import numpy as np
    import onnxruntime as ort

    index = json.loads((folder / "index.json").read_text())
    rows = []
    for fname, info in index.items():
        dt = torch.float16 if info["dtype"] == "float16" else torch.float32
        x = torch.randn(SHAPE, device="cuda", dtype=dt)
        r = torch.randn(SHAPE, device="cuda", dtype=dt)
        opts = ort.SessionOptions()
        opts.log_severity_level = 3
        opts.enable_profiling = True
        opts.profile_file_prefix = str(Path("/tmp") / fname)
        opts.optimized_model_filepath = str(Path("/tmp") / ("opt_" + fname))
        row = {"form": info["form"], "dtype": info["dtype"], "exported_ops": info["ops"]}
        try:
            sess = ort.InferenceSession(str(folder / fname), opts, providers=["CUDAExecutionProvider"])
            assert sess.get_providers()[0] == "CUDAExecutionProvider", sess.get_providers()
            io = sess.io_binding()
            names = [i.name for i in sess.get_inputs()]
            for name, t in zip(names, (x, r)):
                io.bind_input(name, "cuda", 0, np.float16 if info["dtype"] == "float16" else np.float32,
                              list(t.shape), t.data_ptr())
            outs = []
            for o in sess.get_outputs():
                t = torch.empty(SHAPE, device="cuda", dtype=dt)
                outs.append(t)
                io.bind_output(o.name, "cuda", 0, np.float16 if info["dtype"] == "float16" else np.float32,
                               list(t.shape), t.data_ptr())
            for _ in range(10):
                sess.run_with_iobinding(io)
            prof_file = sess.end_profiling()
            walls = []
            for _ in range(runs):
                t0 = time.perf_counter()
                sess.run_with_iobinding(io)
                walls.append(time.perf_counter() - t0)
            k, knames = _cuda_kernel_us(lambda: sess.run_with_iobinding(io), 20)
            events = json.loads(Path(prof_file).read_text())
            node = [e for e in events if e.get("cat") == "Node" and e.get("name", "").endswith("_kernel_time")]
            per_run = sum(e["dur"] for e in node) / 10 if node else None
            import onnx

            ran = [n.op_type for n in onnx.load(opts.optimized_model_filepath).graph.node]
            # correctness of what ran: against torch on the same inputs, in float32
            ref = _reference(info, x, r)
            err = max(float((o.float() - e.float()).abs().max()) for o, e in zip(outs, ref))
            row.update(kernel_us=k, kernels=knames, ort_profiler_us=per_run, wall_us=statistics.median(walls) * 1e6,
                       ran_ops=ran, max_abs_error=err,
                       bytes=(4 if info["skip"] and len(outs) == 2 else 2) * x.numel() * x.element_size())
        except Exception as exc:
            row["error"] = f"{type(exc).__name__}: {str(exc)[:300]}"
        rows.append(row)
        print(row, flush=True)
    return rows


def _reference(info: dict, x: torch.Tensor, r: torch.Tensor) -> list[torch.Tensor]:
    """The form's own torch module on the same inputs, in float32 (same seeds as build)."""
    make, skip, _ = FORMS[info["form"]]
    torch.manual_seed(1)
    m = make().to("cuda").eval()
    with torch.no_grad():
        if skip:
            y, h = SkipNorm(m)(x.float(), r.float())
            return [y, h]
        return [Norm(m)(x.float())]


def markdown(rows: list[dict], device: str) -> str:
    lines = [f"Device: {device}. Shape (8, 2048, 4096). Bandwidth = bytes that must move / kernel time "
             f"(the copy floor and H100's nominal {PEAK_TBS} TB/s for scale).", "",
             "| form | dtype | ops that ran | kernel us | achieved TB/s | % of copy floor | % of 3.35 TB/s | wall us "
             "| ORT profiler us | max abs err |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    floors = {r["dtype"]: r["events_us"] for r in rows if r["form"].startswith("device-to-device")}
    for r in rows:
        if "error" in r:
            lines.append(f"| {r['form']} | {r['dtype']} | error: {r['error'][:120]} | | | | | | | |")
            continue
        t = r.get("kernel_us") or r.get("events_us")
        tbs = r["bytes"] / (t * 1e-6) / 1e12 if t else float("nan")
        floor = floors.get(r["dtype"], 0) * r["bytes"] / (2 * SHAPE[0] * SHAPE[1] * SHAPE[2] *
                                                           (2 if r["dtype"] == "float16" else 4))
        ops = ", ".join(dict.fromkeys(r.get("ran_ops", []))) or "(torch)"
        lines.append(
            f"| {r['form']} | {r['dtype']} | {ops} | {t:.1f} | {tbs:.2f} | {100 * floor / t:.0f}% | "
            f"{100 * tbs / PEAK_TBS:.0f}% | {r.get('wall_us', r.get('events_us', 0)):.1f} | "
            f"{r['ort_profiler_us']:.1f} | {r.get('max_abs_error', float('nan')):.2g} |".replace("| None |", "| - |")
            if r.get("ort_profiler_us") is not None else
            f"| {r['form']} | {r['dtype']} | {ops} | {t:.1f} | {tbs:.2f} | {100 * floor / t:.0f}% | "
            f"{100 * tbs / PEAK_TBS:.0f}% | {r.get('wall_us', r.get('events_us', 0)):.1f} | - | "
            f"{r.get('max_abs_error', float('nan')):.2g} |")
    return "\n".join(lines) + "\n"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--build", type=Path)
    ap.add_argument("--run", type=Path)
    ap.add_argument("--torch-only", action="store_true")
    ap.add_argument("--ort-only", action="store_true")
    ap.add_argument("--runs", type=int, default=100)
    ap.add_argument("--out", type=Path, default=Path("gpu_norms.md"))
    a = ap.parse_args()
    if a.build:
        build(a.build)
        return
    rows = []
    for dt in (torch.float16, torch.float32):  # the copy floor always: the bandwidth columns need it
        rows += run_torch(dt, a.runs, floor_only=a.ort_only)
    if not a.torch_only:
        rows += run_ort(a.run, a.runs)
    device = torch.cuda.get_device_name()
    a.out.write_text(markdown(rows, device))
    a.out.with_suffix(".json").write_text(json.dumps(rows, indent=1, default=str))
    print(a.out.read_text())


if __name__ == "__main__":
    main()
