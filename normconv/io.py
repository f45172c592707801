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

import contextlib
import importlib
import inspect
import os
import pickle
import sys
import tempfile
import zipfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import torch
import torch.nn as nn

from normconv.errors import NormconvError
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
         trust_pickle: bool = False, dtype: str | None = None, check: bool = True) -> Loaded:
    """Turn a model spec into a Loaded; every user mistake raises a one-line NormconvError."""
    loaded = _load_model(spec, weights, trust_pickle)
    if weights and loaded.fmt != "factory":
        raise NormconvError(f"--weights applies to a package.module:factory spec, not to {spec}")
    if input_shapes:
        loaded.inputs = parse_input_shapes(loaded.model, input_shapes)
    if dtype:
        cast_to = parse_dtype(dtype)
        loaded.model = loaded.model.to(cast_to)
        if loaded.inputs is not None:
            loaded.inputs = loaded.inputs.to(cast_to)
    if check and loaded.inputs is not None:
        check_inputs(loaded)
    return loaded


def _load_model(spec: str, weights: str | None, trust_pickle: bool) -> Loaded:
    if spec.startswith("zoo:"):
        return _load_zoo(spec)
    path = Path(spec)
    if path.is_dir():
        if (path / "config.json").is_file():
            return _load_hf(path, spec)
        raise NormconvError(f"{spec} is a folder without config.json: not a Hugging Face model folder")
    if path.exists():
        if not path.is_file():
            raise NormconvError(f"{spec} is not a regular file")
        if path.suffix == ".pt2":
            return _load_pt2(path, spec)
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


def _load_pt2(path: Path, spec: str) -> Loaded:
    try:
        ep = torch.export.load(str(path))
    except Exception as exc:
        raise NormconvError(f"{spec} is not a readable torch.export program ({_why(exc)})") from None
    model = ep.module()
    inputs = None
    if ep.example_inputs is not None:
        args, kwargs = ep.example_inputs
        inputs = Inputs(tuple(args), dict(kwargs))
    return Loaded(model, inputs, spec, "pt2", path)


def _why(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0][:200]}" if text else type(exc).__name__


def _torch_load_safely(path: Path, spec: str) -> Any:
    """torch.load(weights_only=True), with the zip/pickle failures turned into plain words."""
    if path.stat().st_size == 0:
        raise NormconvError(f"{spec} is empty")
    if zipfile.is_zipfile(path) is False and _looks_truncated_zip(path):
        raise NormconvError(f"{spec} is truncated or corrupt (its zip archive has no end record)")
    try:
        return torch.load(path, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as exc:
        if "Weights only load failed" in str(exc) or "Unsupported global" in str(exc):
            raise _NeedsTrust() from None
        raise NormconvError(f"{spec} is not a model file normconv can read ({_why(exc)})") from None
    except RuntimeError as exc:
        msg = str(exc)
        if "central directory" in msg or "zip archive" in msg or "PytorchStreamReader" in msg:
            raise NormconvError(f"{spec} is truncated or corrupt ({_why(exc)})") from None
        raise NormconvError(f"{spec} is not a model file normconv can read ({_why(exc)})") from None
    except (EOFError, OSError, ValueError, KeyError) as exc:
        raise NormconvError(f"{spec} is not a model file normconv can read ({_why(exc)})") from None


def _looks_truncated_zip(path: Path) -> bool:
    with open(path, "rb") as f:
        return f.read(4) == b"PK\x03\x04"  # starts as a zip (torch.save) but is_zipfile said no


class _NeedsTrust(Exception):
    pass


def _load_pickle(path: Path, spec: str, trust_pickle: bool) -> Loaded:
    try:
        obj = _torch_load_safely(path, spec)
    except _NeedsTrust:
        globs = _unsafe_globals(path)
        obj = _load_allowlisted(path, globs)
    if obj is _REFUSED:
        if not trust_pickle:
            shown = ", ".join(globs[:8]) + (f" and {len(globs) - 8} more" if len(globs) > 8 else "")
            raise NormconvError(
                f"refusing to unpickle {spec}: a full pickled module runs code on load and would import "
                f"{shown}; pass --trust-pickle if you trust this file") from None
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


def _unsafe_globals(path: Path) -> list[str]:
    try:
        return list(torch.serialization.get_unsafe_globals_in_checkpoint(str(path)))
    except Exception:  # very old or odd pickles: still refuse, without the list
        return ["(globals could not be listed)"]


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
    except ImportError as exc:
        raise NormconvError(f"cannot import {module_name!r} for {spec}: {_why(exc)}") from None
    factory: Callable | None = getattr(module, attr, None)
    if factory is None:
        raise NormconvError(f"{module_name!r} has no attribute {attr!r}")
    try:
        made = factory() if callable(factory) and not isinstance(factory, nn.Module) else factory
    except Exception as exc:
        raise NormconvError(f"{spec}() failed: {_why(exc)}") from None
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


def load_weights(model: nn.Module, weights: str) -> None:
    """Load a .pt state_dict or a .safetensors file into ``model`` strictly, with a one-line error on mismatch."""
    path = Path(weights)
    if not path.is_file():
        raise NormconvError(f"no such weights file: {weights}")
    if path.suffix == ".safetensors":
        try:
            from safetensors.torch import load_file

            state = load_file(str(path))
        except Exception as exc:
            raise NormconvError(f"{weights} is not a readable safetensors file ({_why(exc)})") from None
    else:
        try:
            state = _torch_load_safely(path, weights)
        except _NeedsTrust:
            raise NormconvError(f"{weights} is not a plain state_dict (it pickles objects); save "
                                f"model.state_dict() instead") from None
        if isinstance(state, dict) and "state_dict" in state and isinstance(state["state_dict"], dict):
            state = state["state_dict"]
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


def _load_hf(path: Path, spec: str) -> Loaded:
    try:
        import transformers
    except ImportError:
        raise NormconvError(f"{spec} is a Hugging Face folder: pip install transformers") from None
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    try:
        config = transformers.AutoConfig.from_pretrained(str(path), local_files_only=True)
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
        model = cls.from_pretrained(str(path), config=config, local_files_only=True)
    except Exception as exc:
        raise NormconvError(f"cannot load the Hugging Face model in {spec} ({_why(exc)})") from None
    finally:
        if bars:
            hf_logging.enable_progress_bar()
    return Loaded(model.eval(), hf_example_inputs(model), spec, "hf", path)


def hf_example_inputs(model: nn.Module, batch: int = HF_BATCH, seq: int = HF_SEQ_LEN) -> Inputs | None:
    """Inputs a Hugging Face model takes, built from its config (ids, masks, decoder ids or pixels)."""
    config = getattr(model, "config", None)
    if config is None:
        return None
    g = torch.Generator().manual_seed(0)
    params = forward_params(model)
    kwargs: dict[str, Any] = {}
    if "pixel_values" in params:
        channels = getattr(config, "num_channels", 3)
        size = getattr(config, "image_size", 32)
        size = size if isinstance(size, int) and size <= 64 else 32
        kwargs["pixel_values"] = torch.randn(batch, channels, size, size, generator=g)
        return Inputs((), kwargs)
    vocab = getattr(config, "vocab_size", None)
    if "input_ids" not in params or not vocab:
        return None
    max_pos = getattr(config, "max_position_embeddings", None) or getattr(config, "n_positions", None) or seq
    seq = min(seq, max_pos)
    kwargs["input_ids"] = torch.randint(0, vocab, (batch, seq), generator=g)
    if getattr(config, "is_encoder_decoder", False) and "decoder_input_ids" in params:
        kwargs["decoder_input_ids"] = torch.randint(0, vocab, (batch, max(seq // 2, 1)), generator=g)
    elif "attention_mask" in params and not getattr(config, "is_decoder", False) and \
            getattr(config, "model_type", "") in ("bert", "roberta", "distilbert", "electra", "albert", "deberta"):
        kwargs["attention_mask"] = torch.ones(batch, seq, dtype=torch.long)
    return Inputs((), kwargs)


# ---------------------------------------------------------------------------------------------------------
# example inputs from the command line


def forward_params(model: nn.Module) -> list[str]:
    try:
        sig = inspect.signature(model.forward)
    except (TypeError, ValueError):
        return []
    return [n for n, p in sig.parameters.items() if p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)]


def parse_dtype(text: str) -> torch.dtype:
    try:
        return _DTYPES[text.lower()]
    except KeyError:
        raise NormconvError(f"unknown dtype {text!r}; choose from: {', '.join(sorted(set(_DTYPES)))}") from None


def parse_input_shapes(model: nn.Module, specs: list[str]) -> Inputs:
    """``NAME:D0,D1,...[:DTYPE]`` per forward argument -> Inputs (random normal floats, small random ints)."""
    params = forward_params(model)
    g = torch.Generator().manual_seed(0)
    given: dict[str, torch.Tensor] = {}
    for spec in specs:
        parts = spec.split(":")
        if len(parts) not in (2, 3) or not parts[0]:
            raise NormconvError(f"bad --input-shape {spec!r}: expected NAME:D0,D1,...[:DTYPE]")
        name, dims = parts[0], parts[1]
        try:
            shape = tuple(int(d) for d in dims.split(",") if d.strip())
        except ValueError:
            raise NormconvError(f"bad --input-shape {spec!r}: dimensions must be integers") from None
        if any(d <= 0 for d in shape):
            raise NormconvError(f"bad --input-shape {spec!r}: dimensions must be positive")
        dtype = parse_dtype(parts[2]) if len(parts) == 3 else torch.float32
        if params and name not in params:
            raise NormconvError(f"--input-shape names {name!r}, but forward takes: {', '.join(params)}")
        if dtype.is_floating_point:
            given[name] = torch.randn(shape, generator=g).to(dtype)
        elif dtype == torch.bool:
            given[name] = torch.ones(shape, dtype=torch.bool)
        else:
            vocab = getattr(getattr(model, "config", None), "vocab_size", None) or 10
            given[name] = torch.randint(0, vocab, shape, generator=g, dtype=dtype)
    # positional in forward order up to the first gap, keywords after
    args: list[torch.Tensor] = []
    for name in params:
        if name in given:
            args.append(given.pop(name))
        else:
            break
    return Inputs(tuple(args), given)


def check_inputs(loaded: Loaded) -> Any:
    """Run the model once on its example inputs; a mismatch is the user's input, said in one line."""
    try:
        return run(loaded.model, loaded.inputs)
    except Exception as exc:
        raise NormconvError(f"the model rejected its example inputs ({loaded.inputs.describe()}): {_why(exc)}") from None


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
    return "pt2" if loaded.fmt == "pt2" else "pickle"  # no telling suffix: the input's own format


def check_output_path(loaded: Loaded, out: str | os.PathLike, in_place: bool = False) -> Path:
    """Refuse to write over the input (unless in place) or into a folder that does not exist."""
    path = Path(out)
    if loaded.path is not None and path.exists() and path.resolve() == loaded.path.resolve() and not in_place:
        raise NormconvError(f"refusing to overwrite the input {out}: choose another -o or pass --in-place")
    return check_writable(path)


def check_writable(path: Path) -> Path:
    """A file can be created at ``path``: its folder exists and it is not itself a folder."""
    if not path.parent.exists():
        raise NormconvError(f"cannot write {path}: folder {path.parent} does not exist")
    if path.is_dir():
        raise NormconvError(f"cannot write {path}: it is a folder")
    return path


def save(loaded: Loaded, model: nn.Module, out: str | os.PathLike, in_place: bool = False,
         inputs: Inputs | None = None) -> Path:
    """Write ``model`` atomically (temp file + rename): a failure leaves no file and never a partial one."""
    path = check_output_path(loaded, out, in_place)
    fmt = output_format(loaded, path)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=str(path.parent))
    os.close(fd)
    try:
        WRITERS[fmt](model, tmp, inputs or (loaded.require_inputs() if fmt == "pt2" else loaded.inputs))
        os.replace(tmp, path)
    except NormconvError:
        _unlink(tmp)
        raise
    except Exception as exc:
        _unlink(tmp)
        raise NormconvError(f"cannot write {out}: {_why(exc)}") from None
    return path


def _unlink(path: str) -> None:
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass
