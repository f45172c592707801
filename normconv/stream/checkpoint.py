"""A Hugging Face folder's safetensors checkpoint, a tensor at a time: headers, ``Checkpoint`` (each tensor read
into a buffer of its own, its key mapped to the model's name as from_pretrained maps it), ``ShardWriter`` /
``write_shards`` (a shard written a tensor at a time behind a header computed up front), and the folder around the
shards: ``open_folder`` (the checks before any work: a Hugging Face folder without remote code, an output that is
new and writable) and ``copy_folder`` (the index, config.json and every other file of the folder).

The lowest module of the streaming room: it imports io only.
"""

from __future__ import annotations

import json
import os
import shutil
import struct
from pathlib import Path
from typing import Any, Callable

import torch
import torch.nn as nn

from normconv.errors import NormconvError
from normconv.io.load import remote_code
from normconv.io.write import check_writable

INDEX = "model.safetensors.index.json"
SINGLE = "model.safetensors"
# weight files of other formats are not copied: they would hold the original weights under the rewritten config
_OTHER_WEIGHTS = (".bin", ".pt", ".pth", ".ckpt", ".h5", ".msgpack", ".safetensors", ".gguf")

_DTYPES = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
           "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
           "BOOL": torch.bool, "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2}
_CODES = {v: k for k, v in _DTYPES.items()}


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


# ---------------------------------------------------------------------------------------------------------
# the folder


def open_folder(folder: str | os.PathLike, output: str | os.PathLike, overwrite: bool = False) -> tuple[Path, Path, Checkpoint, Any, Any,
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
    if out.exists() and not overwrite:
        raise NormconvError(f"cannot write the Hugging Face folder {out}: it exists; pass --overwrite to replace it, "
                            f"or choose a new folder")
    if overwrite and out.resolve() in src.resolve().parents:
        raise NormconvError(f"refusing to overwrite {out}: the input folder {src} is inside it")
    check_writable(out, overwrite)
    ckpt = Checkpoint(src)
    try:
        cls, config = model_class(src)
    except Exception as exc:
        raise NormconvError(f"{src}/config.json is not a readable Hugging Face config ({exc})") from None
    return src, out, ckpt, cls, config, float_dtype(ckpt)


def model_class(folder: Path):
    """The transformers class and config a Hugging Face folder names (never the folder's own code); no KV cache."""
    import transformers

    config = transformers.AutoConfig.from_pretrained(str(folder), local_files_only=True, trust_remote_code=False)
    archs = getattr(config, "architectures", None) or []
    cls = next((getattr(transformers, a) for a in archs if hasattr(transformers, a)), None)
    if hasattr(config, "use_cache"):
        config.use_cache = False  # torch.export cannot capture a KV cache object
    return (cls or transformers.AutoModel), config


def copy_folder(src: Path, tmp: Path, ckpt: Checkpoint, weight_map: dict[str, str], untied: bool,
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
