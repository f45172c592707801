"""The options every rewriting command shares, typed once: the command line builds them from its flags
(``cli/common.options_from_flags``), the Python API from its keywords, and the commands read them from here.

A command's own arguments (``--to``, ``--rotation``, ``--target`` ...) stay the command's parameters.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

METHODS = ("auto", "symbolic_trace", "torch.export")


@dataclass(frozen=True)
class Options:
    """Tolerances, capture, output and precision of one command run."""

    atol: float | None = None  # absolute tolerance of the checks (None: the dtype's default)
    rtol: float | None = None  # relative tolerance of the checks (None: the dtype's default)
    method: str = "auto"  # capture method: auto (symbolic_trace, else torch.export), or one of them
    output: str | None = None  # where to write the result (None: nothing is written)
    in_place: bool = False  # -o may name the input file itself
    bench: bool = False  # time the model before and after (extra forwards)
    keep_normconv: bool = False  # keep normconv's own modules in the written model (else torch's)
    eval_mode: bool = False  # rewrite a training-mode model as its eval-mode self (fold)
    dtype: torch.dtype | None = None  # a half-precision target (float16 / bfloat16), measured against float32
    # a rewrite of a capture that specialized a branch on tensor values is accepted unproven (verified for inputs that
    # take the same branches only); else it is proven for the other branches or refused (engine.branches)
    accept_specialized: bool = False
    static: bool = False  # written .onnx / .pt2 files keep every input shape as the example's (else: dynamic dims)
    overwrite: bool = False  # -o may replace an existing output (a folder too), never one that was read


__all__ = ["Options", "METHODS"]
