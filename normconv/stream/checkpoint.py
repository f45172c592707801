"""A Hugging Face folder's safetensors checkpoint, a tensor at a time: headers, ``Checkpoint`` (each tensor read
into a buffer of its own, its key mapped to the model's name as from_pretrained maps it), ``shard_header`` (a
shard's first bytes, computed up front) and ``ShardWriter`` (a shard written a tensor at a time in order: the
benchmarks' floor and the tests; the commands write at offsets, stream.writer), and the folder around the shards:
``open_folder`` (the checks before any work: a Hugging Face folder without remote code whose weights are the ones
from_pretrained loads, every path it names inside it and every header valid (io.hf_folder), an output that is new,
writable and nothing the run read (io.ledger)) and ``copy_folder`` (the index, config.json and the folder's other files as
the in-memory folder writer copies them).

The lowest module of the streaming room: it imports io only.
"""

from __future__ import annotations

import json
import os
import struct
from pathlib import Path
from typing import Any, Callable

import torch
import torch.nn as nn

from normconv.errors import NormconvError
from normconv.io import config_size, durable, hf_folder
from normconv.io.archive import memory_bytes
from normconv.io.hf_folder import safetensors_header, tensor_names
from normconv.io.ledger import Ledger
from normconv.io.load import hf_config, hf_model_class, remote_code
from normconv.io.write import check_writable, refuse_empty

INDEX = hf_folder.SAFE_INDEX
SINGLE = hf_folder.SAFE_SINGLE

_DTYPES = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
           "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
           "BOOL": torch.bool, "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2}
# the library's other dtypes that torch holds (F4 / F6 pack several values per byte: refused in one line)
_DTYPES.update({code: getattr(torch, name) for code, name in (("U16", "uint16"), ("U32", "uint32"), ("U64", "uint64"),
                                                              ("F8_E8M0", "float8_e8m0fnu"), ("C64", "complex64"))
                if hasattr(torch, name)})
_CODES = {v: k for k, v in _DTYPES.items()}
# the suffixes an -o names a file format with (io.write.output_format, export's .onnx): --stream writes a folder only
FILE_SUFFIXES = (".pt", ".pth", ".bin", ".pkl", ".pt2", ".safetensors", ".onnx")
_entries = tensor_names  # a header's tensor names (io.hf_folder: headers validated by the safetensors library)


class Checkpoint:
    """The tensors of a Hugging Face folder's safetensors shards, read one at a time (never all at once).

    Each tensor is read into a buffer of its own: ``safe_open(...).get_tensor`` returns tensors backed by the file's
    mapping, cached per handle (an edit in place shows in the next read of the same name: a norm bias zeroed before
    its consumer's bias was computed read back as zeros), and every mapped page it touched counts in the RSS."""

    def __init__(self, folder: Path, weights: hf_folder.Weights | None = None):
        self.folder = folder
        # the weights from_pretrained loads (its own rules), every path inside the folder, every header valid
        w = weights if weights is not None else hf_folder.resolve(folder)
        if w is None or not w.safetensors:
            loads = f": from_pretrained would load {w.files[0].name if w.index is None else w.index.name}" if w else ""
            raise NormconvError(f"{folder} has no safetensors weights ({SINGLE} or {INDEX}){loads}; --stream reads "
                                f"safetensors checkpoints only")
        odd = next((s for s in w.headers if hf_folder.top_level(s) is None), None)
        if odd is not None:
            raise NormconvError(f"{folder}: the shard {odd} lies in a subfolder; --stream reads shards at the top of "
                                f"the folder")
        unknown = next((f"{s}: {k} ({h[k]['dtype']})" for s, h in w.headers.items() for k in _entries(h)
                        if h[k]["dtype"] not in _DTYPES), None)
        if unknown is not None:
            raise NormconvError(f"{folder}/{unknown}: a dtype --stream does not read (it reads "
                                f"{', '.join(_DTYPES)})")
        self.index_name = w.index.name if w.index is not None else None
        self.index_metadata = dict(w.index_metadata or {}) if w.index is not None else None
        # shards by their file names (an index's ./x is the file x: from_pretrained joins it to the folder)
        self.weight_map: dict[str, str] = {k: hf_folder.top_level(v) for k, v in w.weight_map.items()}
        self.shards: dict[str, hf_folder.Header] = {hf_folder.top_level(s): h for s, h in w.headers.items()}
        self.key = {k: k for k in self.weight_map}  # model's state_dict name -> checkpoint key
        self.name = dict(self.key)  # checkpoint key -> model's state_dict name
        self.uncached = False  # each tensor's pages dropped from the page cache once read (``larger_than_memory``)

    def larger_than_memory(self) -> bool:
        """The shards hold more bytes than the machine has memory: their pages cannot all stay in the page cache
        (a tensor read is read once; what the cache keeps of it, the kernel reclaims later inside the pass)."""
        memory = memory_bytes()
        if memory is None:  # no such query here: keep the cache as it is
            return False
        return sum((self.folder / s).stat().st_size for s in self.shards) > memory

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
        meta = dict.fromkeys(model.state_dict(), True)  # transformers adds or strips the prefix where a value is not None
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

    def get(self, name: str, reuse: Callable[[tuple[int, ...], torch.dtype], torch.Tensor | None] | None = None
            ) -> torch.Tensor:
        """One tensor, read from its shard into a new buffer (positioned read, no mapping), or into the contiguous
        tensor ``reuse(shape, dtype)`` returns (None: a new one)."""
        shard = self.weight_map[name]
        h = self.shards[shard]
        e = h[name]
        shape, dtype = tuple(e["shape"]), _DTYPES[e["dtype"]]
        t = reuse(shape, dtype) if reuse is not None else None
        if t is None:
            t = torch.empty(shape, dtype=dtype)
        start, end = e["data_offsets"]
        if end > start:
            buf = memoryview(t.reshape(-1).view(torch.uint8).numpy())
            with open(self.folder / shard, "rb") as f:
                f.seek(h.start + start)
                if f.readinto(buf) != end - start or buf.nbytes != end - start:
                    raise NormconvError(f"{self.folder / shard}: tensor {name} is truncated")
                if self.uncached:  # OPT-13B (25.7 GB, 23 GB of RAM): 44 -> 41 s
                    durable.drop_cached(f.fileno(), h.start + start, end - start)
        return t

    def dtype(self, key: str) -> torch.dtype:
        """The dtype ``key`` is stored in (its header's)."""
        return _DTYPES[self.shards[self.weight_map[key]][key]["dtype"]]


def holds(stored: torch.dtype, model: torch.dtype) -> bool:
    """A value computed in the model's dtype ``model`` keeps its precision stored as ``stored`` (a floating dtype at
    least as fine): a centered writer stored narrower (a float16 wpe in a float32 checkpoint, a float8 embedding
    in a bfloat16 one, an int8 weight) is written in ``model``, the dtype from_pretrained loads it in."""
    return stored.is_floating_point and torch.finfo(stored).eps <= torch.finfo(model).eps \
        and torch.finfo(stored).max >= torch.finfo(model).max


def tied_names(model: nn.Module) -> dict[str, list[str]]:
    """state_dict name -> every name of the same tensor (tied weights), the name itself first."""
    by_id: dict[int, list[str]] = {}
    for n, t in list(model.named_parameters(remove_duplicate=False)) + list(model.named_buffers(remove_duplicate=False)):
        by_id.setdefault(id(t), []).append(n)
    return {n: [n] + [m for m in names if m != n] for names in by_id.values() for n in names}


def stored_key(ckpt: Checkpoint, aliases: dict[str, list[str]], name: str) -> str | None:
    """The checkpoint key holding the model's tensor ``name`` (its own, or that of a name it is tied to)."""
    return next((ckpt.key[a] for a in aliases.get(name, [name]) if a in ckpt.key), None)


def float_dtype(ckpt: Checkpoint) -> torch.dtype:
    """The dtype most of the checkpoint's floating tensors have (the model is built in it)."""
    count: dict[torch.dtype, int] = {}
    for h in ckpt.shards.values():
        for k in _entries(h):
            v = h[k]
            if _DTYPES[v["dtype"]].is_floating_point:
                count[_DTYPES[v["dtype"]]] = count.get(_DTYPES[v["dtype"]], 0) + torch.Size(v["shape"]).numel()
    return max(count, key=count.get) if count else torch.float32


def shard_header(entries: list[tuple[str, torch.dtype, tuple[int, ...]]],
                 metadata: dict | None) -> tuple[bytes, list[int], int]:
    """A safetensors file's first bytes for ``entries`` (name, dtype, shape) stored in that order: (the 8-byte
    length + the JSON header padded to 8 bytes, each tensor's start within the data, the data's size)."""
    header: dict[str, Any] = {"__metadata__": metadata} if metadata else {}
    offset, starts = 0, []
    for name, dtype, shape in entries:
        size = torch.Size(shape).numel() * torch.empty((), dtype=dtype).element_size()
        header[name] = {"dtype": _CODES[dtype], "shape": list(shape), "data_offsets": [offset, offset + size]}
        starts.append(offset)
        offset += size
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)  # the format aligns the data to 8 bytes
    return struct.pack("<Q", len(raw)) + raw, starts, offset


def tensor_bytes(t: torch.Tensor) -> memoryview:
    """A tensor's bytes as safetensors stores them: row-major, little-endian as in memory (0-dim tensors too)."""
    return memoryview(t.contiguous().reshape(-1).view(torch.uint8).numpy())


class ShardWriter:
    """A safetensors file written a tensor at a time, in order: the header (names, dtypes, shapes, offsets) first."""

    def __init__(self, path: Path, entries: list[tuple[str, torch.dtype, tuple[int, ...]]], metadata: dict | None):
        raw, _, self.size = shard_header(entries, metadata)
        self.expected = [(n, d, tuple(s)) for n, d, s in entries]
        self.f = open(path, "wb")
        self.f.write(raw)

    def write(self, name: str, t: torch.Tensor) -> None:
        n, dtype, shape = self.expected.pop(0)
        if (name, t.dtype, tuple(t.shape)) != (n, dtype, shape):
            raise RuntimeError(f"shard writer expected {n} {dtype} {shape}, got {name} {t.dtype} {tuple(t.shape)}")
        for piece in durable.pieces(tensor_bytes(t)):  # 1 MiB a call: a whole tensor at once is slow
            self.f.write(piece)

    def check(self) -> None:
        if self.expected:
            raise RuntimeError(f"shard writer closed with {len(self.expected)} tensors unwritten")


# ---------------------------------------------------------------------------------------------------------
# the folder


def open_folder(folder: str | os.PathLike, output: str | os.PathLike, overwrite: bool = False) -> tuple[Path, Path, Checkpoint, Any, Any,
                                                                            torch.dtype]:
    """(input folder, output folder, its checkpoint, model class, config, float dtype), or NormconvError: an output
    whose suffix asks for a file format (``FILE_SUFFIXES``: --stream writes a folder), not a Hugging Face folder,
    remote code, weights that are not what from_pretrained loads or that name a path outside the folder, an invalid
    header, an output over / inside anything read or already there, unwritable. Nothing of the weights is read
    before every one of these checks passed."""
    refuse_empty(output)
    src, out = Path(folder), Path(output)
    if out.suffix.lower() in FILE_SUFFIXES:  # the flag's meaning first: nothing is read for an -o it cannot honour
        raise NormconvError(f"-o {output}: --stream writes a Hugging Face folder, not the {out.suffix} file its "
                            f"suffix asks for; give a folder name without a file suffix, or run without --stream "
                            f"to write a {out.suffix} file")
    if not (src / "config.json").is_file():
        raise NormconvError(f"{src} is not a Hugging Face folder (no config.json): --stream reads Hugging Face "
                            f"folders with safetensors weights")
    remote = remote_code(src / "config.json")
    if remote:
        raise NormconvError(f"{src} ships its own model code (config.json auto_map: {remote}); --stream builds "
                            f"models from transformers' own classes only")
    raw = hf_folder._config(src)
    for entry in sorted(src.iterdir()):  # every file the stream reads or copies resolves inside the folder
        if entry.exists():  # a dangling link is nothing to read (from_pretrained skips it too) nor to copy
            hf_folder.inside(src, entry.name)
    weights = hf_folder.resolve(src, raw)
    ledger = Ledger()
    ledger.record_folder(src, primary=True)
    if weights is not None:
        weights.record(ledger)
    ledger.check_write(out, folder=True, overwrite=overwrite)  # never over or inside anything the run reads
    if out.exists() and not overwrite:
        raise NormconvError(f"cannot write the Hugging Face folder {out}: it exists; pass --overwrite to replace it, "
                            f"or choose a new folder")
    check_writable(out, overwrite)
    ckpt = Checkpoint(src, weights)
    config_size.check_numbers(raw, str(src))  # a layer count or width no model has: never built on meta
    cls, config = model_class(src, ckpt.weight_map)
    return src, out, ckpt, cls, config, float_dtype(ckpt)


def model_class(folder: Path, keys: Any = None):
    """The transformers class and config a Hugging Face folder names (never the folder's own code; io.load's
    resolution, ``keys``: the checkpoint's tensor names); no KV cache."""
    config = hf_config(folder, str(folder))  # transformers' refusals in one line, as the in-memory load gives them
    cls = hf_model_class(config, str(folder), keys)
    if hasattr(config, "use_cache"):
        config.use_cache = False  # torch.export cannot capture a KV cache object
    return cls, config


def copy_folder(src: Path, tmp: Path, ckpt: Checkpoint, weight_map: dict[str, str], untied: bool,
                notes: list[str], cls: Any = None) -> None:
    """The index, config.json (untied if needed; ``architectures`` naming ``cls``, the class the stream proved, as
    save_pretrained names it) and the folder's other files as the in-memory folder writer copies them (io.hf_folder.copy_side_files: tokenizer, generation config, ... as regular files; weight files of other
    formats, which hold the original weights, and subfolders left out, said in ``notes``)."""
    if ckpt.index_metadata is not None:
        sizes = {s: _data_bytes(tmp / s) for s in set(weight_map.values())}
        meta = dict(ckpt.index_metadata)
        meta["total_size"] = sum(sizes.values())
        (tmp / ckpt.index_name).write_text(json.dumps({"metadata": meta, "weight_map": dict(sorted(weight_map.items()))},
                                                      indent=2) + "\n")
    config = json.loads((src / "config.json").read_text())
    if untied:
        config["tie_word_embeddings"] = False
    if isinstance(cls, type) and any(b.__name__ == "PreTrainedModel" for b in cls.__mro__):
        config["architectures"] = [cls.__name__]
    (tmp / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    notes.extend(hf_folder.copy_side_files(src, tmp))  # the shards, the index and config.json are there already


def _data_bytes(path: Path) -> int:
    """Bytes of tensor data in a safetensors file."""
    h = safetensors_header(path)
    return max((h[k]["data_offsets"][1] for k in _entries(h)), default=0)
