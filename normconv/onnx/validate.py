"""Run an exported ONNX file in onnxruntime and compare every output with torch.

Each requested provider runs twice: graph optimizations disabled (what normconv emitted is what runs) and at
onnxruntime's default level (ORT_ENABLE_ALL). Per run: max abs / rel error per output (``verify.compare``),
and the smallest tolerance that would pass:
  min_atol (at the given rtol) = max(|a - b| - rtol |b|, 0)
  min_rtol (at the given atol) = max((|a - b| - atol) / |b|, 0)
Latency: median of timed runs at the default level.

CUDA runs with TF32 off (``use_tf32=0``): onnxruntime's CUDA provider rounds float32 MatMul/Conv inputs to TF32's
10-bit mantissa by default (measured on H100: 1e-3 on tiny float32 models, which no float32 tolerance passes), so the
check proves the graph in float32 and the error under the default TF32 math is reported beside it, not checked.
"""

from __future__ import annotations

import inspect
import time
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, Iterator

import numpy as np
import torch

from normconv.onnx.defaults import RANDOM_OPS
from normconv.report import Validation
from normconv.verify import Inputs, compare, output_leaves

PROVIDERS = {"cpu": "CPUExecutionProvider", "cuda": "CUDAExecutionProvider"}
LEVELS = ("disabled", "default")


@dataclass
class OrtRun:
    provider: str
    level: str
    validation: Validation
    min_atol: float
    min_rtol: float
    latency_ms: float | None = None


@dataclass
class OrtResult:
    runs: list[OrtRun] = field(default_factory=list)
    unavailable: dict[str, str] = field(default_factory=dict)  # requested provider -> why it did not run
    notes: list[str] = field(default_factory=list)
    # the CPU session at the default level, kept for the dynamic dimensions' checks (loading the file again in a
    # new session cost GPT-2 124M 0.8 s of its export)
    cpu_session: Any = field(default=None, repr=False)

    @property
    def passed(self) -> bool:
        return all(r.validation.passed for r in self.runs)


class RuntimeRefusal(Exception):
    """onnxruntime refused the file (a session it cannot build, a kernel it lacks, a run it fails) or the file torch
    wrote does not fit the example (inputs it cannot be fed, another number of outputs): the model's or the runtime's
    own failure, which export reports in one line (exit 2) or answers by pinning the dynamic dimensions. The original
    exception is its ``__cause__``. Anything else raised while validating is normconv's own bug (exit 3)."""


@contextmanager
def refusing() -> Iterator[None]:
    """Around onnxruntime's calls only: whatever they raise becomes a RuntimeRefusal (from the original)."""
    try:
        yield
    except RuntimeRefusal:
        raise
    except Exception as exc:  # noqa: BLE001 - onnxruntime's own exception types, whatever they are
        raise RuntimeRefusal(f"{type(exc).__name__}: {exc}") from exc


def no_kernel(exc: BaseException | None) -> bool:
    """onnxruntime has no kernel for an op at this dtype on this provider (bfloat16 MatMul on CPU)."""
    from onnxruntime.capi.onnxruntime_pybind11_state import NotImplemented as NoKernel

    return isinstance(exc, NoKernel)


def parse_providers(spec: str) -> list[str]:
    from normconv.errors import NormconvError

    names = [s.strip().lower() for s in spec.split(",") if s.strip()] if spec else []
    bad = [n for n in names if n not in PROVIDERS and n != "none"]
    if bad:
        raise NormconvError(f"unknown --validate provider {bad[0]!r}; choose from cpu, cuda (comma separated) or none")
    return [n for n in names if n != "none"]


def available(name: str) -> str | None:
    """None if the provider can run here, else why not."""
    import onnxruntime as ort

    provider = PROVIDERS[name]
    if provider not in ort.get_available_providers():
        return (f"{provider} is not available in this onnxruntime build "
                f"(providers: {', '.join(ort.get_available_providers())}); install onnxruntime-gpu on a machine "
                f"with a GPU")
    if name == "cuda" and not torch.cuda.is_available():
        return f"{provider} is built in but no CUDA device is visible"
    return None


def feeds(session, model: torch.nn.Module, inputs: Inputs) -> dict[str, np.ndarray]:
    """Map example inputs onto the session's inputs: keyword inputs by name, positional ones by parameter name."""
    try:
        params = list(inspect.signature(model.forward).parameters)
    except (TypeError, ValueError):
        params = []
    named: dict[str, Any] = {}
    for i, value in enumerate(inputs.args):
        named[params[i] if i < len(params) else f"arg{i}"] = value
    named.update(inputs.kwargs)
    tensors = [leaf for k, v in named.items() for leaf in _leaves(k, v)]
    by_name = dict(tensors)
    out = {}
    wanted = session.get_inputs()
    for i, spec in enumerate(wanted):
        value = by_name.get(spec.name)
        if value is None and len(tensors) == len(wanted):
            value = tensors[i][1]
        if value is None:
            raise RuntimeRefusal(f"cannot match ONNX input {spec.name!r} to an example input ({', '.join(by_name)})")
        out[spec.name] = value.detach().cpu().numpy()
    return out


def _leaves(name: str, value: Any) -> list[tuple[str, torch.Tensor]]:
    """The tensors of one input under the names torch.onnx gives a nested input's leaves: ``images_0``, ``images_1``
    for a list (a detector's images), ``x_key`` for a dict."""
    if isinstance(value, torch.Tensor):
        return [(name, value)]
    if isinstance(value, (list, tuple)):
        return [leaf for i, v in enumerate(value) for leaf in _leaves(f"{name}_{i}", v)]
    if isinstance(value, dict):
        return [leaf for k, v in value.items() for leaf in _leaves(f"{name}_{k}", v)]
    return []


def _min_tolerances(reference: list[torch.Tensor], outputs: list[np.ndarray], atol: float, rtol: float):
    min_atol = min_rtol = 0.0
    for r, o in zip(reference, outputs):
        if not r.is_floating_point() or r.numel() == 0:
            continue
        b = r.detach().to(torch.float64)
        a = torch.from_numpy(np.asarray(o)).to(torch.float64)
        if a.shape != b.shape:
            return float("inf"), float("inf")
        diff = (a - b).abs()
        min_atol = max(min_atol, float((diff - rtol * b.abs()).clamp_min(0).max()))
        min_rtol = max(min_rtol, float(((diff - atol).clamp_min(0) / b.abs().clamp_min(1e-30)).max()))
    return min_atol, min_rtol


def _like(reference: Any, outs: list) -> Any:
    """ORT's flat outputs in the reference's structure (so outputs are named as torch names them)."""
    from torch.utils._pytree import tree_flatten, tree_unflatten

    if hasattr(reference, "to_tuple") and hasattr(reference, "keys"):  # transformers ModelOutput
        reference = {k: reference[k] for k in reference.keys()}
    leaves, spec = tree_flatten(reference)
    it = iter(outs)
    filled = [torch.from_numpy(np.asarray(next(it))) if isinstance(x, torch.Tensor) else x for x in leaves]
    return tree_unflatten(filled, spec)


def session(path: str, provider: str, level: str, spin: bool = True, tf32: bool = False):
    """An onnxruntime session; ``spin=False`` stops idle threads spinning (for timing sessions side by side);
    on CUDA, ``tf32`` chooses onnxruntime's default TF32 math for float32 (off: exact float32)."""
    import onnxruntime as ort

    opts = ort.SessionOptions()
    if not spin:
        opts.add_session_config_entry("session.intra_op.allow_spinning", "0")
    opts.graph_optimization_level = (ort.GraphOptimizationLevel.ORT_DISABLE_ALL if level == "disabled"
                                     else ort.GraphOptimizationLevel.ORT_ENABLE_ALL)
    opts.log_severity_level = 4  # fatal only: a kernel's failure raises, and normconv says it in one line
    options = {"use_tf32": "1" if tf32 else "0"} if provider == PROVIDERS["cuda"] else {}
    return ort.InferenceSession(path, opts, providers=[(provider, options)])


def run_quietly(sess, feed: dict) -> list:
    """``sess.run`` on a size that may be refused (a dimension tried at a second size): a refusal raises as usual but
    onnxruntime logs nothing (its executor would print the kernel's error on stderr, for a failure normconv
    handles and reports itself)."""
    import onnxruntime as ort

    quiet = ort.RunOptions()
    quiet.log_severity_level = 4  # fatal only
    return sess.run(None, feed, quiet)


REPORT_BUDGET_S = 2.0  # the report's latency: past this many seconds of runs, three timed runs are enough


def latency_ms(sess, feed: dict, repeats: int = 10, warmup: int = 2, budget_s: float | None = None) -> float:
    """Median milliseconds of ``repeats`` runs after ``warmup`` ones. ``budget_s`` (the report's timing, not a
    benchmark's): once the runs have taken that long, the warm-up stops and the timing stops at three runs (MViT's
    export spent 33 s timing a model whose run takes 2.7 s)."""
    start = time.perf_counter()
    for _ in range(warmup):
        sess.run(None, feed)
        if budget_s is not None and time.perf_counter() - start > budget_s:
            break
    times: list[float] = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        sess.run(None, feed)
        times.append(time.perf_counter() - t0)
        if budget_s is not None and len(times) >= 3 and time.perf_counter() - start > budget_s:
            break
    return float(np.median(times) * 1e3)




# a torch model's forward drawing random numbers: its export cannot be compared with torch's (torch and onnxruntime
# draw differently; onnxruntime has no kernel for some at recent opsets)
def refuse_random(ops: dict[str, int], model: torch.nn.Module, pass_name: str = "export") -> None:
    """NormconvError (Code.REFUSED) where the exported graph (``ops``: op type -> count) draws random numbers: the
    model's forward does (MAE's random masking), so its outputs differ run to run and validation has nothing to
    compare. Says how to make the forward deterministic: an input that takes the draw's place where forward has one
    (``noise``), else --validate none."""
    from normconv.errors import Code, NormconvError

    drawn = [op for op in RANDOM_OPS if ops.get(op)]
    if not drawn:
        return
    try:
        params = inspect.signature(model.forward).parameters
    except (TypeError, ValueError):
        params = {}
    given = next((p for p in ("noise", "random_noise", "generator") if p in params), None)
    how = (f"give forward's `{given}` as an input (-i {given}:...) so that nothing is drawn, " if given else
           "give the inputs or config that make the forward deterministic, ")
    raise NormconvError(f"cannot validate the export of {type(model).__name__}: its forward draws random values "
                        f"({', '.join(drawn)}), so its outputs differ run to run and the file cannot be compared with "
                        f"torch", Code.REFUSED, hint=f"{how}or pass --validate none to write it unvalidated",
                        pass_name=pass_name)


def validate(path: str, model: torch.nn.Module, inputs: Inputs, reference: Any, providers: list[str],
             atol: float | None, rtol: float | None, repeats: int = 10) -> OrtResult:
    """Run ``path`` on each provider at both optimization levels and compare with ``reference``."""
    result = OrtResult()
    ref_leaves = output_leaves(reference)
    for name in providers:
        why = available(name)
        if why is not None:
            result.unavailable[name] = why
            continue
        provider = PROVIDERS[name]
        for level in LEVELS:
            with refusing():
                sess = session(path, provider, level)
            feed = feeds(sess, model, inputs)
            with refusing():  # a refusal is raised and reported by normconv, not printed by onnxruntime
                outs = run_quietly(sess, feed)
            if len(outs) != len(ref_leaves):
                raise RuntimeRefusal(f"the ONNX model has {len(outs)} outputs, torch {len(ref_leaves)}")
            label = f"onnxruntime {name}, optimizations {level}"
            v = compare(reference, _like(reference, outs), atol, rtol, label=label)
            ma, mr = _min_tolerances([t for _, t in ref_leaves], outs, v.atol, v.rtol)
            with refusing():
                lat = latency_ms(sess, feed, repeats, budget_s=REPORT_BUDGET_S) if level == "default" and repeats > 0 \
                    else None
            result.runs.append(OrtRun(name, level, v, ma, mr, lat))
            if name == "cpu" and level == "default":
                result.cpu_session = sess
        if name == "cuda" and any(t.dtype == torch.float32 for _, t in ref_leaves):
            with refusing():
                sess = session(path, provider, "default", tf32=True)
            feed = feeds(sess, model, inputs)
            with refusing():
                outs = sess.run(None, feed)
            tf = compare(reference, _like(reference, outs), atol, rtol, label="onnxruntime cuda, TF32")
            result.notes.append(f"cuda: validated with TF32 off (use_tf32=0); with onnxruntime's default TF32 math "
                                f"the max abs error is {tf.max_abs_error:.3g} (information, not a check)")
    return result
