"""Issue 27, class 5: formats are parsed by the field's own rules. Every safetensors header normconv reads is accepted
by normconv exactly when the safetensors library accepts it (its own edge cases), and read positionally to the same
tensors; a bad header, an index that names the wrong shard or omits a shard's tensor is one line and exit 2, in
memory and --stream, nothing written. A zip archive (.pt2, torch.save) whose member would inflate beyond what its
bytes back is refused from its directory, without inflating anything."""

from __future__ import annotations

import json
import shutil
import struct
import time
import zipfile
from pathlib import Path

import pytest
import torch
import torch.nn as nn

from normconv.errors import NormconvError
from normconv.io.hf_folder import safetensors_header
from normconv.stream.checkpoint import Checkpoint
from tests.trust_helpers import fingerprint, index_of, one_line_error, saved_folder, write_index


def _file(path: Path, header: dict | bytes, data: bytes = b"", n: int | None = None) -> Path:
    raw = header if isinstance(header, bytes) else json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(raw) if n is None else n) + raw + data)
    return path


T = {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]}
# the library's own edge cases (bindings/python/tests, attacks/): (name, header, data, header length or None)
CASES = [
    ("valid", {"a": T}, bytes(8), None),
    ("valid I32 from the library's test", {"test": {"dtype": "I32", "shape": [2, 2], "data_offsets": [0, 16]}},
     bytes(16), None),
    ("metadata and padding", b'{"__metadata__":{"framework":"pt"},"a":' + json.dumps(T).encode() + b"}       ",
     bytes(8), None),
    ("empty", {}, b"", None),
    ("zero-size tensors", {"a": {"dtype": "F32", "shape": [0], "data_offsets": [0, 0]}, "b": T}, bytes(8), None),
    ("bf16 and bool", {"a": {"dtype": "BF16", "shape": [2], "data_offsets": [0, 4]},
                       "b": {"dtype": "BOOL", "shape": [4], "data_offsets": [4, 8]}}, bytes(8), None),
    ("unsigned and e8m0", {"a": {"dtype": "U16", "shape": [2], "data_offsets": [0, 4]},
                           "b": {"dtype": "F8_E8M0", "shape": [4], "data_offsets": [4, 8]}}, bytes(8), None),
    ("header length 2^60", {"a": T}, bytes(8), 2 ** 60),
    ("header length past the file (abuse attempt 1)", {"a": T}, bytes(8), 1000),
    ("header length 0", {"a": T}, bytes(8), 0),
    ("unknown dtype", {"a": {"dtype": "Q99", "shape": [2], "data_offsets": [0, 8]}}, bytes(8), None),
    ("negative dimension", {"a": {"dtype": "F32", "shape": [-2], "data_offsets": [0, 8]}}, bytes(8), None),
    ("overlapping offsets", {"a": T, "b": T}, bytes(8), None),
    ("a gap before the data", {"a": {"dtype": "F32", "shape": [2], "data_offsets": [8, 16]}}, bytes(16), None),
    ("offsets end before start", {"a": {"dtype": "F32", "shape": [0], "data_offsets": [8, 0]}}, bytes(8), None),
    ("size not the shape's", {"a": {"dtype": "F32", "shape": [2], "data_offsets": [0, 16]}}, bytes(16), None),
    ("data past the last tensor", {"a": T}, bytes(16), None),
    ("data missing", {"a": T}, bytes(4), None),
    ("shape overflow", {"a": {"dtype": "F32", "shape": [2 ** 40, 2 ** 40], "data_offsets": [0, 8]}}, bytes(8), None),
    ("a name given twice", b'{"a":' + json.dumps(T).encode() + b',"a":{"dtype":"F32","shape":[1],'
                                                                 b'"data_offsets":[0,4]}}', bytes(8), None),
    ("metadata not strings", {"__metadata__": {"x": 1}, "a": T}, bytes(8), None),
    ("not JSON", b"{not json", bytes(8), None),
    ("a list, not a map", b"[1, 2]", bytes(8), None),
    ("not UTF-8", b'{"\xff": 1}', bytes(8), None),
    ("file shorter than its length field", b"", b"", None),
]


def _library_accepts(path: Path) -> bool:
    from safetensors import safe_open

    try:
        with safe_open(str(path), framework="pt"):
            return True
    except Exception:  # noqa: BLE001 - any refusal of the library's
        return False


@pytest.mark.parametrize("name,header,data,n", CASES, ids=[c[0] for c in CASES])
def test_headers_are_accepted_exactly_when_the_library_accepts_them(tmp_path, name, header, data, n):
    """normconv's own reader (the --stream checkpoint: headers, then positioned reads of every tensor) accepts a
    file exactly when the library does, and refuses the others with a one-line NormconvError (never MemoryError,
    KeyError, or a silent read)."""
    folder = tmp_path / "m"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps({"model_type": "gpt2"}))
    path = folder / "model.safetensors"
    if name.startswith("file shorter"):
        path.write_bytes(b"\x10\x00")
    else:
        _file(path, header, data, n)
    ours = True
    try:
        ckpt = Checkpoint(folder)
        for k in ckpt.weight_map:
            ckpt.get(k)
    except NormconvError as exc:
        ours = False
        assert str(path) in str(exc) and "\n" not in str(exc)
    assert ours == _library_accepts(path), name
    if ours:  # the header normconv parsed is the one the library read
        assert set(safetensors_header(path).tensors) == set(ckpt.weight_map)


READABLE = [c for c in CASES if c[0] in ("valid", "valid I32 from the library's test", "metadata and padding",
                                         "zero-size tensors", "bf16 and bool", "unsigned and e8m0")]


@pytest.mark.parametrize("name,header,data,n", READABLE, ids=[c[0] for c in READABLE])
def test_the_positioned_read_gives_the_library_s_tensors(tmp_path, name, header, data, n):
    from safetensors import safe_open

    folder = tmp_path / "m"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps({"model_type": "gpt2"}))
    data = bytes(range(len(data))) if data else data  # distinct bytes: a read at the wrong offset shows
    _file(folder / "model.safetensors", header, data, n)
    ckpt = Checkpoint(folder)
    with safe_open(str(folder / "model.safetensors"), framework="pt") as f:
        assert sorted(f.keys()) == sorted(ckpt.weight_map)
        for k in f.keys():
            assert torch.equal(ckpt.get(k), f.get_tensor(k)), k


@pytest.fixture(scope="module")
def template(tmp_path_factory):
    folder = tmp_path_factory.mktemp("formats") / "gpt2"
    saved_folder(folder)
    return folder


BAD = {
    "header length 2^60": lambda raw: struct.pack("<Q", 2 ** 60) + raw[8:],
    "unknown dtype": lambda raw: raw.replace(b'"F32"', b'"Q99"', 1),
    "negative dimension": lambda raw: raw.replace(b'"shape":[', b'"shape":[-', 1),
    "overlapping offsets": lambda raw: _overlap(raw),
}


def _overlap(raw: bytes) -> bytes:
    """Every tensor of the file made to start at offset 0 (same sizes: the data is no longer covered either)."""
    n = struct.unpack("<Q", raw[:8])[0]
    header = json.loads(raw[8:8 + n])
    for k, v in header.items():
        if k != "__metadata__":
            v["data_offsets"] = [0, v["data_offsets"][1] - v["data_offsets"][0]]
    new = json.dumps(header).encode()
    return struct.pack("<Q", len(new)) + new + raw[8 + n:]


def _damaged(tmp_path: Path, template: Path, how: str) -> Path:
    folder = tmp_path / "model"
    shutil.copytree(template, folder)
    shard = folder / sorted(set(index_of(folder)["weight_map"].values()))[1]
    shard.write_bytes(BAD[how](shard.read_bytes()))
    return folder


@pytest.mark.parametrize("how", sorted(BAD))
@pytest.mark.parametrize("command", ["inspect", "swap --stream", "fold --stream"])
def test_a_bad_header_is_one_line(cli, tmp_path, template, command, how):
    folder = _damaged(tmp_path, template, how)
    before = fingerprint(folder)
    name, *flags = command.split()
    out = tmp_path / "out"
    one_line_error(cli, name, folder, *flags, *(["-o", out] if flags else []), match="not a valid safetensors file")
    assert fingerprint(folder) == before and not out.exists()


def _index_edit(tmp_path: Path, template: Path, edit) -> Path:
    folder = tmp_path / "model"
    shutil.copytree(template, folder)
    index = index_of(folder)
    edit(index["weight_map"])
    write_index(folder, index)
    return folder


def _wrong_shard(weight_map: dict) -> None:
    shards = sorted(set(weight_map.values()))
    name = next(k for k, v in weight_map.items() if v == shards[0])
    weight_map[name] = shards[1]


def _unlisted(weight_map: dict) -> None:
    del weight_map[sorted(weight_map)[0]]


@pytest.mark.parametrize("edit,match", [(_wrong_shard, "does not hold it"), (_unlisted, "does not list it")])
@pytest.mark.parametrize("command", ["inspect", "swap --stream", "fold --stream"])
def test_an_index_that_disagrees_with_its_shards_is_one_line(cli, tmp_path, template, command, edit, match):
    folder = _index_edit(tmp_path, template, edit)
    name, *flags = command.split()
    out = tmp_path / "out"
    one_line_error(cli, name, folder, *flags, *(["-o", out] if flags else []), match=match)
    assert not out.exists()


@pytest.mark.parametrize("sharded", [False, True], ids=["one file", "sharded"])
def test_a_tensor_named_like_normconv_s_own_bookkeeping_is_carried(cli, tmp_path, sharded):
    """Every tensor name the safetensors library accepts is a tensor name to normconv: ``__start__`` (where the data
    begins, which normconv keeps beside the header, never in it) is carried by --stream like any extra tensor."""
    from safetensors import safe_open
    from safetensors.torch import save_file

    folder, out = tmp_path / "model", tmp_path / "out"
    saved_folder(folder, "20KB" if sharded else None)
    shard = folder / (sorted(set(index_of(folder)["weight_map"].values()))[0] if sharded else "model.safetensors")
    with safe_open(str(shard), framework="pt") as f:
        tensors, meta = {k: f.get_tensor(k) for k in f.keys()}, f.metadata()
    extra = {"__start__": torch.arange(6, dtype=torch.float32), "keepme": torch.ones(3)}
    save_file(tensors | extra, str(shard), metadata=meta)
    if sharded:
        index = index_of(folder)
        index["weight_map"].update(dict.fromkeys(extra, shard.name))
        write_index(folder, index)
    assert "__start__" in safetensors_header(shard).tensors
    rc, _, err = cli("--quiet", "swap", folder, "--to", "rmsnorm", "--stream", "-o", out)
    assert rc == 0, err
    carried = {}
    for path in out.glob("*.safetensors"):
        with safe_open(str(path), framework="pt") as f:
            carried |= {k: f.get_tensor(k) for k in f.keys() if k in extra}
    assert sorted(carried) == sorted(extra) and all(torch.equal(carried[k], v) for k, v in extra.items())


# -- zip archives -----------------------------------------------------------------------------------------------


BOMB = 256 << 20  # declared (and real) inflated size of the crafted member: 256 MiB of zeros, ~256 KB deflated


def _bombed(src: Path, dst: Path, member_suffix: str) -> None:
    """``src`` (a torch zip archive) rewritten with the member ending in ``member_suffix`` replaced by a deflated
    stream of BOMB zero bytes, its header declaring that size honestly."""
    with zipfile.ZipFile(src) as zin, zipfile.ZipFile(dst, "w") as zout:
        for item in zin.infolist():
            if item.filename.endswith(member_suffix):
                info = zipfile.ZipInfo(item.filename, date_time=item.date_time)
                info.compress_type = zipfile.ZIP_DEFLATED
                with zout.open(info, "w", force_zip64=True) as f:
                    chunk = bytes(1 << 20)
                    for _ in range(BOMB >> 20):
                        f.write(chunk)
            else:
                zout.writestr(item, zin.read(item))


def _never(*a, **k):
    raise AssertionError("the archive was read")


def test_a_pt2_whose_weight_inflates_far_beyond_its_bytes_is_refused_uninflated(cli, tmp_path, monkeypatch):
    model = nn.Sequential(nn.Linear(4, 4), nn.LayerNorm(4)).eval()
    good = tmp_path / "good.pt2"
    torch.export.save(torch.export.export(model, (torch.randn(2, 4),)), good)
    bomb = tmp_path / "bomb.pt2"
    _bombed(good, bomb, "data/weights/weight_0")
    assert bomb.stat().st_size < 2 << 20
    monkeypatch.setattr(torch.export, "load", _never)
    t0 = time.perf_counter()
    one_line_error(cli, "inspect", bomb, match=("zip bomb", "weight_0"))
    assert time.perf_counter() - t0 < 30


def test_a_torch_save_archive_bomb_is_refused_as_model_and_as_weights(cli, tmp_path, monkeypatch):
    from tests.fixtures.user_models import small_net

    good, bomb = tmp_path / "w.pt", tmp_path / "bomb.pt"
    torch.save(small_net().state_dict(), good)
    _bombed(good, bomb, "data/0")
    real = torch.load
    monkeypatch.setattr(torch, "load", lambda f, *a, **k: _never() if Path(str(f)) == bomb else real(f, *a, **k))
    one_line_error(cli, "inspect", bomb, "-i", "x:2,3,8,8", match="zip bomb")
    one_line_error(cli, "fold", "tests.fixtures.user_models:small_net", "--weights", bomb, "-i", "x:2,3,8,8",
                   match="zip bomb")


def test_a_directory_entry_pointing_at_another_member_is_refused(cli, tmp_path):
    from tests.fixtures.user_models import small_net

    good = tmp_path / "w.pt"
    torch.save(small_net().state_dict(), good)
    raw = bytearray(good.read_bytes())
    with zipfile.ZipFile(good) as z:
        first = z.infolist()[-2]
    cd = raw.rfind(b"PK\x01\x02")  # the last member's directory entry: its local header offset made the one before
    struct.pack_into("<I", raw, cd + 42, first.header_offset)
    bad = tmp_path / "retargeted.pt"
    bad.write_bytes(bytes(raw))
    one_line_error(cli, "fold", "tests.fixtures.user_models:small_net", "--weights", bad, "-i", "x:2,3,8,8",
                   match="local header disagrees")


def test_overlapping_archive_members_are_refused(cli, tmp_path):
    """A member whose data covers the next member (the overlapping-entry zip bomb: one stream counted many times)."""
    bad = tmp_path / "overlap.pt"
    with zipfile.ZipFile(bad, "w") as z:
        z.writestr("x/a", bytes(64))
        z.writestr("x/b", bytes(64))
    raw = bytearray(bad.read_bytes())
    with zipfile.ZipFile(bad) as z:
        a, b = z.infolist()
    grown = b.header_offset + 30 + len(b.filename) + 64 - (a.header_offset + 30 + len(a.filename))
    struct.pack_into("<II", raw, a.header_offset + 18, grown, grown)  # local header: sizes
    cd = raw.find(b"PK\x01\x02")  # a's directory entry comes first
    struct.pack_into("<II", raw, cd + 20, grown, grown)
    bad.write_bytes(bytes(raw))
    one_line_error(cli, "fold", "tests.fixtures.user_models:small_net", "--weights", bad, "-i", "x:2,3,8,8",
                   match="share their data")
