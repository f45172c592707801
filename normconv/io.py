"""Load what a user has into ``(nn.Module, example inputs)``, and save results atomically.

Model specs, sniffed in this order (never guessed silently):
  zoo:NAME                   a built-in reference model (normconv.models)
  DIR with config.json       a Hugging Face model folder, loaded offline
  FILE.pt2                   a torch.export ExportedProgram
  FILE (.pt/.pth/.bin/...)   a pickle: ``weights_only=True`` first; a full module needs ``trust_pickle``
  package.module:factory     a Python factory, plus optional weights (.pt state_dict or .safetensors)

Example inputs come from the zoo, the .pt2, the Hugging Face config, or ``--input-shape NAME:D0,D1[:DTYPE]``.
"""

from __future__ import annotations

import codecs
import contextlib
import importlib
import inspect
import math
import os
import pickle
import sys
import tempfile
import zipfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import torch
import torch.nn as nn

from normconv.errors import NormconvError
from normconv.quiet import quiet
from normconv.outputs import WRITERS
from normconv.verify import Inputs, run

HF_SEQ_LEN = 16
HF_BATCH = 2

_DTYPES = {
    "float32": torch.float32, "fp32": torch.float32, "float": torch.float32,
    "float16": torch.float16, "fp16": torch.float16, "half": torch.float16,
    "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
    "float64": torch.float64, "fp64": torch.float64, "double": torch.float64,
    "int64": torch.int64, "long": torch.int64, "int32": torch.int32, "int": torch.int32, "bool": torch.bool,
}


@dataclass
class Loaded:
    """A model ready to work on, and where it came from (so it can be saved in the same format)."""

    model: nn.Module
    inputs: Inputs | None
    spec: str
    fmt: str  # zoo | hf | pt2 | pickle | factory
    path: Path | None = None
    reads: tuple[Path, ...] = ()  # every file or folder the load read: -o may not be one of them (or inside one)
    # the model is normconv's own (the command line loaded it from a file; no caller holds it): a rewrite may write
    # its tensors in place once the original's outputs are taken, instead of copying every tensor it changes
    disposable: bool = False
    # (inputs, output) of the load's check forward: the original's outputs on exactly these inputs, taken once
    checked: tuple[Inputs, Any] | None = field(default=None, repr=False, compare=False)

    def checked_output(self) -> Any:
        """The model's output on its example inputs: the load's check forward when it ran on these very inputs
        (nothing changed since), else one guarded forward now."""
        if self.checked is not None and self.checked[0] is self.inputs:
            return self.checked[1]
        return run(self.model, self.require_inputs())

    def require_inputs(self) -> Inputs:
        if self.inputs is None:
            names = ", ".join(forward_params(self.model)) or "?"
            raise NormconvError(
                f"no example inputs for {self.spec}: pass --input-shape NAME:D0,D1,...[:DTYPE] for each "
                f"forward argument (forward takes: {names})")
        return self.inputs


# ---------------------------------------------------------------------------------------------------------
# loading


def load(spec: str, weights: str | None = None, input_shapes: list[str] | None = None,
         trust_pickle: bool = False, dtype: str | None = None, check: bool = True,
         trust_remote_code: bool = False) -> Loaded:
    """Turn a model spec into a Loaded; every user mistake raises a one-line NormconvError.

    Nothing from a file runs unless asked: pickles (also inside a .pt2) load with ``weights_only=True`` unless
    ``trust_pickle``; a Hugging Face folder's own code (config ``auto_map``) only with ``trust_remote_code``."""
    cast_to = parse_dtype(dtype, floating=True) if dtype else None  # a bad flag fails before the load
    loaded = _load_model(spec, weights, trust_pickle, trust_remote_code)
    if weights and loaded.fmt != "factory":
        raise NormconvError(f"--weights applies to a package.module:factory spec, not to {spec}")
    reads = [r.resolve() for r in ([loaded.path] if loaded.path else []) + ([Path(weights)] if weights else [])]
    loaded.reads = tuple(dict.fromkeys(reads))
    if input_shapes:
        loaded.inputs = parse_input_shapes(loaded.model, input_shapes)
    if cast_to is not None:
        loaded.model = loaded.model.to(cast_to)
        if loaded.inputs is not None:
            loaded.inputs = loaded.inputs.to(cast_to)
    loaded.inputs = without_kv_cache(loaded.model, loaded.inputs)
    if check and loaded.inputs is not None:
        check_inputs(loaded)
    return loaded


def _load_model(spec: str, weights: str | None, trust_pickle: bool, trust_remote_code: bool = False) -> Loaded:
    if spec.startswith("zoo:"):
        return _load_zoo(spec)
    path = Path(spec)
    if path.is_dir():
        if (path / "config.json").is_file():
            return _load_hf(path, spec, trust_remote_code)
        raise NormconvError(f"{spec} is a folder without config.json: not a Hugging Face model folder")
    if path.exists():
        if not path.is_file():
            raise NormconvError(f"{spec} is not a regular file")
        if path.suffix == ".pt2":
            return _load_pt2(path, spec, trust_pickle)
        if path.suffix == ".safetensors":
            raise NormconvError(f"{spec} holds weights only: pass the model as package.module:factory "
                                f"--weights {spec}")
        return _load_pickle(path, spec, trust_pickle)
    if ":" in spec and not spec.startswith(("/", ".")) and "/" not in spec.split(":", 1)[0]:
        return _load_factory(spec, weights)
    raise NormconvError(f"no such file or folder: {spec}")


def _load_zoo(spec: str) -> Loaded:
    from normconv.models import get

    try:
        entry = get(spec[len("zoo:"):])
    except ValueError as exc:
        raise NormconvError(str(exc)) from None
    model = entry.build().eval()
    return Loaded(model, Inputs(tuple(entry.example_inputs())), spec, "zoo")


def _load_pt2(path: Path, spec: str, trust_pickle: bool = False) -> Loaded:
    """A torch.export program. torch.export.load unpickles example inputs, constants and some weights with
    ``weights_only=False`` (after a failed ``weights_only=True``): every one of those loads goes through
    ``weights_only=True`` here, and one that needs more is refused naming the globals it would import."""
    if path.stat().st_size == 0:
        raise NormconvError(f"{spec} is empty")
    if not zipfile.is_zipfile(path):
        raise NormconvError(f"{spec} is not a torch.export program (not a zip archive; truncated or another format)")
    try:
        with _only_weights_unpickled(trust_pickle), quiet_loaders():
            ep = torch.export.load(str(path))
    except _NeedsTrust as need:
        raise NormconvError(f"refusing to load {spec}: a pickle inside the program runs code on load and would "
                            f"import {_shown(need.globs)}; pass --trust-pickle if you trust this file") from None
    except Exception as exc:
        raise NormconvError(f"{spec} is not a readable torch.export program ({_why(exc)})") from None
    model = ep.module()
    # train or eval is what the program computes, read from its graph; never .eval() on an exported module
    training_ops = _training_ops(ep)
    for m in model.modules():
        m.training = bool(training_ops)
    inputs = None
    if ep.example_inputs is not None:
        args, kwargs = ep.example_inputs
        inputs = Inputs(tuple(args), dict(kwargs))
    return Loaded(model, inputs, spec, "pt2", path)


# ops whose presence means the program was exported in training mode (batch statistics, live dropout)
_TRAINING_OPS = ("_native_batch_norm_legit_functional", "_native_batch_norm_legit.default")


def _training_ops(ep: Any) -> list[str]:
    """Ops of an exported graph that only a training-mode export contains."""
    found = []
    for node in ep.graph.nodes:
        if node.op != "call_function":
            continue
        name = str(node.target)
        if any(t in name for t in _TRAINING_OPS):
            found.append(name)
        elif "batch_norm" in name and "no_training" not in name and len(node.args) > 5 and node.args[5] is True:
            found.append(name)  # aten.batch_norm(..., training=True, ...)
        elif "dropout" in name and any(a is True for a in node.args[2:3]) and node.args[1] not in (0, 0.0):
            found.append(name)  # aten.dropout(x, p, train=True)
    return found


@contextlib.contextmanager
def _only_weights_unpickled(trust: bool):
    """Every torch.load inside the block runs with weights_only=True (unless ``trust``); a pickle that needs
    more raises _NeedsTrust with the globals it names, which no library code can catch and fall back from."""
    real = torch.load

    def load_weights_only(f, *args, weights_only=None, **kwargs):
        if trust:
            return real(f, *args, weights_only=False if weights_only is None else weights_only, **kwargs)
        try:
            return real(f, *args, weights_only=True, **kwargs)
        except pickle.UnpicklingError:
            if hasattr(f, "seek"):
                f.seek(0)
            raise _NeedsTrust(_unsafe_globals(f)) from None

    torch.load = load_weights_only
    try:
        yield
    finally:
        torch.load = real


def quiet_loaders():
    """torch's loaders log warnings and whole tracebacks for files they cannot read; normconv says one line."""
    return quiet(("torch", "torch.export", "torch._export", "torch.serialization"))


def _why(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0][:200]}" if text else type(exc).__name__


def _torch_load_safely(path: Path, spec: str) -> Any:
    """torch.load(weights_only=True), with the zip/pickle failures turned into plain words."""
    if path.stat().st_size == 0:
        raise NormconvError(f"{spec} is empty")
    if zipfile.is_zipfile(path) is False and _looks_truncated_zip(path):
        raise NormconvError(f"{spec} is truncated or corrupt (its zip archive has no end record)")
    if not zipfile.is_zipfile(path) and not _starts_like_a_pickle(path):  # every torch.save writes one of the two
        hint = "; it is text: for a model defined in Python, pass package.module:factory" if _is_text(path) else ""
        raise NormconvError(f"{spec} is not a model file normconv can read (neither a zip archive nor a pickle{hint})")
    if _is_torchscript(path):
        raise NormconvError(f"{spec} is a TorchScript archive (torch.jit.save): normconv rewrites nn.Modules; load "
                            f"the original module, or save it with torch.save(model) or torch.export")
    try:
        with quiet_loaders():
            return torch.load(path, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as exc:
        if "Weights only load failed" in str(exc) or "Unsupported global" in str(exc):
            raise _NeedsTrust(_unsafe_globals(path)) from None
        raise NormconvError(f"{spec} is not a model file normconv can read ({_why(exc)})") from None
    except RuntimeError as exc:
        msg = str(exc)
        if "central directory" in msg or "zip archive" in msg or "PytorchStreamReader" in msg:
            raise NormconvError(f"{spec} is truncated or corrupt ({_why(exc)})") from None
        raise NormconvError(f"{spec} is not a model file normconv can read ({_why(exc)})") from None
    except (EOFError, OSError, ValueError, KeyError) as exc:
        raise NormconvError(f"{spec} is not a model file normconv can read ({_why(exc)})") from None


def _is_text(path: Path) -> bool:
    """The first KB decodes as UTF-8 with no control bytes but whitespace (a script, JSON, YAML, a README)."""
    with open(path, "rb") as f:
        head = f.read(1024)
    try:
        text = codecs.getincrementaldecoder("utf-8")().decode(head, final=False)  # a cut last character is fine
    except UnicodeDecodeError:
        return False
    return all(c.isprintable() or c in "\n\r\t" for c in text)


def _starts_like_a_pickle(path: Path) -> bool:
    """A pickle of protocol 2 or later (every torch.save) opens with the PROTO opcode 0x80 and its version."""
    with open(path, "rb") as f:
        head = f.read(2)
    return len(head) == 2 and head[0] == 0x80 and 2 <= head[1] <= 5


def _is_torchscript(path: Path) -> bool:
    """torch.jit.save writes a zip holding code/ and constants.pkl beside data.pkl."""
    if not zipfile.is_zipfile(path):
        return False
    try:
        with zipfile.ZipFile(path) as z:
            names = z.namelist()
    except (zipfile.BadZipFile, OSError):
        return False
    return any(n.split("/", 1)[-1].startswith("code/") for n in names) and any(
        n.endswith("constants.pkl") for n in names)


def _looks_truncated_zip(path: Path) -> bool:
    with open(path, "rb") as f:
        return f.read(4) == b"PK\x03\x04"  # starts as a zip (torch.save) but is_zipfile said no


class _NeedsTrust(BaseException):
    """A pickle that needs more than weights_only: BaseException, so no ``except Exception`` in a library can
    swallow it and retry with weights_only=False."""

    def __init__(self, globs: list[str] | None = None):
        super().__init__()
        self.globs = globs or []


def _shown(globs: list[str]) -> str:
    return ", ".join(globs[:8]) + (f" and {len(globs) - 8} more" if len(globs) > 8 else "")


def _load_pickle(path: Path, spec: str, trust_pickle: bool) -> Loaded:
    try:
        obj = _torch_load_safely(path, spec)
    except _NeedsTrust as need:
        globs = need.globs
        obj = _load_allowlisted(path, globs)
    if obj is _REFUSED:
        if not trust_pickle:
            raise NormconvError(
                f"refusing to unpickle {spec}: a full pickled module runs code on load and would import "
                f"{_shown(globs)}; pass --trust-pickle if you trust this file") from None
        try:
            with _user_folder_importable():
                obj = torch.load(path, map_location="cpu", weights_only=False)
        except (ImportError, AttributeError) as exc:
            raise NormconvError(f"cannot load {spec}: {_why(exc)} (the model's class must be importable "
                                f"here: install its package or add it to PYTHONPATH)") from None
        except Exception as exc:
            raise NormconvError(f"cannot load {spec}: {_why(exc)}") from None
    if isinstance(obj, nn.Module):
        return Loaded(obj, _carried_inputs(obj), spec, "pickle", path)
    if isinstance(obj, dict) and obj and all(isinstance(v, torch.Tensor) for v in obj.values()):
        raise NormconvError(f"{spec} is a state_dict (weights only): pass the model as package.module:factory "
                            f"--weights {spec}")
    raise NormconvError(f"{spec} holds a {type(obj).__name__}, not a torch.nn.Module")


# classes whose unpickling runs only torch's or normconv's own code: loaded without --trust-pickle
_TRUSTED_PREFIXES = ("torch.nn.modules.", "normconv.models.", "normconv.nn.rmsnorm.", "normconv.nn.modules.")
_REFUSED = object()
_INPUTS_ATTR = "_normconv_example_inputs"  # example inputs saved inside a pickle normconv wrote


def _load_allowlisted(path: Path, globs: list[str]) -> Any:
    """weights_only load with torch.nn / normconv classes allowlisted; _REFUSED if anything else is needed."""
    if not globs or not all(g.startswith(_TRUSTED_PREFIXES) for g in globs):
        return _REFUSED
    try:
        classes = []
        for name in globs:
            module, _, attr = name.rpartition(".")
            classes.append(getattr(importlib.import_module(module), attr))
        with torch.serialization.safe_globals(classes):
            return torch.load(path, map_location="cpu", weights_only=True)
    except Exception:
        return _REFUSED


def _carried_inputs(model: nn.Module) -> Inputs | None:
    carried = model.__dict__.pop(_INPUTS_ATTR, None)
    if isinstance(carried, dict) and isinstance(carried.get("args"), (tuple, list)):
        return Inputs(tuple(carried["args"]), dict(carried.get("kwargs") or {}))
    return None


def _unsafe_globals(f: Any) -> list[str]:
    """The globals a pickle would import that weights_only does not allow: from torch for a zip checkpoint,
    from the opcodes themselves (pickletools, nothing executed) for an old-format or raw pickle."""
    try:
        found = list(torch.serialization.get_unsafe_globals_in_checkpoint(f if hasattr(f, "read") else str(f)))
        if found:
            return found
    except Exception:
        pass
    try:
        data = f.read() if hasattr(f, "read") else Path(f).read_bytes()
    except OSError:
        return ["(globals could not be listed)"]
    return _pickle_globals(data) or ["(globals could not be listed)"]


def _pickle_globals(data: bytes) -> list[str]:
    """module.name of every GLOBAL / STACK_GLOBAL in the pickle streams of ``data`` (legacy torch.save writes
    several pickles back to back), minus what weights_only allows anyway."""
    import io as _io
    import pickletools

    found: list[str] = []
    stream = _io.BytesIO(data)
    while stream.tell() < len(data):
        strings: list[str] = []
        try:
            for op, arg, _ in pickletools.genops(stream):
                if op.name in ("SHORT_BINUNICODE", "BINUNICODE", "UNICODE", "BINUNICODE8"):
                    strings.append(arg)
                elif op.name == "GLOBAL":
                    found.append(arg.replace(" ", "."))
                elif op.name == "STACK_GLOBAL" and len(strings) >= 2:
                    found.append(f"{strings[-2]}.{strings[-1]}")
        except Exception:  # the raw tensor bytes after legacy pickles, or a damaged stream: stop listing
            break
    safe = ("torch._utils.", "collections.OrderedDict", "torch.FloatStorage", "torch.LongStorage", "torch.Size",
            "torch.storage", "builtins.set", "torch.HalfStorage", "torch.DoubleStorage", "torch.BFloat16Storage",
            "torch.IntStorage", "torch.BoolStorage", "torch.ByteStorage", "torch.CharStorage", "torch.ShortStorage")
    return list(dict.fromkeys(g for g in found if not g.startswith(safe)))


@contextlib.contextmanager
def _user_folder_importable():
    """The current folder on sys.path, last: a factory spec or a trusted pickle's classes import from the user's
    project as ``python -m`` would, while a ``rich.py`` or ``onnx.py`` lying there never shadows an installed
    package. Only these two opt-in paths use it; no command puts the folder on sys.path otherwise."""
    here = os.getcwd()
    added = here not in sys.path and "" not in sys.path
    if added:
        sys.path.append(here)
    try:
        yield
    finally:
        if added and here in sys.path:
            sys.path.remove(here)


def _load_factory(spec: str, weights: str | None) -> Loaded:
    module_name, _, attr = spec.partition(":")
    try:
        with _user_folder_importable():
            module = importlib.import_module(module_name)
    except SystemExit as exc:
        raise NormconvError(f"importing {module_name!r} for {spec} called sys.exit({exc.code!r})") from None
    except ImportError as exc:
        raise NormconvError(f"cannot import {module_name!r} for {spec}: {_why(exc)}") from None
    factory: Callable | None = getattr(module, attr, None)
    if factory is None:
        raise NormconvError(f"{module_name!r} has no attribute {attr!r}")
    try:
        made = factory() if callable(factory) and not isinstance(factory, nn.Module) else factory
    except (Exception, SystemExit) as exc:  # a factory calling sys.exit() is a failure too, never a silent exit 0
        raise NormconvError(f"{spec}() failed: {_why(exc) if not isinstance(exc, SystemExit) else f'it called sys.exit({exc.code!r})'}") from None
    inputs = None
    if isinstance(made, tuple) and len(made) == 2 and isinstance(made[0], nn.Module):
        made, example = made
        inputs = example if isinstance(example, Inputs) else Inputs(tuple(example) if isinstance(example, (tuple, list))
                                                                  else (example,))
    if not isinstance(made, nn.Module):
        raise NormconvError(f"{spec} returned a {type(made).__name__}, not a torch.nn.Module")
    if weights:
        load_weights(made, weights)
    return Loaded(made.eval(), inputs, spec, "factory")


def _read_tensors(path: Path, shown: str, if_objects: str) -> Any:
    """A .safetensors file, or a torch.save of tensors loaded with weights_only (``if_objects``: the refusal when it
    pickles more than tensors)."""
    if path.suffix == ".safetensors":
        try:
            from safetensors.torch import load_file

            return load_file(str(path))
        except Exception as exc:
            raise NormconvError(f"{shown} is not a readable safetensors file ({_why(exc)})") from None
    try:
        return _torch_load_safely(path, shown)
    except _NeedsTrust:
        raise NormconvError(f"{shown} {if_objects}") from None


def load_weights(model: nn.Module, weights: str) -> None:
    """Load a .pt state_dict or a .safetensors file into ``model`` strictly, with a one-line error on mismatch."""
    path = Path(weights)
    if not path.is_file():
        raise NormconvError(f"no such weights file: {weights}")
    state = _read_tensors(path, weights, "is not a plain state_dict (it pickles objects); save model.state_dict() "
                                         "instead")
    if isinstance(state, dict) and "state_dict" in state and isinstance(state["state_dict"], dict):
        state = state["state_dict"]  # a training checkpoint {"state_dict": ..., "epoch": ...}
    if not isinstance(state, dict):
        raise NormconvError(f"{weights} does not hold a state_dict")
    result = model.load_state_dict(state, strict=False)
    if result.missing_keys or result.unexpected_keys:
        raise NormconvError(
            f"{weights} does not match the model: {len(result.missing_keys)} missing keys "
            f"(e.g. {result.missing_keys[:2]}), {len(result.unexpected_keys)} unexpected "
            f"(e.g. {result.unexpected_keys[:2]})")


# ---------------------------------------------------------------------------------------------------------
# Hugging Face folders


def _load_hf(path: Path, spec: str, trust_remote_code: bool = False) -> Loaded:
    try:
        import transformers
    except ImportError:
        raise NormconvError(f"{spec} is a Hugging Face folder: pip install transformers") from None
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    remote = remote_code(path / "config.json")
    if remote and not trust_remote_code:
        # transformers would ask [y/N] on a terminal, and 'y' runs the folder's code: never prompt, refuse
        raise NormconvError(f"{spec} ships its own model code (config.json auto_map: {remote}); normconv does not "
                            f"run it unless you pass --trust-remote-code")
    try:
        config = transformers.AutoConfig.from_pretrained(str(path), local_files_only=True,
                                                         trust_remote_code=trust_remote_code)
    except Exception as exc:
        raise NormconvError(f"{spec}/config.json is not a readable Hugging Face config ({_why(exc)})") from None
    archs = getattr(config, "architectures", None) or []
    cls = next((getattr(transformers, a) for a in archs if hasattr(transformers, a)), None)
    if cls is None:
        cls = transformers.AutoModel
    if hasattr(config, "use_cache"):
        config.use_cache = False  # torch.export cannot capture a KV cache object
    hf_logging = transformers.utils.logging
    bars = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()  # normconv's output is normconv's: no "Loading weights" bar on stderr
    try:
        model = cls.from_pretrained(str(path), config=config, local_files_only=True,
                                    trust_remote_code=trust_remote_code)
    except Exception as exc:
        raise NormconvError(f"cannot load the Hugging Face model in {spec} ({_why(exc)})") from None
    finally:
        if bars:
            hf_logging.enable_progress_bar()
    from normconv.hf_inputs import hf_example_inputs  # it reads forward_params from here

    return Loaded(model.eval(), hf_example_inputs(model), spec, "hf", path)


def remote_code(config_json: Path) -> str | None:
    """The code a Hugging Face config asks to import (``auto_map``), or None."""
    import json

    try:
        auto_map = json.loads(config_json.read_text()).get("auto_map")
    except (OSError, ValueError, AttributeError):
        return None  # unreadable: transformers says so next, in its own words
    if not auto_map:
        return None
    values = auto_map.values() if isinstance(auto_map, dict) else [auto_map]
    return ", ".join(sorted({str(v if isinstance(v, str) else v[0]) for v in values}))[:200]


# ---------------------------------------------------------------------------------------------------------
# example inputs from the command line


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


def _memory_bytes() -> int | None:
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return None


def load_calibration(path_text: str, model: nn.Module | None = None) -> Inputs:
    """Calibration inputs from a .pt (weights_only) or .safetensors file of tensors: one tensor or a list / tuple
    of tensors (positional arguments), or a dict (keyword arguments by forward parameter name; keys "0", "1",
    ... are positional). One-line NormconvError on anything else."""
    path = Path(path_text)
    if not path.is_file():
        raise NormconvError(f"no such calibration file: {path_text}")
    obj: Any = _read_tensors(path, path_text, "pickles objects; save a tensor, a list or a dict of tensors")
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
        dtype = parse_dtype(parts[2]) if len(parts) == 3 else torch.float32
        nbytes = math.prod(shape) * (torch.finfo(dtype).bits if dtype.is_floating_point else
                                     (8 if dtype == torch.bool else torch.iinfo(dtype).bits)) // 8
        memory = _memory_bytes()
        if memory and nbytes > _INPUT_MEMORY_SHARE * memory:
            raise NormconvError(f"--input-shape {spec!r} needs {nbytes / 2**30:.1f} GiB, more than half of this "
                                f"machine's {memory / 2**30:.1f} GiB: choose a smaller example input")
        if params and name not in params:
            raise NormconvError(f"--input-shape names {name!r}, but forward takes: {', '.join(params)}")
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


def check_inputs(loaded: Loaded) -> Any:
    """Run the model once on its example inputs; a mismatch is the user's input, said in one line."""
    try:
        out = run(loaded.model, loaded.inputs)
    except Exception as exc:
        raise NormconvError(f"the model rejected its example inputs ({loaded.inputs.describe()}): {_why(exc)}") from None
    loaded.checked = (loaded.inputs, out)  # the original's outputs: a rewrite compares against them, not a rerun
    return out


# ---------------------------------------------------------------------------------------------------------
# saving


def output_format(loaded: Loaded, out: Path) -> str:
    """Same format as the input unless the suffix asks: .pt2 -> ExportedProgram, .safetensors -> weights."""
    if out.suffix == ".pt2":
        return "pt2"
    if out.suffix == ".safetensors":
        return "safetensors"
    if out.suffix == ".onnx":
        raise NormconvError(f"{out} is an ONNX path: use normconv export to write ONNX")
    if out.suffix in (".pt", ".pth", ".bin", ".pkl"):
        return "pickle"
    if loaded.fmt == "hf":  # a Hugging Face folder in, no telling suffix: a folder out (save_pretrained)
        return "hf"
    return "pt2" if loaded.fmt == "pt2" else "pickle"  # no telling suffix: the input's own format


def check_output_path(loaded: Loaded, out: str | os.PathLike, in_place: bool = False) -> Path:
    """Refuse to write over anything the load read (the model file, its --weights, a file inside its Hugging
    Face folder) unless ``in_place``, or where no file can be created."""
    path = Path(out)
    target = path.resolve()
    for read in loaded.reads or ((loaded.path.resolve(),) if loaded.path else ()):
        inside = read.is_dir() and read in target.parents
        if (target == read or inside) and not in_place:
            what = f"a file inside the input folder {read}" if inside else f"the input {out}"
            raise NormconvError(f"refusing to overwrite {what}: choose another -o or pass --in-place")
    return check_writable(path)


def check_writable(path: Path) -> Path:
    """A file can be created at ``path``: its folder exists, is a folder and is writable; it is not a folder."""
    parent = path.parent
    if not parent.exists():
        raise NormconvError(f"cannot write {path}: folder {parent} does not exist")
    if not parent.is_dir():
        raise NormconvError(f"cannot write {path}: {parent} is a file, not a folder")
    if path.is_dir():
        raise NormconvError(f"cannot write {path}: it is a folder")
    if not os.access(parent, os.W_OK | os.X_OK):
        raise NormconvError(f"cannot write {path}: folder {parent} is not writable")
    return path


TEMP_SUFFIX = ".normconv-tmp"  # every temp file / folder normconv makes next to an output ends with this


def temp_name(path: Path) -> str:
    """Prefix of normconv's temp files for ``path``: hidden, named after the output and this process."""
    return f".{path.name}.{os.getpid()}."


def remove_stale_temps(path: Path) -> list[str]:
    """Temp files / folders an earlier, killed normconv left next to ``path`` (its process is gone): removed."""
    import re
    import shutil

    removed = []
    pattern = re.compile(rf"^\.{re.escape(path.name)}\.(\d+)\..*{re.escape(TEMP_SUFFIX)}$")
    try:
        entries = list(path.parent.iterdir())
    except OSError:
        return removed
    for entry in entries:
        m = pattern.match(entry.name)
        if not m or _alive(int(m.group(1))):
            continue
        try:
            shutil.rmtree(entry) if entry.is_dir() else entry.unlink()
            removed.append(entry.name)
        except OSError:
            pass
    return removed


def _alive(pid: int) -> bool:
    if pid == os.getpid():
        return True
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def write_error(out: Any, exc: BaseException) -> NormconvError:
    """An OSError while writing is the user's situation (full disk, permissions), said in one line."""
    import errno

    why = {errno.ENOSPC: "no space left on the device", errno.EACCES: "permission denied",
           errno.EROFS: "read-only file system", errno.EDQUOT: "disk quota exceeded"}.get(
        getattr(exc, "errno", None), _why(exc))
    return NormconvError(f"cannot write {out}: {why}; nothing was written")


def save(loaded: Loaded, model: nn.Module, out: str | os.PathLike, in_place: bool = False,
         inputs: Inputs | None = None) -> Path:
    """Write ``model`` atomically (temp file + rename): any failure or interrupt (Ctrl-C, SIGTERM) leaves no
    file under ``out`` and no temp file beside it."""
    path = check_output_path(loaded, out, in_place)
    fmt = output_format(loaded, path)
    if fmt == "hf":
        _check_hf_folder_output(loaded, model, path)
    remove_stale_temps(path)
    tmp = None
    try:
        if fmt == "hf":
            tmp = tempfile.mkdtemp(prefix=temp_name(path), suffix=TEMP_SUFFIX, dir=str(path.parent))
        else:
            fd, tmp = tempfile.mkstemp(prefix=temp_name(path), suffix=TEMP_SUFFIX, dir=str(path.parent))
            os.close(fd)
        WRITERS[fmt](model, tmp, inputs or (loaded.require_inputs() if fmt == "pt2" else loaded.inputs))
        os.replace(tmp, path)
        tmp = None
    except NormconvError:
        raise
    except OSError as exc:
        raise write_error(out, exc) from None
    except Exception as exc:
        # a .pt2 is a torch.export program: a model torch.export cannot take whole has none
        hint = f"; write -o {path.with_suffix('.pt').name} (torch.load) instead" if fmt == "pt2" else ""
        raise NormconvError(f"cannot write {out}: {_why(exc)}{hint}") from None
    finally:  # every exit path, KeyboardInterrupt and SystemExit (SIGTERM) included
        if tmp is not None:
            import shutil

            shutil.rmtree(tmp, ignore_errors=True) if os.path.isdir(tmp) else _unlink(tmp)
    return path


def _check_hf_folder_output(loaded: Loaded, model: nn.Module, path: Path) -> None:
    """A folder is written only where its config.json still describes the rewritten model, and only as a new
    folder (a folder is renamed into place whole)."""
    from normconv.outputs import config_mismatch

    if path.exists():
        raise NormconvError(f"cannot write the Hugging Face folder {path}: it exists; choose a new folder, or a file "
                            f"with a suffix (.pt2, .pt, .safetensors)")
    why = config_mismatch(loaded.model, model) if hasattr(model, "save_pretrained") else "it is no longer a " \
        "Hugging Face model class"
    if why:
        raise NormconvError(f"cannot write {path} as a Hugging Face folder: the rewrite changed the architecture its "
                            f"config.json describes ({why}); write -o {path.name}.pt2 (torch.export.load, torch "
                            f"alone) or -o {path.name}.pt (torch.load, needs transformers) instead")


def _unlink(path: str) -> None:
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass
