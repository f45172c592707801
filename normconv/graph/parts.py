"""Capture by parts: for a model that no method captures whole, a graph of each submodule on its own.

Each level runs the model once, eagerly, with forward pre-hooks that record the first inputs of the modules wanted
at that level (the children of the modules that failed so far); each is then captured alone with those inputs. A part
that fails too is split into its children at the next level, down to leaves. What no graph holds is said, not
guessed: the leaves that failed, and each failed module's own code between its submodules (a norm written inline
there is not seen). Fold, canonicalize and swap run on parts too (``engine.run``): each proves its rewrite
within one graph, and the whole rewritten model is verified as always; rotation, DeepNorm and export need the
whole graph.
"""

from __future__ import annotations

import collections
import copy
import dataclasses
from dataclasses import dataclass, field
from typing import Sequence

import torch.nn as nn

from normconv.errors import NormconvError
from normconv.graph.capture import Captured, _one_line, capture
from normconv.graph.detect import NormSite, spans_graph, whole_module_call
from normconv.verify import Inputs, run


@dataclass
class Part:
    path: str  # module path in the whole model
    cap: Captured
    calls: int  # how many times the whole model's forward called it (its graph is of the first call)


@dataclass
class Parts:
    parts: list[Part] = field(default_factory=list)
    failed: dict[str, str] = field(default_factory=dict)  # path -> why its own capture failed (split further)
    leaves_failed: list[str] = field(default_factory=list)  # failed paths with no submodule to split into


def _record(model: nn.Module, inputs: Inputs, wanted: dict[str, nn.Module], rewritten_by: Sequence[str] = ()) \
        -> tuple[dict[str, Inputs], collections.Counter, dict[str, int]]:
    """One eager forward: the first inputs each wanted module was called with, its call count, and the order of
    every module's first call. ``rewritten_by``: the passes that already changed ``model`` (then a failing forward
    is theirs, not the user's inputs')."""
    seen: dict[str, Inputs] = {}
    calls: collections.Counter = collections.Counter()
    order: dict[str, int] = {}

    def hook(name, keep):
        def pre(_mod, args, kwargs):
            calls[name] += 1
            order.setdefault(name, len(order))
            if keep and name not in seen:  # copied: the forward goes on and may write into them
                try:
                    seen[name] = Inputs(copy.deepcopy(tuple(args)), copy.deepcopy(dict(kwargs)))
                except Exception:  # noqa: BLE001 - inputs that cannot be copied (a lock, a stream): split it instead
                    pass
        return pre

    handles = [m.register_forward_pre_hook(hook(n, n in wanted), with_kwargs=True)
               for n, m in model.named_modules() if n]
    try:
        run(model, inputs)
    except Exception as exc:
        if rewritten_by:  # the model ran on these inputs before: the passes that changed it broke it (a bug)
            raise RuntimeError(f"the model as {', '.join(rewritten_by)} rewrote it fails on its example inputs "
                               f"({inputs.describe()}): {_one_line(exc)}") from None
        raise NormconvError(f"the model rejected its example inputs ({inputs.describe()}): {_one_line(exc)}") from None
    finally:
        for h in handles:
            h.remove()
    return seen, calls, order


def capture_parts(model: nn.Module, inputs: Inputs, method: str = "auto",
                  known_failed: dict[str, str] | None = None, rewritten_by: Sequence[str] = ()) -> Parts:
    """Graphs of the largest submodules that capture alone, level by level (see the module docstring).
    ``known_failed``: paths whose capture already failed in this run (path -> why), split without being tried again:
    a pass rewrites layers, not the control flow that kept a module from capturing."""
    known_failed = known_failed or {}
    result = Parts()
    pending = [(n, c) for n, c in model.named_children()]
    order: dict[str, int] = {}
    while pending:
        wanted = dict(pending)
        recorded, calls, order = _record(model, inputs, wanted, rewritten_by)
        pending = []
        for name, module in wanted.items():
            if name not in recorded:  # a container (ModuleList) or a module these inputs never call: its children
                pending.extend((f"{name}.{n}", c) for n, c in module.named_children())
                continue
            try:
                if name in known_failed:
                    raise NormconvError(known_failed[name])
                cap = capture(module, recorded[name], method)
            except NormconvError as exc:
                result.failed[name] = str(exc)
                children = [(f"{name}.{n}", c) for n, c in module.named_children()]
                if children:
                    pending.extend(children)
                else:
                    result.leaves_failed.append(name)
                continue
            result.parts.append(Part(name, cap, calls[name]))
    result.parts.sort(key=lambda p: order.get(p.path, len(order)))  # in the order the forward calls them
    return result


def in_whole_model(site: NormSite, whole: Part) -> NormSite:
    """A part's site named as in the whole model: module paths and parameter names under the part's path, graph
    node names as ``part:node`` (each part has its own graph); its calls times the part's. A hand-written norm
    module captured alone is its part's whole graph (input to output): that module's site, as in a whole graph."""
    part, cap = whole.path, whole.cap
    if spans_graph(cap, site):
        site = dataclasses.replace(site, target="", module_type=type(cap.model).__name__)

    def path(name):
        return f"{part}.{name}" if name else part

    def node(name):
        return f"{part}:{name}"

    return dataclasses.replace(
        site, target=path(site.target) if whole_module_call(site) else node(site.target),
        owner=path(site.owner), calls=site.calls * whole.calls, node=node(site.node), input=node(site.input), nodes=tuple(map(node, site.nodes)),
        **{k: path(getattr(site, k)) for k in ("weight", "bias", "running_mean", "running_var") if getattr(site, k)},
        # what computes the input of a norm at a part's boundary is outside the part's graph
        **({"placement": "unknown", "producer": "unknown"} if site.placement == "input" else {}),
        notes=site.notes + (f"found in a graph of {part} alone: placement is judged within it",))


__all__ = ["Part", "Parts", "capture_parts", "in_whole_model"]
