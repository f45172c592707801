"""What a Hugging Face model folder means, decided before anything in it is read: which weight files
``from_pretrained`` loads (transformers' own resolution, in its order), that every path the folder names stays inside
it, and that every safetensors header obeys the safetensors library's own rules.

    weights = resolve(folder)        # Weights: the index (or None), the weight files, their validated headers
    weights.record(ledger)           # every file read, for the writes to check

transformers 5 (``modeling_utils._get_resolved_checkpoint_files``) loads, from a local folder without a variant:
config.json's ``transformers_weights`` if set; else ``model.safetensors``; else ``model.safetensors.index.json`` and
the shards its ``weight_map`` names; else ``pytorch_model.bin``; else ``pytorch_model.bin.index.json``. normconv
reads exactly that. A folder holding a single file and an index of the same format is refused as ambiguous
(transformers would silently ignore the shards, and the user may mean either).

Paths: every file normconv reads from the folder (config.json, the index, each shard) must resolve (realpath) inside
the folder; a Hugging Face cache snapshot (``models--X/snapshots/REV/``) may also link into its own repository's
``blobs/``. Anything else (``../x.safetensors``, an absolute path, a symlink elsewhere) is refused, nothing read.

Headers: ``safetensors.safe_open`` validates each header (length, JSON, dtypes, shapes, offsets contiguous and
covering the data exactly) before anything of the file is used; normconv's positioned reads use the header only
after the library accepted it and the names, dtypes and shapes normconv parsed are the ones the library read.
The index and the shards must agree: each tensor in the shard the index names, no shard tensor the index omits.

Imports io.ledger and errors only (io.load and stream.checkpoint use it).
"""

from __future__ import annotations

import json
import os
import struct
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from normconv.errors import NormconvError
from normconv.io.ledger import Ledger

CONFIG = "config.json"
SAFE_SINGLE = "model.safetensors"
SAFE_INDEX = "model.safetensors.index.json"
BIN_SINGLE = "pytorch_model.bin"
BIN_INDEX = "pytorch_model.bin.index.json"
# transformers' order for a local folder (after config.json's transformers_weights)
_ORDER = ((SAFE_SINGLE, False), (SAFE_INDEX, True), (BIN_SINGLE, False), (BIN_INDEX, True))


def inside(folder: Path, name: str, named_by: str = "") -> Path:
    """``folder / name``, refused unless it resolves inside ``folder`` (or, for a hub cache snapshot, into its
    repository's blobs/). ``named_by``: the file that names it, for the message."""
    by = f"{named_by} names {name!r}, which" if named_by else f"{name!r}"
    if not isinstance(name, str) or not name or os.path.isabs(name) or "\x00" in name:
        raise NormconvError(f"{folder}: {by} is not a file name inside the folder; nothing was read")
    path = folder / name
    base = Path(os.path.realpath(folder))
    lexical = Path(os.path.normpath(os.path.join(os.path.abspath(folder), name)))
    real = Path(os.path.realpath(path))
    if Path(os.path.abspath(folder)) not in lexical.parents:
        raise NormconvError(f"{folder}: {by} leaves the folder; every path a model folder names must stay inside "
                            f"it (nothing was read)")
    if base in real.parents or _hub_blob(base, real):
        return path
    raise NormconvError(f"{folder}: {by} resolves to {real}, outside the folder; every path a model folder names "
                        f"must stay inside it (nothing was read)")


def _hub_blob(base: Path, real: Path) -> bool:
    """A Hugging Face cache snapshot links its files into its own repository's blobs/ (models--X/blobs/SHA)."""
    return base.parent.name == "snapshots" and real.parent == base.parent.parent / "blobs"


def _regular(folder: Path, name: str, named_by: str = "") -> Path:
    path = inside(folder, name, named_by)
    if not path.is_file():
        what = f"{named_by} names {name}, which" if named_by else name
        raise NormconvError(f"{folder}: {what} is missing (or not a regular file)")
    return path


# ---------------------------------------------------------------------------------------------------------
# safetensors headers, by the library's rules


_FORMAT_BYTES = 8  # a safetensors file opens with the header's length, a little-endian u64


@dataclass
class Header:
    """A safetensors file's validated header: ``tensors`` ({name: {dtype, shape, data_offsets}}, every name the
    library reads, whatever it is), ``metadata`` (its ``__metadata__``, or None) and ``start`` (where the data
    begins). normconv's own bookkeeping lives beside the tensors, never among them: a tensor may be named anything
    the format allows (``__start__`` included)."""

    tensors: dict[str, dict[str, Any]]
    metadata: dict[str, Any] | None
    start: int

    def __getitem__(self, name: str) -> dict[str, Any]:
        return self.tensors[name]

    def __contains__(self, name: object) -> bool:
        return name in self.tensors


def safetensors_header(path: Path) -> Header:
    """The header of a safetensors file (``Header``: its tensors, its metadata, where the data begins), after
    ``safetensors.safe_open`` accepted the file: a header the library refuses (too long, not JSON, an unknown dtype,
    a negative dimension, offsets that overlap, leave gaps, disagree with the shape or do not cover the data
    exactly) is a one-line NormconvError, nothing read."""
    from safetensors import safe_open

    try:
        with safe_open(str(path), framework="pt") as f:
            library = {k: (f.get_slice(k).get_dtype(), list(f.get_slice(k).get_shape())) for k in f.keys()}
    except Exception as exc:  # SafetensorError and the like: the library's own reason
        text = (str(exc).strip().splitlines() or [type(exc).__name__])[0][:200]
        raise NormconvError(f"{path} is not a valid safetensors file ({text})") from None
    with open(path, "rb") as f:
        (n,) = struct.unpack("<Q", f.read(_FORMAT_BYTES))
        header = json.loads(f.read(n))
    metadata = header.pop("__metadata__", None)
    mine = {k: (v["dtype"], list(v["shape"])) for k, v in header.items()}
    if mine != library:  # e.g. a name given twice, read otherwise than the library reads it
        raise NormconvError(f"{path} is not a valid safetensors file (its header reads differently than the "
                            f"safetensors library reads it)")
    return Header(header, metadata, _FORMAT_BYTES + n)


def tensor_names(header: Header) -> list[str]:
    return list(header.tensors)


# ---------------------------------------------------------------------------------------------------------
# which weights


@dataclass
class Weights:
    """The weights ``from_pretrained`` loads from ``folder``: ``index`` (None for a single file), the files in the
    order transformers reads them, whether they are safetensors, and for safetensors each file's validated header
    and the weight map (tensor -> file name, a single file's own tensors)."""

    folder: Path
    index: Path | None
    files: list[Path]
    safetensors: bool
    weight_map: dict[str, str] = field(default_factory=dict)
    headers: dict[str, Header] = field(default_factory=dict)  # file name -> header (safetensors)
    index_metadata: dict | None = None

    def record(self, ledger: Ledger) -> None:
        ledger.record_folder(self.folder, primary=True)
        for path in [self.folder / CONFIG] + ([self.index] if self.index else []) + self.files:
            ledger.record(path)


def _config(folder: Path) -> dict[str, Any]:
    path = _regular(folder, CONFIG)
    try:
        config = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise NormconvError(f"{path} is not a readable Hugging Face config ({type(exc).__name__}: {exc})") from None
    if not isinstance(config, dict):
        raise NormconvError(f"{path} is not a readable Hugging Face config (a JSON object is expected)")
    return config


def chosen(folder: Path, config: dict[str, Any] | None = None) -> tuple[str, bool] | None:
    """(file name, is an index) that from_pretrained loads from ``folder``, or None when it holds no weights."""
    config = _config(folder) if config is None else config
    explicit = config.get("transformers_weights")
    if explicit is not None:  # config.json names the file: transformers loads it and nothing else
        if not isinstance(explicit, str) or not explicit.endswith((".safetensors", ".safetensors.index.json")):
            raise NormconvError(f"{folder}/{CONFIG}: transformers_weights {explicit!r} is neither a .safetensors "
                                f"file nor a .safetensors.index.json")
        inside(folder, explicit, CONFIG)
        return explicit, explicit.endswith(".index.json")
    # transformers tests each name with os.path.isfile: a link is followed (one leading outside the folder is then
    # refused by ``inside``), a dangling link is no file and skipped, as transformers skips it
    present = [(name, sharded) for name, sharded in _ORDER if os.path.isfile(folder / name)]
    for single, index in ((SAFE_SINGLE, SAFE_INDEX), (BIN_SINGLE, BIN_INDEX)):
        names = [n for n, _ in present]
        if single in names and index in names:
            raise NormconvError(f"{folder} holds both {single} and {index}: from_pretrained loads {single} and "
                                f"ignores the shards, so which weights the folder means is ambiguous; remove one "
                                f"(or name it in config.json as transformers_weights)")
    return present[0] if present else None


def resolve(folder: str | os.PathLike, config: dict[str, Any] | None = None, *, headers: bool = True) -> Weights | None:
    """The weights from_pretrained loads from ``folder`` (None: it holds none), every path checked to stay inside
    the folder; with ``headers``, every safetensors header validated by the library's rules and the index checked
    against the shards. One-line NormconvError otherwise; nothing of the weights is read before these checks."""
    folder = Path(folder)
    found = chosen(folder, config)
    if found is None:
        return None
    name, sharded = found
    safetensors = ".safetensors" in name
    if not sharded:
        path = _regular(folder, name)
        w = Weights(folder, None, [path], safetensors)
        if safetensors and headers:
            h = safetensors_header(path)
            w.headers[name] = h
            w.weight_map = {k: name for k in tensor_names(h)}
        return w
    index_path = _regular(folder, name)
    try:
        index = json.loads(index_path.read_text())
        weight_map = index["weight_map"]
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise NormconvError(f"{index_path} is not a readable checkpoint index ({type(exc).__name__}: {exc})") from None
    if not isinstance(weight_map, dict) or not all(isinstance(k, str) and isinstance(v, str)
                                                   for k, v in weight_map.items()):
        raise NormconvError(f"{index_path}: weight_map must map tensor names to file names")
    shards = list(dict.fromkeys(weight_map.values()))
    files = [_regular(folder, s, index_path.name) for s in shards]  # every path checked before any is read
    meta = index.get("metadata") if isinstance(index, dict) else None
    w = Weights(folder, index_path, files, safetensors, dict(weight_map), index_metadata=meta if isinstance(meta, dict)
                else {})
    if safetensors and headers:
        for shard, path in zip(shards, files):
            w.headers[shard] = safetensors_header(path)
        _check_index(w, index_path.name)
    return w


def _check_index(w: Weights, index_name: str) -> None:
    """The index and the shards agree: each tensor is in the shard the index names, each shard tensor is listed."""
    for tensor, shard in w.weight_map.items():
        if tensor not in w.headers[shard]:
            holder = next((s for s, h in w.headers.items() if tensor in tensor_names(h)), None)
            where = f" (it is in {holder})" if holder else ""
            raise NormconvError(f"{w.folder}/{index_name} places tensor {tensor} in {shard}, which does not hold "
                                f"it{where}")
    for shard, h in w.headers.items():
        for tensor in tensor_names(h):
            listed = w.weight_map.get(tensor)
            if listed != shard:
                what = "does not list it" if listed is None else f"places it in {listed}"
                raise NormconvError(f"{w.folder}/{shard} holds tensor {tensor}, but {index_name} {what}")


def top_level(name: str) -> str | None:
    """The file name a shard path names at the top of its folder (``./x`` and ``x`` alike: ``.`` and empty
    segments change no POSIX path), or None where it names one in a subfolder."""
    parts = [p for p in name.split("/") if p not in ("", ".")]
    return parts[0] if len(parts) == 1 and not name.startswith("/") else None


def check_folder_files(folder: Path, names: list[str]) -> None:
    """Every entry of ``names`` present in the folder resolves inside it (config.json, generation_config.json, a
    config class's extra weight files)."""
    for name in names:
        if (folder / name).exists() or (folder / name).is_symlink():
            inside(folder, name)


# weight files of any format: they hold the original weights, never copied beside the rewritten ones
OTHER_WEIGHTS = (".bin", ".pt", ".pth", ".ckpt", ".h5", ".msgpack", ".safetensors", ".gguf")


def copy_side_files(src: str | os.PathLike, dst: str | os.PathLike) -> list[str]:
    """The files of the folder ``src`` besides its weights (tokenizer, processor, chat template, README, ...) copied
    into the new folder ``dst`` where save_pretrained wrote no file of that name, as regular files (a symlink into a
    hub cache copied as the bytes it names); weight files and their indexes are left out, and so are subfolders and
    any link resolving outside the folder (``inside``'s rule: never read). Returns notes on what was left
    out."""
    import shutil

    left, outside = [], []
    for entry in sorted(Path(src).iterdir()):
        target = Path(dst) / entry.name
        if target.exists() or entry.name.endswith(".index.json"):
            continue  # written by save_pretrained (config.json, generation_config.json, the weights and their index)
        if entry.is_dir():
            left.append(entry.name + "/")
        elif entry.is_file() and entry.suffix not in OTHER_WEIGHTS:
            try:
                inside(Path(src), entry.name)  # a link out of the folder (to a key, another model): not read
            except NormconvError:
                outside.append(entry.name)
                continue
            shutil.copyfile(entry, target)  # follows a link: the bytes, never a link
        elif entry.is_file():
            left.append(entry.name)
    notes = [f"not copied into the folder: {', '.join(left)} (weights of the original, or subfolders)"] if left else []
    return notes + ([f"not copied into the folder: {', '.join(outside)} (a link resolving outside the input folder: "
                     f"not read)"] if outside else [])

__all__ = ["Header", "Weights", "resolve", "chosen", "inside", "safetensors_header", "tensor_names", "check_folder_files",
           "copy_side_files", "top_level", "OTHER_WEIGHTS", "CONFIG", "SAFE_SINGLE", "SAFE_INDEX", "BIN_SINGLE", "BIN_INDEX"]
