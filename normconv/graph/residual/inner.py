"""Norms inside a sublayer: their input reaches the residual stream only through linear layers that read it.

  q = n(z W^T)    z the output of a norm on the stream (or the stream itself), n a norm inside the sublayer
A rewrite of the stream that each reader linear takes back out (rotate: z -> z Q, W <- W Q; the scale fold:
g -> W diag(g); the swap's centering, which a LayerNorm on the stream does not see) leaves z W^T unchanged, and so
n's input: n is not on the stream and is left as it is. Per-head query / key norms (Qwen3, Qwen3-MoE, OLMo2, Gemma3,
Persimmon's q_layernorm / k_layernorm) and a sub-norm before an output projection are such norms.

A norm whose input is a sum of residual adds reads a stream. A norm reading one value is inside a sublayer when,
going back from its input through every operand (size reads and shape-only
operands are not values), every path stops at
  - a linear layer whose input is, through casts and views, a value of another norm's stream (its sum tree, its
    writers' outputs) or the output of another norm on the stream: the rewrite does not reach past it; or
  - a model input, a parameter or a constant: no stream at all,
at least one path stops at such a linear, and no path meets a stream value or a stream norm's output first. Which
norms are on the stream depends on which are not (a norm reading a per-head norm's output is judged past it), so
the decision is repeated until it no longer changes.
"""

from __future__ import annotations

from typing import Sequence

import torch.fx as fx

from normconv.graph.capture import Captured
from normconv.graph.detect import NormSite

from .axes import passes_through
from .walk import Leaf, template_use, walks
from .writers import linear_of


def inner_norms(cap: Captured, sites: Sequence[NormSite],
                walked: Sequence[tuple[set[str], list[Leaf]]] | None = None) -> dict[int, list[str]]:
    """Index of each site inside a sublayer -> the linear layers (module paths) through which its input reads the
    stream. ``walked``: ``walks(cap, sites)`` when the caller has it."""
    walked = list(walked) if walked is not None else walks(cap, sites)
    # node name -> the sites whose stream (its values, the norm's own nodes, and the writers' outputs of a sum tree
    # with adds) holds it; a norm reading one value (no add) has no writers of its own: q_norm and k_norm read
    # one view of a fused q | k | v projection, which is the stream of neither
    holders: dict[str, set[int]] = {}
    for i, (site, (values, leaves)) in enumerate(zip(sites, walked)):
        names = set(values) | set(site.nodes) | {site.node}
        for leaf, path, _ in leaves if values else ():
            names.update(n.name for n in [leaf, *path] if isinstance(n, fx.Node))
        for n in names:
            holders.setdefault(n, set()).add(i)
    inner: dict[int, list[str]] = {}
    for _ in range(len(sites) + 1):
        on = set(range(len(sites))) - set(inner)
        found = {}
        for i, site in enumerate(sites):
            if walked[i][0]:
                continue  # a sum tree of residual adds: the stream itself
            via = _through_linears(cap, cap.nodes[site.input], lambda n, i=i: bool(holders.get(n, set()) & on - {i}))
            if via:
                found[i] = via
        if found.keys() == inner.keys():
            return found
        inner = found
    return inner


def _through_linears(cap: Captured, start: fx.Node, on_stream) -> list[str] | None:
    """The linears every path back from ``start`` stops at before the stream (``on_stream(name)``), or None when
    a path meets the stream first or none stops at a linear."""
    via: list[str] = []
    stack, seen = [start], set()
    while stack:
        v = stack.pop()
        if v.name in seen:
            continue
        seen.add(v.name)
        if on_stream(v.name):
            return None  # the norm reads the stream (or a stream norm's output) itself
        lin = linear_of(cap, v) if cap.op(v) in ("linear", "matmul") else None
        if lin is not None and lin[1] is not None and isinstance(lin[0], fx.Node):
            x = lin[0]
            while not on_stream(x.name) and passes_through(cap, x) and isinstance(x.args[0], fx.Node):
                x = x.args[0]
            if on_stream(x.name):  # a reader linear: the rewrite is taken back out of its output
                if cap.describe(v) not in via:
                    via.append(cap.describe(v))
                continue
        stack.extend(a for a in v.all_input_nodes if not cap.is_size(a) and not template_use(v, a))
    return via or None


__all__ = ["inner_norms"]
