"""Discrete selections in a forward, and replaying one forward's selections in another.

A *selection* is an op whose result is discrete in its floating inputs: a non-floating output (``aten.gt`` and
the other comparisons, ``argmax``, ``topk`` / ``sort`` / ``max.dim`` indices, ``nonzero``, ``torchvision::nms``,
a cast to an integer dtype) or a step function (``floor``, ``ceil``, ``round``, ``trunc``, ``sign``). Float32
rounding moves its inputs by a few units in the last place, and where two candidates are within that of each other
(a score at the threshold, two near-equal boxes in NMS) the result flips: the outputs downstream (a detector's
boxes and labels) then differ by whole elements, however exact the rewrite. Comparing them says nothing about the
rewrite; comparing the tensors *before* the selection does.

``Recorder`` is a ``TorchDispatchMode`` that sees every aten (and custom) op of a forward:

- recording (the original model): each selection's op name, its non-floating results and its floating inputs
  (copies) are kept, in program order;
- replaying (the rewritten model, given the original's ``Trace``): at the k-th selection the forward gets the
  original's results instead of its own (``topk`` / ``sort`` / ``max.dim`` values are gathered from its own input at
  the original's indices), so every op after it computes on the same selections, and the rewritten model's
  outputs are comparable element by element again: an error of the rewrite in the boxes, or in a head that runs on
  the selected regions, still shows. The selections whose own result differed are ``flipped``; its floating inputs
  are kept too, so the caller can check that each flip is within rounding (a selection's inputs may reach no
  output: an RPN's objectness). Where the op sequence itself differs (Python branching on a float's value), replay
  stops there and says so (``lost``). A *scalar* selection (every floating input 0-dim: a number computed once and
  cached, as torchvision's MultiScaleRoIAlign does with its scales on its first forward) that one forward makes and
  the other does not is passed over on either side, not a lost replay; each replayed pick names the original's pick
  it was matched with (``ref``), and ``Trace.pairs`` gives them side by side.

Continuous results are never replayed: a ``topk``'s values, ``max``'s value, a float ``.item()``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten, tree_leaves, tree_unflatten

aten = torch.ops.aten

STEPS = frozenset({"floor", "ceil", "round", "trunc", "sign", "frac"})  # float -> float, but piecewise constant
# (values, indices) ops whose values are the input at the indices: replayed as a gather at the original's indices
GATHERED = frozenset({"topk", "sort", "max", "min", "kthvalue", "median", "mode", "nanmedian"})
# ops whose non-floating output does not depend on any value of their floating input
SHAPE_ONLY = ("new_", "empty", "zeros_like", "ones_like", "full_like", "rand", "_to_copy_meta")
BUDGET = 2 ** 28  # elements of floating inputs kept at most (1 GiB of float32); past it, inputs are not kept


@dataclass
class Pick:
    """One selection of a forward: the op, its non-floating results, its floating inputs (None past the budget),
    and (replaying) whether the replayed forward's own result differed from the original's."""

    op: str
    results: tuple[torch.Tensor, ...]
    inputs: tuple[torch.Tensor, ...] | None
    flipped: bool = False
    scalar: bool = False  # every floating input 0-dim (module docstring)
    ref: int | None = None  # replaying: the index of the original's pick this one was matched with


@dataclass
class Trace:
    """The selections of one forward, in program order. ``lost``: the index at which a replayed forward's ops
    stopped matching the original's (None: they matched throughout)."""

    picks: list[Pick] = field(default_factory=list)
    lost: int | None = None
    truncated: bool = False

    @property
    def flipped(self) -> list[int]:
        return [k for k, p in enumerate(self.picks) if p.flipped]

    def describe(self, k: int) -> str:
        return f"{self.picks[k].op} #{k + 1}"

    def pairs(self, original: Trace) -> list[tuple[int, Pick, Pick]]:
        """This replay's picks matched with ``original``'s, up to where it was lost: (the original's index, its pick,
        this forward's)."""
        last = len(self.picks) if self.lost is None else self.lost
        return [(p.ref, original.picks[p.ref], p) for p in self.picks[:last] if p.ref is not None]


def _name(func: Any) -> str:
    """aten.topk, torchvision.nms: the op without its overload."""
    return str(func.overloadpacket) if hasattr(func, "overloadpacket") else str(func)


def _base(name: str) -> str:
    return name.rpartition(".")[2]


def is_selection(func: Any, inputs: list[torch.Tensor], outputs: list[torch.Tensor]) -> bool:
    """A floating input and a result that is discrete in it (see the module docstring)."""
    if not any(t.is_floating_point() for t in inputs):
        return False
    base = _base(_name(func))
    if base.startswith(SHAPE_ONLY) or base in ("_local_scalar_dense", "sym_size", "detach", "alias"):
        return False
    if base in STEPS:
        return True
    return any(not (t.is_floating_point() or t.is_complex()) for t in outputs)


class Recorder(TorchDispatchMode):
    """Records a forward's selections (``replay`` None) or replays ``replay``'s in this forward."""

    def __init__(self, replay: Trace | None = None) -> None:
        super().__init__()
        self.replay = replay
        self.trace = Trace()
        self.kept = 0
        self.at = 0  # replaying: the original's next pick not yet matched

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        ins = [t for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)]
        outs, spec = tree_flatten(out)
        tensors = [t for t in outs if isinstance(t, torch.Tensor)]
        if not is_selection(func, ins, tensors):
            return out
        name = _name(func)
        k = len(self.trace.picks)
        floats = [t for t in ins if t.is_floating_point()]
        inputs = None
        if self.kept + sum(t.numel() for t in floats) <= BUDGET:
            inputs = tuple(t.detach().clone() for t in floats)
            self.kept += sum(t.numel() for t in floats)
        else:
            self.trace.truncated = True
        results = tuple(t for t in tensors if not t.is_floating_point() or _base(name) in STEPS)
        pick = Pick(name, tuple(t.detach().clone() for t in results), inputs, scalar=all(t.dim() == 0 for t in floats))
        self.trace.picks.append(pick)
        if self.replay is None or self.trace.lost is not None:
            return out
        j = self._match(pick)
        if j is None:
            if not pick.scalar:
                self.trace.lost = k  # another op sequence from here: nothing after it is replayed
            return out  # a scalar selection the original did not make: passed over
        theirs, self.at, pick.ref = self.replay.picks[j], j + 1, j
        if all(a.shape == b.shape and torch.equal(a, b) for a, b in zip(results, theirs.results)):
            return out
        pick.flipped = True
        return tree_unflatten(_replayed(name, outs, theirs.results, args, kwargs), spec)

    def _match(self, pick: Pick) -> int | None:
        """The original's pick this one replays: its next one, past scalar picks this forward does not make."""
        for j in range(self.at, len(self.replay.picks)):
            theirs = self.replay.picks[j]
            if theirs.op == pick.op and len(theirs.results) == len(pick.results) and theirs.scalar == pick.scalar:
                return j
            if not theirs.scalar:
                return None
        return None


def _replayed(name: str, outs: list, theirs: tuple[torch.Tensor, ...], args: tuple, kwargs: dict) -> list:
    """This op's outputs with the original's discrete results in place of its own; the values of a
    (values, indices) op are its own input gathered at the original's indices."""
    it = iter(theirs)
    new = [next(it).to(o.device).clone() if isinstance(o, torch.Tensor) and (not o.is_floating_point() or
                                                                           _base(name) in STEPS) else o
           for o in outs]
    base = _base(name)
    if base in GATHERED and len(new) == 2 and isinstance(new[0], torch.Tensor) and new[0].is_floating_point():
        source, indices = args[0], new[1]
        dim = _dim(base, args, kwargs, source.dim())
        keep = indices.dim() == source.dim()
        idx = indices if keep else indices.unsqueeze(dim)
        values = source.gather(dim, idx)
        new[0] = values if keep else values.squeeze(dim)
    return new


def _dim(base: str, args: tuple, kwargs: dict, ndim: int) -> int:
    """The reduced dimension of a (values, indices) op, from torch's schemas: topk(self, k, dim=-1),
    sort(self, dim=-1) / sort.stable(self, *, stable, dim=-1), the others (self, dim)."""
    if "dim" in kwargs:
        dim = kwargs["dim"]
    elif base in ("topk", "kthvalue"):
        dim = args[2] if len(args) > 2 else -1
    else:
        dim = args[1] if len(args) > 1 and isinstance(args[1], int) and not isinstance(args[1], bool) else -1
    return dim % max(ndim, 1)


def selects(leaves: list[tuple[str, torch.Tensor]]) -> bool:
    """An output with a non-floating tensor (labels, indices, a mask): what a discrete selection makes."""
    return any(not (t.is_floating_point() or t.is_complex()) for _, t in leaves)
