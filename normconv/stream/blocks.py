"""A model too large to hold, run block by block: built from its config with its parameters on the meta device
(``build_on_meta``), each block loaded from the checkpoint just before it runs and dropped after it (``OnDemand``),
and ``write_verified``: the rewritten shards written into a temp folder, both folders run on the example inputs and
a second shape, every block's output compared, the temp folder renamed into place only if all of it passed.

Peak memory while verifying: one block plus the embeddings and head. Imports stream.checkpoint and io (no graph,
no passes: it runs models, it does not analyze them).
"""

from __future__ import annotations

import contextlib
import os
import threading
from pathlib import Path
from typing import Any, Callable, Iterator

import torch
import torch.nn as nn

from normconv.quiet import phase
from normconv.errors import NormconvError, VerificationError
from normconv.io.hf_inputs import hf_example_inputs
from normconv.io.inputs import HF_SEQ_LEN
from normconv.io.write import remove_stale_temps, remove_temp, replace, signals_held, temp_file, write_error
from normconv.report import Report, Validation
from normconv.stream.checkpoint import Checkpoint, copy_folder, model_class, stored_key, tied_names
from normconv.verify import Inputs, compare, default_tolerance

# ---------------------------------------------------------------------------------------------------------
# models whose parameters live on the meta device


@contextlib.contextmanager
def _parameters_on_meta() -> Iterator[None]:
    """Modules built inside get meta parameters and real buffers (rotary frequencies, masks: computed, not read)."""
    register = nn.Module.register_parameter

    def on_meta(self, name, param):
        if param is not None and param.device.type != "meta":  # a meta one is kept as is: ties stay ties
            param = nn.Parameter(param.to("meta"), requires_grad=False)
        register(self, name, param)

    nn.Module.register_parameter = on_meta
    try:
        yield
    finally:
        nn.Module.register_parameter = register


def build_on_meta(cls, config, dtype: torch.dtype) -> nn.Module:
    """``cls`` from ``config`` with its parameters on the meta device and its buffers computed (a model all on
    meta fails where code reads a buffer's values, e.g. BERT's aten.equal on token_type_ids)."""
    import transformers

    hf_logging = transformers.utils.logging
    verbosity = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()
    old = torch.get_default_dtype()
    torch.set_default_dtype(dtype if dtype.is_floating_point else old)
    try:
        with _parameters_on_meta():
            model = cls._from_config(config) if hasattr(cls, "_from_config") else cls.from_config(config)
    finally:
        torch.set_default_dtype(old)
        hf_logging.set_verbosity(verbosity)
    return model.eval()


# ---------------------------------------------------------------------------------------------------------
# verify block by block


def _blocks(model: nn.Module) -> tuple[str, nn.ModuleList]:
    """The repeated blocks: the longest nn.ModuleList."""
    lists = [(n, m) for n, m in model.named_modules() if isinstance(m, nn.ModuleList)]
    if not lists:
        raise NormconvError(f"{type(model).__name__} has no nn.ModuleList of blocks to verify one at a time")
    return max(lists, key=lambda nm: len(nm[1]))


def tensor_slots(module: nn.Module, prefix: str = "",
                 skip: set[int] = frozenset()) -> list[tuple[nn.Module, str, str]]:
    """(owner, attribute, state_dict name) of every parameter and stored buffer under ``module``, but not under
    the modules in ``skip`` (by id)."""
    out = []
    for path, m in module.named_modules(prefix=prefix, remove_duplicate=False):
        if id(m) in skip:
            continue
        for k, p in m._parameters.items():
            if p is not None:
                out.append((m, k, f"{path}.{k}" if path else k))
        for k, b in m._buffers.items():
            if b is not None and k not in m._non_persistent_buffers_set:
                out.append((m, k, f"{path}.{k}" if path else k))
    return out


def _trim_heap() -> None:
    """Give freed heap pages back to the OS (glibc's malloc_trim): each verification thread allocates in its own
    malloc arena, which otherwise keeps a dropped block's pages resident."""
    try:
        import ctypes

        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):  # not glibc: nothing to do
        pass


def fill(slots: list[tuple[nn.Module, str, str]], ckpt: Checkpoint, aliases: dict[str, list[str]], folder: Path,
         compute: torch.dtype | None = None) -> list:
    """Load the (owner, attribute, name) ``slots`` of a meta-parameter model from the checkpoint (floating tensors
    cast to ``compute``); returns what to put back. A buffer the checkpoint does not store keeps its value."""
    saved = []
    for m, k, name in slots:
        stored = stored_key(ckpt, aliases, name)
        is_param = k in m._parameters
        if stored is None:
            if is_param:
                raise NormconvError(f"{folder}: the checkpoint has no tensor {name}")
            continue  # a buffer the checkpoint does not store keeps the value the model computed
        table = m._parameters if is_param else m._buffers
        saved.append((table, k, table[k]))
        t = ckpt.get(stored)
        if compute is not None and t.is_floating_point():
            t = t.to(compute)
        table[k] = nn.Parameter(t, requires_grad=False) if is_param else t
    return saved


class OnDemand:
    """Parameters (and stored buffers) of a meta-parameter model loaded from a checkpoint when needed: each block
    just before it runs (dropped after it), everything else for the whole forward. Records each block's output."""

    def __init__(self, model: nn.Module, ckpt: Checkpoint, folder: Path, compute: torch.dtype | None = None,
                 label: str = "blocks"):
        self.model, self.ckpt, self.folder, self.compute, self.label = model, ckpt, folder, compute, label
        self.aliases = tied_names(model)
        prefix, blocks = _blocks(model)
        self._saved: list = []
        self.blocks = len(blocks)
        self.rest = tensor_slots(model, skip={id(m) for b in blocks for m in b.modules()})
        self.block_slots = [(block, tensor_slots(block, f"{prefix}.{i}")) for i, block in enumerate(blocks)]

    def _fill(self, slots) -> list:
        """Load ``slots`` from the checkpoint; returns what to put back."""
        return fill(slots, self.ckpt, self.aliases, self.folder, self.compute)

    @staticmethod
    def _restore(saved: list) -> None:
        for table, k, old in reversed(saved):
            table[k] = old  # back to meta: the loaded tensor is freed

    def run(self, inputs: Inputs) -> tuple[Any, list[torch.Tensor]]:
        """The model's outputs on ``inputs`` and each block's output, in call order."""
        return self.run_many([inputs])[0]

    def run_many(self, shapes: list[Inputs]) -> list[tuple[Any, list[torch.Tensor]]]:
        """``run`` for several inputs at once, in lockstep: one thread per input, meeting at every block, so each
        block is read from the checkpoint once for all of them (verification at two shapes read it twice)."""
        # the timeout only backs up the check below (a forward that ends just as another starts waiting)
        barrier = threading.Barrier(len(shapes), timeout=_LOCKSTEP_TIMEOUT_S)
        finished = threading.Event()
        mine = threading.local()
        results: list[Any] = [None] * len(shapes)
        errors: list[BaseException | None] = [None] * len(shapes)

        def meet() -> int:
            if finished.is_set():  # another forward is over while this one still calls blocks: their flows differ
                raise threading.BrokenBarrierError
            return barrier.wait()

        def before(i, slots):
            if meet() == 0:  # one thread loads the block for all
                phase("verify", i + 1, self.blocks, detail=f"read + run {self.label}, block")
                self._saved = self._fill(slots)
            meet()

        def after(out):
            first = out[0] if isinstance(out, (tuple, list)) else out
            mine.outputs.append(first.detach())
            if meet() == 0:  # every thread is done with the block: one drops it
                self._restore(self._saved)
                self._saved = []
                _trim_heap()
            barrier.wait()  # the last meeting of a block: the others may be over once it releases

        def work(k: int) -> None:
            mine.outputs = []
            try:
                with torch.no_grad():  # grad mode is per thread
                    results[k] = (self.model(*shapes[k].args, **shapes[k].kwargs), mine.outputs)
            except BaseException as exc:  # noqa: BLE001 - handed to the caller below
                errors[k] = exc
            finally:
                finished.set()
                # a thread waiting now would wait forever (its forward calls a block this one did not, or this one
                # failed); one still leaving the last meeting is not waiting, and an abort would break it there
                if errors[k] is not None or barrier.n_waiting:
                    barrier.abort()

        hooks = []
        for i, (block, slots) in enumerate(self.block_slots):  # hooks for these forwards only (several shapes)
            hooks.append(block.register_forward_pre_hook(lambda m, a, i=i, slots=slots: before(i, slots)))
            hooks.append(block.register_forward_hook(lambda m, a, out: after(out)))
        saved = []
        try:
            saved = self._fill(self.rest)
            threads = [threading.Thread(target=work, args=(k,), name=f"normconv-verify-{k}")
                       for k in range(len(shapes))]
            for t in threads:
                t.start()
            for t in threads:
                t.join()
        finally:
            for h in hooks:
                h.remove()
            self._restore(self._saved + saved)
            self._saved = []
        real = [e for e in errors if e is not None and not isinstance(e, threading.BrokenBarrierError)]
        if real:
            raise real[0]
        if any(e is not None for e in errors):  # the inputs made the model call its blocks differently: one by one
            return [self.run(inputs) for inputs in shapes]
        return results


_LOCKSTEP_TIMEOUT_S = 600.0  # a block meeting waits this long at most, then the shapes run one by one


def _verify(src: Path, tmp: Path, cls, config, dtype: torch.dtype, atol: float | None, rtol: float | None,
            out_config, reference: Callable[[torch.Tensor], torch.Tensor]) -> tuple[list[Validation],
                                                                                    list[dict[str, Any]]]:
    """Per-block and final comparisons of the original and rewritten folders, at two input shapes: each rewritten
    block's output against ``reference(the original block's output)`` (float64).

    A half-precision checkpoint runs in float32 (its tensors cast as they are loaded), at its own dtype's
    tolerance: the check then sees what the rewrite wrote (bf16-rounded centered weights), not bf16 arithmetic
    drifting apart over the blocks (0.083 at block 1 of a 1.3B OPT in bf16 compute)."""
    compute = torch.float32 if dtype in (torch.float16, torch.bfloat16) else dtype
    original = build_on_meta(cls, config, compute)
    rewritten = build_on_meta(cls, out_config, compute)
    shapes = [hf_example_inputs(original), hf_example_inputs(original, 1, HF_SEQ_LEN - 1)]
    d_atol, d_rtol = default_tolerance(dtype)
    atol, rtol = (d_atol if atol is None else atol), (d_rtol if rtol is None else rtol)
    how = "" if compute == dtype else f", {str(dtype).removeprefix('torch.')} weights computed in float32"
    validations, blocks = [], []
    refs = OnDemand(original, Checkpoint(src).rename_for(original), src, compute, "original").run_many(shapes)
    news = OnDemand(rewritten, Checkpoint(tmp).rename_for(rewritten), tmp, compute, "rewritten").run_many(shapes)
    for k, (inputs, (ref, ref_blocks), (new, new_blocks)) in enumerate(zip(shapes, refs, news)):
        where = inputs.describe()
        for i, (r, c) in enumerate(zip(ref_blocks, new_blocks)):
            # within the tolerance scaled by the block output's largest value (the stream's scale grows with
            # depth; an element near zero of a large stream carries the rounding of the large terms that summed
            # to it)
            r64 = reference(r.double())
            v = compare(r64, c.double(), atol + rtol * float(r64.abs().max()), 0.0, label=f"block {i} ({where})")
            blocks.append({"block": i, "inputs": where, "max_abs_error": v.max_abs_error, "passed": v.passed})
            if not v.passed:
                validations.append(v)
        # final outputs: the logits (a second shape too, where the model's sequence length is free)
        validations.append(compare(ref, new, atol, rtol, label=(f"torch, streamed, final outputs{how}" if k == 0 else
                                                                f"torch, streamed, second shape ({where}){how}")))
        if len(ref_blocks) != len(new_blocks) or not ref_blocks:
            validations.append(compare(None, None, label=f"blocks ({where})"))  # nothing compared: not a pass
    return validations, blocks


def write_verified(src: Path, out: Path, ckpt: Checkpoint, cls, config, dtype: torch.dtype, report: Report,
                   write: Callable[[Path], tuple[dict[str, str], bool]],
                   reference: Callable[[torch.Tensor], torch.Tensor], atol: float | None, rtol: float | None,
                   keep_temp_on_failure: bool = False, after_rewrite: Callable[[Path], None] | None = None) -> None:
    """``write(temp folder)`` the rewritten shards (returns the weight map and whether it untied a weight), copy
    the folder's other files, verify block by block against ``reference(original block output)``, and only then
    rename the temp folder to ``out``; on any failure nothing is left under ``out`` or beside it."""
    remove_stale_temps(out)
    tmp: Path | None = None
    try:
        with signals_held():  # an interrupt waits until the temp folder exists and is known to the cleanup below
            tmp = Path(temp_file(out, folder=True))
        weight_map, untied = write(tmp)
        copy_folder(src, tmp, ckpt, weight_map, untied, report.notes)
        if after_rewrite is not None:
            after_rewrite(tmp)
        out_config = model_class(tmp)[1]
        report.validation, report.extra["blocks"] = _verify(src, tmp, cls, config, dtype, atol, rtol, out_config,
                                                            reference)
        failed = next((v for v in report.validation if not v.passed), None)
        if failed is not None:
            raise VerificationError(
                f"{report.command} --stream: {failed.label}: max abs error {failed.max_abs_error:.3g} (atol "
                f"{failed.atol:g}, rtol {failed.rtol:g}); nothing written", report)
        with signals_held():
            replace(tmp, out)  # over an existing folder only with --overwrite (checked first): exchanged
            tmp = None
    except OSError as exc:
        raise write_error(out, exc) from None
    finally:  # every exit path, interrupts included: no folder under OUT, no temp beside it
        if not keep_temp_on_failure:
            remove_temp(tmp)
    report.output = str(out)

