"""A model as torch.save pickles it: whether it pickles, what ``torch.load`` of it imports, and a GraphModule's
tracer class written as torch's own.

A GraphModule pickles as its generated code plus its ``__dict__``, and that dict names the class that traced it
(``_tracer_cls``): torch.load re-traces the code with it. normconv's captures trace with its own tracer
(graph.capture.NormLeafTracer), which would make every GraphModule normconv writes need normconv to load.
``torch_tracers`` writes such a class as a subclass of ``torch.fx.Tracer`` made at load time (``builtins.type``)
with the same ``proxy_buffer_attributes`` (a buffer read in the code stays a read of the buffer, not a constant),
the one thing that matters there: the re-trace keeps every submodule a leaf, whatever the tracer says.
"""

from __future__ import annotations

import contextlib
import io
import pickle
import pickletools
import re
import sys
from typing import Any, Iterator

import torch
import torch.fx as fx
import torch.nn as nn


class _TorchTracer:
    """Pickles as ``type(name, (torch.fx.Tracer,), {...})``. The name holds ``<locals>`` so that a loaded
    GraphModule does not keep the class (torch keeps no local tracer): saving it again pickles."""

    def __init__(self, cls: type):
        self.name = f"<locals>.{cls.__name__}"
        self.proxy_buffers = bool(cls().proxy_buffer_attributes)

    def __reduce__(self):
        return type, (self.name, (fx.Tracer,), {"proxy_buffer_attributes": self.proxy_buffers,
                                                "__qualname__": self.name, "__module__": "torch.fx"})


def _holders(model: nn.Module) -> Iterator[Any]:
    for m in model.modules():
        yield from (m, *m._forward_hooks.values(), *m._forward_pre_hooks.values())


@contextlib.contextmanager
def torch_tracers(model: nn.Module) -> Iterator[None]:
    """While the block runs, every GraphModule in ``model`` (module or hook) traced by normconv's own tracer class
    names a torch-only stand-in instead; the model is as it was afterwards. A user's own tracer is left alone."""
    changed = []
    for x in _holders(model):
        cls = getattr(x, "_tracer_cls", None) if isinstance(x, fx.GraphModule) else None
        if isinstance(cls, type) and cls.__module__.split(".")[0] == "normconv":
            changed.append((x, cls))
            x.__dict__["_tracer_cls"] = _TorchTracer(cls)
    try:
        yield
    finally:
        for x, cls in changed:
            x.__dict__["_tracer_cls"] = cls


class _Probe(pickle.Pickler):
    """pickle as torch.save does, tensor storages left out (their bytes always pickle): only the structure is tried."""

    def persistent_id(self, obj: Any) -> Any:
        return 0 if isinstance(obj, (torch.storage.TypedStorage, torch.storage.UntypedStorage)) else None


class _Sink:
    def write(self, b: bytes) -> int:
        return len(b)


def _pickles(obj: Any) -> str | None:
    try:
        _Probe(_Sink(), protocol=2).dump(obj)
    except Exception as exc:  # noqa: BLE001 - whatever pickle raises is the answer
        return f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"
    return None


def unpicklable(model: nn.Module) -> str | None:
    """Why ``torch.save(model)`` would fail, naming the attribute that does not pickle (a hook that is a local
    function, a module object, a lock), or None when it pickles. Tensor bytes are not written: this costs the walk."""
    why = _pickles(model)
    if why is None:
        return None
    for path, m in model.named_modules():
        for key, value in vars(m).items():
            if key != "_modules" and _pickles(value) is not None:
                where = f"{path}.{key}" if path else key
                if isinstance(value, dict):  # a hook dict, a cache: which entry
                    bad = next((k for k, v in value.items() if _pickles(v) is not None), None)
                    where += f"[{bad!r}]" if bad is not None else ""
                return f"{where}: {why}"
    return why


_IMPORT = re.compile(r"^(?:from|import)\s+(\w+)", re.M)


def load_needs(model: nn.Module) -> list[str]:
    """The packages besides torch and Python's own that ``torch.load`` of ``model`` as ``io.outputs.write_pickle``
    pickles it imports: every global its pickle names (a class, a function, a tracer) and every import a
    GraphModule's code makes, read off the pickle of its structure (tensor bytes left out)."""
    from torch.fx.graph_module import _format_import_block
    from torch.package import sys_importer

    buf = io.BytesIO()
    with torch_tracers(model):
        try:
            _Probe(buf, protocol=2).dump(model)
        except Exception:  # noqa: BLE001 - it does not pickle (io.write.save refuses it): what it named so far
            pass
    found = set()
    try:
        for op, arg, _ in pickletools.genops(buf.getvalue()):
            if op.name in ("GLOBAL", "INST"):
                found.add(arg.split(" ")[0].split(".")[0])
    except ValueError:  # a pickle cut short where it failed
        pass
    for x in _holders(model):
        if isinstance(x, fx.GraphModule):
            found.update(_IMPORT.findall(_format_import_block(x.graph.python_code("self").globals, sys_importer)))
    return sorted(found - {"torch", "__builtin__"} - set(sys.stdlib_module_names))


__all__ = ["torch_tracers", "unpicklable", "load_needs"]
