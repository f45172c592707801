"""Example inputs: from the command line (``--input-shape NAME:D0,D1[:DTYPE]``, ``--dtype``), from a calibration
file, and the forward parameters they are matched against; the defaults a Hugging Face model's inputs are made at
(``HF_SEQ_LEN``, ``HF_BATCH``; io.hf_inputs makes them); inputs completed where forward takes what the caller left
unset (``use_cache=False``, an all-ones ``attention_mask``).

One of the io room's lowest modules (graph.capture uses ``with_attention_mask``): it imports io.pickles and io.archive only.
"""

from __future__ import annotations

import inspect
import math
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
import torch.nn as nn

from normconv.errors import NormconvError
from normconv.io.archive import memory_bytes
from normconv.io.pickles import read_tensors
from normconv.verify import Inputs

if TYPE_CHECKING:  # the annotation only: the caller hands its run's ledger in
    from normconv.io.ledger import Ledger

HF_SEQ_LEN = 16
HF_BATCH = 2

_DTYPES = {
    "float32": torch.float32, "fp32": torch.float32, "float": torch.float32,
    "float16": torch.float16, "fp16": torch.float16, "half": torch.float16,
    "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
    "float64": torch.float64, "fp64": torch.float64, "double": torch.float64,
    "int64": torch.int64, "long": torch.int64, "int32": torch.int32, "int": torch.int32, "bool": torch.bool,
}


def forward_params(model: nn.Module, positional_only: bool = False) -> list[str]:
    """Names of forward's parameters (no *args / **kwargs); ``positional_only``: those that can be passed by
    position (a keyword-only ``forward(self, *, x)`` takes x by name only)."""
    try:
        sig = inspect.signature(model.forward)
    except (TypeError, ValueError):
        return []
    kinds = (inspect.Parameter.VAR_POSITIONAL, inspect.Parameter.VAR_KEYWORD) + (
        (inspect.Parameter.KEYWORD_ONLY,) if positional_only else ())
    return [n for n, p in sig.parameters.items() if p.kind not in kinds]


def without_kv_cache(model: nn.Module, inputs: Inputs | None) -> Inputs | None:
    """``inputs`` with ``use_cache=False`` added where forward takes a ``use_cache`` the caller left unset.

    A Hugging Face model built from a default config (``use_cache=True``) returns its KV cache, a DynamicCache that
    torch.export cannot capture and no check can compare. The cache is what generation reuses, not a result of the
    forward; the rewritten model is the same module and takes ``use_cache`` as before. Forward takes it by name,
    or through ``**kwargs`` on a Hugging Face model whose config (or text config) caches: a VLM such as LLaVA
    hands its kwargs to the language model."""
    if inputs is None:
        return None
    params = forward_params(model)
    if "use_cache" in inputs.kwargs:
        return inputs
    if "use_cache" not in params:
        return Inputs(inputs.args, {**inputs.kwargs, "use_cache": False}) if _caches_through_kwargs(model) else inputs
    # unset: not among the keyword arguments, and not reached by the positional ones
    if len(inputs.args) > params.index("use_cache"):
        return inputs
    return Inputs(inputs.args, {**inputs.kwargs, "use_cache": False})


def _caches_through_kwargs(model: nn.Module) -> bool:
    """Whether forward takes ``**kwargs`` and the model's config, or its text config, has ``use_cache`` on."""
    try:
        takes_kwargs = any(p.kind is inspect.Parameter.VAR_KEYWORD
                           for p in inspect.signature(model.forward).parameters.values())
    except (TypeError, ValueError):
        return False
    config = getattr(model, "config", None)
    return takes_kwargs and any(getattr(c, "use_cache", False) is True
                                for c in (config, getattr(config, "text_config", None)) if c is not None)


def with_attention_mask(model: nn.Module, inputs: Inputs) -> Inputs | None:
    """``inputs`` with an all-ones ``attention_mask`` for token ids given without one, where forward takes a mask
    the caller left unset; None where that does not apply. All ones is what a Hugging Face model assumes for no
    mask, so the outputs are the same."""
    ids = inputs.kwargs.get("input_ids")
    params = forward_params(model)
    if not isinstance(ids, torch.Tensor) or ids.dim() != 2 or "attention_mask" not in params \
            or "attention_mask" in inputs.kwargs or len(inputs.args) > params.index("attention_mask"):
        return None
    return Inputs(tuple(inputs.args), {**inputs.kwargs, "attention_mask": torch.ones_like(ids)})


# an example input larger than this share of the machine's memory is refused before it is allocated
_INPUT_MEMORY_SHARE = 0.5


def load_calibration(path_text: str, model: nn.Module | None = None, ledger: Ledger | None = None) -> Inputs:
    """Calibration inputs from a .pt (weights_only) or .safetensors file of tensors: one tensor or a list / tuple
    of tensors (positional arguments), or a dict (keyword arguments by forward parameter name; keys "0", "1",
    ... are positional). One-line NormconvError on anything else. ``ledger``: the run's record of what it read (an
    output is never written over the calibration file, through any link)."""
    path = Path(path_text)
    if not path.is_file():
        raise NormconvError(f"no such calibration file: {path_text}")
    if ledger is not None:
        ledger.record(path)
    obj: Any = read_tensors(path, path_text, "pickles objects; save a tensor, a list or a dict of tensors")
    if isinstance(obj, torch.Tensor):
        return Inputs((obj,))
    if isinstance(obj, (list, tuple)) and obj and all(isinstance(t, torch.Tensor) for t in obj):
        return Inputs(tuple(obj))
    if isinstance(obj, dict) and obj and all(isinstance(t, torch.Tensor) for t in obj.values()):
        if all(str(k).isdigit() for k in obj):
            return Inputs(tuple(obj[k] for k in sorted(obj, key=lambda k: int(k))))
        params = forward_params(model) if model is not None else []
        unknown = [k for k in obj if params and k not in params]
        if unknown:
            raise NormconvError(f"calibration file {path_text}: {unknown[0]!r} is not an argument of the model's "
                                f"forward")
        return Inputs((), dict(obj))
    raise NormconvError(f"calibration file {path_text} holds {type(obj).__name__}; expected a tensor, a list of "
                        f"tensors or a dict of tensors")


def parse_dtype(text: str, floating: bool = False) -> torch.dtype:
    """A dtype by name; ``floating``: only the float dtypes a model can be cast to (--dtype)."""
    names = {k: v for k, v in _DTYPES.items() if v.is_floating_point or not floating}
    try:
        return names[text.lower()]
    except KeyError:
        what = "float dtype (the model's weights are cast to it)" if floating else "dtype"
        raise NormconvError(f"unknown {what} {text!r}; choose from: {', '.join(sorted(names))}") from None


def parse_input_shapes(model: nn.Module, specs: list[str]) -> Inputs:
    """``NAME:D0,D1,...[:DTYPE]`` per forward argument -> Inputs (random normal floats, small random ints); a single
    spec without NAME is the forward's first argument."""
    params = forward_params(model)
    g = torch.Generator().manual_seed(0)
    given: dict[str, torch.Tensor] = {}
    for spec in specs:
        parts = spec.split(":")
        if parts[0] and set(parts[0]) <= set("0123456789, ") and len(parts) in (1, 2):
            # D0,D1,...[:DTYPE] without a name (onnxsim / trtexec style): the forward's first argument, alone
            if len(specs) != 1 or not params:
                raise NormconvError(f"bad --input-shape {spec!r}: a shape without a name is for one input given "
                                    f"once; name each (NAME:D0,D1,...)" + (f"; forward takes: {', '.join(params)}"
                                                                           if params else ""))
            parts = [params[0]] + parts
        if len(parts) not in (2, 3) or not parts[0]:
            raise NormconvError(f"bad --input-shape {spec!r}: expected NAME:D0,D1,...[:DTYPE]")
        name, dims = parts[0], parts[1]
        try:
            # every comma separates a dimension: "1,,3" is a mistake, not (1, 3)
            shape = tuple(int(d) for d in dims.split(",")) if dims.strip() else ()
        except ValueError:
            raise NormconvError(f"bad --input-shape {spec!r}: dimensions must be integers separated by single "
                                f"commas") from None
        if any(d <= 0 for d in shape):
            raise NormconvError(f"bad --input-shape {spec!r}: dimensions must be positive")
        # token ids are integers whatever the spelling omits (input_ids, decoder_input_ids): floats there only make
        # the model refuse its example
        dtype = parse_dtype(parts[2]) if len(parts) == 3 else torch.int64 if name.endswith("input_ids") else \
            torch.float32
        nbytes = math.prod(shape) * (torch.finfo(dtype).bits if dtype.is_floating_point else
                                     (8 if dtype == torch.bool else torch.iinfo(dtype).bits)) // 8
        memory = memory_bytes()
        if memory and nbytes > _INPUT_MEMORY_SHARE * memory:
            raise NormconvError(f"--input-shape {spec!r} needs {nbytes / 2**30:.1f} GiB, more than half of this "
                                f"machine's {memory / 2**30:.1f} GiB: choose a smaller example input")
        if params and name not in params:
            raise NormconvError(f"--input-shape names {name!r}, but forward takes: {', '.join(params)}")
        if name in given:  # the same input twice: which one is meant is the user's to say, never the last silently
            raise NormconvError(f"--input-shape gives {name!r} twice ({spec!r} and an earlier one): give each input once")
        if dtype.is_floating_point:
            given[name] = torch.randn(shape, generator=g).to(dtype)
        elif dtype == torch.bool:
            given[name] = torch.ones(shape, dtype=torch.bool)
        else:
            vocab = getattr(getattr(model, "config", None), "vocab_size", None) or 10
            given[name] = torch.randint(0, vocab, shape, generator=g, dtype=dtype)
    # positional in forward order up to the first gap (or keyword-only parameter), keywords after
    args: list[torch.Tensor] = []
    for name in forward_params(model, positional_only=True):
        if name in given:
            args.append(given.pop(name))
        else:
            break
    return Inputs(tuple(args), given)
