"""The dynamic dimensions of a written ONNX file checked in onnxruntime at more sizes against the original model
(``io.dims.check`` chooses the sizes and judges them; a dimension that fails is pinned by the caller, which exports
the file again without it)."""

from __future__ import annotations

from typing import Any, Sequence

import torch.nn as nn

from normconv.report import Report


def check_dims(path: str, dims: list, prepared: nn.Module, truth: nn.Module, inputs, reference: Any, atol, rtol,
               report: Report, validate: Sequence[str] = ("cpu",), sess: Any = None) -> frozenset:
    """Each dynamic dimension checked in onnxruntime (CPU, default optimizations) at a second size against
    ``truth`` at that size; the checks join the report's validation. Returns the places of the dimensions that
    failed (to be pinned), empty when every one held. Without the CPU provider among ``validate`` (--validate
    none / cuda) the dimensions are kept unchecked, and the report says so. ``sess``: validation's CPU session at
    the default level on ``path``, reused (else one is made)."""
    from normconv.io import dims as io_dims
    from normconv.onnx.validate import RuntimeRefusal, _like, available, feeds, refusing, run_quietly, session
    from normconv.verify import compare, run

    if not dims:
        return frozenset()
    why = "not validated on onnxruntime's CPU provider" if "cpu" not in validate else available("cpu")
    if why is not None:
        report.notes.append(f"dynamic dimensions {', '.join(d.name for d in dims)} not checked at a second size "
                            f"({why}); --static pins them")
        return frozenset()
    if sess is None:
        with refusing():
            sess = session(path, "CPUExecutionProvider", "default")

    def candidate(alt):  # onnxruntime's outputs in the structure of torch's
        feed = feeds(sess, prepared, alt)
        with refusing():  # onnxruntime refusing the size pins the dimension, said in the notes
            outs = run_quietly(sess, feed)
        return _like(reference, outs)

    checks = io_dims.check(dims, prepared, inputs, lambda alt: run(truth, alt), candidate,
                           lambda a, b, label: compare(a, b, atol, rtol,
                                                       label=f"onnxruntime cpu, second shape ({label})"),
                           refusals=RuntimeRefusal)
    report.validation.extend(v for _, v in checks if v.passed)
    return frozenset(p for d in dims if d.pinned for p in d.places)  # said in the notes of the file exported again


__all__ = ["check_dims"]
