"""The Python API: the commands, on a model you hold.

    import normconv
    folded, report = normconv.fold(model, x)                 # x: one tensor, a tuple of args, or Inputs
    swapped, report = normconv.swap(model, x, to="rmsnorm")
    frozen, report = normconv.swap(model, x, to="frozen-batchnorm")   # or batchnorm, affine, groupnorm[:G], ...
    recalibrated, report = normconv.recalibrate(model, calibration_tensor)
    rotated, report = normconv.rotate(model, x)              # scales folded, residual stream rotated
    report = normconv.export(model, x, "model.onnx")
    report = normconv.inspect(model, x)

Every call leaves ``model`` unchanged, verifies what it returns against it, and raises NormconvError (a user
mistake or a refusal, with a one-line reason) or VerificationError (an exact rewrite that missed its tolerance,
carrying the report). ``report.to_json()`` is what ``--json`` prints.
"""

from __future__ import annotations

import dataclasses

import functools
from typing import Any, Callable, Mapping, Sequence, TypeVar

import torch
import torch.nn as nn

from normconv.commands import canonicalize as canonicalize_cmd, deepnorm as deepnorm_cmd, export as export_cmd
from normconv.commands import fold as fold_cmd, inspect as inspect_cmd, swap as swap_cmd
from normconv.commands import recalibrate as recalibrate_cmd, swap_batchnorm as swap_batchnorm_cmd
from normconv.errors import NormconvError
from normconv.io.inputs import without_kv_cache
from normconv.io.load import Loaded, refuse_torchscript
from normconv.options import Options
from normconv.quiet import collector_frozen_at_phases
from normconv.report import Report
from normconv.verify import Inputs


F = TypeVar("F", bound=Callable[..., Any])


def _command(fn: F) -> F:
    """A command of the API: what is alive at each phase's start is left out of the collector's scans while it runs
    (``quiet.collector_frozen_at_phases``; nothing is done where the caller froze objects of its own)."""

    @functools.wraps(fn)
    def call(*args: Any, **kwargs: Any) -> Any:
        with collector_frozen_at_phases():
            return fn(*args, **kwargs)

    return call  # type: ignore[return-value]


def as_inputs(example_inputs: Any) -> Inputs:
    """Inputs from one tensor, a tuple / list of positional args, a mapping of keyword args (a dict, or a tokenizer's
    BatchEncoding, which is a UserDict), or Inputs."""
    if isinstance(example_inputs, Inputs):
        return example_inputs
    if isinstance(example_inputs, Mapping):
        return Inputs((), dict(example_inputs))
    if isinstance(example_inputs, (tuple, list)):
        return Inputs(tuple(example_inputs))
    return Inputs((example_inputs,))


def _loaded(model: nn.Module, example_inputs: Any) -> Loaded:
    if not isinstance(model, nn.Module):
        raise NormconvError(f"normconv needs a torch.nn.Module, got {type(model).__name__}")
    refuse_torchscript(model, "the model")
    return Loaded(model, without_kv_cache(model, as_inputs(example_inputs)), type(model).__name__, "python")


@_command
def fold(model: nn.Module, example_inputs: Any, *, eval_mode: bool = False, atol: float | None = None,
         rtol: float | None = None, method: str = "auto", accept_specialized: bool = False) -> tuple[nn.Module, Report]:
    """BatchNorm folded into its neighbouring conv / linear; ``eval_mode`` rewrites a training-mode model as its
    eval-mode self. Returns (folded model, report). ``accept_specialized`` (every command): accept a rewrite whose
    capture took a branch on tensor values as the example inputs take it, unproven for the other branch."""
    report, new = fold_cmd.fold(_loaded(model, example_inputs), Options(atol=atol, rtol=rtol, method=method,
                                                              eval_mode=eval_mode,
                                                              accept_specialized=accept_specialized))
    return new, report


@_command
def canonicalize(model: nn.Module, example_inputs: Any, *, atol: float | None = None, rtol: float | None = None,
                 method: str = "auto", accept_specialized: bool = False) -> tuple[nn.Module, Report]:
    """Hand-written norms replaced by torch's native modules. Returns (new model, report)."""
    report, new = canonicalize_cmd.canonicalize(_loaded(model, example_inputs), Options(
        atol=atol, rtol=rtol, method=method, accept_specialized=accept_specialized))
    return new, report


@_command
def swap(model: nn.Module, example_inputs: Any, to: str = "rmsnorm", approximate: bool = False, *,
         atol: float | None = None, rtol: float | None = None, method: str = "auto",
         canonicalize: bool = True, fold_scales: bool = False, partial: bool = False,
         as_conv: bool = False, accept_specialized: bool = False, eval_mode: bool = False) -> tuple[nn.Module, Report]:
    """LayerNorm -> RMSNorm (exact on pre-LN models) or back; ``approximate`` swaps the rest and reports the drift;
    ``partial`` swaps only the sites that are exact and keeps the others (the result stays exact);
    ``fold_scales`` then makes every RMSNorm weight-free (scale folded into its readers).
    BatchNorm: ``to`` = "frozen-batchnorm", "batchnorm" (from SyncBatchNorm / frozen), "affine" (``as_conv``: a
    depthwise 1x1 conv), "groupnorm" / "groupnorm:G" or "instancenorm" (approximate: drift reported); ``eval_mode``
    converts a training-mode model as its eval-mode self (to="affine" refuses a training-mode model without it).
    Returns (new model, report)."""
    opts = Options(atol=atol, rtol=rtol, method=method, accept_specialized=accept_specialized, eval_mode=eval_mode)
    if swap_batchnorm_cmd.parse_target(to) is None and eval_mode:
        raise NormconvError(f"eval_mode goes with a BatchNorm target, not to={to!r}")
    if swap_batchnorm_cmd.parse_target(to) is not None:
        if approximate or partial or fold_scales:
            raise NormconvError(f"approximate, partial and fold_scales do not go with to={to!r}")
        report, new = swap_batchnorm_cmd.swap_batchnorm(_loaded(model, example_inputs), opts, to, as_conv=as_conv)
        return new, report
    if as_conv:
        raise NormconvError("as_conv goes with to='affine'")
    report, new = swap_cmd.swap(_loaded(model, example_inputs), opts, to, approximate,
                      canonicalize=canonicalize, fold_scales_=fold_scales, partial=partial)
    return new, report


@_command
def recalibrate(model: nn.Module, calibration: Any, *, batch_size: int = 32, example_inputs: Any = None,
                atol: float | None = None, rtol: float | None = None,
                method: str = "auto") -> tuple[nn.Module, Report]:
    """Every BatchNorm's running statistics re-estimated from ``calibration`` (a tensor, tuple or dict of tensors whose
    first dim is the samples, cut into batches of ``batch_size``; or a list of ready batches, each a tensor, tuple,
    dict or Inputs), as a cumulative average; nothing else changes (checked). ``example_inputs``: what the checks
    run on (default: the first batch). Returns (new model, report)."""
    if isinstance(calibration, list):
        batches = [as_inputs(b) for b in calibration]
    else:
        batches = recalibrate_cmd.split_batches(as_inputs(calibration), batch_size)
    if not batches:
        raise NormconvError("recalibrate needs at least one calibration batch")
    loaded = _loaded(model, example_inputs if example_inputs is not None else batches[0])
    if example_inputs is None:  # the first batch, as the command takes it (its floats in the model's dtype)
        loaded = dataclasses.replace(loaded, inputs=None)
    report, new = recalibrate_cmd.recalibrate(loaded, Options(atol=atol, rtol=rtol, method=method), batches)
    return new, report


@_command
def stream_swap(folder: str, output: str, *, atol: float | None = None, rtol: float | None = None) -> Report:
    """The exact LayerNorm -> RMSNorm swap of a Hugging Face folder (safetensors), streamed tensor by tensor and
    verified block by block without ever holding the model; writes ``output`` (a new folder: the same architecture
    with rewritten weights). Returns the report (per-block errors in ``report.extra["blocks"]``)."""
    from normconv.stream import swap as streaming

    return streaming.swap(folder, output, atol=atol, rtol=rtol)


@_command
def stream_fold(folder: str, output: str, *, atol: float | None = None, rtol: float | None = None) -> Report:
    """BatchNorm folded into the conv / linear before it in a Hugging Face folder (safetensors), streamed tensor
    by tensor and verified block by block without ever holding the model; writes ``output`` (a new folder: the
    same architecture, each folded BatchNorm now the identity or a per-channel shift). Returns the report."""
    from normconv.stream import fold as streaming

    return streaming.fold(folder, output, atol=atol, rtol=rtol)


@_command
def rotate(model: nn.Module, example_inputs: Any, rotation: str = "hadamard", seed: int = 0, *,
           atol: float | None = None, rtol: float | None = None, method: str = "auto",
           accept_specialized: bool = False) -> tuple[nn.Module, Report]:
    """Exact swap (pre-LN) -> norm scales folded into the linears -> residual stream rotated by an orthogonal Q
    (``rotation``: hadamard, random or none). Returns (new model, report)."""
    report, new = swap_cmd.rotate(_loaded(model, example_inputs), Options(atol=atol, rtol=rtol, method=method,
                                  accept_specialized=accept_specialized), rotation, seed)
    return new, report


@_command
def deepnorm(model: nn.Module, example_inputs: Any, arch: str | None = None, alpha: float | None = None,
             beta: float | None = None, beta_mode: str = "init", n_layers: int | None = None,
             m_layers: int | None = None, *, seed: int | None = 0, method: str = "auto", atol: float | None = None,
             rtol: float | None = None, value_proj: Sequence[str] = (),
             out_proj: Sequence[str] = (), accept_specialized: bool = False) -> tuple[nn.Module, Report]:
    """DeepNorm: LN(alpha*x + f(x)) at every post-LN sublayer, beta on FFN / v / out. Returns (new model, report).
    ``value_proj`` / ``out_proj``: module-name patterns (fnmatch) naming attention projections the graph does
    not identify."""
    report, new = deepnorm_cmd.deepnorm(_loaded(model, example_inputs), Options(
        atol=atol, rtol=rtol, method=method, accept_specialized=accept_specialized), arch=arch,
                      alpha=alpha, beta=beta, beta_mode=beta_mode, n_layers=n_layers, m_layers=m_layers, seed=seed,
                      value_proj=value_proj, out_proj=out_proj)
    return new, report


@_command
def export(model: nn.Module, example_inputs: Any, path: str, target: str | None = None, opset: int | None = None, *,
           static: bool = False, dynamic: bool | None = None, fold: bool = True, canonicalize: bool = True,
           validate: Sequence[str] = ("cpu",),
           atol: float | None = None, rtol: float | None = None, baseline: bool = False, repeats: int = 10,
           skip_fusion: bool | None = None, dim_names: dict[str, str] | None = None, dtype: torch.dtype | None = None,
           keep_fp32: str = "auto", device: str = "cpu", accept_specialized: bool = False) -> Report:
    """ONNX at ``path`` with one fused op per norm, validated in onnxruntime. Returns the report. ``dtype``
    (torch.float16 / bfloat16): exported in it, validated against ``model``; ``keep_fp32``: auto | none | all norm
    sites in float32 between Casts. Every input dimension the model lets vary stays dynamic unless ``static``
    (``dynamic=False``, the former default's spelling, means the same; ``dynamic=True`` is the default)."""
    static = static or dynamic is False
    return export_cmd.export(_loaded(model, example_inputs), Options(atol=atol, rtol=rtol, output=str(path), dtype=dtype,
                                                                     accept_specialized=accept_specialized,
                                                                     static=static), target,
               opset, fold=fold, canonicalize=canonicalize, validate=validate, baseline=baseline,
               repeats=repeats, skip_fusion=skip_fusion, dim_names=dim_names, keep_fp32=keep_fp32, device=device)


@_command
def inspect(model: nn.Module, example_inputs: Any, method: str = "auto") -> Report:
    """Every norm site, and what each pass would do with it or why not."""
    return inspect_cmd.inspect(_loaded(model, example_inputs), method)


def load(spec: str, **kwargs: Any) -> tuple[nn.Module, Inputs | None]:
    """What the command line loads: ``zoo:NAME``, a Hugging Face folder, a .pt2, a pickle, or
    ``package.module:factory``; returns (model, example inputs or None). See ``normconv.io.load.load`` for options."""
    from normconv.io.load import load as load_spec

    loaded = load_spec(spec, **kwargs)
    return loaded.model, loaded.inputs


__all__ = ["fold", "canonicalize", "swap", "recalibrate", "rotate", "deepnorm", "export", "inspect", "load", "as_inputs", "Inputs"]
