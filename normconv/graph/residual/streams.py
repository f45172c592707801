"""Streams: the norms that read one residual stream, grouped, and whether its writers may be centered.

  LN(x) = LN(x - mean_D(x))   for every x: a LayerNorm does not see a shift along the hidden axis
Centering every writer (W <- W - mean_rows W, b <- b - mean b; embedding rows minus their means) makes mean_D(x) = 0
everywhere on the stream and changes no LayerNorm reading it. So a stream may be centered when
  - its writers are all centerable (``writer``) and write D-wide rows,
  - each writer's output flows only into the stream (its adds, or straight into the first norm),
  - each writer's tensors are read by that writer only (a tied embedding is cloned first: ``unties``),
  - the stream's values are read only by its adds and by the (mean-invariant) norms being swapped (``center``);
and it is zero-mean already when every writer is (RMSNorm -> LayerNorm edits nothing: |mean| <= 1e-5 max |W|).
Norms whose sum trees share a value or a writer's tensor read one stream and are decided together.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

import torch
import torch.fx as fx
import torch.nn as nn

from normconv.graph.capture import Captured
from normconv.graph.detect import NormSite
from normconv.graph.handwritten import owns_only
from normconv.match import CAT, TRANSPARENT, call_name, permute_dims
from normconv.nn.rmsnorm import RMSNorm

from .walk import Leaf, cat_on_last, in_words, live_users, stream_end
from .why import Refused, ResidualWhy as W
from .writers import HIDDEN_CAT, Writer, owns, writer

_NORM_FORWARDS = (nn.LayerNorm.forward, nn.RMSNorm.forward, RMSNorm.forward)  # forwards that are the norm alone
# a writer counts as zero-mean when |mean over the hidden dim| <= this * max |weight|
_ZERO_MEAN_RTOL = 1e-5
# float64 working set per slice: 8 MB, under glibc's largest mmap threshold (32 MB), so a slice's temporaries reuse
# heap pages instead of faulting fresh ones in (centering a 2048 x 8192 bf16 weight: 113 ms at 4M elements, 104 of
# them in the kernel, against 28 ms at 1M with center_'s reused buffer)
_SLICE_ELEMENTS = 1 << 20


@dataclass
class Stream:
    """Norm sites reading one residual stream, its values, its writers, and why it cannot be centered (if so)."""

    sites: list[int]  # indices into the sites it was built from
    values: set[str]
    writers: dict[str, Writer]
    problem: Refused | None = None
    unties: list[str] = field(default_factory=list)  # embedding modules whose tied weight is cloned first


def norm_module(cap: Captured, site: NormSite) -> str | None:
    """Path of the norm module computing the site (module sites; our own RMSNorm traced as F.rms_norm)."""
    if site.source == "module":
        return site.target
    mod = _norm_owner(cap, site)
    if mod is None:
        return None
    # a norm subclass whose own forward does more (DINOv3 ConvNeXt channels_first: permute, LayerNorm, permute
    # back) is replaceable only where that forward computed the norm call alone (ESM-C's cast back to the input's
    # dtype included: the replacement returns that dtype too)
    if type(mod).forward in _NORM_FORWARDS or owns_only(cap, site.owner, set(site.nodes) | _casts_back(cap, site)):
        return site.owner
    return None


def kept_norm_module(cap: Captured, site: NormSite) -> str | None:
    """The module an output that keeps the architecture (a Hugging Face folder) keeps computing a hand-written or
    functional site: its owner, a module without submodules that computes the site and nothing else (the casts to
    and from its compute dtype included: Cohere's and OLMo's LayerNorm classes), else None."""
    mod = cap.modules.get(site.owner) if site.owner else None
    if mod is None or list(mod.children()) or site.source == "module":
        return None
    casts, node = set(), cap.nodes[site.input]
    while cap.op(node) in TRANSPARENT and site.owner in cap.owner_stack(node) and node.args:
        casts.add(node.name)
        node = node.args[0]
    return site.owner if owns_only(cap, site.owner, set(site.nodes) | casts | _casts_back(cap, site)) else None


def moved_dims(cap: Captured, site: NormSite) -> tuple[int, ...] | None:
    """A channels-first norm module (timm's and torchvision's LayerNorm2d: ``permute`` one dim last, the norm over it,
    the inverse ``permute``), where that forward computes nothing else: the dim of its input it normalizes (negative,
    as ``MovedDimNorm`` takes it); else None."""
    if _norm_owner(cap, site) is None or hidden(site) is None:
        return None
    before, users = cap.nodes[site.input], cap.users(cap.nodes[site.node])
    after = users[0] if len(users) == 1 else None
    if after is None or call_name(before) != "permute" or call_name(after) != "permute" or after.args[0] is not \
            cap.nodes[site.node]:
        return None
    rank = len(permute_dims(before))
    perm, back = ([int(d) % rank for d in permute_dims(n)] for n in (before, after))
    moved = perm[-1]
    # one dim moved last, the others in order; then back where it was  =>  MovedDimNorm(norm, (moved - rank,))
    if perm != [d for d in range(rank) if d != moved] + [moved] or [perm[d] for d in back] != list(range(rank)):
        return None
    return (moved - rank,) if owns_only(cap, site.owner, set(site.nodes) | {before.name, after.name}) else None


def _norm_owner(cap: Captured, site: NormSite) -> nn.Module | None:
    """The LayerNorm / RMSNorm module (no submodules) whose own forward made this functional site, else None."""
    mod = cap.modules.get(site.owner)
    return mod if site.source == "functional" and site.owner and isinstance(mod, (nn.LayerNorm, nn.RMSNorm)) \
        and not list(mod.children()) else None


def _casts_back(cap: Captured, site: NormSite) -> set[str]:
    """Pass-through ops right after the site (casts, identities) that give back the site input's dtype."""
    out, node = set(), cap.nodes[site.node]
    while len(cap.users(node)) == 1 and cap.op(cap.users(node)[0]) in TRANSPARENT and \
            cap.dtype(cap.users(node)[0]) == cap.dtype(cap.nodes[site.input]):
        node = cap.users(node)[0]
        out.add(node.name)
    return out


def hidden(site: NormSite) -> int | None:
    """The width D a norm normalizes, None when it normalizes more than one dim."""
    shape = site.normalized_shape
    return shape[0] if shape is not None and len(shape) == 1 else None


def streams(cap: Captured, sites: Sequence[NormSite], walks: Sequence[tuple[set[str], list[Leaf]]],
            readers: dict[int, list[str]], center: bool, read: Callable[[str], torch.Tensor]) -> list[Stream]:
    """Group sites whose sum trees share a value or a writer parameter; check each group once. ``center``: the
    writers are to be centered (else they must be zero-mean already); ``readers``: ``param_readers(cap)``."""
    parent = list(range(len(sites)))

    def find(i):
        while parent[i] != i:
            parent[i] = parent[parent[i]]
            i = parent[i]
        return i

    owner_of: dict[Any, int] = {}
    leaf_writers: list[list[Writer | Refused]] = []
    found: dict[tuple[str, int | None], Writer | Refused] = {}  # a leaf behind many norms is judged once

    def writer_at(leaf, axis):
        if not isinstance(leaf, fx.Node):
            return writer(cap, leaf, axis, read)
        if (leaf.name, axis) not in found:
            found[(leaf.name, axis)] = writer(cap, leaf, axis, read)
        return found[(leaf.name, axis)]

    for i, (values, leaves) in enumerate(walks):
        ws = [writer_at(leaf, axis) for leaf, _, axis in leaves]
        leaf_writers.append(ws)
        keys: list[Any] = list(values) + [id(cap.tensor(w.weight)) for w in ws if isinstance(w, Writer) and w.weight]
        for key in keys:
            if key in owner_of:
                parent[find(i)] = find(owner_of[key])
            else:
                owner_of[key] = i
    groups: dict[int, list[int]] = {}
    for i in range(len(sites)):
        groups.setdefault(find(i), []).append(i)
    out = []
    for members in groups.values():
        st = Stream(members, set(), {})
        problems: list[Refused] = []
        chains: list[tuple[Any, list[fx.Node]]] = []
        for i in members:
            st.values |= walks[i][0]
            for (leaf, path, _), w in zip(walks[i][1], leaf_writers[i]):
                if isinstance(w, Refused):
                    problems.append(w)
                else:
                    st.writers[w.node] = w
                    chains.append((leaf, path))
        if not problems:
            problems += _check_writers(cap, st, chains, readers, sites, center, read)
        if not problems and center:
            problems += _check_readers(cap, st, sites)
        st.problem = problems[0] if problems else None
        out.append(st)
    return out


def _check_writers(cap, st: Stream, chains, readers, sites, center: bool, read) -> list[Refused]:
    hidden_dims = {hidden(sites[i]) for i in st.sites}
    if len(hidden_dims) != 1 or None in hidden_dims:
        return [Refused(W.WIDTH, "the norm normalizes more than one dim (or streams of different widths meet)")]
    d = hidden_dims.pop()
    problems = []
    for w in st.writers.values():
        if w.kind == "norm" and w.weight is None:  # a constant-scale LayerNorm without bias: zero-mean as it is
            continue
        t = cap.tensor(w.weight)
        dim = w.axis
        if t is None or t.dim() <= dim or (t.dim() != 2 and w.kind in ("linear", "embedding")) or t.shape[dim] != d:
            problems.append(Refused(W.WIDTH, f"stream writer {w.module or w.node} does not write {d}-wide rows"))
    if problems or not center:
        # RMSNorm -> LayerNorm edits no writer: it is exact only if they are zero-mean already
        for w in st.writers.values():
            if not problems:
                m = writer_mean(w, read)
                if m is not None:
                    problems.append(Refused(W.NOT_ZERO_MEAN, f"stream writer {w.module or w.node} is not zero-mean "
                                                             f"(|mean| up to {m:.2g}), so RMSNorm and LayerNorm "
                                                             f"differ on this stream"))
        return problems
    # each writer's output flows only into the stream (its adds, or straight into the first norm)
    allowed = set(st.values).union(*(sites[i].nodes for i in st.sites))
    # a node on the way may feed several ways into the stream (a position table sliced into its class and patch
    # parts, both joined into the stream by cat): its users are the next nodes of every way
    nexts: dict[str, set[str]] = {}
    for leaf, path in chains:
        chain = [leaf] + list(reversed(path))
        for a, b in zip(chain, chain[1:]):
            nexts.setdefault(a.name, set()).add(b.name)
    for leaf, path in chains:
        chain = [leaf] + list(reversed(path))
        for a in chain[:-1]:
            other = next((u for u in live_users(cap, a) if u.name not in nexts[a.name]), None)
            if other is not None:
                problems.append(Refused(W.SHARED_OUTPUT, f"the output of stream writer {in_words(cap, leaf)} is also "
                                                         f"read by {in_words(cap, other)}"))
        for u in live_users(cap, chain[-1]):
            if u.name not in allowed:
                # a residual add past the last norm carries the writer on: name where it ends up (SigLIP's head)
                end = stream_end(cap, u)
                onward = (f", which carries it on to {in_words(cap, end)}, not a LayerNorm (centering the writer "
                          f"would change it)" if end is not u else "")
                problems.append(Refused(W.SHARED_OUTPUT, f"the output of stream writer {in_words(cap, leaf)} is also "
                                                         f"read by {in_words(cap, u)}{onward}"))
    # each writer's parameters are read by the writers only (or by another name: a tie we can clone away)
    # a parameter writer is read by the pass-through ops that carry it into the stream (class_token.expand)
    writer_nodes = set(st.writers).union(st.values, *({n.name for n in path} for _, path in chains),
                                         *(w.via for w in st.writers.values()))
    scales = [id(cap.tensor(w.scale)) for w in st.writers.values() if w.scale]
    if len(scales) != len(set(scales)):  # folded into two writers, it could not become ones for both
        problems.append(Refused(W.SHARED_SCALE, "one layer-scale parameter scales two stream writers"))
    for w in st.writers.values():
        for pname in (w.weight, w.bias, w.scale):
            t = cap.tensor(pname) if pname else None
            if t is None:
                continue
            foreign = [n for n in readers.get(id(t), []) if n not in writer_nodes]
            if not foreign:
                continue
            mod = cap.modules.get(w.module)
            # a tied embedding (lm_head.weight is wte.weight)  =>  clone it, center the clone
            if w.kind == "embedding" and isinstance(mod, nn.Embedding) and mod.weight is t \
                    and all(owns(cap, n, t) not in (None, w.module) for n in foreign):
                if w.module not in st.unties:
                    st.unties.append(w.module)
                continue
            n = foreign[0]
            problems.append(Refused(W.SHARED_TENSOR, f"{pname} is also read by {in_words(cap, cap.nodes[n])}: "
                                                     f"centering it would change that use"))
    return problems


def writer_mean(w: Writer, read) -> float | None:
    """Largest |mean over the hidden dim| of a writer's weight / bias, or None when it is zero-mean."""
    if w.weight is None:  # a constant-scale LayerNorm without bias
        return None
    t = read(w.weight).detach()
    dim = w.axis
    if w.scale:  # lambda * (W x + b): the product's mean
        t = t.double() * along(read(w.scale).detach().double(), t.dim(), dim)
    # float64 one slice at a time (each slice holds whole reductions: the same means, not 2x the weight in float64)
    worst = max(float(s.double().mean(dim).abs().max()) for s in slices(t, dim))
    scale = float(t.abs().max())
    if w.bias:
        b = read(w.bias).detach().double() * (read(w.scale).detach().double().reshape(-1) if w.scale else 1)
        worst = max(worst, abs(float(b.mean())))
        scale = max(scale, float(b.abs().max()))
    return worst if worst > _ZERO_MEAN_RTOL * max(scale, 1e-30) else None


def _check_readers(cap: Captured, st: Stream, sites) -> list[Refused]:
    """Centering the writers is invisible only to mean-invariant readers: the swapped LayerNorms."""
    allowed = set(st.values)
    for i in st.sites:
        allowed.update(sites[i].nodes)
    for name in sorted(st.values):
        for u in live_users(cap, cap.nodes[name]):
            if u.name not in allowed:
                end = stream_end(cap, u)
                if call_name(end) in CAT and cat_on_last(cap, end):  # Swin's patch merging, named as such
                    return [Refused(W.HIDDEN_CAT, HIDDEN_CAT.format(where=cap.describe(end)))]
                past = f" (the stream flows on through {in_words(cap, u)})" if end is not u else ""
                value = in_words(cap, cap.nodes[name])
                return [Refused(W.READ_ELSEWHERE, f"the stream at {value} is also read by {in_words(cap, end)}{past}, "
                                                  f"which is not a LayerNorm (centering the stream would change it)")]
    return []


# -- float64 arithmetic a slice at a time -----------------------------------------------------------------------


def slices(t: torch.Tensor, dim: int):
    """Views of ``t`` along an axis other than ``dim``, each holding whole reductions over ``dim``: a mean over
    ``dim`` computed slice by slice is the mean computed at once, at the memory of one slice."""
    if t.dim() < 2 or t.numel() <= _SLICE_ELEMENTS:
        yield t
        return
    axis = 0 if dim % t.dim() != 0 else 1
    step = max(1, _SLICE_ELEMENTS * t.shape[axis] // t.numel())
    for i in range(0, t.shape[axis], step):
        yield t.narrow(axis, i, min(step, t.shape[axis] - i))


def along(v: torch.Tensor, rank: int, dim: int) -> torch.Tensor:
    """A vector shaped to broadcast along axis ``dim`` of a rank-``rank`` tensor."""
    shape = [1] * rank
    shape[dim] = -1
    return v.reshape(shape)
