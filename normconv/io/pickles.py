"""Reading what a user hands normconv without running it: a pickle is loaded with ``weights_only=True``, torch's
and normconv's own module classes are allowlisted, and a pickle that needs more is refused naming the globals it
would import (listed from its opcodes, nothing executed). Also: safetensors files, torch's loaders kept quiet, and
``why``, the one line of a library's exception that normconv's errors quote.

One of the io room's lowest modules: it imports nothing of normconv but errors, quiet and io.archive.
"""

from __future__ import annotations

import codecs
import contextlib
import importlib
import pickle
import zipfile
from pathlib import Path
from typing import Any

import torch

from normconv.errors import NormconvError, describe
from normconv.io.archive import check_archive
from normconv.quiet import quiet


@contextlib.contextmanager
def only_weights_unpickled(trust: bool):
    """Every torch.load inside the block runs with weights_only=True (unless ``trust``); a pickle that needs
    more raises NeedsTrust with the globals it names, which no library code can catch and fall back from."""
    real = torch.load

    def load_weights_only(f, *args, weights_only=None, **kwargs):
        if trust:
            return real(f, *args, weights_only=False if weights_only is None else weights_only, **kwargs)
        try:
            return real(f, *args, weights_only=True, **kwargs)
        except pickle.UnpicklingError:
            if hasattr(f, "seek"):
                f.seek(0)
            raise NeedsTrust(_unsafe_globals(f)) from None

    torch.load = load_weights_only
    try:
        yield
    finally:
        torch.load = real


def quiet_loaders():
    """torch's loaders log warnings and whole tracebacks for files they cannot read; normconv says one line."""
    return quiet(("torch", "torch.export", "torch._export", "torch.serialization"))


def torch_load_safely(path: Path, spec: str) -> Any:
    """torch.load(weights_only=True), with the zip/pickle failures turned into plain words."""
    if path.stat().st_size == 0:
        raise NormconvError(f"{spec} is empty")
    if zipfile.is_zipfile(path) is False and _looks_truncated_zip(path):
        raise NormconvError(f"{spec} is truncated or corrupt (its zip archive has no end record)")
    if not zipfile.is_zipfile(path) and not _starts_like_a_pickle(path):  # every torch.save writes one of the two
        hint = "; it is text: for a model defined in Python, pass package.module:factory" if _is_text(path) else ""
        raise NormconvError(f"{spec} is not a model file normconv can read (neither a zip archive nor a pickle{hint})")
    check_archive(path, spec)  # every member capped by what its header declares, before any is inflated
    if _is_torchscript(path):
        raise NormconvError(f"{spec} is a TorchScript archive (torch.jit.save): normconv rewrites nn.Modules; load "
                            f"the original module, or save it with torch.save(model) or torch.export")
    try:
        with quiet_loaders():
            return torch.load(path, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as exc:
        # weights_only refused it: because of globals it would import (an opt-in runs them), or it is no pickle
        found = _unsafe_globals(path, listed_only=True)
        if found:
            raise NeedsTrust(found) from None
        raise NormconvError(f"{spec} is not a model file normconv can read ({describe(exc)})") from None
    except RuntimeError as exc:
        if zipfile.is_zipfile(path) and not _zip_intact(path):  # torch's reader failed on a damaged archive
            raise NormconvError(f"{spec} is truncated or corrupt ({describe(exc)})") from None
        raise NormconvError(f"{spec} is not a model file normconv can read ({describe(exc)})") from None
    except (EOFError, OSError, ValueError, KeyError) as exc:
        raise NormconvError(f"{spec} is not a model file normconv can read ({describe(exc)})") from None


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


def _zip_intact(path: Path) -> bool:
    """Every member of the zip archive reads back with its CRC (the error path only: it reads the whole file)."""
    try:
        with zipfile.ZipFile(path) as z:
            return z.testzip() is None
    except (zipfile.BadZipFile, OSError, EOFError, ValueError, RuntimeError):
        return False


def _looks_truncated_zip(path: Path) -> bool:
    with open(path, "rb") as f:
        return f.read(4) == b"PK\x03\x04"  # starts as a zip (torch.save) but is_zipfile said no


class NeedsTrust(BaseException):
    """A pickle that needs more than weights_only: BaseException, so no ``except Exception`` in a library can
    swallow it and retry with weights_only=False."""

    def __init__(self, globs: list[str] | None = None):
        super().__init__()
        self.globs = globs or []


def shown_globals(globs: list[str]) -> str:
    return ", ".join(globs[:8]) + (f" and {len(globs) - 8} more" if len(globs) > 8 else "")


# globals whose unpickling runs only torch's or normconv's own code, loaded without --trust-pickle: torch.nn's and
# normconv's module classes, and torch's functional ops (an nn.TransformerEncoderLayer pickles its activation,
# torch.nn.functional.relu or torch._C._nn.gelu). torch's weights_only unpickler matches an allowlisted object by
# where it is defined: a name a trusted module merely imports (torch.nn.modules.module.namedtuple) stays refused
_TRUSTED_PREFIXES = ("torch.nn.modules.", "normconv.models.", "normconv.nn.rmsnorm.", "normconv.nn.modules.",
                     "torch.nn.functional.", "torch._C._nn.")
REFUSED = object()


def load_allowlisted(path: Path, globs: list[str]) -> Any:
    """weights_only load with torch.nn / normconv classes allowlisted; REFUSED if anything else is needed."""
    if not globs or not all(g.startswith(_TRUSTED_PREFIXES) for g in globs):
        return REFUSED
    try:
        classes = []
        for name in globs:
            module, _, attr = name.rpartition(".")
            classes.append(getattr(importlib.import_module(module), attr))
        with torch.serialization.safe_globals(classes):
            return torch.load(path, map_location="cpu", weights_only=True)
    except Exception:
        return REFUSED


def _unsafe_globals(f: Any, listed_only: bool = False) -> list[str]:
    """The globals a pickle would import that weights_only does not allow: from torch for a zip checkpoint,
    from the opcodes themselves (pickletools, nothing executed) for an old-format or raw pickle. ``listed_only``:
    [] when none can be listed (else a placeholder saying so)."""
    try:
        found = list(torch.serialization.get_unsafe_globals_in_checkpoint(f if hasattr(f, "read") else str(f)))
        if found:
            return found
    except Exception:
        pass
    try:
        data = f.read() if hasattr(f, "read") else Path(f).read_bytes()
    except OSError:
        return [] if listed_only else ["(globals could not be listed)"]
    return _pickle_globals(data) or ([] if listed_only else ["(globals could not be listed)"])


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


def read_tensors(path: Path, shown: str, if_objects: str) -> Any:
    """A .safetensors file, or a torch.save of tensors loaded with weights_only (``if_objects``: the refusal when it
    pickles more than tensors)."""
    if path.suffix == ".safetensors":
        try:
            from safetensors.torch import load_file

            return load_file(str(path))
        except Exception as exc:
            raise NormconvError(f"{shown} is not a readable safetensors file ({describe(exc)})") from None
    try:
        return torch_load_safely(path, shown)
    except NeedsTrust:
        raise NormconvError(f"{shown} {if_objects}") from None
