"""``swap --stream``: a Hugging Face checkpoint through the exact LayerNorm -> RMSNorm swap, never holding the model.

  plan     the model built from config.json on the meta device, captured with torch.export (shapes only) and planned
           by swap_norm.analyze / swap_norm.edits, which read the few values they need (the norms' biases) from the
           shards: the writers to center (name, axis), the norm biases to fold into which consumer biases, the ties
  rewrite  tensor by tensor, shard by shard, with the swap's own functions (center_, bias_delta, add_: float64 a
           slice at a time); each output shard is written a tensor at a time behind a header computed up front
  verify   the original and the rewritten folder run on the example inputs (and a second shape) in models whose
           parameters live on the meta device: each block of the longest ModuleList is loaded from the shards just
           before it runs and dropped after it, the rest (embeddings, final norm, head) for the forward; every
           block's output and the final outputs are compared
  write    everything under a temp folder next to OUT, renamed into place only after every check passed

The reading, writing and block-by-block verification here are shared with ``fold --stream`` (streamed_fold.py).

Peak memory: the largest tensor (twice, in float64 slices at most 32 MB) while rewriting; one block plus the
embeddings and head while verifying. The output is the same architecture with rewritten weights: every LayerNorm
now reads a zero-mean stream, so it equals RMSNorm(weight, eps) (+ its bias where that could not be folded).
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import struct
import tempfile
import threading
from pathlib import Path
from typing import Any, Callable, Iterator

import torch
import torch.nn as nn

from normconv.errors import NormconvError, VerificationError
from normconv.graph.capture import capture
from normconv.graph.detect import find_norms
from normconv.hf_inputs import hf_example_inputs
from normconv.io import (HF_SEQ_LEN, TEMP_SUFFIX, check_writable, remote_code, remove_stale_temps, temp_name,
                         write_error)
from normconv.passes import swap_norm
from normconv.report import Report, Validation
from normconv.verify import Inputs, compare, default_tolerance

INDEX = "model.safetensors.index.json"
SINGLE = "model.safetensors"
# weight files of other formats are not copied: they would hold the original weights under the rewritten config
_OTHER_WEIGHTS = (".bin", ".pt", ".pth", ".ckpt", ".h5", ".msgpack", ".safetensors", ".gguf")

_DTYPES = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
           "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
           "BOOL": torch.bool, "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2}
_CODES = {v: k for k, v in _DTYPES.items()}


# ---------------------------------------------------------------------------------------------------------
# reading and writing safetensors a tensor at a time


def _header(path: Path) -> dict[str, Any]:
    """A safetensors file's header: {name: {dtype, shape, data_offsets}, "__metadata__": {...}}, plus
    "__start__": where its data begins."""
    with open(path, "rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(n))
    header["__start__"] = 8 + n
    return header


def _entries(header: dict[str, Any]) -> list[str]:
    return [k for k in header if k not in ("__metadata__", "__start__")]


class Checkpoint:
    """The tensors of a Hugging Face folder's safetensors shards, read one at a time (never all at once).

    Each tensor is read into a buffer of its own: ``safe_open(...).get_tensor`` returns tensors backed by the file's
    mapping, cached per handle (an edit in place shows in the next read of the same name: a norm bias zeroed before
    its consumer's bias was computed read back as zeros), and every mapped page it touched counts in the RSS."""

    def __init__(self, folder: Path):
        self.folder = folder
        if (folder / INDEX).exists():
            index = json.loads((folder / INDEX).read_text())
            self.index_metadata = index.get("metadata", {})
            self.weight_map: dict[str, str] = index["weight_map"]
        elif (folder / SINGLE).exists():
            self.index_metadata = None
            self.weight_map = {k: SINGLE for k in _entries(_header(folder / SINGLE))}
        else:
            raise NormconvError(f"{folder} has no safetensors weights ({SINGLE} or {INDEX}): --stream reads "
                                f"safetensors checkpoints only")
        self.shards: dict[str, dict[str, Any]] = {}  # shard -> header, in the index's order
        for shard in dict.fromkeys(self.weight_map.values()):
            if not (folder / shard).exists():
                raise NormconvError(f"{folder}/{INDEX} names {shard}, which is missing")
            self.shards[shard] = _header(folder / shard)
        self.key = {k: k for k in self.weight_map}  # model's state_dict name -> checkpoint key
        self.name = dict(self.key)  # checkpoint key -> model's state_dict name

    def rename_for(self, model: nn.Module) -> "Checkpoint":
        """Map checkpoint keys to ``model``'s names as from_pretrained does (transformers renames some on load:
        GPT-NeoX's embed_out -> lm_head, old LayerNorm gamma / beta -> weight / bias). A key transformers converts
        (merges, splits, permutes) is refused: its tensor is not the model's tensor."""
        try:
            from transformers.conversion_mapping import get_model_conversion_mapping
            from transformers.core_model_loading import WeightRenaming, rename_source_key
        except ImportError:  # a transformers without conversion mappings loads keys as they are
            return self
        transforms = get_model_conversion_mapping(model)
        renamings = [t for t in transforms if isinstance(t, WeightRenaming)]
        converters = [t for t in transforms if not isinstance(t, WeightRenaming)]
        meta = dict.fromkeys(model.state_dict())
        for k in self.weight_map:
            name, converted = rename_source_key(k, renamings, converters, getattr(model, "base_model_prefix", None),
                                                meta)
            if converted is not None:
                raise NormconvError(f"{self.folder}: transformers converts checkpoint tensor {k} on load "
                                    f"({converted}); --stream rewrites checkpoints whose tensors are the model's own")
            self.key[name], self.name[k] = k, name
        return self

    def names(self, shard: str) -> list[str]:
        """The shard's tensors in file order."""
        h = self.shards[shard]
        return sorted(_entries(h), key=lambda k: h[k]["data_offsets"][0])

    def get(self, name: str) -> torch.Tensor:
        """One tensor, read from its shard into a new buffer (positioned read, no mapping)."""
        shard = self.weight_map[name]
        h = self.shards[shard]
        e = h[name]
        t = torch.empty(e["shape"], dtype=_DTYPES[e["dtype"]])
        start, end = e["data_offsets"]
        if end > start:
            buf = memoryview(t.reshape(-1).view(torch.uint8).numpy())
            with open(self.folder / shard, "rb") as f:
                f.seek(h["__start__"] + start)
                if f.readinto(buf) != end - start or buf.nbytes != end - start:
                    raise NormconvError(f"{self.folder / shard}: tensor {name} is truncated")
        return t


class ShardWriter:
    """A safetensors file written a tensor at a time: the header (names, dtypes, shapes, offsets) first."""

    def __init__(self, path: Path, entries: list[tuple[str, torch.dtype, tuple[int, ...]]], metadata: dict | None):
        header: dict[str, Any] = {"__metadata__": metadata} if metadata else {}
        offset = 0
        for name, dtype, shape in entries:
            size = torch.Size(shape).numel() * torch.empty((), dtype=dtype).element_size()
            header[name] = {"dtype": _CODES[dtype], "shape": list(shape), "data_offsets": [offset, offset + size]}
            offset += size
        raw = json.dumps(header, separators=(",", ":")).encode()
        raw += b" " * (-len(raw) % 8)  # the format aligns the data to 8 bytes
        self.expected = [(n, d, tuple(s)) for n, d, s in entries]
        self.size = offset
        self.f = open(path, "wb")
        self.f.write(struct.pack("<Q", len(raw)) + raw)

    def write(self, name: str, t: torch.Tensor) -> None:
        n, dtype, shape = self.expected.pop(0)
        if (name, t.dtype, tuple(t.shape)) != (n, dtype, shape):
            raise RuntimeError(f"shard writer expected {n} {dtype} {shape}, got {name} {t.dtype} {tuple(t.shape)}")
        self.f.write(memoryview(t.contiguous().reshape(-1).view(torch.uint8).numpy()))  # 0-dim tensors too

    def check(self) -> None:
        if self.expected:
            raise RuntimeError(f"shard writer closed with {len(self.expected)} tensors unwritten")


# ---------------------------------------------------------------------------------------------------------
# models whose parameters live on the meta device


def _model_class(folder: Path):
    import transformers

    config = transformers.AutoConfig.from_pretrained(str(folder), local_files_only=True, trust_remote_code=False)
    archs = getattr(config, "architectures", None) or []
    cls = next((getattr(transformers, a) for a in archs if hasattr(transformers, a)), None)
    if hasattr(config, "use_cache"):
        config.use_cache = False  # torch.export cannot capture a KV cache object
    return (cls or transformers.AutoModel), config


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


def _build(cls, config, dtype: torch.dtype) -> nn.Module:
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


def _float_dtype(ckpt: Checkpoint) -> torch.dtype:
    """The dtype most of the checkpoint's floating tensors have (the model is built in it)."""
    count: dict[torch.dtype, int] = {}
    for h in ckpt.shards.values():
        for k in _entries(h):
            v = h[k]
            if _DTYPES[v["dtype"]].is_floating_point:
                count[_DTYPES[v["dtype"]]] = count.get(_DTYPES[v["dtype"]], 0) + torch.Size(v["shape"]).numel()
    return max(count, key=count.get) if count else torch.float32


def _aliases(model: nn.Module) -> dict[str, list[str]]:
    """state_dict name -> every name of the same tensor (tied weights), the name itself first."""
    by_id: dict[int, list[str]] = {}
    for n, t in list(model.named_parameters(remove_duplicate=False)) + list(model.named_buffers(remove_duplicate=False)):
        by_id.setdefault(id(t), []).append(n)
    return {n: [n] + [m for m in names if m != n] for names in by_id.values() for n in names}


def _stored(ckpt: Checkpoint, aliases: dict[str, list[str]], name: str) -> str | None:
    """The checkpoint key holding the model's tensor ``name`` (its own, or that of a name it is tied to)."""
    return next((ckpt.key[a] for a in aliases.get(name, [name]) if a in ckpt.key), None)


# ---------------------------------------------------------------------------------------------------------
# plan


def _plan(folder: Path, ckpt: Checkpoint, cls, config, dtype: torch.dtype):
    """(analysis, edits, tied names), or NormconvError with the reason the swap cannot be exact."""
    meta = _build(cls, config, dtype)
    ckpt.rename_for(meta)
    inputs = hf_example_inputs(meta)
    if inputs is None:
        raise NormconvError(f"{folder}: no example inputs from its config (--stream needs a model taking input_ids)")
    cap = capture(meta, inputs, "torch.export")  # the graph needs shapes only: parameters stay on meta
    aliases = _aliases(meta)

    def read(name: str) -> torch.Tensor:
        stored = _stored(ckpt, aliases, name)
        if stored is None:
            raise NormconvError(f"{folder}: the checkpoint has no tensor {name}")
        return ckpt.get(stored)

    a = swap_norm.analyze(cap, find_norms(cap), "rmsnorm", read=read)
    if not a.plans:
        raise NormconvError(f"swap: {type(meta).__name__} has no layernorm to swap to rmsnorm")
    why = swap_norm.refusal(a)
    if why:
        raise NormconvError(f"{why} (--stream rewrites exact swaps only; normconv inspect lists every site)")
    plan = swap_norm.edits(cap, a, read=read)
    # a layer scale folded into its writer edits two tensors at once: not streamed yet (the in-memory swap does it)
    if plan.scales:
        raise NormconvError(f"{folder}: the stream has layer scales ({plan.scales[0].scale}, ...): --stream does not "
                            f"fold them yet; run normconv swap without --stream")
    return a, plan, aliases


# ---------------------------------------------------------------------------------------------------------
# rewrite


def _rewrite(ckpt: Checkpoint, plan: swap_norm.Edits, aliases: dict[str, list[str]], tmp: Path,
             notes: list[str]) -> tuple[dict[str, str], bool, int]:
    """Write every shard of ``ckpt`` into ``tmp`` with the edits applied; returns the new weight map, whether a
    tied tensor was written under a second name (untied), and how many norm biases were folded."""
    fold_into = plan.fold_into()
    # a norm whose bias would need a new bias parameter (a consumer without one) keeps its bias: the architecture
    # is not changed, and LN(x) = RMSNorm(x) * g + b on the zero-mean stream all the same
    kept = {f.norm for f in plan.folds if f.bias is None}
    for norm in sorted(kept):
        notes.append(f"{norm}.bias kept (a linear reading {norm} has no bias parameter to absorb it): that norm is "
                     f"RMSNorm(x) * weight + bias")
    fold_into = {b: [f for f in fs if f.norm not in kept] for b, fs in fold_into.items()}
    zeroed = {f.beta for f in plan.folds if f.norm not in kept}
    # untie: the centered embedding keeps its name; each name tied to it is written with the original values
    copies: dict[str, list[str]] = {}
    for path, weight in plan.untie.items():
        stored = _stored(ckpt, aliases, weight)
        others = [a for a in aliases.get(weight, []) if a != ckpt.name[stored] and a not in ckpt.key]
        copies[stored] = others
        if others:
            notes.append(f"untied {weight} from {', '.join(others)}: the embedding is centered, {', '.join(others)} "
                         f"keeps the original values (config.json: tie_word_embeddings = false)")

    def edited(name: str, t: torch.Tensor) -> torch.Tensor:
        for alias in aliases.get(name, [name]):
            if alias in plan.center:
                return swap_norm.center_(t, plan.center[alias])  # writer: minus its mean along the hidden axis
        return t

    def produce(name: str, t: torch.Tensor) -> torch.Tensor:
        t = edited(name, t)
        for f in fold_into.get(name, []):
            # consumer bias <- bias + W b  (W as rewritten: centered first if it is also a writer)
            t = swap_norm.add_(t, swap_norm.bias_delta(edited(f.weight, ckpt.get(_stored(ckpt, aliases, f.weight))),
                                                       ckpt.get(_stored(ckpt, aliases, f.beta)), f.layout))
        return t.zero_() if name in zeroed else t  # a zeroed norm bias now lives in its consumers

    weight_map = write_shards(ckpt, tmp, produce, copies)
    return weight_map, any(copies.values()), len({f.norm for f in plan.folds} - kept)


def write_shards(ckpt: Checkpoint, tmp: Path, produce: Callable[[str, torch.Tensor], torch.Tensor],
                 copies: dict[str, list[str]] | None = None) -> dict[str, str]:
    """Every shard of ``ckpt`` written into ``tmp`` under its own name, a tensor at a time: each tensor as
    ``produce(model name, stored tensor)`` returns it, after the names in ``copies[key]`` (written with the stored
    values: the untied copies of a rewritten tied weight). Returns the new weight map."""
    copies = copies or {}
    weight_map: dict[str, str] = {}
    for shard, header in ckpt.shards.items():
        names = ckpt.names(shard)
        entries = []
        for n in names:
            shape, dtype = tuple(header[n]["shape"]), _DTYPES[header[n]["dtype"]]
            entries += [(c, dtype, shape) for c in copies.get(n, [])] + [(n, dtype, shape)]
        writer = ShardWriter(tmp / shard, entries, header.get("__metadata__") or {"format": "pt"})
        try:
            for n in names:
                t = ckpt.get(n)
                for c in copies.get(n, []):
                    writer.write(c, t)  # the tied name keeps the original rows
                    weight_map[c] = shard
                t = produce(ckpt.name[n], t)
                writer.write(n, t)
                weight_map[n] = shard
                del t
            writer.check()
        finally:
            writer.f.close()
    return weight_map


def _copy_folder(src: Path, tmp: Path, ckpt: Checkpoint, weight_map: dict[str, str], untied: bool,
                 notes: list[str]) -> None:
    """The index, config.json (untied if needed) and every other file of the folder (tokenizer, generation
    config, ...); weight files of other formats are left out (they hold the original weights)."""
    if ckpt.index_metadata is not None:
        sizes = {s: _data_bytes(tmp / s) for s in set(weight_map.values())}
        meta = dict(ckpt.index_metadata)
        meta["total_size"] = sum(sizes.values())
        (tmp / INDEX).write_text(json.dumps({"metadata": meta, "weight_map": dict(sorted(weight_map.items()))},
                                            indent=2) + "\n")
    skipped = []
    for entry in sorted(src.iterdir()):
        if entry.name in ckpt.shards or entry.name == INDEX:
            continue
        if entry.name == "config.json":
            config = json.loads(entry.read_text())
            if untied:
                config["tie_word_embeddings"] = False
            (tmp / entry.name).write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
        elif entry.is_file() and entry.suffix in _OTHER_WEIGHTS:
            skipped.append(entry.name)
        elif entry.is_dir():
            shutil.copytree(entry, tmp / entry.name, symlinks=True)
        else:
            shutil.copy2(entry, tmp / entry.name)
    if skipped:
        notes.append(f"not copied (other weight files, they hold the original weights): {', '.join(skipped)}")


def _data_bytes(path: Path) -> int:
    """Bytes of tensor data in a safetensors file."""
    h = _header(path)
    return max((h[k]["data_offsets"][1] for k in _entries(h)), default=0)


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
        stored = _stored(ckpt, aliases, name)
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


class _OnDemand:
    """Parameters (and stored buffers) of a meta-parameter model loaded from a checkpoint when needed: each block
    just before it runs (dropped after it), everything else for the whole forward. Records each block's output."""

    def __init__(self, model: nn.Module, ckpt: Checkpoint, folder: Path, compute: torch.dtype | None = None):
        self.model, self.ckpt, self.folder, self.compute = model, ckpt, folder, compute
        self.aliases = _aliases(model)
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

        def before(slots):
            if meet() == 0:  # one thread loads the block for all
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
        for block, slots in self.block_slots:  # hooks for these forwards only (a model runs at several shapes)
            hooks.append(block.register_forward_pre_hook(lambda m, a, slots=slots: before(slots)))
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
    original = _build(cls, config, compute)
    rewritten = _build(cls, out_config, compute)
    shapes = [hf_example_inputs(original), hf_example_inputs(original, 1, HF_SEQ_LEN - 1)]
    d_atol, d_rtol = default_tolerance(dtype)
    atol, rtol = (d_atol if atol is None else atol), (d_rtol if rtol is None else rtol)
    how = "" if compute == dtype else f", {str(dtype).removeprefix('torch.')} weights computed in float32"
    validations, blocks = [], []
    refs = _OnDemand(original, Checkpoint(src).rename_for(original), src, compute).run_many(shapes)
    news = _OnDemand(rewritten, Checkpoint(tmp).rename_for(rewritten), tmp, compute).run_many(shapes)
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


# ---------------------------------------------------------------------------------------------------------
# the command


def open_folder(folder: str | os.PathLike, output: str | os.PathLike) -> tuple[Path, Path, Checkpoint, Any, Any,
                                                                            torch.dtype]:
    """(input folder, output folder, its checkpoint, model class, config, float dtype), or NormconvError: not a
    Hugging Face folder, remote code, an output over / inside the input or already there, unwritable."""
    src = Path(folder)
    if not (src / "config.json").is_file():
        raise NormconvError(f"{src} is not a Hugging Face folder (no config.json): --stream reads Hugging Face "
                            f"folders with safetensors weights")
    remote = remote_code(src / "config.json")
    if remote:
        raise NormconvError(f"{src} ships its own model code (config.json auto_map: {remote}); --stream builds "
                            f"models from transformers' own classes only")
    out = Path(output)
    if out.resolve() == src.resolve() or src.resolve() in out.resolve().parents:
        raise NormconvError(f"refusing to write {out} over or inside the input folder {src}: choose another -o")
    if out.exists():
        raise NormconvError(f"cannot write the Hugging Face folder {out}: it exists; choose a new folder")
    check_writable(out)
    ckpt = Checkpoint(src)
    try:
        cls, config = _model_class(src)
    except Exception as exc:
        raise NormconvError(f"{src}/config.json is not a readable Hugging Face config ({exc})") from None
    return src, out, ckpt, cls, config, _float_dtype(ckpt)


def write_verified(src: Path, out: Path, ckpt: Checkpoint, cls, config, dtype: torch.dtype, report: Report,
                   write: Callable[[Path], tuple[dict[str, str], bool]],
                   reference: Callable[[torch.Tensor], torch.Tensor], atol: float | None, rtol: float | None,
                   keep_temp_on_failure: bool = False, after_rewrite: Callable[[Path], None] | None = None) -> None:
    """``write(temp folder)`` the rewritten shards (returns the weight map and whether it untied a weight), copy
    the folder's other files, verify block by block against ``reference(original block output)``, and only then
    rename the temp folder to ``out``; on any failure nothing is left under ``out`` or beside it."""
    remove_stale_temps(out)
    tmp: Path | None = Path(tempfile.mkdtemp(prefix=temp_name(out), suffix=TEMP_SUFFIX, dir=str(out.parent)))
    try:
        weight_map, untied = write(tmp)
        _copy_folder(src, tmp, ckpt, weight_map, untied, report.notes)
        if after_rewrite is not None:
            after_rewrite(tmp)
        out_config = _model_class(tmp)[1]
        report.validation, report.extra["blocks"] = _verify(src, tmp, cls, config, dtype, atol, rtol, out_config,
                                                            reference)
        failed = next((v for v in report.validation if not v.passed), None)
        if failed is not None:
            raise VerificationError(
                f"{report.command} --stream: {failed.label}: max abs error {failed.max_abs_error:.3g} (atol "
                f"{failed.atol:g}, rtol {failed.rtol:g}); nothing written", report)
        os.replace(tmp, out)
        tmp = None
    except OSError as exc:
        raise write_error(out, exc) from None
    finally:  # every exit path, interrupts included: no folder under OUT, no temp beside it
        if tmp is not None and not keep_temp_on_failure:
            shutil.rmtree(tmp, ignore_errors=True)
    report.output = str(out)


def _centered(block_output: torch.Tensor) -> torch.Tensor:
    """What a swapped block must output: the residual stream, which the rewrite makes zero-mean, equals the
    original stream minus its mean over the hidden axis (what every LayerNorm reads)."""
    return block_output - block_output.mean(-1, keepdim=True)


def swap(folder: str | os.PathLike, output: str | os.PathLike, *, atol: float | None = None,
         rtol: float | None = None, keep_temp_on_failure: bool = False,
         after_rewrite: Callable[[Path], None] | None = None) -> Report:
    """``normconv swap FOLDER --to rmsnorm --stream -o OUT``: see the module docstring. ``after_rewrite`` sees the
    temp folder before verification (tests use it to corrupt the output)."""
    src, out, ckpt, cls, config, dtype = open_folder(folder, output)
    analysis, plan, aliases = _plan(src, ckpt, cls, config, dtype)
    report = Report(command="swap", model=str(src), sites=analysis.sites())
    report.extra.update({"to": "rmsnorm", "exact": True, "streamed": True, "swapped": len(analysis.plans),
                         "centered": len(plan.center)})

    def write(tmp: Path) -> tuple[dict[str, str], bool]:
        weight_map, untied, report.extra["folded"] = _rewrite(ckpt, plan, aliases, tmp, report.notes)
        return weight_map, untied

    write_verified(src, out, ckpt, cls, config, dtype, report, write, _centered, atol, rtol, keep_temp_on_failure,
                   after_rewrite)
    report.notes.append("the output is the same architecture with rewritten weights: every LayerNorm reads a "
                        "zero-mean stream, so it equals RMSNorm(weight, eps) + bias (bias 0 where it was folded); "
                        "normconv swap OUT --to rmsnorm in memory makes the module swap")
    return report
