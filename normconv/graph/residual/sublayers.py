"""Post-LN sublayers around the residual adds: LN(x + f(x)), and what f is (attention, cross-attention, FFN).

  x_{l+1} = LN(x_l + f(x_l))        the residual x_l, the branch f, the add, the norm that reads it
Read from the graph, not from names: at the add, x is the operand computed first (an ancestor of the other); the
branch's nodes are the ancestors of f computed after x, stopping at norm outputs (a norm output read inside the branch
is another stream: the encoder's memory in cross-attention). The module computing f's last value (its out_proj, an
FFN's last linear, an nn.MultiheadAttention) is what a rewrite of the branch hooks. Roles of the branch's linears:
the attention core (softmax(q k^T) v, or scaled_dot_product_attention) names q, k, v by position, each traced back
through reshapes (and a split / chunk of a fused q|k|v projection: its rows) to its linear; out is the linear that
produces the branch; a branch without an attention core is an FFN and all its linears are FFN linears.
nn.MultiheadAttention is read by type (in_proj_weight slices q | k | v, out_proj). Sizes read from x.shape
(view(b, l, h, d), split(e)) are followed like constants. Where the graph gives no v / out (an einsum core), the
caller names them by module pattern (fnmatch). A site that is not such a sublayer says why (``Sublayer.code``).
"""

from __future__ import annotations

import fnmatch
import collections
import math
from dataclasses import dataclass, field
from typing import Any, Sequence

import torch
import torch.fx as fx
import torch.nn as nn

from normconv.graph.capture import Captured
from normconv.graph.detect import NormSite, is_ancestor, producer_of
from normconv.match import COPY, RESHAPE, SPLIT, TRANSPARENT, call_name as _name, permute_dims
from normconv.report import Why


class SublayerWhy(Why):
    """Why a post-LN norm site is not a sublayer that can be rewritten (one member per rule)."""

    AMBIGUOUS = "residual-ambiguous"  # the add's operands do not tell the residual x from the branch f(x)
    INLINE_NORM = "inline-norm"  # the norm is written inline / functional: no module to set eps on or hook
    BRANCH_NORMED = "branch-normed"  # x + LN(f(x)): the layers normalize their branches, not the stream
    NOT_IDENTIFIED = "sublayer-not-identified"  # f(x) has no module output to hook, or its roles are not found
    SHARED_NORM = "norm-shared"  # the norm module is also called where it is no post-LN sublayer
    RESHAPED = "branch-reshaped"  # f(x) is added reshaped / transposed after its module: no module output is f(x)


BRANCH_NORMED = "branch normed"  # the words that open those problems
NOT_IDENTIFIED = "sublayer not identified"


@dataclass
class Proj:
    """One projection whose weight beta touches: module path, weight name, row/col slice of a fused weight."""

    role: str  # q | k | v | out | ffn
    module: str
    weight: str
    rows: tuple[int, int] | None = None  # slice along the output-feature axis of a fused q/k/v weight
    out_axis: int = 0  # output-feature axis of the weight (1 for HF Conv1D)

    def label(self) -> str:
        return self.module + (f"[{self.rows[0]}:{self.rows[1]}]" if self.rows else "")


@dataclass
class Sublayer:
    """A post-LN residual site LN(x + f(x)) and what f is."""

    norm: NormSite
    add: str = ""  # residual add node
    res: str = ""  # residual input node x
    branch_module: str = ""  # module whose output is f (hooked * 1/alpha)
    kind: str = "?"  # attention | cross-attention | ffn
    projs: list[Proj] = field(default_factory=list)
    follows: str | None = None  # norm target of the previous post-LN site on the residual stream
    reads: set[str] = field(default_factory=set)  # norm targets of other stacks the branch reads (memory)
    causal: bool = False
    stack: str = ""
    block: str | None = None  # enclosing numbered block (layers.3)
    problem: str = ""  # why this site cannot be rewritten ('' = it can)
    code: SublayerWhy | None = None  # the rule behind ``problem``

    def roles(self, role: str) -> list[Proj]:
        return [p for p in self.projs if p.role == role]


def shared(cap: Captured, subs: list[Sublayer]) -> None:
    """A norm or branch module called at several places (ALBERT's one layer applied N times) is rewritten once for
    all its calls (eps / alpha^2 and the hooks act at every call): only when every call is a post-LN sublayer here,
    and a branch module's calls are the sublayers it ends."""
    norm_subs = collections.Counter(s.norm.target for s in subs)
    branch_subs = collections.Counter(s.branch_module for s in subs if s.branch_module)
    for s in subs:
        if s.problem:
            continue
        if s.norm.calls != norm_subs[s.norm.target]:
            s.code, s.problem = SublayerWhy.SHARED_NORM, (f"norm module {s.norm.target} is called at {s.norm.calls} "
                                                          f"places, {norm_subs[s.norm.target]} of them post-LN "
                                                          f"sublayers")
        elif _calls(cap, s.branch_module) != branch_subs[s.branch_module]:
            s.code, s.problem = SublayerWhy.NOT_IDENTIFIED, (
                f"{NOT_IDENTIFIED}: {s.branch_module} is called at {_calls(cap, s.branch_module)} places, "
                f"{branch_subs[s.branch_module]} of them ending a post-LN sublayer")


def stream_read(cap: Captured, name: str, by_node: dict[str, NormSite], post_outputs: dict[str, NormSite],
                 all_outputs: frozenset[str]) -> str:
    """The post-LN output a norm output stands for: followed back through norms applied on top of it."""
    seen: set[str] = set()
    while name not in post_outputs and name in by_node and name not in seen:
        seen.add(name)
        kind, prev = producer_of(cap, cap.nodes[by_node[name].input], all_outputs)
        if kind != "norm":
            break
        name = prev.name
    return name


def _unmasked(cap: Captured, x: fx.Node) -> fx.Node:
    """The stream before the padding masks applied to it between layers (Flaubert / XLM: h *= mask[..., None]):
    a per-token factor from the inputs alone, so the layers on either side are one stack."""
    while cap.op(x) == "mul" and len(x.args) == 2:
        a, b = x.args
        # stream * mask  =>  the stream
        keep = [v for v, c in ((a, b), (b, a)) if isinstance(v, fx.Node) and cap.shape(v) == cap.shape(x)
                and cap.per_token_factor(c, cap.shape(x), len(cap.shape(x) or ()) - 1)]
        if not keep:
            break
        x = keep[0]
    return x


def sublayer(cap: Captured, site: NormSite, post_outputs: dict[str, NormSite], all_outputs: frozenset[str],
              beta_mode: str, named: dict[str, tuple[str, ...]] | None = None) -> Sublayer:
    sub = Sublayer(site)
    _, add = producer_of(cap, cap.nodes[site.input], all_outputs)
    sub.add = add.name
    a, b = add.args[0], add.args[1]
    res = branch = None
    for r, f in ((a, b), (b, a)):
        if isinstance(r, fx.Node) and isinstance(f, fx.Node) and is_ancestor(cap, r, f, cap.order):
            res, branch = r, f
            break
    if res is None:
        sub.code, sub.problem = SublayerWhy.AMBIGUOUS, f"cannot tell the residual x from the branch f(x) at {add.name}"
        return sub
    sub.res = res.name
    kind, prev = producer_of(cap, _unmasked(cap, res), all_outputs)
    if kind == "norm" and prev.name in post_outputs:
        sub.follows = post_outputs[prev.name].target
    sub.block = _block(site.target)
    # the norm must be a module we can set eps on (or hook), used at this one site
    mod = cap.modules.get(site.target)
    if mod is None or site.source == "functional":
        sub.code, sub.problem = SublayerWhy.INLINE_NORM, (f"norm {site.target} is written inline / functional, not "
                                                          f"a module: nothing to hook ({_module_hint(cap)})")
        return sub
    normed, norm_node = producer_of(cap, branch, all_outputs)
    if normed == "norm":  # x + LN'(f(x)) read by LN: the layers normalize their branches, not the stream
        sub.code, sub.problem = SublayerWhy.BRANCH_NORMED, (
            f"{BRANCH_NORMED}: f(x) is the output of a norm ({norm_node.name}), so the layers normalize their "
            f"branches (x + LN(f(x)), as OLMo 2) rather than the residual stream")
        return sub
    nodes = _branch_nodes(cap, branch, res, all_outputs, sub)
    mha = _mha_in(cap, nodes)
    bkind, bnode = producer_of(cap, branch)
    # a linear's output reshaped (GPT-1's Conv1D: addmm on x.view(-1, D), viewed back): scaling commutes with it
    while _name(bnode) in _RESHAPES and isinstance(bnode.args[0], fx.Node):
        bkind, bnode = producer_of(cap, bnode.args[0])
    if mha is not None:
        sub.branch_module = mha
    elif bkind == "linear":
        sub.branch_module = _linear_module(cap, bnode) or ""
    if not sub.branch_module:
        sub.code, sub.problem = SublayerWhy.NOT_IDENTIFIED, (f"{NOT_IDENTIFIED}: f(x) ends in {bkind} "
                                                             f"({bnode.name}), not a module output to hook")
        return sub
    after = _op_after(cap, branch, sub.branch_module)
    if after is not None:
        sub.code, sub.problem = SublayerWhy.RESHAPED, (
            f"{NOT_IDENTIFIED}: the output of {sub.branch_module} is added to the stream through {after}, so no "
            f"module output is f(x) as added (its scale would commute, but the literal LN(alpha*x + f(x)) the "
            f"rewrite is proven against needs f(x) itself)")
        return sub
    end = bnode
    if mha is None and not _only_feeds(cap, end, add):
        sub.code, sub.problem = SublayerWhy.NOT_IDENTIFIED, (f"{NOT_IDENTIFIED}: the output of "
                                                             f"{sub.branch_module} is also used outside the residual")
        return sub
    # roles
    if mha is not None:
        _mha_roles(cap, sub, mha)
    else:
        cores = [n for n in nodes if _is_attention_core(n)]
        # a softmax over scores q @ k^T is the attention; another softmax (ConvBERT's dynamic conv kernel, a softmax
        # of a linear's output) is not, so it does not name the roles
        dot = [c for c in cores if _name(c) == "scaled_dot_product_attention" or _score_matmul(cap, c.args[0])]
        if cores:
            _attention_roles(cap, sub, (dot or cores)[0], end)
        else:
            sub.kind = "ffn"
            for n in nodes:
                if _is_linear(cap, n):
                    p = _proj(cap, n, "ffn")
                    if p is not None and p.weight not in {q.weight for q in sub.projs}:
                        sub.projs.append(p)
    if named and mha is None and sub.kind != "ffn":
        _named_roles(cap, sub, nodes, named)
    if beta_mode != "none" and sub.kind != "ffn" and not (sub.roles("v") and sub.roles("out")):
        missing = " / ".join(r for r, f in (("value", "v"), ("output", "out")) if not sub.roles(f))
        sub.code = SublayerWhy.NOT_IDENTIFIED
        sub.problem = (f"{NOT_IDENTIFIED}: attention without a recognisable {missing} projection "
                       f"(found {', '.join(p.role + '=' + p.label() for p in sub.projs) or 'none'}; "
                       f"name them with --value-proj / --out-proj)")
    return sub


def matches(module: str, patterns: Sequence[str]) -> bool:
    return any(fnmatch.fnmatchcase(module, p) for p in patterns)


def _named_roles(cap: Captured, sub: Sublayer, nodes: list[fx.Node], named: dict[str, tuple[str, ...]]) -> None:
    """Roles the user named by module pattern (--value-proj / --out-proj), for the linears of this branch."""
    hits = []
    for n in nodes:
        if not _is_linear(cap, n):
            continue
        for role, patterns in named.items():
            p = _proj(cap, n, role)
            if p is not None and matches(p.module, patterns):
                hits.append(p)
    if not hits:
        return
    # a user-named linear takes the named role, replacing what the graph gave it
    taken = {p.weight for p in hits}
    sub.projs = [p for p in sub.projs if p.weight not in taken] + hits


_RESHAPES = RESHAPE  # the same values in another shape
# what carries a norm output's values unchanged into another shape or layout
_LAYOUT = RESHAPE | COPY | {"transpose", "permute", "t", "detach", "to", "_to_copy", "dropout", "identity"}


def _layout_source(n: fx.Node, norm_outputs: frozenset[str]) -> fx.Node:
    """``n``, or the norm output it is a transpose / view / copy of (FSMT hands its encoder's last norm output to
    the decoder transposed, T x B x C -> B x T x C)."""
    for _ in range(16):
        if n.name in norm_outputs or _name(n) not in _LAYOUT or not n.args or not isinstance(n.args[0], fx.Node):
            break
        n = n.args[0]
    return n


def _branch_nodes(cap: Captured, branch: fx.Node, res: fx.Node, norm_outputs: frozenset[str],
                  sub: Sublayer) -> list[fx.Node]:
    """Nodes computing f(x): ancestors of the branch computed after x, stopping at x and at norm outputs."""
    stop = cap.order[res.name]
    seen: dict[str, fx.Node] = {}
    stack = [branch]
    while stack:
        n = stack.pop()
        if n.name in seen or n.op in ("placeholder", "get_attr", "output"):
            continue
        if cap.order[n.name] <= stop or n.name in norm_outputs:
            read = _layout_source(n, norm_outputs)
            if read.name in norm_outputs and read is not res:
                sub.reads.add(read.name)  # another stream read inside the branch (cross-attention memory)
            continue
        seen[n.name] = n
        stack.extend(n.all_input_nodes)
        if _name(n) in ("tril", "triu") or (_is_attention_core(n) and n.kwargs.get("is_causal")):
            sub.causal = True
    return sorted(seen.values(), key=lambda n: cap.order[n.name])


def _is_attention_core(n: fx.Node) -> bool:
    return _name(n) in ("softmax", "_softmax", "_safe_softmax", "scaled_dot_product_attention")


def _is_linear(cap: Captured, n: fx.Node) -> bool:
    return cap.op(n) == "linear"


def _linear_module(cap: Captured, n: fx.Node) -> str | None:
    p = _proj(cap, n, "out")
    return p.module if p is not None else None


def _proj(cap: Captured, n: fx.Node, role: str) -> Proj | None:
    """The module / weight of a linear node: nn.Linear call, F.linear / aten.linear, or aten.addmm (HF Conv1D)."""
    if n.op == "call_module":
        mod = cap.modules.get(n.target)
        return Proj(role, n.target, f"{n.target}.weight") if isinstance(mod, nn.Linear) else None
    w = None
    out_axis = 0
    if _name(n) == "addmm":
        w, out_axis = cap.param_name(n.args[2]), 1
    elif len(n.args) > 1:
        w = cap.param_name(n.args[1])
    if w is None or not w.endswith(".weight"):
        return None
    return Proj(role, w[: -len(".weight")], w, out_axis=out_axis)


def _calls(cap: Captured, module: str) -> int:
    """How many graph nodes compute the output of ``module`` (1 for a module called once)."""
    if module in cap.module_calls:
        return cap.module_calls[module]
    if isinstance(cap.modules.get(module), nn.MultiheadAttention):
        module += ".out_proj"  # exported MHA: its out_proj linear runs once per call
    weight = f"{module}.weight"
    projs = [_proj(cap, n, "out") for n in cap.gm.graph.nodes if _is_linear(cap, n)]
    return sum(1 for p in projs if p is not None and p.weight == weight)


def _op_after(cap: Captured, operand: Any, module: str) -> str | None:
    """The first op other than a pass-through one (dropout, identity, a cast) between ``module``'s output and the
    add's operand ``operand``, going back from the add; None when the operand is the module's output (computed inside
    the module, its call in FX, or item 0 of the tuple that call returns)."""
    node = operand
    for _ in range(64):
        if not isinstance(node, fx.Node):
            return "a constant"
        if module in cap.owner_stack(node):
            return None
        if _name(node) == "getitem" and node.args[1] == 0 and isinstance(node.args[0], fx.Node) and \
                node.args[0].op == "call_module" and node.args[0].target == module:
            return None
        if cap.op(node) not in TRANSPARENT or not node.args:
            return _name(node) or node.op
        node = node.args[0]
    return "a chain of ops"


def _only_feeds(cap: Captured, node: fx.Node, add: fx.Node) -> bool:
    """``node`` reaches ``add`` through pass-through ops and reshapes only, and has no other user on the way."""
    while node is not add:
        users = cap.users(node)
        if len(users) != 1:
            return False
        node = users[0]
        if node is not add and cap.op(node) not in TRANSPARENT and _name(node) not in _RESHAPES:
            return False
    return True


# layout ops, plus shape changes and the scalar scaling of q (mul / div): what q / k / v pass through
_SHAPING = _LAYOUT | {"unflatten", "flatten", "unsqueeze", "squeeze", "expand", "type_as", "float", "mul", "div"}
_SPLITS = SPLIT


def _to_linear(cap: Captured, v: Any) -> tuple[fx.Node, tuple[int, int] | None] | None:
    """Trace a q/k/v operand back through reshapes (and a split of a fused projection) to its linear node."""
    rows = None
    width = None  # the split axis' size: from the split back to the linear, that axis must stay the features
    for _ in range(64):
        if not isinstance(v, fx.Node):
            return None
        if width is not None and not _keeps_last_axis(cap, v, width):
            return None  # the split cut a reshaped axis (heads x (q|k|v) per head): its rows are not W's rows
        if _is_linear(cap, v):
            return v, rows
        if cap.op(v) == "getitem" and isinstance(v.args[0], fx.Node) and _name(v.args[0]) in _SPLITS:
            sp, idx = v.args[0], v.args[1]
            rows = _split_rows(cap, sp, idx)
            if rows is None or rows and width is not None:
                return None
            width = (cap.shape(sp.args[0]) or [None])[-1]
            v = sp.args[0]
            continue
        name = _name(v)
        if name == "cat" and v.args and isinstance(v.args[0], (list, tuple)):
            # an empty KV cache joined in front (Flaubert / XLM: cat([past (0 elements), k])): the one real part
            full = [p for p in v.args[0] if not (isinstance(p, fx.Node) and 0 in (cap.shape(p) or (1,)))]
            if len(full) == 1 and isinstance(full[0], fx.Node):
                v = full[0]
                continue
        # unary shaping ops (the other args are constants or sizes read from x.shape): follow the tensor operand
        tensors = [a for a in v.args if _is_tensor(cap, a)]
        if name in _SHAPING and len(tensors) == 1 and tensors[0] is v.args[0]:
            v = v.args[0]
            continue
        return None
    return None


def _keeps_last_axis(cap: Captured, v: fx.Node, width: int | None) -> bool:
    """``v`` (on the way from a split back to the linear) still has the split's axis last, unmoved."""
    shape = cap.shape(v)
    if width is None or shape is None or shape[-1] != width:
        return False
    name = _name(v)
    if name in ("t", "numpy_T"):
        return False  # swaps the last axis
    if name not in ("transpose", "permute"):
        return True
    # an axis move must leave the last axis in place: permute(x, dims) / permute(x, *dims) / transpose(x, a, b)
    dims = permute_dims(v) if name == "permute" else v.args[1:]
    if not all(isinstance(d, int) for d in dims):
        return False
    last = len(shape) - 1
    return dims[-1] % len(shape) == last if name == "permute" else last not in [d % len(shape) for d in dims]


def _is_tensor(cap: Captured, a: Any) -> bool:
    """A node that carries a tensor (not a size read from ``x.shape`` / ``x.size()``, nor arithmetic on one)."""
    if not isinstance(a, fx.Node):
        return False
    m = cap.meta(a)
    if m is None:  # no recorded value: a tensor unless it is a shape read or arithmetic on ints
        return not (cap.is_noise(a) or (a.op == "call_function" and _name(a) in _INT_OPS)
                    or (cap.op(a) == "getitem" and isinstance(a.args[0], fx.Node) and cap.is_noise(a.args[0])))
    return isinstance(m, torch.Tensor) or hasattr(m, "shape") and hasattr(m, "dtype")


_INT_OPS = {"floordiv", "mul", "add", "sub", "truediv", "getitem", "sym_size"}


def _split_rows(cap: Captured, sp: fx.Node, idx: Any) -> tuple[int, int] | None:
    shape = cap.shape(sp.args[0])
    if shape is None or not isinstance(idx, int):
        return None
    dim = sp.kwargs.get("dim", sp.args[2] if len(sp.args) > 2 else 0)
    if dim not in (-1, len(shape) - 1):
        return None  # a split on another axis is not a q | k | v split of the output features
    size = shape[-1]
    arg = sp.args[1] if len(sp.args) > 1 else sp.kwargs.get("split_size_or_sections", sp.kwargs.get("chunks"))
    if isinstance(arg, fx.Node) or (isinstance(arg, (list, tuple)) and any(isinstance(a, fx.Node) for a in arg)):
        # sizes computed from x.shape (split(e, -1)): the pieces' recorded widths give the bounds
        pieces = {g.args[1]: cap.shape(g) for g in cap.users(sp) if cap.op(g) == "getitem"}
        if any(w is None for w in pieces.values()) or sorted(pieces) != list(range(len(pieces))):
            return None
        starts = [sum(pieces[i][-1] for i in range(j)) for j in range(len(pieces))]
        return (starts[idx], starts[idx] + pieces[idx][-1]) if idx < len(starts) else None
    if _name(sp) == "chunk":
        step = math.ceil(size / arg)
        bounds = [(i, min(i + step, size)) for i in range(0, size, step)]
    elif isinstance(arg, int):
        bounds = [(i, min(i + arg, size)) for i in range(0, size, arg)]
    elif isinstance(arg, (list, tuple)):
        starts = [sum(arg[:i]) for i in range(len(arg))]
        bounds = [(s, s + a) for s, a in zip(starts, arg)]
    else:
        return None
    return bounds[idx] if idx < len(bounds) else None


def _attention_roles(cap: Captured, sub: Sublayer, core: fx.Node, end: fx.Node) -> None:
    """q, k, v from the attention core by position; out = the linear that produces the branch."""
    q = k = v = None
    if _name(core) == "scaled_dot_product_attention":
        q, k, v = core.args[0], core.args[1], core.args[2]
    else:
        pv = next((u for u in _users_through_reshapes(cap, core) if cap.op(u) == "matmul" and u.args[0] is not None),
                  None)
        if pv is not None:
            v = pv.args[1]
        scores = _score_matmul(cap, core.args[0])
        if scores is not None:
            q, k = scores.args[0], scores.args[1]
    found = {}
    for role, operand in (("q", q), ("k", k), ("v", v)):
        hit = _to_linear(cap, operand)
        if hit is not None:
            p = _proj(cap, hit[0], role)
            if p is not None:
                p.rows = hit[1]
                found[role] = (p, hit[0])
                sub.projs.append(p)
    out = _proj(cap, end, "out")
    if out is not None:
        sub.projs.append(out)
    sub.kind = "attention"
    if "q" in found and "v" in found and found["q"][1].args[0] is not found["v"][1].args[0] and \
            cap.source(found["q"][1].args[0]) is not cap.source(found["v"][1].args[0]):
        sub.kind = "cross-attention"


def _users_through_reshapes(cap: Captured, node: fx.Node) -> list[fx.Node]:
    """Users of ``node`` past pass-through ops, reshapes and masking (DeBERTa views the probabilities (B*H, L, L)
    before the bmm with v; SEW-D's XSoftmax zeroes the masked ones with masked_fill)."""
    out = []
    for u in cap.users(node):
        through = cap.op(u) in TRANSPARENT or _name(u) in _RESHAPES or \
            (_name(u) in ("masked_fill", "masked_fill_") and u.args[0] is node)
        out.extend(_users_through_reshapes(cap, u) if through else [u])
    return out


def _score_matmul(cap: Captured, s: Any) -> fx.Node | None:
    """From the softmax input back to q @ k^T through scaling, masking and casts."""
    for _ in range(16):
        if not isinstance(s, fx.Node):
            return None
        if cap.op(s) == "matmul":
            return s
        nodes = [a for a in s.args if isinstance(a, fx.Node)]
        if not nodes:
            return None
        s = nodes[0]  # scores are the first operand of mul / div / add(mask) / masked_fill / cast
    return None


def _mha_in(cap: Captured, nodes: list[fx.Node]) -> str | None:
    """An nn.MultiheadAttention computing the branch (a call_module in FX, its owner path in export)."""
    for n in nodes:
        for path in reversed(cap.owner_stack(n)):
            if isinstance(cap.modules.get(path), nn.MultiheadAttention):
                return path
    return None


def _mha_roles(cap: Captured, sub: Sublayer, path: str) -> None:
    mha = cap.modules[path]
    e = mha.embed_dim
    sub.kind = "attention"
    if mha._qkv_same_embed_dim:
        for i, role in enumerate(("q", "k", "v")):
            sub.projs.append(Proj(role, path, f"{path}.in_proj_weight", rows=(i * e, (i + 1) * e)))
    else:
        for role in ("q", "k", "v"):
            sub.projs.append(Proj(role, path, f"{path}.{role}_proj_weight"))
    sub.projs.append(Proj("out", f"{path}.out_proj", f"{path}.out_proj.weight"))


def _block(path: str) -> str | None:
    """The numbered block holding a module: encoder.layer.3.output.LayerNorm -> encoder.layer.3."""
    parts = path.split(".")
    idx = [i for i, p in enumerate(parts) if p.isdigit()]
    return ".".join(parts[: idx[-1] + 1]) if idx else None


def _module_hint(cap) -> str:
    """How to give deepnorm a norm module: a torch.export program (a .pt2) holds none (its norms are aten calls, and
    canonicalize keeps them so): the eager model it was exported from; else canonicalize's native modules."""
    from torch.export._unlift import _StatefulGraphModule  # what ExportedProgram.module() returns

    if isinstance(cap.model, _StatefulGraphModule):
        return "a .pt2 program holds no norm modules to hook: give deepnorm the eager model it was exported from"
    return "run normconv canonicalize first"
