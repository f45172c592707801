"""The edits of a residual stream as data, and the float64 arithmetic that applies them.

An ``Edits`` lists, by state_dict name and in the order they apply:
  untie    a tied embedding gets its own copy first (the other holder keeps the original values)
  scale    a layer scale lambda folded into its writer: W <- diag(lambda) W, b <- lambda b, lambda <- 1
  center   each writer tensor minus its mean along the hidden axis: T <- T - mean_D(T)
           (embedding (V, D): each row; linear W (D, in): over the output rows, b (D) over its entries)
  fold     a norm's bias b into each linear reading the norm: c <- c + W b (c None: a bias is added)
Two interpreters apply it with the same ``center_`` / ``bias_delta`` / ``add_``: the in-memory swap (a module tree)
and the streaming writer (``normconv.stream``: a checkpoint tensor by tensor), so their bytes are equal. Every sum is
taken in float64 a slice at a time (each slice holds whole reductions: the same result at the memory of one slice)
and rounded once into the tensor's dtype.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Sequence

import torch
import torch.nn as nn

from normconv.clone import adopt, owned
from normconv.graph.capture import Captured

from .readers import Consumer, Reader, own_module_attr
from .streams import Stream, along, slices
from .why import Refused


@dataclass(frozen=True)
class Fold:
    """A norm's bias b folded into a consumer linear: bias <- bias + W b (bias None: one is added)."""

    beta: str  # the norm's bias (state_dict name)
    norm: str  # the norm module
    weight: str
    bias: str | None
    layout: str
    module: str


@dataclass(frozen=True)
class Scale:
    """A layer scale lambda folded into its writer before centering: W <- diag(lambda) W, b <- lambda b, lambda <- 1."""

    scale: str
    weight: str | None
    axis: int
    bias: str | None


@dataclass
class Edits:
    """The weight edits, by state_dict name, in the order they apply: untie, scale, center, fold."""

    untie: dict[str, str] = field(default_factory=dict)  # centered embedding module -> its weight's name
    scales: list[Scale] = field(default_factory=list)
    center: dict[str, int] = field(default_factory=dict)  # writer weight / bias -> the axis centered along
    folds: list[Fold] = field(default_factory=list)
    dropped: list[str] = field(default_factory=list)  # approximate: "norm (why its bias could not fold)"

    def fold_into(self) -> dict[str, list[Fold]]:
        """consumer bias name -> the folds that add to it."""
        out: dict[str, list[Fold]] = {}
        for f in self.folds:
            if f.bias is not None:
                out.setdefault(f.bias, []).append(f)
        return out


@dataclass(frozen=True)
class Replaced:
    """A norm module being replaced: the stream it reads and where its bias goes (or why it cannot go)."""

    module: str
    stream: int | None  # index into the streams
    consumers: Sequence[Consumer] = ()
    beta_problem: Refused | None = None  # why its bias cannot fold: then it is dropped (approximate only)


def edits(cap: Captured, streams: Sequence[Stream], replaced: Sequence[Replaced],
          read: Callable[[str], torch.Tensor] | None = None) -> Edits:
    """The weight edits that center the streams read by ``replaced`` norms and fold those norms' biases into their
    consumers; norm bias values are read through ``read`` (default: the captured model's tensors) to skip zero
    biases."""
    read = read or (lambda name: cap.tensor(name))
    out = Edits()
    done: set[int] = set()
    edited = {r.stream for r in replaced}
    untied: set[str] = set()
    for k, st in enumerate(streams):
        if st.problem is not None or k not in edited:
            continue  # no norm of this stream is replaced: its writers stay as they are
        for path in st.unties:
            out.untie[path] = f"{path}.weight"
            untied.add(f"{path}.weight")
        for w in st.writers.values():
            if w.scale:  # layer scale: folded into the writer first, so the product is what gets centered
                out.scales.append(Scale(w.scale, w.weight, w.axis, w.bias))
            # embedding (V, D)  =>  each row minus its mean;  linear  =>  W - mean over output rows, b - mean(b)
            for pname, dim in ((w.weight, w.axis), (w.bias, 0)):
                t = cap.tensor(pname) if pname else None
                # one tensor is centered once; an untied embedding gets its own copy first, so each one untied is
                # centered (BART-style encoder and decoder embeddings tied to one head: two copies of one tensor)
                if t is not None and (pname in untied or id(t) not in done):
                    done.add(id(t))
                    out.center[pname] = dim
    folded: set[int] = set()
    for r in replaced:
        if getattr(cap.modules[r.module], "bias", None) is None:
            continue
        beta = f"{r.module}.bias"
        if not bool(torch.count_nonzero(read(beta).detach())):
            continue  # b = 0: nothing to fold
        if r.beta_problem:
            out.dropped.append(f"{r.module} ({r.beta_problem})")
            continue
        for c in r.consumers:
            w = cap.tensor(c.weight)
            if id(w) not in folded:  # a consumer shared by two norms reads the same b once
                folded.add(id(w))
                out.folds.append(Fold(beta, r.module, c.weight, c.bias, c.layout, c.module))
    return out


# -- the arithmetic --------------------------------------------------------------------------------------------


def work_dtype(t: torch.Tensor) -> torch.dtype:
    """The arithmetic of an exact edit: float64 for float32 / float64 weights (the result, rounded once to float32,
    is the exact value's rounding); float32 for half precision, whose 8 (bf16) or 11 (fp16) bits the one rounding
    of the result keeps: float32's 24 bits carry the exact value that far, at half float64's traffic and with
    float32's matrix kernels (a streamed 1.3B bf16 swap spent 9 s of 47 in this arithmetic)."""
    return torch.float64 if t.dtype in (torch.float32, torch.float64) else torch.float32


def center_(t: torch.Tensor, dim: int) -> torch.Tensor:
    """t <- t - mean(t, dim) in place, computed in ``work_dtype`` one slice at a time (peak: a slice, not the
    weight); the mean is accumulated in float64 either way."""
    work = work_dtype(t)
    buf: torch.Tensor | None = None  # one work-dtype buffer for every slice (fresh memory costs its page faults)
    for s in slices(t.detach(), dim):
        if buf is None or buf.numel() < s.numel():
            buf = torch.empty(s.numel(), dtype=work, device=s.device)
        sw = buf[: s.numel()].view(s.shape).copy_(s)
        mean = sw.mean(dim, keepdim=True, dtype=torch.float64).to(work)
        s.copy_(sw.sub_(mean))  # in place: one slice alive in the work dtype, rounded once by copy_
    return t


def bias_delta(w: torch.Tensor, beta: torch.Tensor, layout: str) -> torch.Tensor:
    """W b in ``work_dtype(w)``, a slice of output features at a time (each output is one whole dot product):
    W (out, D) [out_in]: W @ b;  HF Conv1D W (D, out) [in_out]: b @ W."""
    work = work_dtype(w)
    b = beta.detach().to(work)
    if layout == "out_in":
        return torch.cat([s.to(work) @ b for s in slices(w.detach(), 1)])
    return torch.cat([b @ s.to(work) for s in slices(w.detach(), 0)])


def add_(b: torch.Tensor, delta: torch.Tensor) -> torch.Tensor:
    """b <- b + delta in place, summed in the wider of float64 / the delta's dtype (rounded once to b's dtype)."""
    work = torch.promote_types(work_dtype(b), delta.dtype)
    b.data.copy_((b.detach().to(work) + delta.to(work)).to(b.dtype))
    return b


# -- in memory: a module tree whose tensors are shared with the user's (``clone.owned`` before a write) --------------


def apply_(model: nn.Module, cap: Captured, plan: Edits, notes: list[str]) -> None:
    """Apply ``plan`` to ``model`` (the tree ``cap`` captured); a bias added to a bias-free linear is noted."""
    for path in plan.untie:
        untie_embedding(model, cap, path, notes)
    for sc in plan.scales:
        fold_scale_(model, cap, sc)
    for name, dim in plan.center.items():
        center_(owned(model, cap.tensor(name)), dim)
    for f in plan.folds:
        # linear after the norm: c <- c + W b
        delta = bias_delta(cap.tensor(f.weight), getattr(cap.modules[f.norm], "bias"), f.layout)
        if f.bias is None:
            w = cap.tensor(f.weight)
            cap.modules[f.module].bias = nn.Parameter(delta.to(w.dtype), requires_grad=w.requires_grad)
            notes.append(f"added a bias to {f.module} to carry the bias of {f.norm}")
        else:
            add_(owned(model, cap.tensor(f.bias)), delta)


def fold_scale_(model: nn.Module, cap: Captured, w: Scale) -> None:
    """lambda * (W x + b)  =>  (diag(lambda) W) x + lambda b, lambda <- ones: the same output, centered next."""
    lam = owned(model, cap.tensor(w.scale))
    vec = lam.detach().double().reshape(-1)
    for pname, dim in ((w.weight, w.axis), (w.bias, 0)):
        if pname:
            t = owned(model, cap.tensor(pname))
            t.data.copy_((t.detach().double() * along(vec, t.dim(), dim)).to(t.dtype))
    lam.data.fill_(1)


def untie_embedding(model: nn.Module, cap: Captured, path: str, notes: list[str]) -> None:
    """A tied embedding (lm_head.weight is wte.weight) gets its own copy: the other user keeps the original rows."""
    emb = cap.modules[path]
    old = emb.weight
    others = [n for n, t in model.named_parameters(remove_duplicate=False) if t is old and n != f"{path}.weight"]
    emb.weight = nn.Parameter(old.detach().clone(), requires_grad=old.requires_grad)
    adopt(model, emb.weight)  # already this rewrite's own copy: centering it must not clone it again
    notes.append(f"untied {path}.weight from {', '.join(others)}: the embedding is centered, "
                 f"{', '.join(others)} keeps the original values")
    untie_config(model, notes)


def untie(model: nn.Module, cap: Captured, r: Reader, notes: list[str]) -> None:
    """Give the reader's module its own copy of a tied weight (the other holder keeps the original)."""
    found = own_module_attr(cap, r)
    assert found is not None
    mod, attr = found
    old = getattr(mod, attr)
    setattr(mod, attr, nn.Parameter(old.detach().clone(), requires_grad=old.requires_grad))
    notes.append(f"untied {r.module}.{attr}: it takes a norm scale (or rotation) its tied twin does not")
    untie_config(model, notes)


def untie_config(model: nn.Module, notes: list[str]) -> None:
    """A Hugging Face model re-ties its embeddings on tie_weights()/from_pretrained unless told not to."""
    config = getattr(model, "config", None)
    configs = (config, getattr(config, "get_text_config", lambda: None)())
    for cfg in {id(c): c for c in configs if c is not None}.values():
        if getattr(cfg, "tie_word_embeddings", False):
            cfg.tie_word_embeddings = False
            notes.append("set config.tie_word_embeddings = False so Hugging Face does not re-tie the weights")
