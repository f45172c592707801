"""DeepNorm (Wang et al. 2022, "DeepNet"): every post-LN sublayer computes LN(alpha * x + f(x)) instead of
LN(x + f(x)); at init the FFN, v_proj and out_proj weights (not q, k) are Xavier-normal with gain beta.

  encoder-only  alpha = (2N)^(1/4),  beta = (8N)^(-1/4)      decoder-only  alpha = (2M)^(1/4),  beta = (8M)^(-1/4)
  enc-dec: encoder alpha = 0.81 (N^4 M)^(1/16), beta = 0.87 (N^4 M)^(-1/16); decoder alpha = (3M)^(1/4), beta = (12M)^(-1/4)

How the model is changed (module level, the user's own class stays, state_dict keys intact): LN is scale
invariant, LN_eps(alpha x + f) = LN_{eps/alpha^2}(x + f / alpha), exactly, for the forward and for gradients
w.r.t. the same weights. So the module that computes f's last value gets a forward hook ``* 1/alpha`` and a
native norm gets ``eps / alpha^2``; a hand-written norm module whose eps is a constant in its forward gets an
input pre-hook ``* alpha`` instead (alpha (x + f/alpha) = alpha x + f). The model is marked with the attribute
``_normconv_deepnorm`` (saved with it by torch.save) so a second application is refused.

Roles are read from the graph, not from names: the attention core (softmax(q k^T) v or
scaled_dot_product_attention) names q, k, v by position, each traced back through reshapes (and a
split/chunk of a fused q/k/v projection) to its linear; out_proj is the linear that produces the branch;
a branch without an attention core is an FFN and all its linears are FFN linears. nn.MultiheadAttention is
read by type (in_proj_weight slices q | k | v, out_proj). Sizes read from x.shape (view(b, l, h, d), split(e))
are followed like constants. Where the graph gives no v / out (an einsum core), the caller names them by module
pattern (value_proj / out_proj, fnmatch); a pattern that names no attention linear is refused.
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

from normconv.clone import clone_sharing_tensors, owned
from normconv.graph.detect import NormSite, _ancestor, find_norms, producer_of
from normconv.errors import NormconvError
from normconv.graph.capture import Captured
from normconv.graph.match import TRANSPARENT, call_name as _name
from normconv.report import PassResult, Site, Validation
from normconv.verify import Inputs, compare, run
from normconv.nn.modules import BranchScale, InputScale

from .base import apply, skip

NAME = "deepnorm"
MARKER = "_normconv_deepnorm"  # attribute on the root module: what was applied (survives torch.save(model))
ARCHS = ("encoder", "decoder", "encoder-decoder")
BETA_MODES = ("init", "rescale", "none")


# ---------------------------------------------------------------------------------------------------------
# constants (DESIGN.md section 4, the paper's table 1)


def constants(arch: str, n: int | None = None, m: int | None = None) -> dict[str, tuple[float, float]]:
    """stack -> (alpha, beta) for an architecture with N encoder and M decoder layers."""
    if arch == "encoder":
        _positive(n, "N")
        return {"encoder": ((2 * n) ** 0.25, (8 * n) ** -0.25)}
    if arch == "decoder":
        _positive(m, "M")
        return {"decoder": ((2 * m) ** 0.25, (8 * m) ** -0.25)}
    if arch == "encoder-decoder":
        _positive(n, "N")
        _positive(m, "M")
        return {"encoder": (0.81 * (n ** 4 * m) ** (1 / 16), 0.87 * (n ** 4 * m) ** (-1 / 16)),
                "decoder": ((3 * m) ** 0.25, (12 * m) ** -0.25)}
    raise NormconvError(f"unknown architecture {arch!r}; choose from: {', '.join(ARCHS)}")


def _positive(v: int | None, name: str) -> None:
    if v is None or v < 1:
        raise NormconvError(f"DeepNorm needs the number of layers {name} >= 1 (got {v})")


# hooks: BranchScale / InputScale live in normconv.nn.modules (picklable, on the weights-only allowlist)
# ---------------------------------------------------------------------------------------------------------
# analysis: the one place decisions are made (plan() shows them, deepnorm() applies them)


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

    def roles(self, role: str) -> list[Proj]:
        return [p for p in self.projs if p.role == role]


@dataclass
class Analysis:
    sublayers: list[Sublayer]
    others: list[tuple[NormSite, str]]  # norm sites DeepNorm does not touch, with the reason
    arch: str | None = None
    layers: dict[str, int] = field(default_factory=dict)  # stack -> N or M
    counted_from: dict[str, str] = field(default_factory=dict)
    consts: dict[str, tuple[float, float]] = field(default_factory=dict)
    refusal: str = ""  # why the whole model is refused ('' = it is not)

    def site_reason(self, s: Sublayer, beta_mode: str) -> str:
        if s.problem:
            return s.problem
        a, b = self.consts.get(s.stack, (float("nan"), float("nan")))
        how = "eps/alpha^2" if _native_eps(s.norm) else "input*alpha"
        text = (f"{s.stack} {s.kind}: LN(alpha*x + f(x)), alpha={a:.4g} ({s.branch_module} * 1/alpha, "
                f"norm {how})")
        if beta_mode != "none":
            touched = [f"{p.role}={p.label()}" for p in s.projs if p.role not in ("q", "k")]
            text += f"; beta={b:.4g} ({beta_mode}) on " + ", ".join(touched)
            if beta_mode == "init" and any(p.role in ("q", "k") for p in s.projs):
                text += "; q,k gain 1: " + ", ".join(p.label() for p in s.projs if p.role in ("q", "k"))
        return text


def analyze(cap: Captured, norms: Sequence[NormSite], arch: str | None = None, n_layers: int | None = None,
            m_layers: int | None = None, beta_mode: str = "init",
            named: dict[str, Sequence[str]] | None = None) -> Analysis:
    """Find the post-LN sublayers, their stacks and layer counts, the roles of their projections.
    ``named`` maps a role (v | out) to module-name patterns (fnmatch) the user gave for it: a linear of an
    attention branch whose module matches takes that role, over what the graph says."""
    post = [s for s in norms if s.kind in ("layernorm", "rmsnorm") and s.placement == "post-norm"]
    others = []
    for s in norms:
        if s in post:
            continue
        # x + f(LN(x))  =>  not DeepNorm's sublayer shape
        if s.placement in ("pre-norm", "final-norm"):
            others.append((s, f"{s.placement} (pre-LN): DeepNorm is defined on post-LN residuals LN(x + f(x))"))
        # not after a residual add (embedding LN, conv/linear norm)  =>  left as is
        else:
            others.append((s, f"not a post-LN residual sublayer ({s.kind}, {s.placement}): left as is"))
    outputs = {s.node: s for s in post}
    all_outputs = frozenset(s.node for s in norms)
    named = {r: tuple(p) for r, p in (named or {}).items() if p}
    subs = [_sublayer(cap, s, outputs, all_outputs, beta_mode, named) for s in post]
    # a post-LN residual outside the numbered layer blocks whose f(x) is no sublayer (wav2vec2 / HuBERT:
    # LN(x + positional conv(x)) before the first layer) belongs to the embeddings, not to the stack: left as is
    if any(s.block is not None for s in subs):
        embedding = [s for s in subs if s.block is None and s.problem.startswith("sublayer not identified")]
        others += [(s.norm, f"post-LN residual outside the numbered layer blocks whose f(x) is not a sublayer "
                            f"({s.problem.removeprefix('sublayer not identified: ')}): the embeddings' own "
                            f"residual, not part of the stack; left as is") for s in embedding]
        subs = [s for s in subs if s not in embedding]
    # a norm over x + LN(f(x)) is no post-LN sublayer: it is left, and alone it refuses the model in words
    others += [(s.norm, f"not a post-LN sublayer: {s.problem.removeprefix(_BRANCH_NORMED + ': ')}; left as is")
               for s in subs if s.problem.startswith(_BRANCH_NORMED)]
    subs = [s for s in subs if not s.problem.startswith(_BRANCH_NORMED)]
    _shared(cap, subs)
    by_node = {s.node: s for s in norms}
    for sub in subs:
        # a final norm over another stack (nn.Transformer's encoder.norm before the memory) reads as that stack
        sub.reads = {_stream_read(cap, r, by_node, outputs, all_outputs) for r in sub.reads}
    an = Analysis(subs, others)
    for role, patterns in named.items():
        for pat in patterns:
            # a name the user gave must name something, or it was a typo
            if not any(_matches(p.module, (pat,)) for sub in subs for p in sub.roles(role)):
                raise NormconvError(f"--{'value' if role == 'v' else role}-proj {pat!r} matches no linear "
                                    f"module inside a post-LN attention sublayer")
    if not subs:
        pre = sum(1 for s in norms if s.placement in ("pre-norm", "final-norm"))
        branch = [s for s, why in others if why.startswith("not a post-LN sublayer: f(x) is the output of a norm")]
        an.refusal = (f"pre-LN model ({pre} pre-norm/final-norm sites, no post-LN residual LN(x + f(x))): "
                      f"DeepNorm is defined on post-LN transformers" if pre else
                      f"the layers normalize their branches (x + LN(f(x)), as OLMo 2), not the residual stream: "
                      f"{branch[0].target} reads x + LN(f(x)), no post-LN residual LN(x + f(x)); DeepNorm is defined "
                      f"on post-LN transformers" if branch else
                      "no post-LN residual site LN(x + f(x)) found: nothing for DeepNorm to rescale")
        return an
    _stacks(cap, an, arch, n_layers, m_layers)
    return an


def _shared(cap: Captured, subs: list[Sublayer]) -> None:
    """A norm or branch module called at several places (ALBERT's one layer applied N times) is rewritten once for
    all its calls (eps / alpha^2 and the hooks act at every call): only when every call is a post-LN sublayer here,
    and a branch module's calls are the sublayers it ends."""
    norm_subs = collections.Counter(s.norm.target for s in subs)
    branch_subs = collections.Counter(s.branch_module for s in subs if s.branch_module)
    for s in subs:
        if s.problem:
            continue
        if s.norm.calls != norm_subs[s.norm.target]:
            s.problem = (f"norm module {s.norm.target} is called at {s.norm.calls} places, "
                         f"{norm_subs[s.norm.target]} of them post-LN sublayers")
        elif _calls(cap, s.branch_module) != branch_subs[s.branch_module]:
            s.problem = (f"sublayer not identified: {s.branch_module} is called at {_calls(cap, s.branch_module)} "
                         f"places, {branch_subs[s.branch_module]} of them ending a post-LN sublayer")


def _stream_read(cap: Captured, name: str, by_node: dict[str, NormSite], post_outputs: dict[str, NormSite],
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


_BRANCH_NORMED = "branch normed"


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


def _sublayer(cap: Captured, site: NormSite, post_outputs: dict[str, NormSite], all_outputs: frozenset[str],
              beta_mode: str, named: dict[str, tuple[str, ...]] | None = None) -> Sublayer:
    sub = Sublayer(site)
    _, add = producer_of(cap, cap.nodes[site.input], all_outputs)
    sub.add = add.name
    a, b = add.args[0], add.args[1]
    res = branch = None
    for r, f in ((a, b), (b, a)):
        if isinstance(r, fx.Node) and isinstance(f, fx.Node) and _ancestor(cap, r, f, cap.order):
            res, branch = r, f
            break
    if res is None:
        sub.problem = f"cannot tell the residual x from the branch f(x) at {add.name}"
        return sub
    sub.res = res.name
    kind, prev = producer_of(cap, _unmasked(cap, res), all_outputs)
    if kind == "norm" and prev.name in post_outputs:
        sub.follows = post_outputs[prev.name].target
    sub.block = _block(site.target)
    # the norm must be a module we can set eps on (or hook), used at this one site
    mod = cap.modules.get(site.target)
    if mod is None or site.source == "functional":
        sub.problem = (f"norm {site.target} is written inline / functional, not a module: nothing to hook "
                       f"(run normconv canonicalize first)")
        return sub
    normed, norm_node = producer_of(cap, branch, all_outputs)
    if normed == "norm":  # x + LN'(f(x)) read by LN: the layers normalize their branches, not the stream
        sub.problem = (f"{_BRANCH_NORMED}: f(x) is the output of a norm ({norm_node.name}), so the layers normalize "
                       f"their branches (x + LN(f(x)), as OLMo 2) rather than the residual stream")
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
        sub.problem = f"sublayer not identified: f(x) ends in {bkind} ({bnode.name}), not a module output to hook"
        return sub
    end = bnode
    if mha is None and not _only_feeds(cap, end, add):
        sub.problem = f"sublayer not identified: the output of {sub.branch_module} is also used outside the residual"
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
        sub.problem = (f"sublayer not identified: attention without a recognisable {missing} projection "
                       f"(found {', '.join(p.role + '=' + p.label() for p in sub.projs) or 'none'}; "
                       f"name them with --value-proj / --out-proj)")
    return sub


def _matches(module: str, patterns: Sequence[str]) -> bool:
    return any(fnmatch.fnmatchcase(module, p) for p in patterns)


def _named_roles(cap: Captured, sub: Sublayer, nodes: list[fx.Node], named: dict[str, tuple[str, ...]]) -> None:
    """Roles the user named by module pattern (--value-proj / --out-proj), for the linears of this branch."""
    hits = []
    for n in nodes:
        if not _is_linear(cap, n):
            continue
        for role, patterns in named.items():
            p = _proj(cap, n, role)
            if p is not None and _matches(p.module, patterns):
                hits.append(p)
    if not hits:
        return
    # a user-named linear takes the named role, replacing what the graph gave it
    taken = {p.weight for p in hits}
    sub.projs = [p for p in sub.projs if p.weight not in taken] + hits


_RESHAPES = {"view", "reshape", "_unsafe_view"}  # the same values in another shape
_LAYOUT = {"transpose", "permute", "view", "reshape", "_unsafe_view", "contiguous", "clone", "alias", "detach", "t",
           "to", "_to_copy", "dropout", "identity"}


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
_SPLITS = {"split", "chunk", "split_with_sizes", "tensor_split"}


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
    dims = v.args[1] if name == "permute" and len(v.args) == 2 and isinstance(v.args[1], (list, tuple)) else v.args[1:]
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


def _stacks(cap: Captured, an: Analysis, arch: str | None, n_layers: int | None, m_layers: int | None) -> None:
    """Chains of post-LN sites along the residual stream -> stacks -> N, M -> constants."""
    chains: list[list[Sublayer]] = []
    chain_of: dict[str, int] = {}
    for s in an.sublayers:  # graph order: a site's predecessor is already placed
        if s.follows in chain_of:
            chains[chain_of[s.follows]].append(s)
            chain_of[s.norm.target] = chain_of[s.follows]
        else:
            chain_of[s.norm.target] = len(chains)
            chains.append([s])
    node_to_target = {s.norm.node: s.norm.target for s in an.sublayers}
    if arch is not None and arch not in ARCHS:
        raise NormconvError(f"unknown --arch {arch!r}; choose from: {', '.join(ARCHS)}")
    reads = [{chain_of[node_to_target[n]] for s in c for n in s.reads if n in node_to_target} - {i}
             for i, c in enumerate(chains)]
    if len(chains) > 1 and not any(reads) and not any(s.causal for c in chains for s in c) \
            and arch is None and n_layers is None and m_layers is None and _independent(cap, chains):
        # stacks that read no other stack's output and attend to every position (LiLT's text and layout streams,
        # dual towers): no decoder among them, so each is an encoder with its own N
        _towers(an, chains)
        return
    if len(chains) == 1:
        found = "decoder" if any(s.causal for s in chains[0]) else "encoder"
        if arch == "encoder-decoder":
            an.refusal = (f"--arch encoder-decoder, but the model has one post-LN stack ({len(chains[0])} "
                          f"sublayers): use --arch encoder or decoder")
            return
        arch = arch or found
        names = {0: arch}
    elif len(chains) == 2:
        if reads[1] == {0} and not reads[0] or not any(reads) and _reads_as_memory(cap, chains[0], chains[1]):
            names = {0: "encoder", 1: "decoder"}
        elif reads[0] == {1} and not reads[1] or not any(reads) and _reads_as_memory(cap, chains[1], chains[0]):
            names = {1: "encoder", 0: "decoder"}
        elif reads[0] and reads[1]:
            an.refusal = ("two post-LN stacks reading each other's output (coupled streams, as LiLT's text and "
                          "layout): DeepNorm's constants cover an encoder, a decoder, or a decoder reading an encoder")
            return
        elif any(s.causal for c in chains for s in c):
            an.refusal = ("two post-LN stacks, neither reading the other's output, one with causal attention: "
                          "neither an encoder with a decoder reading it nor two encoder towers")
            return
        else:
            an.refusal = ("two independent post-LN encoder towers: leave out --arch and the layer counts to rewrite "
                          "each as an encoder with its own N")
            return
        if arch not in (None, "encoder-decoder"):
            an.refusal = (f"--arch {arch}, but the model has an encoder and a decoder stack: use "
                          f"--arch encoder-decoder")
            return
        arch = "encoder-decoder"
    else:
        an.refusal = f"{len(chains)} separate post-LN stacks: DeepNorm's constants cover one or two (encoder, decoder)"
        return
    an.arch = arch
    for i, chain in enumerate(chains):
        _count(an, chain, names[i])
    for stack, given in (("encoder", n_layers), ("decoder", m_layers)):
        if given is not None:
            if stack not in an.layers and len(an.layers) == 1:  # --layers for a decoder-only stack
                stack = next(iter(an.layers))
            an.layers[stack] = given
            an.counted_from[stack] = "given"
    an.consts = constants(arch, an.layers.get("encoder"), an.layers.get("decoder"))


def _count(an: Analysis, chain: list[Sublayer], stack: str) -> None:
    """The stack's layers: its numbered blocks, else its FFN sublayers, else its post-LN sublayers."""
    for s in chain:
        s.stack = stack
    blocks = {s.block for s in chain}
    targets = collections.Counter(s.norm.target for s in chain)
    if max(targets.values()) > 1:
        # shared layers (ALBERT): the depth is how many times the layers run, one FFN sublayer per layer run
        ffn = sum(1 for s in chain if s.kind == "ffn")
        an.layers[stack] = ffn or len(chain)
        an.counted_from[stack] = (f"{an.layers[stack]} {'FFN' if ffn else 'post-LN'} sublayer calls of "
                                  f"{len(targets)} shared norm modules")
        return
    split = [b.rpartition(".") for b in blocks if b is not None]  # (list path, ".", index)
    lists = {lst for lst, _, _ in split}
    indices = {lst: {i for owner, _, i in split if owner == lst} for lst in lists}
    if None not in blocks and len(lists) > 1 and not any(lst.rsplit(".", 1)[-1].isdigit() for lst in lists) \
            and len({frozenset(v) for v in indices.values()}) == 1:
        # parallel ModuleLists indexed by layer (XLM / Flaubert: layer_norm1[i], layer_norm2[i]): N = the indices
        an.layers[stack] = len(next(iter(indices.values())))
        an.counted_from[stack] = f"{an.layers[stack]} layers indexed alike in {', '.join(sorted(lists))}"
    elif None not in blocks:
        an.layers[stack] = len(blocks)
        shown = sorted(blocks, key=lambda b: [int(p) if p.isdigit() else 0 for p in b.split(".")])
        an.counted_from[stack] = f"{len(blocks)} numbered blocks ({shown[0]} .. {shown[-1]})"
    else:
        ffn = sum(1 for s in chain if s.kind == "ffn")
        an.layers[stack] = ffn or len(chain)
        an.counted_from[stack] = f"{ffn} FFN sublayers" if ffn else f"{len(chain)} post-LN sublayers"


def _independent(cap: Captured, chains: list[list[Sublayer]]) -> bool:
    """No stack computes from another's norms, by any path (a stream re-joined by an add breaks the residual chain
    into pieces that are not towers: they must not each count as a shallow encoder)."""
    for i, chain in enumerate(chains):
        others = {s.norm.node for j, c in enumerate(chains) if j != i for s in c}
        if not others.isdisjoint(cap.upstream(cap.nodes[s.add] for s in chain if s.add in cap.nodes)):
            return False
    return True


def _reads_as_memory(cap: Captured, enc: list[Sublayer], dec: list[Sublayer]) -> bool:
    """``dec`` reads ``enc`` as a decoder reads its encoder's memory, by dataflow where no cross-attention was
    recognised (LED): dec's branches compute from enc's norms, dec's residual stream does not start from them (a
    stack continuing another's stream would) and enc computes nothing from dec."""
    enc_norms, dec_norms = {s.norm.node for s in enc}, {s.norm.node for s in dec}
    start = cap.upstream([cap.nodes[dec[0].res]]) if dec[0].res in cap.nodes else set()
    return enc_norms.isdisjoint(start) and not enc_norms.isdisjoint(cap.upstream(cap.nodes[s.add] for s in dec)) \
        and dec_norms.isdisjoint(cap.upstream(cap.nodes[s.add] for s in enc))


def _towers(an: Analysis, chains: list[list[Sublayer]]) -> None:
    """Independent encoder stacks: each its own encoder constants, alpha = (2N)^(1/4), beta = (8N)^(-1/4)."""
    an.arch = "encoder"
    for i, chain in enumerate(chains, 1):
        stack = f"encoder {i}"
        _count(an, chain, stack)
        an.counted_from[stack] += f", the stack of {chain[0].norm.target}"
        an.consts[stack] = constants("encoder", an.layers[stack])["encoder"]


def _native_eps(site: NormSite) -> bool:
    return site.module_type in ("LayerNorm", "RMSNorm") and site.source == "module"


def plan(cap: Captured, norms: Sequence[NormSite]) -> list[Site]:
    """What ``normconv deepnorm`` (default --init) would do at each norm site: the analysis deepnorm() applies."""
    return sites_of(analyze(cap, norms, beta_mode="init"), beta_mode="init")


def sites_of(an: Analysis, beta_mode: str) -> list[Site]:
    sites = []
    for s in an.sublayers:
        # LN(x + f(x))  =>  LN(alpha * x + f(x)) (refused as a whole when the model is)
        if s.problem:
            sites.append(skip(NAME, s.norm, s.problem))
        elif an.refusal:
            sites.append(skip(NAME, s.norm, an.refusal))
        else:
            sites.append(apply(NAME, s.norm, an.site_reason(s, beta_mode)))
    sites.extend(skip(NAME, n, why) for n, why in an.others)
    return sites


# ---------------------------------------------------------------------------------------------------------
# applying


def already_applied(model: nn.Module) -> str | None:
    """Why ``model`` counts as already DeepNorm-rescaled by normconv, or None."""
    mark = getattr(model, MARKER, None)
    if mark is not None:
        return (f"model is already DeepNorm-rescaled by normconv (attribute {MARKER} on the model: arch "
                f"{mark.get('arch')}, alpha {mark.get('alpha')}); applying it twice would compound alpha")
    for path, m in model.named_modules():
        hooks = list(m._forward_hooks.values()) + list(m._forward_pre_hooks.values())
        if any(isinstance(h, (BranchScale, InputScale)) for h in hooks):
            return f"model already carries normconv DeepNorm hooks (on {path or 'the root module'})"
    return None


def _apply(model: nn.Module, an: Analysis, beta_mode: str, alpha: float | None, beta: float | None,
           generator: torch.Generator | None) -> list[dict[str, Any]]:
    modules = dict(model.named_modules())
    done: set[tuple[str, Any]] = set()
    records = []
    for s in an.sublayers:
        if any(r["norm"] == s.norm.target for r in records):
            continue  # a shared norm module (and its branch): rewritten once, acting at every call
        a, b = an.consts[s.stack]
        a = a if alpha is None else alpha
        b = b if beta is None else beta
        norm = modules[s.norm.target]
        # LN_eps(alpha x + f)  =>  LN_{eps/alpha^2}(x + f/alpha)
        modules[s.branch_module].register_forward_hook(BranchScale(1.0 / a))
        if _native_eps(s.norm):
            eps = norm.eps if norm.eps is not None else s.norm.eps
            norm.eps = eps / (a * a)
            how = "eps"
        else:  # hand-written norm module, eps baked into its forward  =>  LN(alpha * (x + f/alpha))
            norm.register_forward_pre_hook(InputScale(a))
            eps, how = None, "input"
        records.append({"norm": s.norm.target, "branch": s.branch_module, "stack": s.stack, "kind": s.kind,
                        "alpha": a, "beta": b, "eps": eps, "how": how,
                        "projections": {p.role: [] for p in s.projs}})
        for p in s.projs:
            records[-1]["projections"][p.role].append(p.label())
        if beta_mode == "none":
            continue
        for p in s.projs:
            key = (p.weight, p.rows)
            if key in done:
                continue  # a weight shared by two sublayers is set once
            if p.role in ("q", "k") and beta_mode != "init":
                continue
            done.add(key)
            _beta(model, p, 1.0 if p.role in ("q", "k") else b, beta_mode, generator)
    return records


def _beta(model: nn.Module, p: Proj, gain: float, mode: str, generator: torch.Generator | None) -> None:
    w = owned(model, model.get_parameter(p.weight))  # written in place below: the rewrite's own copy
    bias_name = p.weight[: -len("weight")] + "bias" if p.weight.endswith("weight") else None  # in_proj_bias too
    try:
        bias = owned(model, model.get_parameter(bias_name)) if bias_name else None
    except AttributeError:
        bias = None
    with torch.no_grad():
        view = w if p.rows is None else w.narrow(p.out_axis, p.rows[0], p.rows[1] - p.rows[0])
        if mode == "init":
            # w  =>  xavier_normal(gain); the slice of a fused weight is initialized as its own matrix
            fresh = torch.empty(view.shape, dtype=torch.float32)
            std = gain * math.sqrt(2.0 / (view.shape[0] + view.shape[1]))
            fresh.normal_(0.0, std, generator=generator)
            view.copy_(fresh.to(view.dtype))
        else:
            # w  =>  beta * w, b  =>  beta * b   (torchscale divides every matching parameter)
            view.mul_(gain)
            if bias is not None:
                bview = bias if p.rows is None else bias.narrow(0, p.rows[0], p.rows[1] - p.rows[0])
                bview.mul_(gain)


class DeepNormPass:
    """The pass object (Pass protocol): not exact, it changes what the model computes."""

    name = NAME
    exact = False

    def __init__(self, arch: str | None = None, alpha: float | None = None, beta: float | None = None,
                 beta_mode: str = "init", n_layers: int | None = None, m_layers: int | None = None,
                 seed: int | None = 0, value_proj: Sequence[str] = (), out_proj: Sequence[str] = ()):
        if beta_mode not in BETA_MODES:
            raise NormconvError(f"unknown beta mode {beta_mode!r}; choose from: {', '.join(BETA_MODES)}")
        for label, v in (("alpha", alpha), ("beta", beta)):
            if v is not None and not (v > 0 and math.isfinite(v)):
                raise NormconvError(f"--{label} must be a positive number (got {v})")
        for label, v in (("--layers", n_layers), ("--decoder-layers", m_layers)):
            if v is not None and v < 1:
                raise NormconvError(f"{label} must be >= 1 (got {v})")
        self.arch, self.alpha, self.beta, self.beta_mode = arch, alpha, beta, beta_mode
        self.n_layers, self.m_layers, self.seed = n_layers, m_layers, seed
        self.named = {"v": tuple(value_proj), "out": tuple(out_proj)}  # user-named roles (module patterns)
        self.analysis: Analysis | None = None
        self.records: list[dict[str, Any]] = []

    def plan(self, cap: Captured, norms: Sequence[NormSite]) -> list[Site]:
        self.analysis = analyze(cap, norms, self.arch, self.n_layers, self.m_layers, self.beta_mode, self.named)
        return sites_of(self.analysis, self.beta_mode)

    def __call__(self, model: nn.Module, cap: Captured) -> PassResult:
        why = already_applied(model)
        if why:
            raise NormconvError(why)
        sites = self.plan(cap, find_norms(cap))
        self.capture_method = cap.method
        an = self.analysis
        if an.refusal:
            raise NormconvError(an.refusal)
        bad = [s for s in an.sublayers if s.problem]
        if bad:
            raise NormconvError(f"{len(bad)} of {len(an.sublayers)} post-LN sites cannot be rewritten, first "
                                f"{bad[0].norm.target}: {bad[0].problem} (a partial DeepNorm would mix scaled "
                                f"and unscaled residuals)")
        gen = torch.Generator().manual_seed(self.seed) if self.seed is not None else None
        self.records = _apply(model, an, self.beta_mode, self.alpha, self.beta, gen)
        stacks = {k: {"layers": an.layers[k], "counted_from": an.counted_from[k],
                      "alpha": self.alpha if self.alpha is not None else v[0],
                      "beta": self.beta if self.beta is not None else v[1]}
                  for k, v in an.consts.items()}
        model.__dict__[MARKER] = {"arch": an.arch, "beta_mode": self.beta_mode,
                                  "alpha": {k: v["alpha"] for k, v in stacks.items()},
                                  "beta": {k: v["beta"] for k, v in stacks.items()},
                                  "layers": dict(an.layers), "sites": self.records}
        self.stacks = stacks
        return PassResult(model, True, tuple(sites))


# ---------------------------------------------------------------------------------------------------------
# reference check: LN(alpha * x + f(x)) computed literally on the same weights


def reference_model(rewritten: nn.Module) -> nn.Module:
    """A copy of a DeepNorm'ed model computing LN_eps(alpha * x + f(x)) literally: hooks removed, eps restored,
    x recovered at each norm as (x + f) - f in float64 from the recorded branch output f."""
    ref = clone_sharing_tensors(rewritten)  # hooks and eps change, no tensor is written
    mark = ref.__dict__.pop(MARKER)
    modules = dict(ref.named_modules())
    # normconv's hooks, or on the recorded sites their torch-only GraphModule form in a written model
    sited = {rec[key] for rec in mark["sites"] for key in ("norm", "branch")}
    for path, m in modules.items():
        for hooks in (m._forward_hooks, m._forward_pre_hooks):
            for k in [k for k, h in hooks.items() if isinstance(h, (BranchScale, InputScale))
                      or (path in sited and isinstance(h, torch.fx.GraphModule))]:
                del hooks[k]
    for rec in mark["sites"]:
        norm, branch = modules[rec["norm"]], modules[rec["branch"]]
        if rec["how"] == "eps":
            norm.eps = rec["eps"]
        box: dict[str, torch.Tensor] = {}
        branch.register_forward_hook(_Record(box))
        norm.register_forward_pre_hook(_Literal(box, rec["alpha"]))
    return ref


class _Record:
    def __init__(self, box):
        self.box = box

    def __call__(self, module, args, output):
        self.box["f"] = output[0] if isinstance(output, tuple) else output


class _Literal:
    def __init__(self, box, alpha):
        self.box, self.alpha = box, alpha

    def __call__(self, module, args):
        z, f = args[0], self.box.pop("f")
        x = z.double() - f.double()
        return ((self.alpha * x + f.double()).to(z.dtype),) + tuple(args[1:])


def check_against_reference(rewritten: nn.Module, inputs: Inputs, atol: float | None = None,
                            rtol: float | None = None) -> Validation:
    """Rewritten model vs the literal LN(alpha * x + f(x)) on the same weights (eval mode)."""
    ref = reference_model(rewritten)
    return compare(run(ref, inputs), run(rewritten, inputs), atol, rtol, label="reference LN(alpha*x + f(x))")


__all__ = ["DeepNormPass", "analyze", "plan", "constants", "already_applied", "reference_model",
           "check_against_reference", "BranchScale", "InputScale", "MARKER"]
