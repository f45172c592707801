"""Autocast regions a torch.export graph hides: ``with torch.autocast(..., enabled=False): h = self.ln(h.float())``
(a norm kept in float32 whatever the caller's autocast, as mixed-precision code writes it) is exported as one
``wrap_with_autocast`` call of a submodule, and the norm inside is invisible to detection and to every pass.

    inline_disabled(gm)   each such call at the graph's top level whose autocast is off is replaced by its body

The rule: a region with autocast off, outside any autocast region (the graph's top level), computes what its body
computes: only an autocast around it could have changed its ops' dtypes, and normconv runs every forward without one
(an enabled region is kept: its ops run in its dtype). The body's nodes are copied as they are, their metadata (module
stack, values) with them; a body holding attributes or regions of its own is kept whole.

Of normconv's, it imports nothing: graph.capture calls it on every torch.export graph.
"""

from __future__ import annotations

import operator

import torch
import torch.fx as fx


def inline_disabled(gm: fx.GraphModule) -> int:
    """Replace each top-level ``wrap_with_autocast`` call of ``gm`` whose autocast is off by its body's nodes; the
    number replaced (the graph recompiled where any was)."""
    hop = getattr(torch.ops.higher_order, "wrap_with_autocast", None)
    if hop is None:
        return 0
    done = 0
    for node in list(gm.graph.nodes):
        if node.op != "call_function" or node.target is not hop or len(node.args) < 5:
            continue
        _device, _dtype, enabled, _cache, body, *operands = node.args
        sub = getattr(gm, body.target, None) if isinstance(body, fx.Node) and body.op == "get_attr" else None
        if enabled or not isinstance(sub, fx.GraphModule) or not _plain(sub, node):
            continue  # an enabled region changes dtypes; a body with attributes of its own is kept whole
        _inline(gm, node, sub, operands)
        if not body.users:
            gm.graph.erase_node(body)
            if not any(n.op == "get_attr" and n.target == body.target for n in gm.graph.nodes):
                delattr(gm, body.target)
        done += 1
    if done:
        gm.graph.lint()
        gm.recompile()
    return done


def _plain(sub: fx.GraphModule, node: fx.Node) -> bool:
    """The body reads only its operands (no attributes, no regions of its own), and the call's results are read only
    by indexing (``getitem``), as torch.export writes them."""
    ops = {n.op for n in sub.graph.nodes}
    return ops <= {"placeholder", "call_function", "output"} and all(
        u.op == "call_function" and u.target is operator.getitem for u in node.users) and not any(
        isinstance(n.target, torch._ops.HigherOrderOperator) for n in sub.graph.nodes if n.op == "call_function")


def _inline(gm: fx.GraphModule, node: fx.Node, sub: fx.GraphModule, operands: list) -> None:
    env: dict[fx.Node, object] = dict(zip((n for n in sub.graph.nodes if n.op == "placeholder"), operands))
    results: tuple = ()
    with gm.graph.inserting_before(node):
        for n in sub.graph.nodes:
            if n.op == "placeholder":
                continue
            if n.op == "output":
                results = tuple(fx.node.map_arg(n.args[0], env.__getitem__))
                break
            env[n] = gm.graph.node_copy(n, env.__getitem__)
    for user in list(node.users):  # each getitem(region, i): the body's i-th result
        user.replace_all_uses_with(results[user.args[1]])
        gm.graph.erase_node(user)
    gm.graph.erase_node(node)


__all__ = ["inline_disabled"]
