"""``normconv recalibrate``: BatchNorm running statistics re-estimated from calibration batches (passes/recalibrate.py),
each site's change reported, the output drift measured, and nothing else changed, checked two ways before anything
is written:
  - every tensor but the new statistics is the original's, bit for bit (most are the very same objects);
  - the recalibrated model equals the original given the new statistics (its BatchNorm buffers replaced by name), at
    the example inputs: the model in eval mode gives the new statistics' outputs, and nothing else moved.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Sequence

import torch
import torch.nn as nn

from normconv.clone import clone_sharing_tensors
from normconv.engine.door import not_verified, rewrite, write_model
from normconv.errors import Code, NormconvError
from normconv.io.load import Loaded
from normconv.io.write import check_output_path
from normconv.options import Options
from normconv.passes import recalibrate as recalibrate_pass
from normconv.report import Report
from normconv.verify import Inputs, compare, run

DEFAULT_BATCH_SIZE = 32


def split_batches(data: Inputs, batch_size: int) -> list[Inputs]:
    """Calibration inputs whose tensors share their first (sample) dim, cut into batches of ``batch_size`` (the
    last may be smaller; a last batch of one sample joins the one before: a BatchNorm computing batch statistics
    needs more than one value per channel, and BatchNorm1d on (N, C) has no other); non-tensor arguments go to
    every batch."""
    if batch_size < 1:
        raise NormconvError(f"--batch-size must be at least 1, got {batch_size}")
    tensors = [v for v in [*data.args, *data.kwargs.values()] if isinstance(v, torch.Tensor)]
    sizes = {t.shape[0] if t.dim() else None for t in tensors}
    if not tensors or len(sizes) != 1 or None in sizes:
        raise NormconvError("calibration tensors must share their first dim (the samples) to be cut into batches")
    n = sizes.pop()
    starts = list(range(0, n, batch_size))
    if len(starts) > 1 and n - starts[-1] == 1:  # one sample left over: it joins the batch before
        starts.pop()
    bounds = list(zip(starts, starts[1:] + [n]))
    cut = lambda v, i, j: v[i:j] if isinstance(v, torch.Tensor) else v  # noqa: E731
    return [Inputs(tuple(cut(a, i, j) for a in data.args), {k: cut(v, i, j) for k, v in data.kwargs.items()})
            for i, j in bounds]


def recalibrate(loaded: Loaded, opts: Options, batches: Sequence[Inputs]) -> tuple[Report, nn.Module]:
    """New running statistics from ``batches`` (each one forward's inputs), checked, then written."""
    if not batches:
        raise NormconvError("recalibrate needs at least one calibration batch")
    batches, cast = _in_model_dtype(loaded.model, batches)
    try:  # the user's data, checked on the first batch before any work
        run(loaded.model, batches[0])
    except Exception as exc:
        raise NormconvError(f"calibration batch 0 ({batches[0].describe()}) does not run through the model: "
                            f"{type(exc).__name__}: {(str(exc).splitlines() or [''])[0]}") from None
    if loaded.inputs is None:  # the first batch is an example of what the model takes
        loaded = dataclasses.replace(loaded, inputs=batches[0])
    inputs = loaded.require_inputs()
    if opts.output is not None:
        check_output_path(loaded, opts.output, opts.in_place)  # fail before the work, not after
    p = recalibrate_pass.Recalibrate(batches)
    # the original is compared with the result below (only the statistics may differ): never written in place, which
    # a model normconv loaded itself would be past the rounding budget (the comparison then held trivially)
    loaded = dataclasses.replace(loaded, disposable=False)
    report, done = rewrite(loaded, [p], opts, command=recalibrate_pass.NAME, write=False)
    if cast is not None:
        report.notes.append(cast)
    names = sorted({n for r in done.of(p) for n in r.extra.get("statistics", [])})
    if not names:
        raise NormconvError("recalibrate: no BatchNorm module with running statistics to re-estimate" + (
            f" ({report.sites[0].target}: {report.sites[0].reason})" if report.sites else ""),
            Code.REFUSED, pass_name=recalibrate_pass.NAME)
    moved = _others_changed(loaded.model, done.model, set(names))
    expected = run(_with_statistics(loaded.model, done.model, names), inputs)
    same = compare(expected, run(done.model, inputs), opts.atol, opts.rtol,
                   label="the original with the new statistics")
    report.validation.append(same)
    report.extra.update({"batches": len(batches), "statistics": names,
                         "changes": {k: v for r in done.of(p) for k, v in r.extra.get("changes", {}).items()},
                         "unchanged_tensors": len(_tensors(done.model)) - len(names) if not moved else None})
    if moved:
        raise NormconvError(f"recalibrate: {moved[0]} changed besides the BatchNorm statistics; nothing written",
                            Code.NOT_VERIFIED)
    if not same.passed:
        raise not_verified(recalibrate_pass.NAME, same, report, "the recalibrated model is not the original with the "
                                                                "new statistics")
    write_model(loaded, done.model, opts, inputs, report, done)
    return report, done.model


def _in_model_dtype(model: nn.Module, batches: Sequence[Inputs]) -> tuple[list[Inputs], str | None]:
    """The batches' floating tensors in the model's floating dtype where it has one (a float16 model, float32 data:
    calibration data is float32 almost always), as a half model's example inputs are; and the note saying so."""
    dts = {t.dtype for t in [*model.parameters(), *model.buffers()] if t.is_floating_point()}
    if len(dts) != 1:  # no floating weights, or mixed dtypes: the data is taken as given
        return list(batches), None
    dtype = dts.pop()
    given = sorted({str(t.dtype).removeprefix("torch.") for b in batches for t in [*b.args, *b.kwargs.values()]
                    if isinstance(t, torch.Tensor) and t.is_floating_point() and t.dtype != dtype})
    if not given:
        return list(batches), None
    return [b.to(dtype) for b in batches], (f"calibration data cast from {', '.join(given)} to "
                                           f"{str(dtype).removeprefix('torch.')}, the model's dtype")


def _tensors(model: nn.Module) -> dict[str, torch.Tensor]:
    return dict(model.state_dict(keep_vars=True))


def _others_changed(original: nn.Module, new: nn.Module, statistics: set[str]) -> list[str]:
    """The state_dict entries other than ``statistics`` that are not the original's bit for bit (or are missing)."""
    old, now = _tensors(original), _tensors(new)
    if set(old) != set(now):
        return sorted(set(old) ^ set(now))
    return [k for k in old if k not in statistics and not (now[k] is old[k] or _bit_equal(now[k], old[k]))]


def _bit_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    if a.shape != b.shape or a.dtype != b.dtype:
        return False
    return bool(torch.equal(a.detach().reshape(-1).view(torch.uint8), b.detach().reshape(-1).view(torch.uint8))) \
        if a.numel() and a.dtype.is_floating_point else bool(torch.equal(a.detach(), b.detach()))


def _with_statistics(original: nn.Module, new: nn.Module, names: list[str]) -> nn.Module:
    """A copy of the original (sharing its tensors) whose BatchNorm statistics are the recalibrated ones."""
    copy = clone_sharing_tensors(original)
    held: dict[str, Any] = _tensors(new)
    for name in names:
        parent, _, attr = name.rpartition(".")
        module = copy.get_submodule(parent) if parent else copy
        module._buffers[attr] = held[name].detach()
    return copy


__all__ = ["recalibrate", "split_batches", "DEFAULT_BATCH_SIZE"]
