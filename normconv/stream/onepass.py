"""``write_verified``: a streamed rewrite read, verified and written in one pass in block order, then checked by
checksum and renamed into place.

  layout   the output shards' headers computed up front (stream.writer.plan_layout: the input's names and order,
           untied copies beside their tensor), the files created at full size, config.json / the index / the
           folder's other files written, the rewritten model built on meta from that config.json
  rest     the tensors outside the blocks (embeddings, final norm, head) read once from the source, rewritten in
           memory by ``produce`` (the same function for every tensor: swap_norm.center_ / bias_delta / add_, or the
           fold's edits), the rewritten ones handed to the writer, the original model and the rewritten model filled
           with them (a half-precision checkpoint cast to float32 once per tensor, a tensor both models read cast
           once; a weight only embeddings and linear layers read kept as stored: an embedding's output cast, the
           same rows; a linear layer's rows cast a slice at a time, the four forwards' calls of one weight made as
           one product: stream.meeting)
  blocks   the original and the rewritten model run at the example inputs and a second shape, four threads in
           lockstep (stream.blocks.lockstep; an encoder-decoder's blocks: both stacks', stream.blocks.blocks); a loader thread reads block i + 1's tensors once from the source,
           rewrites them and hands them to the writer while block i runs (``_Ahead``); before block i runs, both
           models' block i are filled (cast into the buffers of the block dropped before, ``_Buffers``); after it
           ran, each rewritten block output is compared with ``reference(original block output)`` (float64, within
           atol + rtol * max |reference|) and block i is dropped. The final outputs are compared as the in-memory
           commands compare them. A tensor no forward read (a block never called, a key no module holds) is read,
           rewritten and written after the forwards
  written  the writer thread writes each tensor at its offset with the CRC-32 of its bytes as they left memory; each
           shard, once its last tensor is written, fsynced and read back sequentially (header, size, every tensor's
           CRC-32) by a checker thread while the next blocks run (a shard written again later, by a retried pass,
           read back again at the end), then its pages dropped from the page cache, and every other file written
           checked against its checksum: the files on disk are the tensors just verified
  output   the temp folder renamed to OUT only if every comparison and every checksum passed; on any failure
           (exit 1 for a miss) nothing is left under OUT or beside it

The source is read once per tensor (plus a rare consumer outside the block of the norm it absorbs; a source larger
than the memory has each tensor's pages dropped from the page cache once read); the output is never read into a
model. Peak memory: one block (original + rewritten; for a half-precision checkpoint its linear
weights as stored, its other tensors in float32),
the next block's source and rewritten tensors (read ahead), the rest, and at most a few tensors waiting for the
writer.
"""

from __future__ import annotations

import sys
import threading
from concurrent.futures import Future, ThreadPoolExecutor, wait
from pathlib import Path
from typing import Any, Callable

import torch
import torch.nn as nn

from normconv.errors import NormconvError, VerificationError
from normconv.io.hf_inputs import hf_example_inputs
from normconv.io.inputs import HF_SEQ_LEN
from normconv.io.write import remove_stale_temps, remove_temp, replace, signals_held, temp_file, write_error
from normconv.quiet import phase
from normconv.report import Report, Validation
from normconv.stream.blocks import block_list, blocks, build_on_meta, fill, lockstep, restore, tensor_slots, \
    trim_heap
from normconv.stream.checkpoint import Checkpoint, copy_folder, model_class, stored_key, tied_names
from normconv.stream.meeting import Meeting, weight_key
from normconv.stream.writer import PositionedWriter, changed, digests, plan_layout
from normconv.verify import Inputs, compare, default_tolerance, scale_tolerance

# produce(model name, stored tensor, source) -> the tensor to write; it never edits its input in place (the
# original model runs on it); source(model name) -> that tensor's original values (a norm bias a consumer absorbs)
Produce = Callable[[str, torch.Tensor, Callable[[str], torch.Tensor]], torch.Tensor]


class _Buffers:
    """Tensors of the blocks just dropped, reused by a later block's tensors of the same shape and dtype: memory
    written for the first time pays a page fault per 4 KiB (a cast of a 2048 x 8192 bf16 weight into fresh memory
    48 ms, 42 of them in the kernel, against 8 ms into reused memory; reading OPT-2.7B's blocks into fresh buffers
    left the pass 10.7 s of kernel time in 17.8 s). Two pools: the casts (main thread: the next block's casts) and
    the source tensors read (the loader thread: the block it reads next). Only a tensor whose storage nothing else
    holds is reused (the writer thread may still hold one). Each tensor is given with its generation (the unit it
    came from); ``take`` hands out the oldest first, and ``drop(upto)`` lets go of what the reads meant for them left
    (peak memory stays a block), so a read that comes late, while the next block is given, still finds the buffers
    meant for it. Thread-safe."""

    def __init__(self) -> None:
        self.free: dict[tuple[tuple[int, ...], torch.dtype], list[tuple[int, torch.Tensor]]] = {}
        self.lock = threading.Lock()

    def take(self, shape: torch.Size | tuple[int, ...], dtype: torch.dtype) -> torch.Tensor | None:
        with self.lock:
            pool = self.free.get((tuple(shape), dtype))
            return pool.pop(0)[1] if pool else None  # the oldest generation first: the newer ones wait for the next

    def give(self, tensors: dict[Any, torch.Tensor], generation: int = 0) -> None:
        """Take the tensors of ``tensors`` (emptied) for reuse, each one nothing else refers to."""
        while tensors:
            t = tensors.popitem()[1]
            if sys.getrefcount(t) <= 2 and _alone(t):  # this name and the call's argument: no holder elsewhere
                with self.lock:
                    self.free.setdefault((tuple(t.shape), t.dtype), []).append((generation, t))

    def drop(self, upto: int | None = None) -> None:
        """Let go of every tensor (``upto`` None) or of those of generations up to ``upto``."""
        with self.lock:
            if upto is None:
                self.free.clear()
                return
            for key in list(self.free):
                self.free[key] = [(g, t) for g, t in self.free[key] if g > upto]
                if not self.free[key]:
                    del self.free[key]


def _alone(t: torch.Tensor) -> bool:
    """No other tensor, parameter or view shares ``t``'s storage (its use count: ``t`` and the query's handle)."""
    try:
        return t.is_contiguous() and torch._C._storage_Use_Count(t.untyped_storage()._cdata) <= 2
    except (AttributeError, RuntimeError):  # a torch without the query: never reuse
        return False


def _keeps(m: nn.Module) -> bool:
    """A module whose weight the half-precision pass can keep as stored: a torch nn.Embedding with no renorm (it
    edits its weight) or a torch nn.Linear (subclasses may read the weight their own way)."""
    return (type(m) is nn.Embedding and m.max_norm is None) or type(m) is nn.Linear


class _Held:
    """Tensors in memory under their stored keys, read like a Checkpoint by ``fill`` (``key``: model name -> stored
    key); floating ones cast to ``compute`` once per tensor (``cast``: shared by the two models' fills), into a
    dropped block's buffer of the same shape where there is one (``buffers``)."""

    def __init__(self, key: dict[str, str], tensors: dict[str, torch.Tensor], compute: torch.dtype | None,
                 cast: dict[int, torch.Tensor], buffers: _Buffers | None = None, stored: frozenset[str] = frozenset()):
        self.key, self.tensors, self.compute, self.cast, self.buffers = key, tensors, compute, cast, buffers
        self.stored = stored  # keys kept in their stored dtype (``_Pass._kept``)

    def get(self, k: str) -> torch.Tensor:
        t = self.tensors[k]
        if self.compute is None or not t.is_floating_point() or k in self.stored:
            return t
        if id(t) not in self.cast:  # the tensors stay alive while this fill runs: ids are stable
            buf = self.buffers.take(t.shape, self.compute) if self.buffers is not None else None
            self.cast[id(t)] = buf.copy_(t) if buf is not None else t.to(self.compute)
        return self.cast[id(t)]


class _Ahead:
    """The next unit's source tensors read and rewritten in a loader thread while the forwards run the current one
    (reading, the rewrite's arithmetic and the writer hand-off then overlap the forwards instead of stopping all
    four): ``take(u)`` returns unit u's ``prepare(u)``, computed now if u was not the unit read ahead, and starts
    u + 1. One unit ahead at most: one block's source and rewritten tensors in memory beside the running one.
    The loader hands its result over in ``ready``, not as the future's result: the executor's work item holds its
    future until the loader thread runs again, and a future holding a block's tensors then kept them from being read
    into again (``_Buffers``: a busy machine's loader thread, scheduled late, lost the dropped block's buffers)."""

    def __init__(self, prepare: Callable[[int], Any], count: int):
        self.prepare, self.count = prepare, count
        self.pool = ThreadPoolExecutor(1, thread_name_prefix="normconv-read-ahead")
        self.next: tuple[int, Future] | None = None
        self.ready: dict[int, Any] = {}  # unit -> what the loader prepared, taken once by ``take``

    def _load(self, unit: int) -> None:
        self.ready[unit] = self.prepare(unit)  # stored, never a local or the future's result: taken, it is free

    def start(self, unit: int) -> None:
        if unit < self.count:
            self.next = (unit, self.pool.submit(self._load, unit))

    def take(self, unit: int) -> Any:
        guess, self.next = self.next, None
        if guess is not None and guess[0] == unit:
            guess[1].result()  # the loader's exception, if any, is raised here
            got = self.ready.pop(unit)
        else:  # blocks called out of order (a block run twice): the guess is finished and dropped
            if guess is not None:
                wait([guess[1]])
                self.ready.clear()
            got = self.prepare(unit)
        self.start(unit + 1)
        return got

    def close(self) -> None:
        """Wait for the loader; what it read ahead and nobody took is dropped (its writes stand: same bytes)."""
        self.next = None
        self.pool.shutdown(wait=True)
        self.ready.clear()


class _Pass:
    """The original and the rewritten model (parameters on meta) run together block by block, each block's
    tensors read once, rewritten, compared through both models and handed to the writer."""

    def __init__(self, src: Path, ckpt: Checkpoint, out_ckpt: Checkpoint, original, rewritten, produce: Produce,
                 copies: dict[str, list[str]], writer: PositionedWriter, compute: torch.dtype | None,
                 reference: Callable[[torch.Tensor], torch.Tensor], atol: float, rtol: float):
        self.src, self.ckpt, self.out_ckpt, self.produce, self.copies = src, ckpt, out_ckpt, produce, copies
        self.original, self.rewritten, self.writer, self.compute = original, rewritten, writer, compute
        self.reference, self.atol, self.rtol = reference, atol, rtol
        self.aliases = (tied_names(original), tied_names(rewritten))
        self.slots: tuple[list, list] = ([], [])  # per model: [rest slots, block 0 slots, block 1 slots, ...]
        for side, model in enumerate((original, rewritten)):
            listed = blocks(model)  # an encoder-decoder's: both stacks'
            self.slots[side].append(tensor_slots(model, skip={id(m) for _, b in listed for m in b.modules()}))
            self.slots[side].extend(tensor_slots(b, path) for path, b in listed)
        paths = [path for path, _ in blocks(original)]
        # a block's label: its index, or its path where the model has two stacks (model.decoder.layers.0)
        self.label = (lambda i: f"block {i}") if len(paths) == len(block_list(original)[1]) else \
            (lambda i: f"block {i} ({paths[i]})")
        # the source keys of each unit (rest first: a key tied into a block belongs to the rest)
        self.units: list[list[str]] = []
        seen: set[str] = set()
        for slots in self.slots[0]:
            keys = [k for k in dict.fromkeys(stored_key(ckpt, self.aliases[0], n) for _, _, n in slots)
                    if k is not None and k not in seen]
            seen.update(keys)
            self.units.append(keys)
        self.unit_of = {c: u for u, keys in enumerate(self.units) for k in keys for c in [k] + copies.get(k, [])}
        self.undo: list[Callable[[], Any]] = []  # the output casts and sliced forwards of the kept weights
        self.meeting = Meeting(0)  # the kept linear weights' calls (one per lockstep run: ``run``)
        self.sides: tuple[frozenset[int], ...] = (frozenset(), frozenset())  # each model's lockstep runs
        self.linears: tuple[list[nn.Linear], list[nn.Linear]] = ([], [])  # per model: its kept linear layers
        self.kept = (self._kept(original, 0), self._kept(rewritten, 1))
        self.buffers = _Buffers()  # the dropped block's cast tensors, for the next block's casts
        self.reads = _Buffers()  # the dropped block's source tensors, for the loader's next reads
        self.sources: dict[str, torch.Tensor] = {}  # the source tensors of the block loaded last
        self.cast: dict[int, torch.Tensor] = {}  # the cast tensors of the block loaded last
        self.written: set[str] = set()  # source keys whose outputs went to the writer
        self.records: list[list[tuple[int, Validation]]] = []

    def _kept(self, model: nn.Module, side: int) -> frozenset[str]:
        """Stored keys kept in the checkpoint's dtype in the half-precision pass: a weight every reader of which (its
        tied names too) is a torch nn.Embedding, its output cast to the compute dtype (a row read and cast is the
        row of the cast table, bit for bit), or a torch nn.Linear, run on its rows cast a slice at a time, one
        product for the lockstep's calls of it (stream.meeting). A block's linear weights then cost their stored
        bytes in memory, not a float32 copy beside them (OPT-6.7B: 0.40 GB a block, not 1.2 GB), and neither do the
        embeddings and heads."""
        if self.compute is None:
            return frozenset()
        ckpt = self.ckpt if side == 0 else self.out_ckpt
        readers: dict[str, list[nn.Module | None]] = {}
        for slots in self.slots[side]:
            for m, k, name in slots:
                key = stored_key(ckpt, self.aliases[side], name)
                if key is not None:  # another attribute or another class reads it: not kept
                    readers.setdefault(key, []).append(m if k == "weight" and _keeps(m) else None)
        keys = set()
        for key, modules in readers.items():
            if None in modules:
                continue
            keys.add(key)
            for m in {id(m): m for m in modules}.values():
                if type(m) is nn.Embedding:
                    h = m.register_forward_hook(lambda mod, args, y, to=self.compute: y.to(to))
                    self.undo.append(h.remove)
                else:  # an instance attribute over the class's forward, on a model normconv built
                    m.forward = lambda x, m=m, to=self.compute: self.meeting.linear(m, x, to)
                    self.undo.append(lambda m=m: m.__dict__.pop("forward", None))
                    self.linears[side].append(m)
        return frozenset(keys)

    def cast_kept(self) -> bool:
        """Cast the kept weights too from now on (a model that reads one outside its module's forward, as DeBERTa's
        head multiplies by the word embeddings, fails on a stored-dtype weight: it never computes with one silently,
        bf16 -> float32 promotion being exact). False when none was kept."""
        kept = any(self.kept)
        for undo in self.undo:
            undo()
        self.undo, self.kept = [], (frozenset(), frozenset())
        return kept

    def _source(self, held: dict[str, torch.Tensor], name: str) -> torch.Tensor:
        """The original values of the model's tensor ``name``: from ``held`` (its unit's) when there, else read."""
        key = stored_key(self.ckpt, self.aliases[0], name)
        return held[key] if key in held else self.ckpt.get(key)

    def _prepare(self, unit: int) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
        """The unit's tensors read, rewritten and handed to the writer (``_rewrite``). Thread-safe: the loader thread
        runs it a unit ahead."""
        got = self._rewrite(self.units[unit])
        self.reads.drop(upto=unit - 2)  # this read was the last meant for the buffers of unit - 2: what it left goes
        return got

    def _rewrite(self, keys: list[str]) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
        """Read the source tensors ``keys`` once, rewrite them, hand the rewritten ones to the writer: (source
        tensors, rewritten tensors by stored key)."""
        held = {k: self.ckpt.get(k, self.reads.take) for k in keys}
        out: dict[str, torch.Tensor] = {}
        for k in keys:
            for c in self.copies.get(k, []):  # an untied name of the tensor, rewritten as that name is
                out[c] = self.produce(c, held[k], lambda name: self._source(held, name))
            out[k] = self.produce(self.ckpt.name[k], held[k], lambda name: self._source(held, name))
        for k, t in out.items():
            self.writer.write(k, t)
        self.written.update(keys)
        return held, out

    def _fill(self, unit: int, held: dict[str, torch.Tensor], out: dict[str, torch.Tensor]) -> list:
        """Fill both models' slots of the unit (returns what to put back), floating tensors cast to the compute
        dtype (into the dropped block's buffers), embedding and linear weights kept as stored (``_kept``)."""
        self.cast = cast = {}
        self.sources = dict(held) if unit else {}  # a block's, given for reuse when it is dropped
        buffers = self.buffers if unit else None  # the rest stays for the whole pass: no block's buffer for it
        saved = fill(self.slots[0][unit], _Held(self.ckpt.key, held, self.compute, cast, buffers, self.kept[0]),
                     self.aliases[0], self.src)
        saved += fill(self.slots[1][unit], _Held(self.out_ckpt.key, out, self.compute, cast, buffers, self.kept[1]),
                      self.aliases[1], self.src)
        self.buffers.drop()  # what this block did not reuse
        holders: dict = {}  # every kept linear weight loaded now (the rest's and this block's; a tied one is held
        for side, runs in enumerate(self.sides):  # by modules other than its slot's) -> the runs that may call it
            for m in self.linears[side]:
                if m.weight.device.type != "meta" and m.weight.dtype != self.compute:
                    holders.setdefault(weight_key(m.weight), set()).update(runs)
        self.meeting.hold({k: frozenset(v) for k, v in holders.items()})
        return saved

    def run(self, shapes: list[Inputs]) -> list[tuple[Any, Any, list, list]] | None:
        """Both models on every shape in lockstep: per shape (original outputs, rewritten outputs, original block
        outputs, rewritten block outputs); None where the forwards call their blocks differently."""
        n, total = len(shapes), len(self.units) - 1
        self.records = [[] for _ in shapes]
        self.meeting = Meeting(2 * n)  # runs: the original at each shape, then the rewritten model at each
        self.sides = (frozenset(range(n)), frozenset(range(n, 2 * n)))
        block: list = []

        ahead = _Ahead(self._prepare, len(self.units))

        def enter(i: int) -> None:
            phase("read + rewrite + verify + write", i + 1, total, detail="block")
            block[:] = self._fill(i + 1, *ahead.take(i + 1))

        def leave(i: int, outs: list[torch.Tensor]) -> None:
            restore(block)
            block.clear()
            self.buffers.give(self.cast)  # unreferenced now: the next block's casts go into them
            self.reads.give(self.sources, i + 1)  # the block after next is read into them (unit i + 1: block i)
            trim_heap()
            for k in range(n):
                # within the tolerance scaled by the block output's largest value (the stream's scale grows with
                # depth; an element near zero of a large stream carries the rounding of the large terms that
                # summed to it)
                r64 = self.reference(outs[k].double())
                where = shapes[k].describe()
                self.records[k].append((i, compare(r64, outs[n + k].double(), self.atol + self.rtol *
                                                   float(r64.abs().max()), 0.0, label=f"{self.label(i)} ({where})")))

        rest: list = []
        try:
            phase("read + rewrite + verify + write", detail="embeddings, final norm, head (outside the blocks)")
            rest = self._fill(0, *self._prepare(0))
            ahead.start(1)
            results = lockstep([(self.original, s) for s in shapes] + [(self.rewritten, s) for s in shapes],
                               enter, leave, self.meeting)
        finally:
            ahead.close()
            self.meeting = Meeting(0)
            restore(block + rest)
            self.sources = {}
            self.reads.drop()
            trim_heap()
        if results is None:
            return None
        return [(results[k][0], results[n + k][0], results[k][1], results[n + k][1]) for k in range(n)]

    def leftovers(self) -> None:
        """Tensors no forward loaded (a block never called, a key no module holds): read, rewritten, written."""
        for k in [k for keys in self.units for k in keys] + list(self.ckpt.weight_map):
            if k not in self.written:
                self._rewrite([k])

    def where(self, key: str) -> str:
        unit = self.unit_of.get(key)
        return "outside the blocks" if not unit else self.label(unit - 1)


def _verify_and_write(p: _Pass, shapes: list[Inputs], how: str, final: tuple[float | None, float | None]
                      ) -> tuple[list[Validation], list[dict[str, Any]]]:
    """Run the pass (both shapes in lockstep, or one shape at a time where their flows differ) and judge it: the
    final outputs at the tolerances ``final`` (None, None: by each output's scale, as the in-memory commands)."""
    try:
        runs = p.run(shapes)
    except NormconvError:  # normconv's own refusal (a tensor missing): no table is the cause
        raise
    except Exception:  # noqa: BLE001 - retried once with every table cast where a kept one may be the cause
        if not p.cast_kept():
            raise
        runs = p.run(shapes)  # the writes of the first try stand: the same bytes at the same offsets
    if runs is None:  # the shapes make the model call its blocks differently: one shape at a time
        runs, records = [], []
        for s in shapes:
            one = p.run([s])
            if one is None:
                raise VerificationError("the rewritten model calls its blocks differently from the original; "
                                        "nothing written")
            runs += one
            records += p.records
        p.records = records
    validations, blocks = [], []
    for k, (inputs, (ref, new, ref_blocks, new_blocks), records) in enumerate(zip(shapes, runs, p.records)):
        where = inputs.describe()
        for i, v in records:
            blocks.append({"block": i, "inputs": where, "max_abs_error": v.max_abs_error, "passed": v.passed})
            if not v.passed:
                validations.append(v)
        # final outputs: the logits (a second shape too, where the model's sequence length is free)
        validations.append(compare(ref, new, *final, label=(
            f"torch, streamed, final outputs{how}" if k == 0 else f"torch, streamed, second shape ({where}){how}")))
        if len(ref_blocks) != len(new_blocks) or not ref_blocks:
            validations.append(compare(None, None, label=f"blocks ({where})"))  # nothing compared: not a pass
    return validations, blocks


def write_verified(src: Path, out: Path, ckpt: Checkpoint, cls, config, dtype: torch.dtype, report: Report,
                   produce: Produce, copies: dict[str, list[str]], untied: bool,
                   reference: Callable[[torch.Tensor], torch.Tensor], atol: float | None, rtol: float | None,
                   keep_temp_on_failure: bool = False, after_rewrite: Callable[[Path], None] | None = None,
                   dtypes: dict[str, torch.dtype] | None = None) -> None:
    """The module docstring's pass: every source tensor (stored key) written as ``produce`` returns it, after the
    names in ``copies[key]`` (untied names of its tensor, each as ``produce`` returns it for that name: a centered
    embedding or the original values; ``untied``: config.json unties the embeddings);
    every block output compared with ``reference(original block output)``; ``dtypes[key]`` (an output key): a rewritten
    tensor written in another dtype than it is stored in (swap: a centered writer stored narrower than the model's dtype).
    ``after_rewrite(temp folder)`` runs
    once everything is written, before the checksums are read back (tests corrupt the output there)."""
    remove_stale_temps(out)
    tmp: Path | None = None
    writer: PositionedWriter | None = None
    try:
        with signals_held():  # an interrupt waits until the temp folder exists and is known to the cleanup below
            tmp = Path(temp_file(out, folder=True))
        layout = plan_layout(ckpt, copies, dtypes)  # dtypes: rewritten tensors written in another dtype
        ckpt.uncached = ckpt.larger_than_memory()  # read once: its pages would only be reclaimed inside the pass
        writer = PositionedWriter(tmp, layout, early=after_rewrite is None)  # a test's edit comes before any check
        copy_folder(src, tmp, ckpt, layout.weight_map, untied, report.notes, cls)
        others = digests(tmp, set(layout.shards))
        # a half-precision checkpoint runs in float32 (its tensors cast as they are loaded), at its own dtype's
        # tolerance: the check then sees what the rewrite wrote (bf16-rounded centered weights), not bf16
        # arithmetic drifting apart over the blocks (0.083 at block 1 of a 1.3B OPT in bf16 compute)
        compute = torch.float32 if dtype in (torch.float16, torch.bfloat16) else dtype
        original = build_on_meta(cls, config, compute)
        rewritten = build_on_meta(cls, model_class(tmp)[1], compute)  # from the config.json written
        shapes = [hf_example_inputs(original), hf_example_inputs(original, 1, HF_SEQ_LEN - 1)]
        d_atol, d_rtol = default_tolerance(dtype)
        p = _Pass(src, ckpt.rename_for(original), Checkpoint(tmp).rename_for(rewritten), original, rewritten,
                  produce, copies, writer, compute, reference, d_atol if atol is None else atol,
                  d_rtol if rtol is None else rtol)
        how = "" if compute == dtype else f", {str(dtype).removeprefix('torch.')} weights computed in float32"
        # the final outputs as the in-memory commands judge them: by each output's scale where the dtype has a bound
        # (float32: a float16 tensor rounded into the rewrite shows there), element-wise at the dtype's tolerance
        # for half precision
        by_scale = atol is None and rtol is None and scale_tolerance(dtype) is not None
        final = (None, None) if by_scale else (p.atol, p.rtol)
        report.validation, report.extra["blocks"] = _verify_and_write(p, shapes, how, final)
        failed = next((v for v in report.validation if not v.passed), None)
        if failed is not None:
            raise VerificationError(
                f"{report.command} --stream: {failed.label}: max abs error {failed.max_abs_error:.3g} (atol "
                f"{failed.atol:g}, rtol {failed.rtol:g}); nothing written", report)
        p.leftovers()
        phase("fsync + read back checksums")
        writer.finish()
        if after_rewrite is not None:
            after_rewrite(tmp)
        odd = writer.check()
        if odd is not None:
            shard, what = odd  # a tensor: where it belongs, as a failed comparison names its block
            where, what = (p.where(what), what) if what in layout.at else ("the written shards", f"{shard}'s {what}")
            report.validation.append(compare(None, None, label=f"checksums ({shard})"))
            raise VerificationError(f"{report.command} --stream: {where}: {what} in {tmp.name}/{shard} read back "
                                    f"differs from what was verified in memory (CRC-32); nothing written", report)
        name = changed(tmp, others, set(layout.shards))
        if name is not None:
            report.validation.append(compare(None, None, label=f"checksums ({name})"))
            raise VerificationError(f"{report.command} --stream: {tmp.name}/{name} changed after it was written; "
                                    f"nothing written", report)
        with signals_held():
            replace(tmp, out)  # over an existing folder only with --overwrite (checked first): exchanged
            tmp = None
    except OSError as exc:
        raise write_error(out, exc) from None
    finally:  # every exit path, interrupts included: no folder under OUT, no temp beside it
        if writer is not None:
            writer.close()
        if not keep_temp_on_failure:
            remove_temp(tmp)
    report.output = str(out)
