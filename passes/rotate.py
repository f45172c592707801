"""Rotate the residual stream by an orthogonal Q (SliceGPT / QuaRot computational invariance), exactly.

  weight-free RMSNorm:  RMSNorm(x Q) = x Q / sqrt(mean((x Q)^2) + eps) = RMSNorm(x) Q      (||x Q|| = ||x||)
Row-vector stream, torch's y = x W^T + b. Every writer of the stream then writes y Q instead of y:
  embedding E (V, D)            E <- E Q
  linear W (D, in), bias b (D)  W <- Q^T W,  b <- b Q            (x W^T Q = x (Q^T W)^T)
  HF Conv1D W (in, D)           W <- W Q,    b <- b Q
and every linear reading a norm output z Q takes Q back out:
  linear W (out, D)             W <- W Q                          (z Q (W Q)^T = z Q Q^T W^T = z W^T)
  HF Conv1D W (D, out)          W <- Q^T W
so the stream carries x Q everywhere and the model's outputs are unchanged. The stream is the sum tree of residual
adds read by the norms (``normconv.graph.residual``); its leaves (the writers) may be scaled by a constant on the way
(Gemma's sqrt(D) on the embeddings: it commutes with Q). Preconditions (refused with the reason otherwise): every
norm on the stream is a weight-free RMSNorm (``fold_scales``; LayerNorm goes through the exact swap first), the
stream is read only by its adds and norms, every norm output only by linears, and each rotated weight only by
the nodes that rotate it. A norm inside a sublayer (a per-head q / k norm after q_proj / k_proj) reads the stream
only through reader linears: n(z Q (W Q)^T) = n(z W^T), its input is unchanged, so it is left as it is, whatever
its kind or scale (``graph.residual.inner_norms``; its site says NOT_ON_STREAM). Q in float64: a randomized
Hadamard matrix diag(s) H / sqrt(D) when D = 2^k m with a
known Hadamard order m (Sylvester 2^k times Paley m = p + 1, p prime = 3 mod 4), else QR of a seeded Gaussian.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Sequence

import torch
import torch.fx as fx
import torch.nn as nn

from normconv.clone import owned
from normconv.errors import Code, NormconvError
from normconv.graph.capture import Captured
from normconv.graph.detect import NormSite, find_norms
from normconv.graph.residual import (Reader, Refused, Writer, hidden, in_words, inner_norms, norm_module,
                                     norm_readers, param_readers, passes_through, untie, walk, writer)
from normconv.nn.rmsnorm import has_scale
from normconv.report import PassResult, Site, Why

from .base import Check, Pass

NAME = "rotate"
ROTATIONS = ("hadamard", "random", "none")


class RotateWhy(Why):
    """One member per rule of the rotation (a decision about the whole stream: every site gets the same)."""

    ROTATED = "rotated"  # writers and reader linears rewritten: the stream carries x Q
    NO_NORM = "no-norm"  # no norm: no residual stream to rotate
    NOT_RMSNORM = "not-rmsnorm"  # a norm other than RMSNorm does not commute with Q
    INLINE = "inline-norm"  # a norm that is not a module
    HAS_SCALE = "norm-has-scale"  # an RMSNorm still scales: diag(g) Q != Q diag(g)
    WRITER = "writer-refused"  # a stream writer has no rotation of its weights (``RotationPlan.problem``)
    READER = "reader-refused"  # a norm output is read by something other than a linear
    WIDTH = "width-mismatch"  # streams of different widths, or a tensor of another width
    STREAM_READ = "stream-read-elsewhere"  # the stream is read by something that would see it rotated
    WRITER_OUTPUT = "writer-output-shared"  # a writer's output is also read outside the stream
    TENSOR_SHARED = "tensor-shared"  # a rotated tensor is also read unrotated, or rotated two ways
    NOT_ON_STREAM = "not-on-the-stream"  # a norm inside a sublayer, read through reader linears: left as it is


# ---------------------------------------------------------------------------------------------------------
# Q


def _is_prime(n: int) -> bool:
    return n >= 2 and all(n % k for k in range(2, int(math.isqrt(n)) + 1))


def paley(q: int) -> torch.Tensor:
    """Hadamard matrix of order q + 1 (Paley I, q prime, q = 3 mod 4): I + [[0, 1^T], [-1, chi(j - i)]]."""
    residues = {(i * i) % q for i in range(1, q)}
    chi = torch.tensor([0.0] + [1.0 if k in residues else -1.0 for k in range(1, q)], dtype=torch.float64)
    idx = (torch.arange(q)[None, :] - torch.arange(q)[:, None]) % q
    s = torch.zeros(q + 1, q + 1, dtype=torch.float64)
    s[0, 1:], s[1:, 0], s[1:, 1:] = 1.0, -1.0, chi[idx]
    return s + torch.eye(q + 1, dtype=torch.float64)


def hadamard_order(d: int) -> tuple[int, int] | None:
    """(2^k, m) with d = 2^k * m and a Hadamard matrix of order m known here (1, 2, or a Paley order), or None."""
    m = d
    while m % 2 == 0 and m > 1:
        m //= 2
    while True:
        if m == 1 or (m % 4 == 0 and _is_prime(m - 1) and (m - 1) % 4 == 3):
            return d // m, m
        if m >= d or m * 2 > d:
            return None
        m *= 2


def hadamard(d: int) -> torch.Tensor | None:
    """An unnormalized Hadamard matrix of order d (float64), or None when d has no known construction here."""
    found = hadamard_order(d)
    if found is None:
        return None
    two_k, m = found
    h = paley(m - 1) if m > 2 else torch.ones(1, 1, dtype=torch.float64)
    h2 = torch.tensor([[1.0, 1.0], [1.0, -1.0]], dtype=torch.float64)
    while h.shape[0] < d:  # Sylvester: H_2n = H_2 (x) H_n
        h = torch.kron(h2, h)
    return h


def rotation(d: int, kind: str = "hadamard", seed: int = 0) -> tuple[torch.Tensor, str]:
    """(orthogonal Q of shape (d, d) in float64, how it was made)."""
    g = torch.Generator().manual_seed(seed)
    if kind == "hadamard":
        h = hadamard(d)
        if h is not None:
            # randomized Hadamard: random signs on the rows, then H / sqrt(d)
            signs = torch.randint(0, 2, (d,), generator=g, dtype=torch.float64) * 2 - 1
            two_k, m = hadamard_order(d)  # type: ignore[misc]
            return signs[:, None] * h / math.sqrt(d), f"randomized Hadamard ({two_k} x {m})"
    if kind in ("hadamard", "random"):
        # QR of a seeded Gaussian, signs fixed so Q is Haar-distributed
        qm, r = torch.linalg.qr(torch.randn(d, d, generator=g, dtype=torch.float64))
        qm = qm * torch.sign(torch.diagonal(r))[None, :]
        how = "random orthogonal (QR of a Gaussian)"
        return qm, how + (f": no Hadamard matrix of order {d} known here" if kind == "hadamard" else "")
    if kind == "none":
        return torch.eye(d, dtype=torch.float64), "identity (no rotation)"
    raise NormconvError(f"unknown rotation {kind!r}: choose {', '.join(ROTATIONS)}")


# ---------------------------------------------------------------------------------------------------------
# analysis


@dataclass
class RotationPlan:
    d: int | None = None
    sites: list[NormSite] = field(default_factory=list)
    writers: list[Writer] = field(default_factory=list)
    readers: list[Reader] = field(default_factory=list)
    unties: list[Reader] = field(default_factory=list)
    problem: str | None = None
    code: RotateWhy = RotateWhy.ROTATED
    left: dict[str, str] = field(default_factory=dict)  # site target -> the linears it reads the stream through

    def refuse(self, code: RotateWhy, why: str) -> RotationPlan:
        self.code, self.problem = code, why
        return self


def _scalar(cap: Captured, v: Any) -> bool:
    return isinstance(v, (int, float)) or (isinstance(v, fx.Node) and cap.shape(v) == ())


def _through_scalar(cap: Captured, leaf: Any) -> tuple[Any, list[fx.Node]]:
    """A leaf scaled by a constant (Gemma: embeddings * sqrt(D)): the writer behind it, and the nodes on the way."""
    path: list[fx.Node] = []
    while isinstance(leaf, fx.Node):
        if cap.op(leaf) == "mul" and len(leaf.args) == 2:
            a, b = leaf.args
            if isinstance(a, fx.Node) and _scalar(cap, b) and cap.shape(a) == cap.shape(leaf):
                path.append(leaf)
                leaf = a
                continue
            if isinstance(b, fx.Node) and _scalar(cap, a) and cap.shape(b) == cap.shape(leaf):
                path.append(leaf)
                leaf = b
                continue
        if passes_through(cap, leaf):
            path.append(leaf)
            leaf = leaf.args[0]
            continue
        break
    return leaf, path


def analyze(cap: Captured, norms: Sequence[NormSite]) -> RotationPlan:
    plan = RotationPlan()
    # read through reader linears only (q_proj -> q_norm)  =>  its input is unchanged: left as it is
    inner = inner_norms(cap, norms)
    plan.left = {norms[i].target: ", ".join(via) for i, via in sorted(inner.items())}
    outputs = {s.node: s.target for s in norms}
    norms = [s for i, s in enumerate(norms) if i not in inner]
    if not norms:
        return plan.refuse(RotateWhy.NO_NORM, "the model has no norm: no residual stream to rotate")
    other = next((s for s in norms if s.kind != "rmsnorm"), None)
    # RMSNorm(x Q) = RMSNorm(x) Q only: a LayerNorm's mean or a BatchNorm's channels do not commute with Q
    if other is not None:
        return plan.refuse(RotateWhy.NOT_RMSNORM, f"{other.target} is a {other.kind}: only weight-free RMSNorm "
                                                  f"commutes with a rotation")
    values: set[str] = set()
    norm_nodes: set[str] = set()
    chains: list[tuple[fx.Node, list[fx.Node]]] = []
    widths = set()
    followed: dict = {}  # the walks share what they follow back (each norm's stream holds the earlier ones')
    for s in norms:
        mod = cap.modules.get(norm_module(cap, s) or "")
        if not isinstance(mod, nn.RMSNorm):
            return plan.refuse(RotateWhy.INLINE, f"{s.target}: a {s.source} norm that is not a module (canonicalize "
                                                 f"could not make it one)")
        # x Q diag(g) != x diag(g) Q  =>  the scale must be folded into the readers first (fold-scales)
        if has_scale(mod):
            return plan.refuse(RotateWhy.HAS_SCALE, f"{s.target} still has a scale (fold it into its readers first)")
        widths.add(hidden(s))
        plan.sites.append(s)
        norm_nodes.update(s.nodes)
        vals, leaves = walk(cap, s, followed)
        values |= vals
        for leaf, path, axis in leaves:
            w_node, extra = _through_scalar(cap, leaf)
            if w_node is not leaf and cap.shape(w_node) != cap.shape(leaf):
                return plan.refuse(RotateWhy.WRITER, f"{s.target}: stream writer {in_words(cap, w_node)} reaches the "
                                                     f"stream through a reshape")
            # a norm on a sublayer's output (OLMo2, Gemma2/3)  =>  RMSNorm(y) diag(g) Q: Q cannot pass its scale
            if isinstance(w_node, fx.Node) and w_node.name in outputs:
                return plan.refuse(RotateWhy.WRITER, f"{s.target}: stream writer {outputs[w_node.name]} is a norm on "
                                                     f"a sublayer's output: the stream would need its output rotated, "
                                                     f"and a rotation does not pass a norm's per-feature scale "
                                                     f"(diag(g) Q != Q diag(g)), so rotate does not rewrite it")
            w = writer(cap, w_node, axis)
            if isinstance(w, Refused):
                return plan.refuse(RotateWhy.WRITER, f"{s.target}: {w}")
            if w.scale or w.kind == "norm":  # the rotation is not carried through a layer scale or a LayerNorm
                what = f"is scaled by {w.scale}" if w.scale else "is a LayerNorm"
                who = w.module or in_words(cap, cap.nodes[w.node])
                return plan.refuse(RotateWhy.WRITER, f"{s.target}: stream writer {who} {what}, which "
                                                     f"rotate does not rewrite")
            if w.node not in {x.node for x in plan.writers}:
                plan.writers.append(w)
                chains.append((w_node, list(reversed(extra)) + list(reversed(path))))
        # every reader of the norm output a linear  =>  W <- W Q takes Q back out
        readers, why = norm_readers(cap, cap.nodes[s.node])
        if why:
            return plan.refuse(RotateWhy.READER, f"{s.target}: {why}")
        plan.readers += [r for r in readers if r.node not in {x.node for x in plan.readers}]
    if len(widths) != 1 or None in widths:
        return plan.refuse(RotateWhy.WIDTH, "the norms normalize more than one dim, or streams of different widths "
                                            "meet")
    plan.d = d = widths.pop()
    # the stream is read only by its own adds and norms (anything else would see x Q)
    allowed = values | norm_nodes
    for name in sorted(values):
        for u in cap.users(cap.nodes[name]):
            if u.name not in allowed:
                where = in_words(cap, cap.nodes[name])
                return plan.refuse(RotateWhy.STREAM_READ, f"the residual stream ({where}) is also read by "
                                                          f"{in_words(cap, u)}, which would see it rotated")
    # a writer's output flows only into the stream
    for leaf, path in chains:
        chain = [leaf] + path
        for a, b in zip(chain, chain[1:]):
            if [u.name for u in cap.users(a)] != [b.name]:
                return plan.refuse(RotateWhy.WRITER_OUTPUT, f"the output of stream writer {in_words(cap, leaf)} is "
                                                            f"also read elsewhere")
        for u in cap.users(chain[-1]):
            if u.name not in allowed:
                return plan.refuse(RotateWhy.WRITER_OUTPUT, f"the output of stream writer {in_words(cap, leaf)} is "
                                                            f"also read by {in_words(cap, u)}")
    # shapes: writers write d-wide rows, readers read d-wide rows
    for w in plan.writers:
        t = cap.tensor(w.weight)
        axis = w.axis
        if t is None or t.dim() <= axis or t.shape[axis] != d:
            who = w.module or in_words(cap, cap.nodes[w.node])
            return plan.refuse(RotateWhy.WIDTH, f"stream writer {who} does not write {d}-wide rows")
    for r in plan.readers:
        t = cap.tensor(r.weight)
        axis = 1 if r.layout == "out_in" else 0
        if t is None or t.dim() != 2 or t.shape[axis] != d:
            who = r.module or in_words(cap, cap.nodes[r.node])
            return plan.refuse(RotateWhy.WIDTH, f"{who} does not read {d}-wide rows")
    why = _check_tensors(cap, plan)
    return plan.refuse(RotateWhy.TENSOR_SHARED, why) if why else plan


def _ops(plan: RotationPlan) -> list[tuple[str, str, str]]:
    """(state_dict name, node, axis) for every tensor the rotation rewrites: T <- T Q along that axis.

    Along the axis that indexes the hidden dim, one rule covers every layout: embedding E (V, D) and HF Conv1D
    writer W (in, D) -> E Q, W Q (axis 1); nn.Linear / conv writer W (D, ...) -> Q^T W (axis 0); a parameter added
    to the stream (position embedding, class token) along its hidden axis; biases b Q (axis 0); a reader
    nn.Linear W (out, D) -> W Q (axis 1), a Conv1D reader W (D, out) -> Q^T W (axis 0)."""
    ops = []
    for w in plan.writers:
        # writer  =>  rotated along the weight's hidden axis;  its bias  =>  b Q
        ops.append((w.weight, w.node, f"axis {w.axis}"))
        if w.bias:
            ops.append((w.bias, w.node, "axis 0"))
    for r in plan.readers:
        # norm reader  =>  rotated along its input axis (Q taken back out)
        ops.append((r.weight, r.node, "axis 1" if r.layout == "out_in" else "axis 0"))
    return ops


def rotate_along(t: torch.Tensor, q: torch.Tensor, axis: int) -> torch.Tensor:
    """T Q along ``axis``: (T.movedim(axis, -1) @ Q).movedim(-1, axis)."""
    return (t.movedim(axis, -1) @ q).movedim(-1, axis)


def _check_tensors(cap: Captured, plan: RotationPlan) -> str | None:
    """Each rotated tensor is read only by nodes that rotate it the same way (a tie: untie a reader's own copy)."""
    readers_of = param_readers(cap)
    by_tensor: dict[int, set[str]] = {}
    nodes_of: dict[int, set[str]] = {}
    for name, node, op in _ops(plan):
        t = cap.tensor(name)
        by_tensor.setdefault(id(t), set()).add(op)
        nodes_of.setdefault(id(t), set()).add(node)
    for w in plan.writers:
        if w.kind == "param":  # a parameter added as is: the stream node that adds it is its reader, and rotated
            nodes_of[id(cap.tensor(w.weight))].update(u.name for u in cap.nodes[w.node].users)
    for name, node, op in _ops(plan):
        t = cap.tensor(name)
        foreign = [n for n in readers_of.get(id(t), []) if n not in nodes_of[id(t)]]
        if foreign:
            return f"{name} is also read by {in_words(cap, cap.nodes[foreign[0]])}, which is not rotated with it"
        if len(by_tensor[id(t)]) > 1:
            r = next((r for r in plan.readers if r.weight == name), None)
            if r is None or any(x.module == r.module for x in plan.writers):
                return f"{name} would be rotated two different ways ({' and '.join(sorted(by_tensor[id(t)]))})"
            if r not in plan.unties:
                plan.unties.append(r)
    return None


# ---------------------------------------------------------------------------------------------------------
# the pass


class Rotate(Pass):
    """x -> x Q on the residual stream, writers and norm readers compensating; see the module docstring."""

    name = NAME
    check = Check.EXACT

    def __init__(self, kind: str = "hadamard", seed: int = 0):
        if kind not in ROTATIONS:
            raise NormconvError(f"unknown --rotation {kind!r}: choose {', '.join(ROTATIONS)}")
        self.kind, self.seed = kind, seed

    def plan(self, cap: Captured, norms: Sequence[NormSite]) -> list[Site]:
        p = analyze(cap, norms)
        return [_left(s.target, p.left[s.target]) if s.target in p.left else
                Site(NAME, s.target, p.problem is None, p.problem or f"stream of width {p.d} rotated", p.code)
                for s in norms]

    def __call__(self, model: nn.Module, cap: Captured) -> PassResult:
        p = analyze(cap, find_norms(cap))
        if p.problem:
            raise NormconvError(f"rotate: {p.problem}", Code.REFUSED, pass_name=NAME)
        q, how = rotation(p.d, self.kind, self.seed)
        notes: list[str] = []
        with torch.no_grad():
            for r in p.unties:
                untie(model, cap, r, notes)
            done: set[int] = set()
            for name, _, op in _ops(p):
                t = cap.tensor(name)
                if id(t) in done:
                    continue  # a tie rotated the same way by both holders (wte = lm_head: E Q = W Q)
                done.add(id(t))
                new = rotate_along(t.detach().double(), q, int(op.split()[1]))
                mine = owned(model, t)
                mine.data.copy_(new.to(t.dtype))
        sites = tuple(Site(NAME, s.target, True, f"stream of width {p.d} rotated ({how})", p.code)
                      for s in p.sites) + tuple(_left(target, via) for target, via in p.left.items())
        notes.append(f"residual stream (width {p.d}) rotated by a {how} matrix (seed {self.seed}): "
                     f"{len(p.writers)} writer(s), {len(p.readers)} reader linear(s)"
                     + (f"; {len(p.left)} norm(s) inside sublayers left as they are" if p.left else ""))
        return PassResult(model, True, sites, tuple(notes), {"plan": p, "how": how})


def _left(target: str, via: str) -> Site:
    return Site(NAME, target, False, f"not on the residual stream: it reads it only through {via}, whose output the "
                                     f"rotation keeps; left as it is", RotateWhy.NOT_ON_STREAM)


def plan(cap: Captured, norms: Sequence[NormSite]) -> list[Site]:
    return Rotate().plan(cap, norms)


__all__ = ["Rotate", "RotateWhy", "RotationPlan", "analyze", "rotation", "hadamard", "hadamard_order", "paley",
           "plan", "NAME", "ROTATIONS", "rotate_along"]
