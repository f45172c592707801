"""A model too large to hold, run block by block: built from its config with its parameters on the meta device
(``build_on_meta``), its blocks (the longest ``nn.ModuleList``, ``block_list``) filled from tensors just before
they run and put back on meta after (``fill`` / ``restore``), several forwards meeting at every block in threads
(``lockstep``: both input shapes, the original and the rewritten model, run through each block while it is
loaded once; stream.onepass drives them). An encoder-decoder's blocks are both stacks' (``blocks``).

Peak memory: one block plus the embeddings and head. Imports stream.checkpoint and io.load's ``hf_building`` (no
graph, no passes: it runs models, it does not analyze them).
"""

from __future__ import annotations

import contextlib
import ctypes
import threading
from pathlib import Path
from typing import Any, Callable, Iterator

import torch
import torch.nn as nn

from normconv.errors import Code, NormconvError
from normconv.io.load import hf_building
from normconv.libc import c_function
from normconv.stream.checkpoint import Checkpoint, stored_key
from normconv.verify import Inputs

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
    try:  # what transformers refuses to build from the config: one line, as the in-memory load says it
        with _parameters_on_meta(), hf_building(getattr(config, "_name_or_path", "") or cls.__name__):
            model = cls._from_config(config) if hasattr(cls, "_from_config") else cls.from_config(config)
    finally:
        torch.set_default_dtype(old)
        hf_logging.set_verbosity(verbosity)
    return model.eval()


# ---------------------------------------------------------------------------------------------------------
# verify block by block


def block_list(model: nn.Module) -> tuple[str, nn.ModuleList]:
    """The repeated blocks: the longest nn.ModuleList."""
    lists = [(n, m) for n, m in model.named_modules() if isinstance(m, nn.ModuleList)]
    if not lists:
        raise NormconvError(f"{type(model).__name__} has no nn.ModuleList of blocks to verify one at a time",
                            Code.REFUSED, hint="without --stream the command holds the model whole in memory and "
                                               "takes it")
    return max(lists, key=lambda nm: len(nm[1]))


def blocks(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """(path, block) of every block verified one at a time, in the order a forward calls them: an encoder-decoder's
    encoder blocks then its decoder blocks (each stack's longest nn.ModuleList: the decoder's blocks are checked too,
    not held whole with the embeddings), else the longest nn.ModuleList's."""
    stacks = [model]
    if getattr(getattr(model, "config", None), "is_encoder_decoder", False):
        parts = [getattr(model, f"get_{side}", lambda: None)() for side in ("encoder", "decoder")]
        if all(isinstance(p, nn.Module) for p in parts) and parts[0] is not parts[1]:
            stacks = parts
    path = {id(m): n for n, m in model.named_modules()}
    out = []
    for stack in stacks:
        prefix, found = block_list(stack)
        base = path[id(found)] if id(found) in path else prefix
        out += [(f"{base}.{i}", b) for i, b in enumerate(found)]
    return out


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


def trim_heap() -> None:
    """Give freed heap pages back to the OS (glibc's malloc_trim): each verification thread allocates in its own
    malloc arena, which otherwise keeps a dropped block's pages resident."""
    malloc_trim = c_function("malloc_trim", (ctypes.c_size_t,), ctypes.c_int)
    if malloc_trim is not None:  # glibc only: elsewhere nothing to do
        malloc_trim(0)


def fill(slots: list[tuple[nn.Module, str, str]], ckpt: Checkpoint, aliases: dict[str, list[str]], folder: Path,
         compute: torch.dtype | None = None) -> list:
    """Load the (owner, attribute, name) ``slots`` of a meta-parameter model from the checkpoint (floating tensors
    cast to ``compute``, integer ones in a floating slot to the slot's dtype); returns what to put back. A buffer the checkpoint does not store keeps its value.
    ``ckpt`` is anything with a ``key`` map (model name -> stored key) and ``get(key)``: tensors held in memory too."""
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
        elif table[k].is_floating_point() and not t.is_floating_point():
            t = t.to(table[k].dtype)  # an integer tensor in a floating slot: cast, as from_pretrained loads it
        table[k] = nn.Parameter(t, requires_grad=False) if is_param else t
    return saved


def restore(saved: list) -> None:
    """Put back what ``fill`` replaced (the loaded tensors are freed)."""
    for table, k, old in reversed(saved):
        table[k] = old


def lockstep(runs: list[tuple[nn.Module, Inputs]], enter: Callable[[int], None],
             leave: Callable[[int, list[torch.Tensor]], None],
             waits: Any = None) -> list[tuple[Any, list[torch.Tensor]]] | None:
    """The forwards ``model(inputs)`` of ``runs`` in lockstep, one thread each, meeting at every block of each
    model's longest ModuleList: before block i, one thread calls ``enter(i)`` (load it) while the others wait;
    after it, one calls ``leave(i, [each run's block output, in the order of runs])`` (compare, drop it). Returns
    each run's (outputs, block outputs in call order), or None where the runs call their blocks differently (a
    thread meets the others at a block they do not call). An exception in a forward, enter or leave is raised.
    ``waits`` (stream.meeting.Meeting) hears each run's thread start, wait at a meeting (``pause``), the meeting
    let them all go (``release``, before any runs), each go on (``resume``), and each end (``done``)."""
    # the timeout only backs up the check below (a forward that ends just as another starts waiting)
    barrier = threading.Barrier(len(runs), action=None if waits is None else waits.release,
                                timeout=_LOCKSTEP_TIMEOUT_S)
    finished = threading.Event()
    mine = threading.local()
    last: list[Any] = [None] * len(runs)
    results: list[Any] = [None] * len(runs)
    errors: list[BaseException | None] = [None] * len(runs)

    def wait() -> int:
        if waits is None:
            return barrier.wait()
        waits.pause(mine.k)
        try:
            return barrier.wait()
        finally:
            waits.resume(mine.k)

    def meet() -> int:
        if finished.is_set():  # another forward is over while this one still calls blocks: their flows differ
            raise threading.BrokenBarrierError
        return wait()

    def before(i):
        if meet() == 0:  # one thread loads the block for all
            enter(i)
        meet()

    def after(i, out):
        first = out[0] if isinstance(out, (tuple, list)) else out
        mine.outputs.append(first.detach())
        last[mine.k] = first.detach()
        if meet() == 0:  # every thread is done with the block: one hands it over
            outs = list(last)
            last[:] = [None] * len(runs)
            leave(i, outs)
        wait()  # the last meeting of a block: the others may be over once it releases

    def work(k: int) -> None:
        mine.outputs, mine.k = [], k
        model, inputs = runs[k]
        if waits is not None:
            waits.start(k)
        try:
            with torch.no_grad():  # grad mode is per thread
                results[k] = (model(*inputs.args, **inputs.kwargs), mine.outputs)
        except BaseException as exc:  # noqa: BLE001 - handed to the caller below
            errors[k] = exc
        finally:
            if waits is not None:
                waits.done(k)
            finished.set()
            # a thread waiting now would wait forever (its forward calls a block this one did not, or this one
            # failed); one still leaving the last meeting is not waiting, and an abort would break it there
            if errors[k] is not None or barrier.n_waiting:
                barrier.abort()

    hooks = []
    for model in {id(m): m for m, _ in runs}.values():  # hooks for these forwards only
        for i, (_, block) in enumerate(blocks(model)):
            hooks.append(block.register_forward_pre_hook(lambda m, a, i=i: before(i)))
            hooks.append(block.register_forward_hook(lambda m, a, out, i=i: after(i, out)))
    threads_before = torch.get_num_threads()
    try:
        # the cores shared among the forwards: each one's products on cores // runs threads (OPT-6.7B's 32 blocks on
        # 2 cores: 31.3 s, against 36.3 s with every forward's products asking for both cores)
        torch.set_num_threads(max(1, threads_before // len(runs)))
        threads = [threading.Thread(target=work, args=(k,), name=f"normconv-verify-{k}") for k in range(len(runs))]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    finally:
        torch.set_num_threads(threads_before)
        for h in hooks:
            h.remove()
    real = [e for e in errors if e is not None and not isinstance(e, threading.BrokenBarrierError)]
    if real:
        raise real[0]
    if any(e is not None for e in errors):
        return None
    return results


_LOCKSTEP_TIMEOUT_S = 600.0  # a block meeting waits this long at most, then the shapes run one by one
