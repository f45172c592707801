"""A Hugging Face folder back as a folder: the rewrite expressed in the architecture config.json describes (the
original module classes, the rewritten weights), as ``--stream`` writes it, so that ``from_pretrained`` loads it.

  same key, same class       the rewritten value (centered writers, rotated linears, folded convs)
  norm -> another norm       the original norm module takes the rewritten norm's weight and bias (a weight-free
                             result: a weight of ones; Gemma's ``1 + w``: the offset taken off; a bias kept as an
                             add after the norm, ``BiasAfterNorm``: its bias; a norm run in float32 or over a moved dim,
                             ``Float32Norm`` / ``MovedDimNorm``: its norm's), so the module
                             computes what the rewritten one does on the stream it reads (a LayerNorm on the zero-mean
                             stream an exact swap leaves is an RMSNorm); the check below proves it on the model
  BatchNorm -> Identity      the BatchNorm left as the identity (weight 1, bias 0, mean 0, var 1 - eps), or as a
  (or ChannelShift)          per-channel shift where its layer had no bias to carry it: backward fold t, forward
                             fold t / s (``folds``: the fold pass's BatchNorm -> (layer, direction, eps)); a
                             BatchNorm class of the model's own (frozen: its tensors buffers) alike
  tied weights that differ   untied (config: tie_word_embeddings = false), and every tensor the architecture built
                             so holds apart (asked of it on the meta device) saved under its own key
  a tensor the original      not expressible (a bias added to a linear config.json gives none): NormconvError
  lacks                      naming it, before anything is written (swap keeps such a bias on its norm instead)
  anything else              not expressible: NormconvError naming what

The written folder is then loaded with ``from_pretrained`` and run at the example inputs and the second shape
against the original's outputs (``check``): a folder that does not reproduce them is not written. Where it does not,
and from_pretrained gave some weight other values than save_pretrained was given (transformers' checkpoint key
renaming that does not invert: PixioBackbone's two final LayerNorms come back swapped, its own round trip changes
the model), the refusal says so, naming the weight, instead of reporting a failed proof.
"""

from __future__ import annotations

import contextlib
import copy
import os
from typing import Any, Iterator, Sequence

import torch
import torch.nn as nn

from normconv.clone import clone_sharing_tensors
from normconv.errors import NormconvError
from normconv.kinds import of_module
from normconv.nn.modules import BiasAfterNorm, Float32Norm, MovedDimNorm, NormWrapper
from normconv.report import Validation
from normconv.verify import Inputs, compare, run


def folder_form(original: nn.Module, rewritten: nn.Module,
                folds: dict[str, tuple[str, str, float | None]] | None = None) -> tuple[nn.Module, list[str]]:
    """(the original architecture carrying the rewrite, notes); NormconvError where it cannot carry it."""
    model = clone_sharing_tensors(original)
    new_state = rewritten.state_dict()
    notes: list[str] = []
    swapped: dict[str, str] = {}
    handled: set[str] = set()
    orig_modules = dict(original.named_modules())
    for path, old in orig_modules.items():
        try:
            new = rewritten.get_submodule(path) if path else rewritten
        except AttributeError:
            raise NormconvError(f"{path} is gone from the rewritten model") from None
        if type(new) is type(old):
            continue
        target = model.get_submodule(path) if path else model
        if of_module(old) is not None and of_module(old).name == "batchnorm" or path in (folds or {}):
            _batchnorm_as(target, old, new, path, folds or {}, orig_modules, new_state)
        elif _is_norm(old) and _is_norm(new):
            _norm_as(target, old, new, path)
        else:
            raise NormconvError(f"{path or 'the model'} is now {type(new).__name__} (was {type(old).__name__})")
        swapped[path] = f"{type(old).__name__} -> {type(new).__name__}"
        handled.update(f"{path}.{k}" if path else k for k in old.state_dict())
    ties = _tie_groups(original)
    old_state = original.state_dict()
    carried = {f"{layer}.bias" for layer, _, _ in (folds or {}).values()}  # a fold's new bias: its BatchNorm carries it
    extra = [k for k in new_state if k not in old_state and k not in carried and not any(
        k.startswith(f"{path}.") for path in swapped if path)]
    if extra:
        raise NormconvError(f"{extra[0]} is a tensor the architecture has no place for"
                            + (f" (and {len(extra) - 1} more)" if len(extra) > 1 else ""))
    for key, value in old_state.items():
        if key in handled:
            continue
        if key not in new_state or new_state[key].shape != value.shape:
            raise NormconvError(f"{key} has no counterpart of its shape in the rewritten model")
        _set(model, key, new_state[key])
    untied, kept = _untied(original, ties, new_state)
    if untied:
        for config in _configs(model):
            config.tie_word_embeddings = False
        _own_tensors(model, kept)
        notes.append(f"untied {' / '.join(untied[0])} (config.json: tie_word_embeddings = false)")
    headless = embedding_a_head_would_tie(original)
    if headless is not None and not untied and not torch.equal(new_state[headless], old_state[headless]):
        for config in _configs(model):
            config.tie_word_embeddings = False
        notes.append(headless_untie_note(original, headless))
    if swapped:
        kinds = sorted(set(swapped.values()))
        notes.append(f"the folder keeps the module classes config.json names, each carrying the rewritten weights "
                     f"so that it computes the same; the in-memory module swap ({len(swapped)} modules: "
                     f"{', '.join(kinds[:3])}{', ...' if len(kinds) > 3 else ''}) changes no output (faster kernels, "
                     f"one op per norm in ONNX): write a .pt2 to get it, or run the same command on the written "
                     f"folder with -o OUT.pt2")
    return model, notes


def _is_norm(m: nn.Module) -> bool:
    if isinstance(m, NormWrapper):
        return _is_norm(m.norm)
    # a norm class of the model's own, by its attributes (OLMo's weight-free LayerNorm has only normalized_shape)
    return of_module(m) is not None or any(hasattr(m, a) for a in ("weight", "eps", "variance_epsilon",
                                                                    "normalized_shape")) \
        and "norm" in type(m).__name__.lower()


def _norm_as(target: nn.Module, old: nn.Module, new: nn.Module, path: str) -> None:
    """The original norm module ``target`` given ``new``'s scale and shift: weight (minus a stored offset, found by
    computing the module) and bias (zeros where ``new`` has none)."""
    w, b = _scale_shift(new)
    w_old = getattr(old, "weight", None)
    if isinstance(w_old, torch.Tensor) and "weight" in old._buffers:
        # a weight the class makes itself (a buffer; FalconMamba's weightless RMSNorm: non-persistent, never saved):
        # the folder rebuilds it as it was, so it carries only that value
        value = w.detach() if isinstance(w, torch.Tensor) else torch.ones_like(w_old)
        if not torch.equal(value.to(w_old.dtype), w_old.detach()):  # the folder's check proves the class uses it so
            raise NormconvError(f"{path} ({type(old).__name__}) makes its own weight: it cannot carry the rewritten "
                                f"scale")
    elif isinstance(w_old, torch.Tensor):
        value = w.detach() if isinstance(w, torch.Tensor) else torch.ones_like(w_old)
        target._parameters["weight"] = nn.Parameter((value - _offset(old)).to(w_old.dtype), w_old.requires_grad)
    elif isinstance(w, torch.Tensor) and not torch.equal(w, torch.ones_like(w)):
        raise NormconvError(f"{path} ({type(old).__name__}) has no weight to carry the rewritten scale")
    b_old = getattr(old, "bias", None)
    if isinstance(b_old, torch.Tensor):
        value = b.detach() if isinstance(b, torch.Tensor) else torch.zeros_like(b_old)
        target._parameters["bias"] = nn.Parameter(value.to(b_old.dtype), b_old.requires_grad)
    elif isinstance(b, torch.Tensor) and bool(b.detach().any()):
        raise NormconvError(f"{path} ({type(old).__name__}) has no bias to carry the rewritten shift")


def _inner(m: nn.Module) -> nn.Module:
    """The norm a wrapper runs: ``Float32Norm`` (its norm in a wider dtype, as HF norms compute inside) and
    ``MovedDimNorm`` (its norm over a moved dim, as the original channels-first class does itself)."""
    while isinstance(m, (Float32Norm, MovedDimNorm)):
        m = m.norm
    return m


def _scale_shift(new: nn.Module) -> tuple[Any, Any]:
    """The (weight, bias) a rewritten norm computes with: ``BiasAfterNorm(norm, b)`` is norm's weight, then + b."""
    new = _inner(new)
    if isinstance(new, BiasAfterNorm):
        w, _ = _scale_shift(new.norm)
        return w, new.bias
    return getattr(new, "weight", None), getattr(new, "bias", None)


def _offset(norm: nn.Module) -> float:
    """What the module adds to its stored weight (Gemma: 1 + w), computed rather than read off the class: with a
    stored weight of zeros a plain norm outputs 0, one that adds 1 outputs the normalized input."""
    w = norm.weight
    probe = clone_sharing_tensors(norm)
    probe._parameters["weight"] = nn.Parameter(torch.zeros_like(w), requires_grad=False)
    if isinstance(getattr(probe, "bias", None), torch.Tensor):
        probe._parameters["bias"] = nn.Parameter(torch.zeros_like(probe.bias), requires_grad=False)
    # the features last (a LayerNorm, an RMSNorm), else first after the batch (ConvNeXt's channels_first LayerNorm
    # over (N, C, H, W), a 1-D signal's (N, C, L)): the first layout the module computes on
    for shape in ((3, *w.shape), (3, *w.shape, 2, 2), (3, *w.shape, 4)):
        try:
            y = run(probe, Inputs((torch.randn(shape, dtype=w.dtype),)))
        except Exception:  # noqa: BLE001 - not this layout: the next
            continue
        y = y[0] if isinstance(y, tuple) else y
        return 1.0 if float(y.abs().max()) > 1e-3 else 0.0
    raise NormconvError(f"{type(norm).__name__} computes on none of the layouts (batch, features), (batch, channels, "
                        f"H, W), (batch, channels, L): what it adds to its weight cannot be measured")


def _batchnorm_as(target: nn.Module, old: nn.Module, new: nn.Module, path: str,
                  folds: dict[str, tuple[str, str, float | None]], modules: dict[str, nn.Module],
                  new_state: dict[str, torch.Tensor]) -> None:
    """A folded BatchNorm left in place as the identity, or as the per-channel shift its layer cannot carry: torch's
    BatchNorm, or a class of the model's own computing one (DETR's DetrFrozenBatchNorm2d: weight, bias and the
    running statistics as buffers, eps in its forward: the fold's eps, as the capture read it)."""
    if not isinstance(new, nn.Identity) and not isinstance(getattr(new, "bias", None), torch.Tensor):
        raise NormconvError(f"{path} is now {type(new).__name__}: no BatchNorm form for it")
    w, b, rm, rv = (getattr(old, k, None) for k in ("weight", "bias", "running_mean", "running_var"))
    if not isinstance(rm, torch.Tensor) or not isinstance(rv, torch.Tensor):
        raise NormconvError(f"{path} ({type(old).__name__}) keeps no running_mean / running_var to be left as the "
                            f"identity")
    eps = folds[path][2] if path in folds and folds[path][2] is not None else getattr(old, "eps", None)
    if not isinstance(eps, (int, float)):
        raise NormconvError(f"{path} ({type(old).__name__}): its eps is not known, so no identity form for it")
    affine = isinstance(w, torch.Tensor) and isinstance(b, torch.Tensor)
    c = rv.numel()
    var = rv.detach().double().reshape(-1)
    s = (w.detach().double().reshape(-1) if affine else 1) / torch.sqrt(var + eps)
    t = (b.detach().double().reshape(-1) if affine else 0) - rm.detach().double().reshape(-1) * s
    shift = torch.zeros(c, dtype=torch.float64)
    if not isinstance(new, nn.Identity):  # ChannelShift: the shift a bias-free ConvTranspose kept out
        shift = new.bias.detach().double().reshape(-1)
    elif path in folds:
        layer, direction, _ = folds[path]
        if getattr(modules.get(layer), "bias", None) is None:  # the layer got a bias the config does not have
            if direction == "forward" and bool((s == 0).any()):
                raise NormconvError(f"{path}: a zero scale leaves no shift to carry before {layer}")
            shift = t if direction == "backward" else t / s
    if bool(shift.any()) and not affine:
        raise NormconvError(f"{path} has no bias to carry the shift its layer's fold left")
    _put(target, "running_mean", torch.zeros_like(rm))
    _put(target, "running_var", torch.full_like(rv, 1 - eps))
    if affine:
        _put(target, "weight", torch.ones_like(w))
        _put(target, "bias", shift.to(b.dtype).reshape(b.shape))


def _put(module: nn.Module, name: str, value: torch.Tensor) -> None:
    """``module.name`` set to ``value`` where it lives: a Parameter (its requires_grad kept) or a buffer."""
    if name in module._parameters:
        module._parameters[name] = nn.Parameter(value.detach(), module._parameters[name].requires_grad)
    else:
        module._buffers[name] = value.detach()


def embedding_a_head_would_tie(model: nn.Module) -> str | None:
    """The state_dict name of ``model``'s input embedding where its config ties word embeddings but ``model`` has no
    output embedding (a base model: GPT2Model, BertModel): a head class built from the same config.json (as
    AutoModelForCausalLM builds one from it) ties its head to that tensor, which no proof on ``model`` covers. Where
    the rewrite changes that tensor, the folder is written with tie_word_embeddings = false. None otherwise."""
    if not any(getattr(c, "tie_word_embeddings", False) for c in _configs(model)):
        return None
    try:
        head, embedding = model.get_output_embeddings(), model.get_input_embeddings()
    except Exception:  # noqa: BLE001 - not a transformers model, or one without these
        return None
    weight = getattr(embedding, "weight", None)
    if head is not None or not isinstance(weight, torch.Tensor):
        return None
    return next((k for k, p in model.named_parameters(remove_duplicate=False) if p is weight), None)


def headless_untie_note(model: nn.Module, key: str) -> str:
    return (f"config.json: tie_word_embeddings = false: {type(model).__name__} has no head, and a head class built "
            f"from this folder would tie its head to the rewritten {key}, which the proof does not cover")


def _untied(original: nn.Module, ties: list[list[str]],
            new_state: dict[str, torch.Tensor]) -> tuple[list[list[str]], list[set[str]]]:
    """The tie groups the rewrite gives different values, and the ties the architecture keeps when config.json says
    tie_word_embeddings = false (``_ties_untied``: transformers 5 then gives BART's encoder and decoder embeddings, and
    BERT's decoder bias, tensors of their own). A split the architecture cannot hold even so: NormconvError."""
    differ = [g for g in ties if any(not torch.equal(new_state[g[0]], new_state[k]) for k in g[1:])]
    if not differ:
        return [], []
    kept = _ties_untied(original)
    for group in differ:
        for k in group[1:]:
            if not torch.equal(new_state[group[0]], new_state[k]) and any({group[0], k} <= t for t in kept):
                raise NormconvError(f"{group[0]} and {k} are one tensor in the architecture config.json describes, "
                                    f"even untied, and the rewrite gives them different values")
    return differ, kept


def _ties_untied(original: nn.Module) -> list[set[str]]:
    """The state_dict keys that stay one tensor in ``original``'s architecture built with tie_word_embeddings = false
    (``config_size.built_on_meta``: the library's own answer); every tie as it is where it cannot be built so."""
    from normconv.io.config_size import built_on_meta

    config = copy.deepcopy(getattr(original, "config", None))
    for c in _configs_of(config):
        c.tie_word_embeddings = False
    try:
        fresh = built_on_meta(type(original), config)
    except Exception:  # noqa: BLE001 - a class that takes no config alone, or a build past its time: every tie kept
        return [set(g) for g in _tie_groups(original)]
    return [set(g) for g in _tie_groups(fresh)]


def _own_tensors(model: nn.Module, kept: list[set[str]]) -> None:
    """Parameters one tensor in ``model`` that the untied architecture gives tensors of their own, each given its
    own copy: save_pretrained writes a shared tensor under one key, and from_pretrained would leave the others at
    their initial values."""
    by_tensor: dict[Any, list[str]] = {}  # the same bytes: one tensor to save_pretrained
    for key, p in model.named_parameters(remove_duplicate=False):
        by_tensor.setdefault((p.data_ptr(), p.numel()) if p.device.type != "meta" else id(p), []).append(key)
    for keys in by_tensor.values():
        for k in keys[1:]:
            if not any({keys[0], k} <= t for t in kept):  # apart once loaded: its own copy
                _set(model, k, model.get_parameter(k).detach().clone())


def _tie_groups(model: nn.Module) -> list[list[str]]:
    """state_dict keys that are one Parameter (tied embeddings), in groups of two or more."""
    groups: dict[int, list[str]] = {}
    for key, p in model.named_parameters(remove_duplicate=False):
        groups.setdefault(id(p), []).append(key)
    return [g for g in groups.values() if len(g) > 1]


def _configs(model: nn.Module) -> list[Any]:
    return _configs_of(getattr(model, "config", None))


def _configs_of(config: Any) -> list[Any]:
    return [c for c in (config, getattr(config, "text_config", None)) if c is not None and
            hasattr(c, "tie_word_embeddings")]


def _set(model: nn.Module, key: str, value: torch.Tensor) -> None:
    """``model``'s tensor ``key`` replaced by ``value`` (a new Parameter where it was one): the user's tensors,
    shared with the clone, are never written."""
    prefix, _, name = key.rpartition(".")
    mod = model.get_submodule(prefix) if prefix else model
    if name in mod._parameters and mod._parameters[name] is not None:
        old = mod._parameters[name]
        if value is not old:
            mod._parameters[name] = nn.Parameter(value.detach(), requires_grad=old.requires_grad)
    elif name in mod._buffers:
        mod._buffers[name] = value


@contextlib.contextmanager
def users_settings(model: nn.Module, use_cache: bool | None) -> Iterator[None]:
    """While the folder is saved, the setting normconv changed for its own runs as the user had it: ``use_cache``
    (``Loaded.use_cache``; normconv runs without a KV cache, which torch.export cannot capture; a folder written with
    use_cache false would generate without one)."""
    config = getattr(model, "config", None)
    if use_cache is None or not hasattr(config, "use_cache"):
        yield
        return
    ours, config.use_cache = config.use_cache, use_cache
    try:
        yield
    finally:
        config.use_cache = ours


def check(folder: str | os.PathLike, cls: type, expected: Sequence[tuple[Inputs, Any]], atol: float | None,
          rtol: float | None, written: nn.Module | None = None) -> list[Validation]:
    """The written folder loaded with ``cls.from_pretrained`` and run at each (inputs, original's outputs).
    ``written``: the module save_pretrained wrote; where a check fails, a weight it loads otherwise is named
    (``_round_trip``: NormconvError)."""
    from transformers.utils import logging as hf_logging

    bars = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()  # normconv's output is normconv's: no "Loading weights" bar
    try:
        model = cls.from_pretrained(str(folder), local_files_only=True).eval()
    finally:
        if bars:
            hf_logging.enable_progress_bar()
    for config in (model.config, getattr(model.config, "text_config", None)):
        if config is not None and hasattr(config, "use_cache"):
            config.use_cache = False  # as the original ran: no KV cache (the folder keeps the user's setting)
    out = []
    for i, (inputs, reference) in enumerate(expected):
        label = "from_pretrained(written folder)" + ("" if i == 0 else f", second shape ({inputs.describe()})")
        out.append(compare(reference, run(model, inputs), atol, rtol, label=label))
    if written is not None and not all(v.passed or v.drift for v in out):
        _round_trip(written, model, cls)
    return out


def _round_trip(written: nn.Module, loaded: nn.Module, cls: type) -> None:
    """A failed check explained where it can be: a weight from_pretrained gave other values than save_pretrained
    was given (NormconvError naming it, and whose values it holds where another weight's); nothing otherwise."""
    given, back = written.state_dict(), loaded.state_dict()
    moved = [k for k, t in back.items() if k in given and given[k].shape == t.shape and not torch.equal(given[k], t)]
    if not moved:
        return
    k = moved[0]
    source = next((j for j, t in given.items() if j != k and t.shape == back[k].shape and torch.equal(t, back[k])),
                  None)
    holds = f"{source}'s values" if source is not None else "other values"
    raise NormconvError(f"transformers does not load back what save_pretrained writes for {cls.__name__}: "
                        f"from_pretrained gives {k} {holds} ({len(moved)} tensor(s); its checkpoint key renaming does "
                        f"not invert), so no folder holds this model")


__all__ = ["folder_form", "check", "users_settings", "embedding_a_head_would_tie", "headless_untie_note"]
