"""The module a norm site can be replaced as: the norm module itself, or a module whose forward is the norm followed
by its own child modules alone, which a replacement keeps in their order:

  nn.BatchNorm2d / SyncBatchNorm / a hand-written norm module        ->  ModuleForm(path)
  timm's BatchNormAct2d: F.batch_norm(x, ...) -> self.drop -> self.act  ->  ModuleForm(path, tail=("drop", "act"))
  mmcv's SyncBatchNorm, detectron2's FrozenBatchNorm2d: F.batch_norm   ->  ModuleForm(path)

A module's forward qualifies when, in the call that computes the site, the norm reads the module's input as it comes
and every value from the norm's output to the module's output is computed by one child module after another. Nodes
the output does not depend on (timm's ``_assert(x.ndim == 4)``) do not count. Children that leave no node in a graph
(nn.Identity, nn.Dropout in eval) are kept too, in the order the module registers them.

A module the model never calls, whose tensors the model's own graph reads (an exported program's module, loaded
from a .pt2: ``getattr(self, "1").running_mean`` feeding ``aten.batch_norm``), is a holder: replacing it alone would
leave the graph reading tensors the replacement lacks. Its form is ``held``: the replacement takes the holder's place
and the graph calls it in place of the one batch-norm op that read the holder's tensors (``replace_in_graph``).
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

import operator

import torch.fx as fx
import torch.nn as nn

from normconv.graph.capture import Captured
from normconv.graph.site import NormSite
from normconv.match import batch_norm_args, op_of
from normconv.report import Why

_SILENT = (nn.Identity, nn.Dropout, nn.Dropout1d, nn.Dropout2d, nn.Dropout3d, nn.AlphaDropout)


class FormWhy(Why):
    """Why a norm site is not a module a replacement can take the place of."""

    INLINE = "inline"  # the norm is computed inside a larger forward
    MORE_CODE = "forward-computes-more"  # the module's forward computes more than the norm and its children
    CALLED_TWICE = "module-called-several-times"  # one module, several calls: replacing it replaces every call
    READ_BY_GRAPH = "tensors-read-by-graph"  # never called: the model's graph reads its tensors in more than one op


class NotAModule(Exception):
    """The site is no module to replace: its code, and the message reported for the site."""

    def __init__(self, code: FormWhy, message: str):
        super().__init__(message)
        self.code = code


@dataclass(frozen=True)
class ModuleForm:
    """The module at ``path`` computes the site and then its children ``tail`` in order, nothing else."""

    path: str
    tail: tuple[str, ...] = ()
    held: bool = False  # a holder the graph reads: the replacement takes the place of its batch-norm op there


def module_form(cap: Captured, site: NormSite) -> ModuleForm:
    """Where a replacement of ``site`` goes, or NotAModule."""
    whole = site.source == "module" or (site.source == "handwritten" and site.target == site.owner)
    path = site.target if whole else site.owner
    module = cap.model if path == "" else cap.modules.get(path)
    # a whole norm module called twice is two sites of one target (detect counts them); a module around a
    # functional norm is counted by its calls in the graph
    calls = set() if whole or not path else \
        {c for n in cap.gm.graph.nodes if (c := cap.call_of(n, path)) is not None}
    if site.calls > 1 or len(calls) > 1 or cap.module_calls.get(path, 1) > 1:
        raise NotAModule(FormWhy.CALLED_TWICE, f"{path} is called at {max(site.calls, len(calls), 2)} places: a "
                                               f"replacement would replace every call")
    # never called, its tensors read by the model's graph  =>  the replacement takes the place of that op
    held = held_by(cap.model, path) if path else None
    if held is not None:
        _held_op(*held)
        return ModuleForm(path, held=True)
    if whole:
        return ModuleForm(path)
    if module is None:
        raise NotAModule(FormWhy.INLINE, f"the {site.kind} is computed inline in {site.owner or 'the root forward'}")
    inside = [n for n in cap.gm.graph.nodes if n.op not in ("placeholder", "get_attr", "output")
              and not cap.is_noise(n) and (path == "" or path in cap.owner_stack(n))]
    names = {n.name for n in inside}
    start = cap.nodes[site.input]
    if start.name in names:
        raise NotAModule(FormWhy.MORE_CODE, f"{path or 'the model'} computes the {site.kind}'s input itself "
                                            f"({cap.describe(start)})")
    # from the norm's output, one child module after another to the module's output
    v, visited, chain = cap.nodes[site.node], [], []
    while True:
        users = [u for u in cap.users(v) if u.name in names]
        if not users:
            break
        child = _child(cap, users[0], path)
        if len(users) > 1 or child is None:
            raise NotAModule(FormWhy.MORE_CODE, f"{path or 'the model'} computes more than the {site.kind} and its "
                                                f"child modules ({cap.describe(users[0])})")
        if not chain or chain[-1] != child:
            if child in chain:
                raise NotAModule(FormWhy.MORE_CODE, f"{path}.{child} is called twice after the {site.kind}")
            chain.append(child)
        visited.append(users[0])
        v = users[0]
    # nothing else inside the module feeds its output
    ours = set(site.nodes) | {n.name for n in visited}
    extra = [n for n in inside if n.name not in ours and n.name in cap.upstream([v])]
    if extra:
        raise NotAModule(FormWhy.MORE_CODE, f"{path or 'the model'} computes more than the {site.kind} and its child "
                                            f"modules ({cap.describe(extra[0])})")
    registered = [name for name, _ in module.named_children()]
    if [c for c in registered if c in chain] != chain:
        raise NotAModule(FormWhy.MORE_CODE, f"{path or 'the model'} calls its children in another order than it "
                                            f"registers them")
    tail = tuple(c for c in registered if c in chain or isinstance(getattr(module, c), _SILENT))
    return ModuleForm(path, tail)


def replaceable(cap: Captured, site: NormSite) -> ModuleForm | None:
    """The form of a norm computed by a call inside a module of the model (not its root, not a holder the graph
    reads) whose forward is that norm and its own children: a rewrite that removes the norm replaces the module by
    those children alone, whatever captured the graph (timm's BatchNormAct2d -> its drop, act). None otherwise: a
    norm module itself, or a norm only a graph can lose."""
    if site.source == "module" or (site.source == "handwritten" and site.target == site.owner) or not site.owner:
        return None
    found = _replaceable(cap, site)
    return found if isinstance(found, ModuleForm) else None


def not_replaceable(cap: Captured, site: NormSite) -> str | None:
    """Why the module around a norm computed by a call cannot be replaced by its own children (None: it can, or
    no module of the model holds the call)."""
    if site.source == "module" or (site.source == "handwritten" and site.target == site.owner) or not site.owner:
        return None
    found = _replaceable(cap, site)
    return found if isinstance(found, str) else None


def with_tail(new: nn.Module, module: nn.Module, tail: tuple[str, ...]) -> nn.Module:
    """What takes the place of a module whose forward was the norm and then its own children ``tail``: ``new`` (what
    is left of the norm: nn.Identity when nothing), then those children in order under their own names."""
    if not tail:
        return new
    head = [] if isinstance(new, nn.Identity) else [("norm", new)]
    return nn.Sequential(OrderedDict(head + [(name, getattr(module, name)) for name in tail]))


def _replaceable(cap: Captured, site: NormSite) -> ModuleForm | str:
    key = ("replaceable", site)  # decided once per capture: the analysis and the rewrite read the same answer
    if key not in cap.found:
        try:
            form = module_form(cap, site)
            cap.found[key] = form if not form.held else f"{form.path} is never called: the graph reads its tensors"
        except NotAModule as why:
            cap.found[key] = str(why)
    return cap.found[key]


def _child(cap: Captured, node: fx.Node, path: str) -> str | None:
    """The direct child of the module at ``path`` that computes ``node`` (None: the module's own code)."""
    prefix = f"{path}." if path else ""
    for p in cap.owner_stack(node):
        if p.startswith(prefix) and p != path and p:
            return p[len(prefix):].split(".")[0]
    return None


def held_by(model: nn.Module, path: str) -> tuple[fx.GraphModule, str] | None:
    """The GraphModule whose code reads the tensors of the module at ``path`` itself, and the path below it, when
    no call runs that module's forward (None: a forward of it runs, as in every model that is not a GraphModule)."""
    root, rel = model, path
    while isinstance(root, fx.GraphModule) and rel:
        called = [n.target for n in root.graph.nodes if n.op == "call_module"]
        hit = next((t for t in called if rel == t or rel.startswith(f"{t}.")), None)
        if hit is None:
            return root, rel
        if hit == rel:
            return None
        root, rel = root.get_submodule(hit), rel[len(hit) + 1:]
    return None


def _held_op(gm: fx.GraphModule, rel: str) -> tuple[fx.Node, fx.Node]:
    """The one batch-norm op of ``gm`` that reads the holder ``rel``'s tensors, and the node of its output; NotAModule
    when the holder is read otherwise (several ops, a child it calls, a hand-written norm, a tuple output used)."""
    def under(target: str) -> bool:
        return target == rel or target.startswith(f"{rel}.")

    nodes = gm.graph.nodes
    reads = [n for n in nodes if n.op in ("get_attr", "call_module") and under(str(n.target))]
    ops = {u for n in reads for u in n.users}
    why = f"{rel} is never called: the model's graph reads its tensors itself"
    # one batch-norm op, reading the holder through get_attr alone  =>  one op to replace
    if len(ops) != 1 or any(n.op == "call_module" for n in reads) or op_of(next(iter(ops))) != "batch_norm":
        raise NotAModule(FormWhy.READ_BY_GRAPH, f"{why}, and not in one batch-norm op alone")
    op = next(iter(ops))
    if not isinstance(batch_norm_args(op)["input"], fx.Node):
        raise NotAModule(FormWhy.READ_BY_GRAPH, f"{why}, and its batch-norm op has no input node")
    # aten's native forms return (out, mean, rstd): only the output may be used
    items = [u for u in op.users if u.op == "call_function" and u.target is operator.getitem]
    if not items:
        return op, op
    if len(items) != len(op.users) or any(u.args[1] != 0 and u.users for u in items):
        raise NotAModule(FormWhy.READ_BY_GRAPH, f"{why}, and its batch-norm op's statistics are used")
    out = [u for u in items if u.args[1] == 0]
    if len(out) != 1:
        raise NotAModule(FormWhy.READ_BY_GRAPH, f"{why}, and its batch-norm op's output is read more than once")
    return op, out[0]


def replace_in_graph(model: nn.Module, path: str, new: nn.Module) -> None:
    """A held form's replacement: ``new`` takes the holder's place (in its mode), the graph calls it on the input of
    the batch-norm op that read the holder, and that op and the holder's reads leave the graph."""
    found = held_by(model, path)
    assert found is not None, f"{path} is called: not a held form"
    gm, rel = found
    op, out = _held_op(gm, rel)
    parent_path, _, name = rel.rpartition(".")
    parent = gm.get_submodule(parent_path) if parent_path else gm
    new.train(getattr(parent, name).training)
    setattr(parent, name, new)
    graph = gm.graph
    with graph.inserting_before(op):
        call = graph.call_module(rel, (batch_norm_args(op)["input"],))
    call.meta.update({k: v for k, v in out.meta.items() if k in ("nn_module_stack", "tensor_meta", "val")})
    out.replace_all_uses_with(call)
    # the op, its unused outputs, then every read of the holder (now unused: the old tensors are gone with it)
    for node in [*(u for u in op.users), op]:
        graph.erase_node(node)
    for node in [n for n in graph.nodes if n.op == "get_attr" and (n.target == rel or n.target.startswith(f"{rel}."))]:
        graph.erase_node(node)
    gm.recompile()


__all__ = ["FormWhy", "NotAModule", "ModuleForm", "module_form", "replaceable", "not_replaceable", "with_tail",
           "held_by", "replace_in_graph"]
