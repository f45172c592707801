"""Load what a user has into a ``Loaded``: the model, its example inputs, and where it came from.

Model specs, sniffed in this order (never guessed silently):
  zoo:NAME                   a built-in reference model (normconv.models)
  DIR with config.json       a Hugging Face model folder, loaded offline
  FILE.pt2                   a torch.export ExportedProgram
  FILE (.pt/.pth/.bin/...)   a pickle: ``weights_only=True`` first; a full module needs ``trust_pickle``
  package.module:factory     a Python factory, plus optional weights (.pt state_dict or .safetensors)

Example inputs come from the zoo, the .pt2, the Hugging Face config (io.hf_inputs), or ``--input-shape
NAME:D0,D1[:DTYPE]`` (io.inputs). The top of the io room: it imports io.pickles, io.inputs, io.hf_inputs and
io.outputs; io.write saves what a command made of a ``Loaded``.
"""

from __future__ import annotations

import contextlib
import importlib
import os
import sys
import zipfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Mapping

import torch
import torch.nn as nn

from normconv.errors import NormconvError, describe
from normconv.io import config_size, hf_folder
from normconv.io.archive import check_archive
from normconv.io.hf_inputs import first_sample, hf_example_inputs, single_images
from normconv.io.inputs import forward_params, parse_dtype, parse_input_shapes, without_kv_cache
from normconv.io.ledger import Ledger
from normconv.io.outputs import INPUTS_ATTR
from normconv.io.pickles import (REFUSED, NeedsTrust, load_allowlisted, only_weights_unpickled,
                                 quiet_loaders, read_tensors, shown_globals, torch_load_safely)
from normconv.verify import Inputs, positive, run


@dataclass
class Loaded:
    """A model ready to work on, and where it came from (so it can be saved in the same format)."""

    model: nn.Module
    inputs: Inputs | None
    spec: str
    fmt: str  # zoo | hf | pt2 | pickle | factory
    path: Path | None = None
    # every file and folder the run read (model, weights, config, shards, the factory's modules, calibration data),
    # by real path and inode: every write checks it (io.write.check_output_path -> ledger.check_write)
    ledger: Ledger = field(default_factory=Ledger, repr=False, compare=False)
    # the model is normconv's own (the command line loaded it from a file; no caller holds it): a rewrite may write
    # its tensors in place once the original's outputs are taken, instead of copying every tensor it changes
    disposable: bool = False
    # (inputs, output) of the load's check forward: the original's outputs on exactly these inputs, taken once
    checked: tuple[Inputs, Any] | None = field(default=None, repr=False, compare=False)
    # a Hugging Face config's use_cache as config.json gave it: normconv runs with it False (torch.export cannot
    # capture a KV cache), and a folder written back keeps the user's value (io.hf_output.users_settings)
    use_cache: bool | None = None

    @property
    def reads(self) -> tuple[Path, ...]:
        """The real paths of everything the run read (the ledger's entries)."""
        return self.ledger.paths

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
        return positive(self.inputs)  # an empty dimension refused as --input-shape refuses it


# ---------------------------------------------------------------------------------------------------------
# loading


def load(spec: str, weights: str | None = None, input_shapes: list[str] | None = None,
         trust_pickle: bool = False, dtype: str | None = None, check: bool = True,
         trust_remote_code: bool = False) -> Loaded:
    """Turn a model spec into a Loaded; every user mistake raises a one-line NormconvError.

    Nothing from a file runs unless asked: pickles (also inside a .pt2) load with ``weights_only=True`` unless
    ``trust_pickle``; a Hugging Face folder's own code (config ``auto_map``) only with ``trust_remote_code``."""
    cast_to = parse_dtype(dtype, floating=True) if dtype else None  # a bad flag fails before the load
    ledger = Ledger()
    modules = set(sys.modules)
    with ledger.watching():  # every file opened for reading while loading (a factory's own torch.load too)
        loaded = _load_model(spec, weights, trust_pickle, trust_remote_code, ledger)
    refuse_torchscript(loaded.model, spec)
    if weights and loaded.fmt != "factory":
        raise NormconvError(f"--weights applies to a package.module:factory spec, not to {spec}")
    if loaded.path is not None:
        ledger.record(loaded.path, primary=True)
    if weights:
        ledger.record(weights)
    imported = set(sys.modules) - modules
    if loaded.fmt == "factory":  # the factory's own module and its packages, even when imported before this load
        parts = spec.partition(":")[0].split(".")
        imported |= {".".join(parts[:i]) for i in range(1, len(parts) + 1)}
    for name in imported:  # the modules the load imported (a factory's code): by their __file__
        file = getattr(sys.modules.get(name), "__file__", None)
        if isinstance(file, str):
            ledger.record(file)
    loaded.ledger = ledger
    if input_shapes:
        loaded.inputs = parse_input_shapes(loaded.model, input_shapes)
    if cast_to is not None:
        loaded.model = loaded.model.to(cast_to)
        if loaded.inputs is not None:
            loaded.inputs = loaded.inputs.to(cast_to)
    loaded.inputs = without_kv_cache(loaded.model, loaded.inputs)
    if check and loaded.inputs is not None:
        try:
            check_inputs(loaded)
        except NormconvError as first_error:
            # inputs made from a config, that the model rejects: a config that names frames gets single images, a
            # model that takes one sample at a time (a decoder classifier without a pad token) batch 1
            made = loaded.inputs
            tries = [single_images(made), first_sample(made)] if loaded.fmt == "hf" and not input_shapes else []
            for other in (t for t in tries if t is not None):
                loaded.inputs = other
                try:
                    check_inputs(loaded)
                    return loaded
                except NormconvError:
                    continue
            loaded.inputs = made
            raise first_error from None  # the inputs' own error is the one said
    return loaded


def refuse_torchscript(model: nn.Module, what: str) -> None:
    """A TorchScript module (torch.jit.script / trace) is compiled code, not a module tree normconv can rewrite."""
    if isinstance(model, torch.jit.ScriptModule):
        raise NormconvError(f"{what} is a TorchScript module ({type(model).__name__}): TorchScript modules are not "
                            f"supported; pass the eager module (before torch.jit.script / torch.jit.trace)")


def check_inputs(loaded: Loaded) -> Any:
    """Run the model once on its example inputs; a mismatch is the user's input, said in one line."""
    try:
        out = run(loaded.model, loaded.inputs)
    except NormconvError:  # normconv's own refusal before the forward (an uninitialized lazy module): as it is
        raise
    except Exception as exc:
        raise NormconvError(f"the model rejected its example inputs ({loaded.inputs.describe()}): "
                            f"{describe(exc)}") from None
    loaded.checked = (loaded.inputs, out)  # the original's outputs: a rewrite compares against them, not a rerun
    return out


def _load_model(spec: str, weights: str | None, trust_pickle: bool, trust_remote_code: bool = False,
                ledger: Ledger | None = None) -> Loaded:
    if spec.startswith("zoo:"):
        return _load_zoo(spec)
    path = Path(spec)
    if path.is_dir():
        if (path / "config.json").is_file():
            return _load_hf(path, spec, trust_remote_code, ledger)
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
    check_archive(path, spec)  # every member capped by what its header declares, before any is inflated
    try:
        with only_weights_unpickled(trust_pickle), quiet_loaders():
            ep = torch.export.load(str(path))
    except NeedsTrust as need:
        raise NormconvError(f"refusing to load {spec}: a pickle inside the program runs code on load and would "
                            f"import {shown_globals(need.globs)}; pass --trust-pickle if you trust this file") from None
    except Exception as exc:
        raise NormconvError(f"{spec} is not a readable torch.export program ({describe(exc)})") from None
    model = ep.module()
    # train or eval is what the program computes, read from its graph; never .eval() on an exported module
    found = training_ops(ep)
    for m in model.modules():
        m.training = bool(found)
    inputs = None
    if ep.example_inputs is not None:
        args, kwargs = ep.example_inputs
        inputs = Inputs(tuple(args), dict(kwargs))
    return Loaded(model, inputs, spec, "pt2", path)


# ops whose presence means the program was exported in training mode (batch statistics, live dropout)
_TRAINING_OPS = ("_native_batch_norm_legit_functional", "_native_batch_norm_legit.default")


def training_ops(ep: Any) -> list[str]:
    """Ops of an exported graph (an ExportedProgram, or a GraphModule: anything with a ``graph``) that only a
    training-mode export contains."""
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


def _load_pickle(path: Path, spec: str, trust_pickle: bool) -> Loaded:
    try:
        obj = torch_load_safely(path, spec)
    except NeedsTrust as need:
        globs = need.globs
        obj = load_allowlisted(path, globs)
    if obj is REFUSED:
        if not trust_pickle:
            raise NormconvError(
                f"refusing to unpickle {spec}: a full pickled module runs code on load and would import "
                f"{shown_globals(globs)}; pass --trust-pickle if you trust this file") from None
        try:
            with _user_folder_importable():
                obj = torch.load(path, map_location="cpu", weights_only=False)
        except (ImportError, AttributeError) as exc:
            raise NormconvError(f"cannot load {spec}: {describe(exc)} (the model's class must be importable "
                                f"here: install its package or add it to PYTHONPATH)") from None
        except Exception as exc:
            raise NormconvError(f"cannot load {spec}: {describe(exc)}") from None
    if isinstance(obj, nn.Module):
        return Loaded(obj, _carried_inputs(obj), spec, "pickle", path)
    if isinstance(obj, dict) and obj and all(isinstance(v, torch.Tensor) for v in obj.values()):
        raise NormconvError(f"{spec} is a state_dict (weights only): pass the model as package.module:factory "
                            f"--weights {spec}")
    raise NormconvError(f"{spec} holds a {type(obj).__name__}, not a torch.nn.Module")


def _carried_inputs(model: nn.Module) -> Inputs | None:
    carried = model.__dict__.pop(INPUTS_ATTR, None)
    if isinstance(carried, dict) and isinstance(carried.get("args"), (tuple, list)):
        return Inputs(tuple(carried["args"]), dict(carried.get("kwargs") or {}))
    return None


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
    except Exception as exc:  # ImportError, and the module's own failure (a SyntaxError, a raise at import)
        raise NormconvError(f"cannot import {module_name!r} for {spec}: {describe(exc)}") from None
    factory: Callable | None = getattr(module, attr, None)
    if factory is None:
        raise NormconvError(f"{module_name!r} has no attribute {attr!r}")
    try:
        called = callable(factory) and not isinstance(factory, nn.Module)
        made = factory() if called else factory
    except (Exception, SystemExit) as exc:  # a factory calling sys.exit() is a failure too, never a silent exit 0
        raise NormconvError(f"{spec}() failed: {describe(exc) if not isinstance(exc, SystemExit) else f'it called sys.exit({exc.code!r})'}") from None
    inputs = None
    if isinstance(made, tuple) and len(made) == 2 and isinstance(made[0], nn.Module):
        made, example = made
        if isinstance(example, Inputs):
            inputs = example
        elif isinstance(example, Mapping):  # forward's keyword arguments by name (as the API's example_inputs)
            inputs = Inputs((), dict(example))
        else:
            inputs = Inputs(tuple(example) if isinstance(example, (tuple, list)) else (example,))
    if not isinstance(made, nn.Module):
        what = type(made).__name__
        raise NormconvError(f"{spec} {'returned' if called else 'is not callable: it is'} "
                            f"{'an' if what[:1].lower() in 'aeiou' else 'a'} {what}, not a torch.nn.Module")
    if weights:
        load_weights(made, weights)
    return Loaded(made.eval(), inputs, spec, "factory")


def load_weights(model: nn.Module, weights: str) -> None:
    """Load a .pt state_dict or a .safetensors file into ``model`` strictly, with a one-line error on mismatch."""
    path = Path(weights)
    if not path.is_file():
        raise NormconvError(f"no such weights file: {weights}")
    state = read_tensors(path, weights, "is not a plain state_dict (it pickles objects); save model.state_dict() "
                                         "instead")
    if isinstance(state, dict) and "state_dict" in state and isinstance(state["state_dict"], dict):
        state = state["state_dict"]  # a training checkpoint {"state_dict": ..., "epoch": ...}
    if not isinstance(state, dict):
        raise NormconvError(f"{weights} does not hold a state_dict")
    expected = model.state_dict()
    wrong = [(k, tuple(v.shape), tuple(expected[k].shape)) for k, v in state.items()
             if k in expected and isinstance(v, torch.Tensor) and tuple(v.shape) != tuple(expected[k].shape)]
    if wrong:
        k, got, want = wrong[0]
        raise NormconvError(f"{weights} does not match the model: {len(wrong)} tensors have another shape (e.g. {k}: "
                            f"{got} in the file, {want} in the model)")
    not_tensors = [k for k, v in state.items() if not isinstance(v, torch.Tensor)]
    if not_tensors:
        raise NormconvError(f"{weights} does not hold a state_dict of tensors ({not_tensors[0]!r} is a "
                            f"{type(state[not_tensors[0]]).__name__})")
    try:
        result = model.load_state_dict(state, strict=False)
    except Exception as exc:  # anything else load_state_dict refuses (a dtype it cannot copy, ...)
        raise NormconvError(f"{weights} does not match the model ({describe(exc)})") from None
    missing, unexpected = list(result.missing_keys), list(result.unexpected_keys)
    if missing and path.suffix == ".safetensors":  # tied tensors stored once (save_model, transformers): as load_model
        missing, unexpected = _tied_as_safetensors(expected, state, missing, unexpected)
    if missing or unexpected:
        raise NormconvError(
            f"{weights} does not match the model: {len(missing)} missing keys (e.g. {missing[:2]}), "
            f"{len(unexpected)} unexpected (e.g. {unexpected[:2]})")


def _tied_as_safetensors(expected: dict, state: dict, missing: list[str],
                         unexpected: list[str]) -> tuple[list[str], list[str]]:
    """The missing and unexpected keys as ``safetensors.torch.load_model`` counts them, by the library's own rule
    (``_remove_duplicate_names``): of the names sharing one tensor in the model, those the file leaves out
    (``save_model`` keeps one, as transformers does) are not missing, as the kept one loads them all; one the file
    holds beside its kept name is unexpected."""
    from safetensors.torch import _remove_duplicate_names

    try:
        groups = _remove_duplicate_names(expected, preferred_names=list(state))
    except Exception:  # noqa: BLE001 - no name of a shared tensor it would keep: load_model refuses the model too
        return missing, unexpected
    missing = list(missing)
    for removed in groups.values():
        for name in removed:
            if name in missing:
                missing.remove(name)
            else:
                unexpected = [*unexpected, name]
    return missing, unexpected


# ---------------------------------------------------------------------------------------------------------
# Hugging Face folders


def _load_hf(path: Path, spec: str, trust_remote_code: bool = False, ledger: Ledger | None = None) -> Loaded:
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
    # what the folder means, decided before transformers reads any of it: the weights from_pretrained loads (its
    # own rules; an ambiguous folder refused), every path inside the folder, every safetensors header valid
    raw = hf_folder._config(path)
    hf_folder.check_folder_files(path, ["generation_config.json"])
    weights = hf_folder.resolve(path, raw)
    config_size.check_numbers(raw, spec)  # a layer count or width no model has: refused from the numbers
    for file in (weights.files if weights is not None and not weights.safetensors else []):
        check_archive(file, str(file))  # a pytorch_model.bin is a zip archive torch inflates
    if ledger is not None:
        ledger.record_folder(path, primary=True)
        if weights is not None:
            weights.record(ledger)
    config = hf_config(path, spec, trust_remote_code)
    hf_folder.check_folder_files(path, list(getattr(type(config), "extra_files", ())))
    cls = hf_model_class(config, spec, weights.weight_map if weights is not None else None)
    config_size.check_memory(raw, spec, cls, config)  # past memory: estimated, and where so, counted on meta
    use_cache = getattr(config, "use_cache", None)
    if hasattr(config, "use_cache"):
        config.use_cache = False  # torch.export cannot capture a KV cache object
    hf_logging = transformers.utils.logging
    bars = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()  # normconv's output is normconv's: no "Loading weights" bar on stderr
    try:
        with hf_building(spec):
            model = cls.from_pretrained(str(path), config=config, local_files_only=True,
                                        trust_remote_code=trust_remote_code)
    finally:
        if bars:
            hf_logging.enable_progress_bar()
    inputs = hf_example_inputs(model)
    dtype = next((p.dtype for p in model.parameters() if p.is_floating_point()), None)  # its input layer's
    if inputs is not None and dtype is not None and dtype != torch.float32:
        inputs = inputs.to(dtype)  # pixels and audio in the model's own dtype: a float16 checkpoint takes float16
    return Loaded(model.eval(), inputs, spec, "hf", path,
                  use_cache=use_cache if isinstance(use_cache, bool) else None)


def hf_config(path: str | os.PathLike, spec: str, trust_remote_code: bool = False) -> Any:
    """transformers' config for the folder ``path``; what transformers refuses in it (an unknown model_type, a value
    its config class rejects) is the user's: one line, exit 2 (in memory and --stream alike)."""
    import transformers

    try:
        return transformers.AutoConfig.from_pretrained(str(path), local_files_only=True,
                                                       trust_remote_code=trust_remote_code)
    except Exception as exc:
        raise NormconvError(f"{spec}/config.json is not a readable Hugging Face config ({describe(exc)})") from None


@contextlib.contextmanager
def hf_building(spec: str):
    """transformers' refusal to build or load the model a config describes (a dtype no model is built in, a size
    its code rejects) is the user's: one line, exit 2, whether the model is loaded (in memory) or built on the meta
    device (--stream)."""
    try:
        yield
    except NormconvError:
        raise
    except Exception as exc:
        raise NormconvError(f"cannot load the Hugging Face model in {spec} ({describe(exc)})") from None


def hf_model_class(config: Any, spec: str, keys: Any = None) -> Any:
    """The transformers model class a config's ``architectures`` names, resolved as transformers resolves it: a
    transformers class of that name, or the Auto class config.json's ``auto_map`` maps to it (the folder's own
    code, where trusted). A name that is neither, or is not a model class (a tokenizer, a config, a function), is
    refused: normconv never falls back to another class, whose head (or lack of one) the folder did not name.
    With no ``architectures``: the class transformers' AutoModel builds from the config (the base model, no head),
    unless the checkpoint's tensor names ``keys`` show a model with a head (the base model's prefix on them)."""
    import transformers

    archs = getattr(config, "architectures", None) or []
    if not isinstance(archs, (list, tuple)):
        archs = [archs]
    for name in archs:
        cls = getattr(transformers, name, None) if isinstance(name, str) else None
        if cls is None:
            auto = _auto_map_class(config, name)
            if auto is not None:
                return auto
            raise NormconvError(f"{spec}/config.json: architectures names {name!r}, which is not a transformers "
                                f"model class (transformers has no class of that name); name the model's class "
                                f"there{_examples(config)}")
        auto = getattr(transformers.models.auto.auto_factory, "_BaseAutoModelClass", ())
        if isinstance(cls, type) and (issubclass(cls, transformers.PreTrainedModel) or (auto and issubclass(cls, auto))):
            return cls
        what = f"defined in {getattr(cls, '__module__', '?')}"
        raise NormconvError(f"{spec}/config.json: architectures names {name}, which is not a transformers model class "
                            f"({what}); name the model's class there, or remove architectures")
    if getattr(config, "auto_map", None):
        return transformers.AutoModel  # the folder's own code (trusted): its AutoModel entry
    try:
        from transformers.models.auto.auto_factory import _get_model_class

        base = _get_model_class(config, transformers.AutoModel._model_mapping)
    except Exception:  # noqa: BLE001 - no base model for this config: AutoModel says why, in one line
        return transformers.AutoModel
    prefix = getattr(base, "base_model_prefix", "") or ""
    headed = sorted(k for k in (keys or ()) if prefix and k.startswith(f"{prefix}."))
    if headed:
        raise NormconvError(f"{spec}/config.json names no architectures, and its weights are a model with a head's "
                            f"({headed[0]}: {base.__name__}, the model transformers' AutoModel builds, holds no "
                            f"{prefix}.*), so which head the folder means is not said; name the model's class in "
                            f"architectures{_examples(config)}")
    return base


def _auto_map_class(config: Any, name: str) -> Any:
    """The Auto class whose ``auto_map`` entry is the class ``name`` (the folder's own code), or None."""
    import transformers

    auto_map = getattr(config, "auto_map", None)
    for auto, ref in (auto_map.items() if isinstance(auto_map, dict) else ()):
        refs = ref if isinstance(ref, (list, tuple)) else [ref]
        if any(isinstance(r, str) and r.rsplit(".", 1)[-1] == name for r in refs) and auto.startswith("AutoModel"):
            return getattr(transformers, auto, None)
    return None


def _examples(config: Any) -> str:
    """' (e.g. GPT2LMHeadModel, GPT2Model)': the classes transformers has for the config's model type."""
    import transformers

    names: list[str] = []
    for auto in ("AutoModelForCausalLM", "AutoModelForMaskedLM", "AutoModelForSeq2SeqLM", "AutoModel"):
        try:
            found = getattr(transformers, auto)._model_mapping[type(config)]
        except Exception:  # noqa: BLE001 - no such task for this model type
            continue
        names += [c.__name__ for c in (found if isinstance(found, (list, tuple)) else [found])
                  if c.__name__ not in names]
    return f" (e.g. {', '.join(names[:3])})" if names else ""


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
