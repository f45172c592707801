"""Where a capture decided a Python branch: ``Guard`` (the branch, the module whose forward holds it, what it
decided, and for a branch on input sizes the ranges the captured path holds for) and how each is found:

    _ValueReads      while symbolic_trace runs, a concrete tensor's value read in Python (``bool(t)``, ``t.item()``)
    branch_site      the forward line a tracer stands on where it met a branch over a traced value
    draft_guards     the data-dependent decisions torch.export.draft_export specialized, each placed in its module

Of normconv's, it imports nothing: graph.capture builds on it (and keeps ``Guard`` importable by its old name).
"""

from __future__ import annotations

import os
import traceback
from dataclasses import dataclass
from typing import Any

import torch
import torch.fx as fx
from torch.overrides import TorchFunctionMode


@dataclass(frozen=True)
class Guard:
    """A Python branch the capture decided on a tensor's value, as the example inputs decided it."""

    owner: str  # the module whose forward holds the branch ('' : the model's own forward)
    where: str  # file:line and the code there
    what: str  # the condition (torch.export's expression) or the value read
    # a branch on input sizes (``graph.size_guards``): the dimensions the captured path holds for, each
    # ((input, axis), ...), name, low, high (None: unbounded); empty for a branch on a value
    sizes: tuple[tuple[tuple[tuple[str, int], ...], str, int, int | None], ...] = ()

    def describe(self) -> str:
        return f"{self.where} in {self.owner or 'the model'}'s forward ({self.what})"

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {"owner": self.owner, "where": self.where, "what": self.what}
        if self.sizes:
            out["on"] = "size"  # one entry per dimension it narrowed, written by ``engine.branches``
        return out


def clean_path(path: str) -> str:
    """torch.export writes some paths as ``L['self'].layer.0`` or ``L__self___layer_0``; keep the dotted form."""
    if path.startswith("L['self']"):
        path = path[len("L['self']"):].lstrip(".")
    path = path.replace("._modules['", ".").replace("']", "")
    return path



_VALUE_READS = {"__bool__", "item", "tolist", "__int__", "__float__", "__index__", "__complex__", "numpy"}
_INTERNAL = (os.sep + "torch" + os.sep, os.sep + "normconv" + os.sep, os.sep + "typer" + os.sep,
             os.sep + "click" + os.sep, os.sep + "pluggy" + os.sep, os.sep + "_pytest" + os.sep)


def _user_frame() -> traceback.FrameSummary | None:
    """The innermost frame of the stack outside torch and normconv: the model's own code."""
    frames = traceback.extract_stack()
    return next((f for f in reversed(frames) if not any(part in f.filename for part in _INTERNAL)), None)


def _where(filename: str, line: Any, code: str | None) -> str:
    return f"{os.path.basename(str(filename))}:{line}" + (f" `{code.strip()}`" if code and code.strip() else "")


def branch_site(tracer: fx.Tracer) -> tuple[str, str]:
    """(owner, where) of the forward line the tracer stands on: the module whose forward it is, file:line and code."""
    stack = getattr(tracer, "module_stack", None) or {}
    owner = clean_path(list(stack.values())[-1][0]) if stack else ""
    frame = _user_frame()
    return owner, _where(frame.filename, frame.lineno, frame.line) if frame else "the model's forward"


class ValueReads(TorchFunctionMode):
    """While symbolic_trace runs: a concrete tensor's value read in Python (``bool(t)``, ``t.item()``, ``int(t)``)
    is a decision the graph bakes in (a Proxy's would have failed the trace). Each is a Guard."""

    def __init__(self, tracer: fx.Tracer):
        super().__init__()
        self.tracer, self.guards = tracer, []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        name = getattr(func, "__name__", "")
        if name in _VALUE_READS and args and isinstance(args[0], torch.Tensor):
            owner, where = branch_site(self.tracer)
            self.guards.append(Guard(owner, where, f"a tensor's value read ({name}) while tracing"))
        return func(*args, **(kwargs or {}))


def _last_frame(trace: str) -> tuple[str, int] | None:
    """(file, line) of the last ``File "...", line N`` of a node's stack trace."""
    import re

    found = re.findall(r'File "([^"]+)", line (\d+)', trace or "")
    return (found[-1][0], int(found[-1][1])) if found else None


def draft_guards(ep: Any) -> tuple[Guard, ...]:
    """The data-dependent decisions draft_export specialized (its report's failures), each with the module whose
    forward made it (the module stack of the graph's nodes from that line; the model's own when none)."""
    report = getattr(ep, "_report", None)
    names = dict(getattr(report, "str_to_filename", None) or {})
    try:  # the report maps only the file names first interned during this export; torch's table has them all
        from torch._logging.structured import INTERN_TABLE

        names.update({v: k for k, v in INTERN_TABLE.items()})
    except ImportError:
        pass
    owners: dict[tuple[str, int], str] = {}
    for n in ep.graph_module.graph.nodes:
        last = _last_frame(n.meta.get("stack_trace") or "")
        stack = n.meta.get("nn_module_stack")
        if last is not None and stack:
            owners.setdefault(last, clean_path(list(stack.values())[-1][0]))
    guards = []
    for failure in getattr(report, "failures", None) or []:
        data = failure.data if isinstance(failure.data, dict) else {}
        frames = data.get("user_stack") or []
        if frames:
            f = frames[-1]
            filename = names.get(f.get("filename"), str(f.get("filename")))
            where, owner = _where(filename, f.get("line"), f.get("loc")), owners.get((filename, f.get("line")), "")
        else:
            where, owner = "the model's forward", ""
        what = str(data.get("expr") or getattr(failure.failure_type, "name", "a guard"))
        guards.append(Guard(owner, where, what + (f", taken as {data['result']}" if data.get("result") else "")))
    return tuple(dict.fromkeys(guards)) or (Guard("", "the model's forward", "a branch on tensor values"),)


__all__ = ["Guard", "ValueReads", "branch_site", "clean_path", "draft_guards"]
