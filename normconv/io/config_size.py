"""The size a Hugging Face config describes, judged before transformers loads anything from it.

  a number no released model has         refused from the numbers alone: building it would never end
  (past 10,000 layers, a width past 10^6)  (a ``num_hidden_layers`` of 1e9)
  a rough estimate within memory         passes: nothing is built to judge it
  an estimate past this machine's        the model is built on the meta device (transformers' own construction:
  memory                                 no memory, no weights) and its parameters and buffers counted; refused
                                         only if that count is past memory. The estimate's formula fits a
                                         transformer of one width; a CNN's ``hidden_dim`` is its last layer's
                                         alone (EfficientNet-B7's config reads as 64 layers x 2560 = 6.7e9
                                         parameters; it has 66M), so the estimate alone refused real checkpoints

``check_numbers`` runs on the raw config.json (before transformers reads it); ``check_memory`` once the config
and its class are known (before ``from_pretrained``). One of the io room's low modules: it reads io.archive and
io.time_limit only.
"""

from __future__ import annotations

import contextlib
from typing import Any

import torch

from normconv.errors import NormconvError
from normconv.io.archive import memory_bytes
from normconv.io.time_limit import Overtime, available, time_limit

_LAYERS = ("num_hidden_layers", "num_layers", "n_layer", "n_layers", "encoder_layers", "decoder_layers",
           "num_decoder_layers", "num_encoder_layers")
_WIDTH = ("hidden_size", "d_model", "n_embd", "embed_dim", "hidden_dim", "dim", "width")
_FFN = ("intermediate_size", "d_ff", "n_inner", "ffn_dim", "encoder_ffn_dim", "decoder_ffn_dim", "mlp_dim")
# past these no released model goes (the deepest: DeepNet's 1,000 layers; the widest hidden sizes: 2^16)
MAX_LAYERS = 10_000
MAX_WIDTH = 1_000_000
# a meta-device build of any model within those numbers takes seconds; past this it is not a model
META_BUILD_S = 60.0
_HINT = "check num_hidden_layers, hidden_size, vocab_size"


def _count(value: Any) -> int | None:
    """A size from a config: a number (1e9 in JSON is a float) as a non-negative int; None for anything else."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or value != value or value in (float("inf"),
                                                                                                     float("-inf")):
        return None
    return abs(int(value))


def _nested(config: dict[str, Any], depth: int = 0):
    """``config`` and the configs nested in it (a text_config, a vision_config), three levels deep."""
    yield config
    if depth < 3:
        for key, value in config.items():
            if isinstance(value, dict) and key not in ("id2label", "label2id"):
                yield from _nested(value, depth + 1)


def estimated_parameters(config: dict[str, Any]) -> int:
    """A rough count of the parameters a Hugging Face config describes (layers x (4 h^2 + 3 h i) + vocab x h, summed
    over its nested configs): a transformer's size, enough to tell which configs need a closer look."""
    total = 0
    for c in _nested(config):
        width = next((n for n in (_count(c.get(k)) for k in _WIDTH) if n), 0)
        layers = sum(n for n in (_count(c.get(k)) for k in _LAYERS) if n)
        ffn = next((n for n in (_count(c.get(k)) for k in _FFN) if n), 4 * width)
        vocab = _count(c.get("vocab_size")) or 0
        total += layers * (4 * width * width + 3 * width * ffn) + vocab * width
    return total


def dtype_bytes(config: dict[str, Any]) -> int:
    """Bytes per parameter of the dtype a config names (2 for float16 / bfloat16, else 4)."""
    name = str(config.get("dtype") or config.get("torch_dtype") or "float32")
    return 2 if name.removeprefix("torch.") in ("float16", "bfloat16", "half") else 4


def check_numbers(config: dict[str, Any], where: str) -> None:
    """Refuse a config (config.json's dict) with a layer count or width no model has, before anything reads it."""
    for c in _nested(config):
        for keys, limit, what in ((_LAYERS, MAX_LAYERS, "layers"), (_WIDTH, MAX_WIDTH, "a width")):
            for k in keys:
                n = _count(c.get(k))
                if n is not None and n > limit:
                    raise NormconvError(f"{where}/config.json: {k} = {c[k]:.3g}, {what} past any model's ({limit:,}), "
                                        f"describes about {estimated_parameters(config):.3g} parameters: refused "
                                        f"before building it ({_HINT})")


def counted_on_meta(cls: Any, config: Any) -> int:
    """The parameters and buffers of ``cls`` built from ``config`` on the meta device (nothing allocated), counted;
    a build past ``META_BUILD_S`` is refused."""
    model = built_on_meta(cls, config)
    seen: set[int] = set()
    total = 0
    for t in list(model.parameters()) + list(model.buffers()):
        if id(t) not in seen:  # tied weights once
            seen.add(id(t))
            total += t.numel()
    return total


def built_on_meta(cls: Any, config: Any) -> Any:
    """``cls`` built from ``config`` on the meta device (nothing allocated; the architecture's own answer to what
    it holds and ties), transformers' warnings about the config silenced; a build past ``META_BUILD_S`` is
    refused."""
    import transformers

    hf_logging = transformers.utils.logging
    verbosity = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()
    try:
        with time_limit(META_BUILD_S) if available() else contextlib.nullcontext(), torch.device("meta"):
            model = cls._from_config(config) if hasattr(cls, "_from_config") else cls.from_config(config)
    except Overtime:
        raise NormconvError(f"building the model config.json describes ran past {META_BUILD_S:g} s on the meta "
                            f"device: refused before building it ({_HINT})") from None
    finally:
        hf_logging.set_verbosity(verbosity)
    return model


def check_memory(raw: dict[str, Any], where: str, cls: Any, config: Any) -> None:
    """Refuse a config whose model is larger than this machine's memory: the estimate where it is within memory,
    else the count of the model built on the meta device."""
    memory = memory_bytes()
    per = dtype_bytes(raw)
    if not memory or estimated_parameters(raw) * per <= memory:
        return
    how = "counted on the meta device"
    try:
        params = counted_on_meta(cls, config)
    except NormconvError as exc:
        raise NormconvError(f"{where}/config.json: {exc.message}") from None
    except Exception:  # noqa: BLE001 - a class that cannot be built on meta: the estimate decides, as it did
        params, how = estimated_parameters(raw), "estimated from its numbers"
    if params * per > memory:
        raise NormconvError(f"{where}/config.json describes a model of about {params:.3g} parameters ({how}, "
                            f"{params * per / 2**30:.3g} GiB), more than this machine's {memory / 2**30:.1f} GiB of "
                            f"memory: refused before building it ({_HINT})")


__all__ = ["estimated_parameters", "dtype_bytes", "check_numbers", "check_memory", "counted_on_meta", "built_on_meta", "MAX_LAYERS",
           "MAX_WIDTH"]
