"""Branches on input sizes: the range of sizes a captured path holds for.

    narrowed(model, inputs)   # -> (((input, axis), ...), name, low, high) per dimension narrowed, () when none

``torch.export`` with the example's shapes takes a Python branch on a size (``if x.shape[1] > 2:``, a decode fast
path) as the example takes it and records nothing: the graph, the rewrite planned from it and both checks (the
example and the second shape, which may take the same branch) say nothing of the other side. symbolic_trace does
see it: it fails on the branch (``NormLeafTracer.to_bool``), and only then is this asked. The original is exported
once more with ``Dim.AUTO`` on every dimension (``io.dims``: an example batch of 1 traced at 2); a branch on a size
becomes a guard on its symbol, so the program's range for it (``range_constraints``) is the sizes that take the
example's branches. A dimension whose range is narrower than torch.export's 0/1 specialization alone makes it (a
minimum above 2, or a maximum) is a size the capture specialized (``graph.capture`` makes one Guard of them). A model
whose dynamic export fails or runs past its limit has no range to read: nothing is said (the branch may be on a
rank or a dtype, which no size changes).

Only a capture that met such a branch pays the second export, and at most a few times what the capture itself cost
(``BUDGET``: past it nothing is learnt, as before); a Hugging Face model (keyword inputs) is captured
by torch.export directly and never is.
"""

from __future__ import annotations

import torch.nn as nn

from normconv.verify import Inputs

# the second export's time limit: this many seconds, or this many times the capture's own, whichever is more (a
# positional GPT-2 124M: 6.9 s against its 2.95 s static export)
BUDGET = (10.0, 3.0)
Narrowed = tuple[tuple[tuple[str, int], ...], str, int, "int | None"]  # (input, axis) places, name, low, high


def narrowed(model: nn.Module, inputs: Inputs, spent: float = 0.0) -> tuple[Narrowed, ...]:
    """The dimensions whose range the example's path narrows, with that range (module docstring); () when none, or
    when the dynamic export runs past its budget (``BUDGET``, from ``spent``: the seconds the capture took)."""
    from normconv.io import dims as io_dims
    from normconv.io.outputs import export_program  # the dynamic export the .pt2 writer makes (batch 1 traced at 2)
    from normconv.io.time_limit import time_limit
    from normconv.quiet import quiet

    shapes = io_dims.export_shapes(model, inputs)
    if shapes is None:
        return ()
    try:
        with quiet(("torch",), stderr=True), time_limit(max(BUDGET[0], BUDGET[1] * spent)):
            program = export_program(model, inputs, shapes)
    except Exception:  # noqa: BLE001 - no dynamic program, no range to read (module docstring)
        return ()
    dims = io_dims.name_dims(io_dims.found(program, io_dims.input_names(model, inputs)),
                             io_dims.input_shapes(model, inputs))
    return tuple((tuple(d.places), d.name, d.low or 1, d.high) for d in dims if (d.low or 1) > 2 or d.high is not None)


__all__ = ["narrowed"]
