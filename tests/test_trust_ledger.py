"""Issue 27, class 4: never write over what was read, tracked not listed. Every file a run opened for reading (the
model, --weights, config and shards, the factory's own module files, a file the factory itself read) is in one
ledger, by real path and inode: -o naming it, a hard link or symlink to it, or the Hugging Face cache blob a snapshot
links to is refused in one line (exit 2), in memory and --stream. An output only ever replaces a regular file: a
FIFO, a device node, a folder or a symlink is refused."""

from __future__ import annotations

import os
import shutil
import stat
import sys
import textwrap

import pytest
import torch

from normconv.io.ledger import Ledger
from tests.trust_helpers import fingerprint, hub_snapshot, index_of, one_line_error, saved_folder

FACTORY = "tests.fixtures.user_models:small_net"
SHAPE = ["-i", "x:2,3,8,8"]


@pytest.fixture
def user_project(tmp_path, monkeypatch):
    """A user's folder: a factory module importing a helper module, and a weights file the factory loads itself."""
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Conv2d(3, 4, 3), torch.nn.BatchNorm2d(4)).eval()
    torch.save(net.state_dict(), tmp_path / "trained.pt")
    from safetensors.torch import save_file

    save_file({"scale": torch.ones(4)}, tmp_path / "extra.safetensors")
    (tmp_path / "userhelpers.py").write_text("import torch.nn as nn\n\n"
                                            "def body():\n    return nn.Sequential(nn.Conv2d(3, 4, 3), "
                                            "nn.BatchNorm2d(4))\n")
    (tmp_path / "userfactory.py").write_text(textwrap.dedent(f"""
        import torch
        from userhelpers import body

        def make():
            net = body()
            net.load_state_dict(torch.load({str(tmp_path / 'trained.pt')!r}))  # read by the factory itself
            from safetensors.torch import load_file
            load_file({str(tmp_path / 'extra.safetensors')!r})  # read in Rust: no audit event
            return net.eval(), (torch.randn(2, 3, 8, 8),)
    """))
    monkeypatch.chdir(tmp_path)
    yield tmp_path
    for name in ("userfactory", "userhelpers"):
        sys.modules.pop(name, None)


@pytest.mark.parametrize("target", ["userfactory.py", "userhelpers.py", "trained.pt", "extra.safetensors"])
def test_the_factory_s_code_and_what_it_read_are_never_written(cli, user_project, target):
    path = user_project / target
    before = fingerprint(path)
    one_line_error(cli, "fold", "userfactory:make", "-o", path, match="refusing to overwrite")
    assert fingerprint(path) == before


def test_in_place_writes_over_the_model_only(cli, tmp_path):
    from tests.fixtures.user_models import small_net

    weights = tmp_path / "w.pt"
    torch.save(small_net().state_dict(), weights)
    one_line_error(cli, "fold", FACTORY, "--weights", weights, *SHAPE, "-o", weights, "--in-place",
                   match="refusing to overwrite")
    model = tmp_path / "model.pt"
    torch.save(torch.nn.Sequential(torch.nn.Conv2d(3, 4, 3), torch.nn.BatchNorm2d(4)).eval(), model)
    rc, _, err = cli("fold", model, "-i", "2,3,8,8", "-o", model, "--in-place")
    assert rc == 0, err


@pytest.mark.parametrize("link", ["hard", "symbolic"])
def test_a_link_to_what_was_read_is_the_same_file(cli, tmp_path, link):
    from tests.fixtures.user_models import small_net

    weights = tmp_path / "w.pt"
    torch.save(small_net().state_dict(), weights)
    alias = tmp_path / "alias.pt"
    (os.link if link == "hard" else os.symlink)(weights, alias)
    before = fingerprint(weights)
    one_line_error(cli, "fold", FACTORY, "--weights", weights, *SHAPE, "-o", alias,
                   match=("refusing to",))
    assert fingerprint(weights) == before and os.path.lexists(alias)


@pytest.mark.parametrize("kind", ["fifo", "device", "folder", "dangling symlink"])
def test_an_output_only_ever_replaces_a_regular_file(cli, tmp_path, kind):
    if kind == "device":
        out = "/dev/null"
    else:
        out = tmp_path / "out.pt"
        if kind == "fifo":
            os.mkfifo(out)
        elif kind == "folder":
            out.mkdir()
        else:
            os.symlink(tmp_path / "nowhere.pt", out)
    one_line_error(cli, "fold", "zoo:mlp", "-o", out, match="refusing to write")
    if kind == "device":
        assert stat.S_ISCHR(os.stat("/dev/null").st_mode)
    elif kind == "fifo":
        assert stat.S_ISFIFO(os.lstat(out).st_mode)
    elif kind == "dangling symlink":
        assert os.path.islink(out) and not (tmp_path / "nowhere.pt").exists()


def test_export_never_writes_its_data_file_over_what_was_read(cli, tmp_path):
    from tests.fixtures.user_models import small_net

    weights = tmp_path / "m.onnx.data"  # the name an external-data export of m.onnx writes beside it
    torch.save(small_net().state_dict(), weights)
    one_line_error(cli, "export", FACTORY, "--weights", weights, *SHAPE, "-o", tmp_path / "m.onnx", "--no-baseline",
                   match="refusing to overwrite")


@pytest.fixture(scope="module")
def template(tmp_path_factory):
    folder = tmp_path_factory.mktemp("ledger") / "gpt2"
    saved_folder(folder)
    return folder


def test_the_hub_cache_blob_a_snapshot_links_to_is_protected(cli, tmp_path, template):
    snap, blobs = hub_snapshot(tmp_path, template)
    shard = sorted(set(index_of(snap)["weight_map"].values()))[0]
    blob = (snap / shard).resolve()
    before = fingerprint(blobs)
    one_line_error(cli, "fold", snap, "-o", blob, match="refusing to overwrite")
    one_line_error(cli, "fold", snap, "-o", blobs / os.path.basename((snap / "config.json").resolve()),
                   match="refusing to overwrite")
    assert fingerprint(blobs) == before


def test_stream_output_never_lands_over_or_inside_what_it_reads(cli, tmp_path, template):
    snap, blobs = hub_snapshot(tmp_path, template)
    one_line_error(cli, "swap", snap, "--stream", "-o", snap / "sub", match="inside the input folder")
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    link = tmp_path / "link"
    os.symlink(snap, link)
    one_line_error(cli, "swap", snap, "--stream", "-o", link / "new", match="inside the input folder")


def test_the_ledger_records_what_a_block_opens(tmp_path):
    f = tmp_path / "read.bin"
    f.write_bytes(b"x")
    ledger = Ledger()
    with ledger.watching():
        with open(f, "rb"):
            pass
    assert f.resolve() in ledger.paths
    (tmp_path / "new.bin").write_bytes(b"y")  # written, not read: not recorded
    assert (tmp_path / "new.bin").resolve() not in ledger.paths


def test_the_ledger_resolves_every_path_as_realpath_and_stat_do(tmp_path, monkeypatch):
    # the ledger resolves a file through its folder's cached real path (a transformers load records ~7,000 paths):
    # on os.path.realpath's own edge cases it must name the same file realpath + stat name
    real_dir = tmp_path / "real"
    (real_dir / "sub").mkdir(parents=True)
    (real_dir / "sub" / "f.bin").write_bytes(b"x")
    (real_dir / "g.bin").write_bytes(b"y")
    (tmp_path / "dirlink").symlink_to(real_dir / "sub", target_is_directory=True)
    (tmp_path / "filelink").symlink_to(real_dir / "g.bin")
    (real_dir / "sub" / "chain").symlink_to(tmp_path / "filelink")  # a link to a link
    (real_dir / "rel").symlink_to("sub/f.bin")  # a relative link target
    monkeypatch.chdir(real_dir)
    cases = [real_dir / "sub" / "f.bin", tmp_path / "dirlink" / "f.bin", tmp_path / "filelink",
             real_dir / "sub" / "chain", real_dir / "rel",
             f"{tmp_path}/dirlink/../g.bin",  # ".." after a symlinked folder: the link's parent, not tmp_path
             f"{real_dir}/./sub/f.bin", "sub/f.bin", "./g.bin", f"{tmp_path}/dirlink/", str(tmp_path / "missing"),
             f"{tmp_path}//real//g.bin"]
    for case in cases:
        ledger = Ledger()
        ledger.record(case)
        expected = os.path.realpath(case)
        if not os.path.exists(expected):
            assert ledger.entries == {}, case
            continue
        st = os.stat(expected)
        (entry,) = ledger.entries.values()
        assert (str(entry.real), entry.ident) == (expected, (st.st_dev, st.st_ino)), case
    # a relative path names the file under the working folder of the moment: after a chdir, another file
    other = tmp_path / "other" / "sub"
    other.mkdir(parents=True)
    (other / "f.bin").write_bytes(b"z")
    ledger = Ledger()
    ledger.record("sub/f.bin")
    monkeypatch.chdir(tmp_path / "other")
    ledger.record("sub/f.bin")
    assert sorted(map(str, ledger.entries)) == sorted([os.path.realpath(real_dir / "sub" / "f.bin"),
                                                       os.path.realpath(other / "f.bin")])
    # the same path twice is one entry, and a later primary record still marks it primary
    ledger = Ledger()
    ledger.record(tmp_path / "filelink")
    ledger.record(tmp_path / "filelink", primary=True)
    assert [e.primary for e in ledger.entries.values()] == [True]
