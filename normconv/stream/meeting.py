"""The lockstep forwards' calls of one kept linear weight, made as one product they compute together.

The streamed pass runs the original and the rewritten model at two shapes, four forwards in lockstep
(stream.blocks.lockstep); a half-precision checkpoint's linear weights are kept as stored and cast a slice of rows at
a time for each product (stream.onepass). The four forwards of a block call the same weights: all four where the
rewrite left a weight unchanged (one tensor in both models), each model's two shapes where it changed it. Alone,
each call casts the weight and the BLAS packs it again; together, over the tokens of every call (each output row is
the dot products of its own input row, so the rows do not mix):

    y_k = x_k W^T + b_k   for the calls k   =   rows of  cat_k(x_k) W^T,  then each call's bias added

the weight is cast and packed once, and the calls present share its slices among their threads (OPT-style block, 16384
x 4096 bf16, the four calls of two shapes: 120 ms against 162 ms alone, same bits here).

  meet    a call waits for the calls of the same weight (storage, shape, dtype) with the same count of calls of it in
          the same phase of the lockstep by the other forwards whose model holds it (``hold``)
  phases  a forward that reaches a meeting of the lockstep (``pause``) or ends (``done``) makes no more calls in its
          phase: no call waits for it. When no forward is running (all waiting here or at the lockstep), the waiting
          calls go ahead with the forwards present: forwards whose flows differ never wait for each other for ever
  share   the calls present take the weight's slices one at a time (cast into their thread's buffer, multiplied);
          the last slice done joins them; each call returns its rows, its own bias added

A call outside the lockstep (no ``start`` in its thread), or of a weight already in the compute dtype, is one call
alone. Imports torch only.
"""

from __future__ import annotations

import threading
from typing import Hashable

import torch
import torch.nn as nn

SLICE_BYTES = 4 << 20  # a kept weight is cast this many bytes of rows at a time (a slice stays in cache)
_slice = threading.local()  # each thread's buffer for the slices
_ENDED = 1 << 62  # the phase of a forward that has returned


def weight_key(w: torch.Tensor) -> Hashable:
    """What makes two calls' weights one: the same storage, offset, shape, strides and dtype."""
    return w.data_ptr(), tuple(w.shape), tuple(w.stride()), w.dtype


class _Call:
    """One product: the inputs of the calls present (run -> x), then the slices taken and done, then the rows."""

    def __init__(self, phase: int, weight: Hashable):
        self.phase, self.weight = phase, weight
        self.xs: dict[int, torch.Tensor] = {}
        self.go = False  # no more calls join: the slices may be taken
        self.x: torch.Tensor | None = None  # the inputs of every call, rows in run order
        self.rows: dict[int, tuple[int, int]] = {}
        self.parts: list[torch.Tensor | None] = []
        self.taken = self.left = 0
        self.y: torch.Tensor | None = None
        self.error: BaseException | None = None  # a slice that failed: every call of the product raises


class Meeting:
    """The calls of the kept linear weights by ``runs`` forwards in lockstep (see the module docstring)."""

    def __init__(self, runs: int):
        self.cond = threading.Condition()
        self.phase = [0] * runs  # per forward: the meetings of the lockstep it has reached
        self.state = ["run"] * runs  # per forward: "run", "call" (waiting here), "meet" (at the lockstep), "ended"
        self.holders: dict[Hashable, frozenset[int]] = {}  # weight -> the forwards whose model holds it
        self.open: dict[tuple, _Call] = {}  # (phase, weight, count) -> the call waiting for others
        self.mine = threading.local()

    def hold(self, holders: dict[Hashable, frozenset[int]]) -> None:
        """The weights the forwards' models hold now (called between blocks, while no forward runs)."""
        self.holders = holders

    # -- the lockstep's side: each forward's thread ------------------------------------------------------------

    def start(self, run: int) -> None:
        self.mine.run, self.mine.counts = run, {}

    def pause(self, run: int) -> None:
        """Forward ``run`` waits at a meeting of the lockstep: its calls of this phase are over."""
        with self.cond:
            self.phase[run] += 1
            self.mine.counts = {}
            self.state[run] = "meet"
            self._settle()

    def release(self) -> None:
        """The lockstep's meeting lets every forward waiting at it go (its barrier's action: all at once, before
        any of them runs, so none is taken for waiting while it runs)."""
        with self.cond:
            self.state = ["run" if st == "meet" else st for st in self.state]

    def resume(self, run: int) -> None:
        """Forward ``run`` left the lockstep's meeting (released, or the meeting broken)."""
        with self.cond:
            if self.state[run] == "meet":
                self.state[run] = "run"

    def done(self, run: int) -> None:
        """Forward ``run`` returned or raised: it makes no more calls."""
        with self.cond:
            self.phase[run] = _ENDED
            self.state[run] = "ended"
            self.mine.run = None
            self._settle()

    # -- the calls --------------------------------------------------------------------------------------------

    def linear(self, m: nn.Linear, x: torch.Tensor, to: torch.dtype) -> torch.Tensor:
        """``m(x)`` computed in ``to`` with ``m``'s weight as stored: together with the other forwards' calls of it
        where they make them, else alone."""
        w, b = m.weight, m.bias
        if w.dtype == to:  # cast after all (``cast_kept``): the module's own product
            return nn.functional.linear(x, w, b)
        run = getattr(self.mine, "run", None)
        if run is None:
            return _alone(w, b, x, to)
        key = weight_key(w)
        count = self.mine.counts.get(key, 0)
        self.mine.counts[key] = count + 1
        with self.cond:
            phase = self.phase[run]
            call = self.open.get((phase, key, count))
            if call is None:
                call = self.open[(phase, key, count)] = _Call(phase, key)
            call.xs[run] = x
            self.state[run] = "call"
            self._settle()
            while not call.go:  # let go: its state is "run" again (set with the go, before this thread wakes)
                self.cond.wait()
        self._share(call, w, to)
        with self.cond:
            while call.y is None and call.error is None:
                self.cond.wait()
        if call.y is None:
            raise RuntimeError("a linear product shared with another verification forward failed") from call.error
        start, end = call.rows[run]
        y = call.y[start:end].reshape(*x.shape[:-1], w.shape[0])
        return y + b.to(to) if b is not None else y.clone()

    def _settle(self) -> None:
        """(Lock held.) Let go every call whose forwards are all present, or, when no forward is running, every
        call waiting."""
        stuck = "run" not in self.state
        for k, call in list(self.open.items()):
            expected = {r for r in self.holders.get(call.weight, ()) if self.phase[r] == call.phase}
            if stuck or expected <= call.xs.keys():
                del self.open[k]
                runs = sorted(call.xs)
                at = 0
                for r in runs:
                    n = call.xs[r].numel() // call.xs[r].shape[-1]
                    call.rows[r] = (at, at + n)
                    at += n
                call.x = torch.cat([call.xs[r].reshape(-1, call.xs[r].shape[-1]) for r in runs])
                call.xs = {}
                call.go = True
                for r in runs:  # running from now on, though not woken yet: no other call goes ahead without them
                    self.state[r] = "run"
                stuck = False
        self.cond.notify_all()

    def _share(self, call: _Call, w: torch.Tensor, to: torch.dtype) -> None:
        """Take the call's slices of ``w`` one at a time until none is left; the last one done joins them."""
        step = _rows_per_slice(w, to)
        with self.cond:
            if not call.parts and call.y is None:
                call.parts = [None] * -(-w.shape[0] // step)
                call.left = len(call.parts)
        while True:
            with self.cond:
                if call.taken >= len(call.parts) or call.error is not None:
                    return
                i = call.taken
                call.taken += 1
            try:
                part = nn.functional.linear(call.x, _cast(w[i * step:(i + 1) * step], to))
            except BaseException as exc:  # the calls waiting for the product raise too (none waits for ever)
                with self.cond:
                    call.error = call.error or exc
                    self.cond.notify_all()
                raise
            with self.cond:
                call.parts[i] = part
                call.left -= 1
                if call.left == 0:
                    call.y = torch.cat(call.parts, -1) if len(call.parts) > 1 else call.parts[0]
                    call.parts, call.x = [], None
                    self.cond.notify_all()


def _rows_per_slice(w: torch.Tensor, to: torch.dtype) -> int:
    """How many of ``w``'s rows one slice casts: SLICE_BYTES of them in ``to``, at least one."""
    return max(1, SLICE_BYTES // (w.shape[1] * to.itemsize))


def _cast(rows: torch.Tensor, to: torch.dtype) -> torch.Tensor:
    """``rows`` cast to ``to`` in this thread's buffer (grown when too small)."""
    buf = getattr(_slice, "buf", None)
    if buf is None or buf.dtype != to or buf.numel() < rows.numel():
        _slice.buf = buf = torch.empty(max(rows.numel(), SLICE_BYTES // to.itemsize), dtype=to)
    return buf[:rows.numel()].view(rows.shape).copy_(rows)


def _alone(w: torch.Tensor, b: torch.Tensor | None, x: torch.Tensor, to: torch.dtype) -> torch.Tensor:
    """``x W^T + b`` with ``w`` cast a slice of rows at a time, the outputs joined: each output is the dot product
    with its row cast (bit for bit the product with the cast weight on this machine's BLAS), with no cast copy of
    the whole weight."""
    step = _rows_per_slice(w, to)
    outs = [nn.functional.linear(x, _cast(w[i:i + step], to), None if b is None else b[i:i + step].to(to))
            for i in range(0, w.shape[0], step)]
    return torch.cat(outs, -1) if len(outs) > 1 else outs[0]
