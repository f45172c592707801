"""The readers of a norm's output: the linears that can absorb what the norm stops doing.

With z = n(x) a norm's normalized output and a linear reading it (torch's y = z W^T + c):
  a bias b the norm drops         (z + b) W^T + c = z W^T + (c + W b)        =>  c <- c + W b   (``bias_consumers``)
  a scale g the norm drops        (z * g) W^T + c = z (W diag(g))^T + c      =>  W <- W diag(g) (``norm_readers``)
  a rotation Q the stream takes   (z Q) (W Q)^T + c = z W^T + c              =>  W <- W Q
HF Conv1D holds W as (D, out): the same with W transposed. Every reader must be such a linear taking the norm's output
(through casts, dropout and views) as its input, and a weight or bias that changes must be read by nothing else; a
tied weight held by the reader's own module is cloned first (``untie``). Otherwise a ``Refused`` says why.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch
import torch.fx as fx
import torch.nn as nn

from normconv.graph.capture import Captured

from .axes import passes_through
from .walk import in_words, returned
from .why import Refused, ResidualWhy as W
from .writers import linear_of, own_name, owns


@dataclass(frozen=True)
class Reader:
    """A linear that reads a norm's output: its weight's input axis is the norm's hidden dim."""

    node: str
    weight: str  # state_dict name
    bias: str | None  # None: a bias-free linear (a bias parameter is added to ``module`` when a norm bias folds in)
    layout: str  # out_in: nn.Linear / F.linear (out, D) | in_out: addmm / HF Conv1D (D, out)
    module: str


Consumer = Reader  # a reader that absorbs a norm's bias (c <- c + W b)


def norm_readers(cap: Captured, node: fx.Node) -> tuple[list[Reader], Refused | None]:
    """The linears reading ``node`` (through casts / dropout / views), or why some reader is not one."""
    readers: list[Reader] = []
    stack, seen = [node], set()
    while stack:
        v = stack.pop()
        users = cap.users(v)
        if not users:
            return [], Refused(W.UNREAD, f"the norm's output ({in_words(cap, v)}) is not read by any layer")
        for u in users:
            if u.name in seen:
                continue
            seen.add(u.name)
            if u.op == "output":  # named by modules: the norm, and the op it reaches the output through
                via = "" if v is node else f" (through {in_words(cap, v)})"
                return [], Refused(W.RETURNED, f"the output of {cap.describe(node)} is returned by the model{via}")
            if passes_through(cap, u) and u.args[0] is v:
                stack.append(u)
                continue
            # a linear layer, or x @ W.T in an nn.Linear subclass (FalconLinear: its bias, if any, its own add)
            lin = linear_of(cap, u) if cap.op(u) in ("linear", "matmul") else None
            if lin is not None and lin[2] is None and getattr(cap.modules.get(lin[4]), "bias", None) is not None:
                lin = (*lin[:2], f"{lin[4]}.bias", *lin[3:])
            if lin is None or lin[0] is not v or lin[1] is None:  # named by modules, as the output above
                onward = ", and its result is returned by the model" if u.op != "output" and returned(cap, u) else ""
                return [], Refused(W.NON_LINEAR, f"{in_words(cap, u)} reads the norm output and is not a linear "
                                                 f"layer{onward}")
            readers.append(Reader(u.name, own_name(cap, lin[4], lin[1]), own_name(cap, lin[4], lin[2]), lin[3],
                                  lin[4]))
    return readers, None


def own_module_attr(cap: Captured, r: Reader) -> tuple[nn.Module, str] | None:
    """(module, attribute) when the reader's module holds its weight as its own parameter (it can be re-bound)."""
    mod = cap.modules.get(r.module)
    if mod is None:
        return None
    t = cap.tensor(r.weight)
    for attr, p in mod._parameters.items():
        if p is t:
            return mod, attr
    return None


def check_weights(cap: Captured, readers: Sequence[Reader], param_readers: dict[int, list[str]],
                  allowed: set[str]) -> tuple[list[Reader], Refused | None]:
    """Readers whose weight is also read by nodes outside ``allowed``: untie them (a module's own parameter
    read by another module under a tie) or give the reason it cannot be edited."""
    unties = []
    for r in readers:
        t = cap.tensor(r.weight)
        if t is None:
            return [], Refused(W.NOT_PARAM, f"{r.weight} (read by {r.node}) is not a parameter of the model")
        foreign = [n for n in param_readers.get(id(t), []) if n not in allowed]
        if not foreign:
            continue
        # foreign readers of another module (lm_head.weight is wte.weight)  =>  clone the reader's own copy
        own = own_module_attr(cap, r)
        if own is not None and all(owns(cap, n, t) != r.module for n in foreign):
            unties.append(r)
            continue
        return [], Refused(W.SHARED_TENSOR, f"{r.weight} is also read by {cap.describe(cap.nodes[foreign[0]])}, so "
                                            f"it cannot take the scale")
    return unties, None


def _self_attention_in_proj(cap: Captured, u: fx.Node, v: fx.Node) -> Consumer | None:
    """``u`` calls an nn.MultiheadAttention with ``v`` as query, key and value and nothing else: its packed
    in_proj (q | k | v rows of one weight, one bias) reads v as one linear, so it absorbs the norm's bias."""
    mod = cap.modules.get(u.target) if u.op == "call_module" else None
    if not isinstance(mod, nn.MultiheadAttention) or not mod._qkv_same_embed_dim or mod.in_proj_bias is None:
        return None
    qkv = (list(u.args) + [u.kwargs.get(k) for k in ("query", "key", "value")][len(u.args):])[:3]
    others = list(u.args[3:]) + [a for k, a in u.kwargs.items() if k not in ("query", "key", "value")]
    if qkv != [v, v, v] or any(a is v for a in others):
        return None
    return Consumer(u.name, f"{u.target}.in_proj_weight", f"{u.target}.in_proj_bias", "out_in", u.target)


def bias_consumers(cap: Captured, module: str | None, node: str, readers: dict[int, list[str]],
                   read, add_bias: bool = True) -> tuple[list[Consumer], Refused | None]:
    """The linears the bias b of the norm ``module`` (its output: ``node``) folds into, or why it cannot fold
    (b == 0 needs none). ``readers``: ``param_readers(cap)``; ``read``: where b's value comes from; ``add_bias``
    False: a linear without a bias refuses b (the output keeps the architecture, whose config gives it none)."""
    mod = cap.modules.get(module) if module else None
    beta = read(f"{module}.bias") if getattr(mod, "bias", None) is not None else None
    if beta is None or not bool(torch.count_nonzero(beta.detach())):
        return [], None
    consumers: list[Consumer] = []
    stack = [cap.nodes[node]]
    seen: set[str] = set()
    bias_adds: set[str] = set()  # the adds of a reader's own bias after its matmul: that bias's own readers
    while stack:
        v = stack.pop()
        for u in cap.users(v):
            if u.name in seen:
                continue
            seen.add(u.name)
            if passes_through(cap, u) and u.args[0] is v:
                stack.append(u)
                continue
            mha = _self_attention_in_proj(cap, u, v)
            if mha is not None:  # mha(x, x, x) kept whole by the trace  =>  its in_proj absorbs b
                consumers.append(mha)
                continue
            lin = linear_of(cap, u) if cap.op(u) in ("linear", "matmul") else None
            added = _own_bias_add(cap, u, lin[4]) if lin is not None and lin[2] is None else None
            if added is not None:  # x @ W.T + self.bias (FalconLinear): that bias takes W b
                lin = (*lin[:2], f"{lin[4]}.bias", *lin[3:])
                bias_adds.add(added.name)
            if lin is None or lin[0] is not v or lin[1] is None:
                if cap.op(u) in ("add", "layer_norm", "rms_norm"):  # BLOOM's embedding LayerNorm
                    return [], Refused(W.WRITES_STREAM, f"the norm writes the residual stream (read by "
                                                        f"{cap.describe(u)}), so its bias has no linear layer to "
                                                        f"fold into")
                return [], Refused(W.NON_LINEAR, f"{in_words(cap, u)} reads the norm's output and cannot absorb its "
                                                 f"bias")
            consumers.append(Consumer(u.name, own_name(cap, lin[4], lin[1]), own_name(cap, lin[4], lin[2]),
                                      lin[3], lin[4]))
    mine = {c.node for c in consumers} | bias_adds
    for c in consumers:
        if c.bias is not None:
            # the bias is edited: nothing else may read it (the weight is only read, ties are harmless)
            t = cap.tensor(c.bias)
            foreign = [n for n in readers.get(id(t), []) if n not in mine] if t is not None else []
        else:
            # a bias is added to the module: every call of it must read this norm's output
            lin_mod = cap.modules.get(c.module)
            if not add_bias:  # the output keeps the architecture (a Hugging Face folder): no parameter to add
                return [], Refused(W.NO_BIAS, f"{c.module} has no bias parameter to absorb the norm's bias, and the "
                                              f"output keeps the architecture config.json describes")
            if not (isinstance(lin_mod, nn.Linear) and c.weight == f"{c.module}.weight"):
                return [], Refused(W.NO_BIAS, f"{c.node} has no bias parameter to absorb the norm's bias")
            if lin_mod.bias is not None:  # x @ W.T + b written out: b is not read by the matmul
                return [], Refused(W.NO_BIAS, f"{c.module} adds its bias outside its matmul, so the norm's bias "
                                              f"cannot be folded into it")
            foreign = [n for n in readers.get(id(lin_mod.weight), []) if n not in mine
                       and owns(cap, n, lin_mod.weight) == c.module]
        if foreign:
            return [], Refused(W.SHARED_TENSOR, f"{c.bias or c.module} is also used by "
                                                f"{cap.describe(cap.nodes[foreign[0]])}, so the norm's bias cannot be "
                                                f"folded into it")
    return consumers, None


def _own_bias_add(cap: Captured, u: fx.Node, module: str) -> fx.Node | None:
    """The one user of the matmul ``u`` (x @ W.T of the nn.Linear subclass ``module``) when it adds that module's own
    bias parameter to it, as FalconLinear does (x @ W.T + self.bias); else None."""
    bias = getattr(cap.modules.get(module), "bias", None)
    users = cap.users(u)
    if not isinstance(bias, torch.Tensor) or len(users) != 1 or cap.op(users[0]) != "add" or \
            users[0].kwargs.get("alpha", 1) != 1 or cap.owner(users[0]) != module:
        return None
    other = [a for a in users[0].args[:2] if a is not u]
    name = cap.param_name(other[0]) if len(other) == 1 and len(users[0].args) == 2 else None
    return users[0] if name is not None and cap.tensor(name) is bias else None
