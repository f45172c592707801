"""The one flow every rewriting command runs: capture -> pass(es) -> verify -> save.

    report, model = rewrite(loaded, [fold_pass], command="fold", exact=True, output="out.pt")

The user's model is never mutated (passes work on a deep copy). An exact rewrite whose outputs miss the
tolerance raises VerificationError carrying the report, and nothing is written.
"""

from __future__ import annotations

import copy
import time
from typing import Any, Callable, Sequence

import torch.nn as nn

from .errors import NormconvError, VerificationError
from .graph import Captured, capture
from .io import Loaded, save
from .report import PassResult, Report, Site
from .verify import Inputs, compare, run

PassFn = Callable[[nn.Module, Captured], PassResult]

# module families counted in before/after tables
_COUNTED: tuple[tuple[str, tuple[type, ...]], ...] = (
    ("batchnorm", (nn.modules.batchnorm._BatchNorm,)),
    ("layernorm", (nn.LayerNorm,)),
    ("rmsnorm", (nn.RMSNorm,)),
    ("groupnorm", (nn.GroupNorm,)),
    ("instancenorm", (nn.modules.instancenorm._InstanceNorm,)),
    ("conv", (nn.modules.conv._ConvNd,)),
    ("linear", (nn.Linear,)),
)


def model_stats(model: nn.Module, inputs: Inputs | None = None, repeats: int = 5) -> dict[str, Any]:
    """Parameter count, module counts by family, and median latency (ms) of one eager forward."""
    stats: dict[str, Any] = {"parameters": sum(p.numel() for p in model.parameters())}
    for name, types in _COUNTED:
        stats[f"{name} modules"] = sum(isinstance(m, types) for m in model.modules())
    if inputs is not None:
        times = []
        run(model, inputs)  # warm-up
        for _ in range(repeats):
            t0 = time.perf_counter()
            run(model, inputs)
            times.append(time.perf_counter() - t0)
        stats["latency ms"] = round(sorted(times)[len(times) // 2] * 1e3, 3)
    return stats


def apply_passes(model: nn.Module, inputs: Inputs, passes: Sequence[PassFn],
                 method: str = "auto") -> tuple[nn.Module, list[Site]]:
    """Run passes in order on a copy of ``model``, re-capturing the graph before each; returns (model, sites)."""
    model = copy.deepcopy(model)
    sites: list[Site] = []
    for p in passes:
        before = {path: (id(m), m.training) for path, m in model.named_modules()}
        cap = capture(model, inputs, method)
        try:
            result = p(model, cap)
        except NormconvError:
            raise
        except Exception as exc:  # name the failing pass (onnx-ir's pass manager does the same)
            name = getattr(p, "name", getattr(p, "__name__", type(p).__name__))
            raise RuntimeError(f"pass {name} failed: {type(exc).__name__}: {exc}") from exc
        _inherit_training_flags(before, result.model)
        model = result.model
        sites.extend(result.sites)
    return model, sites


def _inherit_training_flags(before: dict[str, tuple[int, bool]], model: nn.Module) -> None:
    """A module a pass inserted (nn.Identity, nn.RMSNorm, ...) is born in training mode: give it the mode of
    the module it replaced, or of its parent when it is new."""
    for path, module in model.named_modules():
        old = before.get(path)
        if old is not None and old[0] == id(module):
            continue  # the same module as before: its flag is the user's
        parent = path.rpartition(".")[0]
        mode = old[1] if old is not None else before.get(parent, (0, model.training))[1]
        module.training = mode


def rewrite(loaded: Loaded, passes: Sequence[PassFn], *, command: str, exact: bool,
            atol: float | None = None, rtol: float | None = None, output: str | None = None,
            in_place: bool = False, method: str = "auto", stats: bool = True) -> tuple[Report, nn.Module]:
    """Apply ``passes`` to a loaded model, verify against the original, write ``output`` if it passed."""
    inputs = loaded.require_inputs()
    if output is not None:
        from .io import check_output_path

        check_output_path(loaded, output, in_place)  # fail before the work, not after
    reference = run(loaded.model, inputs)
    model, sites = apply_passes(loaded.model, inputs, passes, method)
    validation = compare(reference, run(model, inputs), atol, rtol)
    report = Report(command=command, model=loaded.spec, sites=sites, validation=[validation],
                    before=model_stats(loaded.model, inputs) if stats else {},
                    after=model_stats(model, inputs) if stats else {})
    if exact and not validation.passed:
        raise VerificationError(
            f"{command}: outputs differ beyond tolerance (max abs error {validation.max_abs_error:.3g}, "
            f"atol {validation.atol:g}, rtol {validation.rtol:g}); nothing written", report)
    if output is not None:
        report.output = str(save(loaded, model, output, in_place, inputs))
    return report, model


__all__ = ["rewrite", "apply_passes", "model_stats", "PassFn"]
