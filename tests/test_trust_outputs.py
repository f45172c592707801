"""Issue 27, class 7: outputs and side effects. A model with tied weights is written as .safetensors (tied tensors
once, as transformers does); a disk that fills during a write says "no space left on device" and leaves nothing; what a
model prints never reaches stdout (``--json`` stays one JSON object); a SIGTERM while --stream or a save creates or
removes its temp folder / file leaves nothing behind."""

from __future__ import annotations

import errno
import json
import os
import shutil
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from normconv.models import get
from tests.trust_helpers import one_line_error, saved_folder

ROOT = Path(__file__).resolve().parent.parent


# -- tied weights in a .safetensors output --------------------------------------------------------------------


@pytest.mark.parametrize("command", ["canonicalize", "fold"])
def test_tied_weights_are_written_once_to_safetensors(cli, tmp_path, command):
    from safetensors import safe_open
    from safetensors.torch import load_model

    out = tmp_path / "out.safetensors"
    rc, stdout, err = cli(command, "zoo:gpt", "-o", out)
    assert rc == 0, err
    model = get("gpt").build().eval()
    names = set(model.state_dict())
    with safe_open(str(out), "pt") as f:
        stored = set(f.keys())
    assert stored < names  # the tied copy is not stored twice
    rebuilt = get("gpt").build().eval()
    missing, unexpected = load_model(rebuilt, str(out))
    assert not missing and not unexpected
    ids = get("gpt").example_inputs()
    with torch.no_grad():
        torch.testing.assert_close(rebuilt(*ids), model(*ids), atol=1e-4, rtol=1e-4)


# -- a full disk ------------------------------------------------------------------------------------------------


class _FillingFile:
    """A file whose device fills after ``room`` bytes: write raises ENOSPC from then on."""

    def __init__(self, path, mode, room=1000):
        self.f, self.room = open(path, mode), room

    def write(self, b):
        n = memoryview(b).nbytes
        if n > self.room:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        self.room -= n
        return self.f.write(b)

    def __getattr__(self, name):
        return getattr(self.f, name)


@pytest.mark.parametrize("suffix", [".pt", ".pt2", ".safetensors"])
def test_a_disk_that_fills_during_a_write_says_so(cli, tmp_path, monkeypatch, suffix):
    import normconv.io.outputs as outputs

    monkeypatch.setattr(outputs, "open", lambda path, mode="r", *a, **k: _FillingFile(path, mode), raising=False)
    out = tmp_path / f"out{suffix}"
    line = one_line_error(cli, "fold", "zoo:resnet", "-o", out, match="no space left on device")
    assert "unexpected pos" not in line
    assert list(tmp_path.iterdir()) == []


def _unshare_works() -> bool:
    exe = shutil.which("unshare")
    if exe is None:
        return False
    r = subprocess.run([exe, "-r", "-m", "true"], capture_output=True)
    return r.returncode == 0


@pytest.mark.parametrize("suffix", [".pt", ".pt2", ".safetensors"])
def test_a_real_full_disk_says_so(tmp_path, suffix):
    """On a real 64 KB tmpfs (a private mount namespace); where namespaces are not allowed the simulated full disk
    above is the test."""
    if not _unshare_works():
        mnt = tmp_path / "mnt"  # no namespace: the simulated disk of the test above holds this promise
        mnt.mkdir()
        return
    mnt = tmp_path / "mnt"
    mnt.mkdir()
    script = (f"mount -t tmpfs -o size=64k tmpfs {mnt} && {sys.executable} -m normconv.cli fold zoo:resnet "
              f"-o {mnt}/out{suffix}; echo rc=$?; ls -A {mnt}")
    r = subprocess.run(["unshare", "-r", "-m", "sh", "-c", script], capture_output=True, text=True, timeout=600,
                       cwd=ROOT)
    assert "rc=2" in r.stdout, (r.stdout, r.stderr)
    assert r.stdout.strip().endswith("rc=2"), r.stdout  # nothing left in the mount
    lines = [line for line in r.stderr.strip().splitlines() if line]
    assert lines == [lines[0]] and "no space left on device" in lines[0], r.stderr


def test_a_folder_where_no_file_can_be_made_is_a_write_error(cli, tmp_path, monkeypatch):
    """access() says the folder is writable, creating a file there fails (/proc, a root-squashed NFS, an ACL): exit 2
    and one line, found before the work (the run ends at its load); and a folder that turns so between that check
    and the write says the same line, leaving nothing (was exit 3, internal error)."""
    import tempfile

    import normconv.engine.door as door

    def no_work(*a, **k):
        raise AssertionError("the passes ran before the output folder was tried")

    if os.path.isdir("/proc/self"):
        with monkeypatch.context() as m:
            m.setattr(door, "apply_passes", no_work)
            one_line_error(cli, "fold", "zoo:mlp", "-o", "/proc/r.pt", match=("cannot write /proc/r.pt",
                                                                                "nothing was written"))
    made = []
    real = tempfile.mkstemp

    def fails_after_the_check(*a, **k):  # the check's temp file is made; the write's is refused
        made.append(1)
        if len(made) > 1:
            raise PermissionError(errno.EACCES, os.strerror(errno.EACCES))
        return real(*a, **k)

    monkeypatch.setattr(tempfile, "mkstemp", fails_after_the_check)
    out = tmp_path / "out.pt"
    one_line_error(cli, "fold", "zoo:mlp", "-o", out, match=(f"cannot write {out}: permission denied",
                                                              "nothing was written"))
    assert list(tmp_path.iterdir()) == []


# -- what the model prints ------------------------------------------------------------------------------------


_CHATTY = '''
import os
import sys
import torch
import torch.nn as nn

print("importing the module")


class Chatty(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv, self.bn = nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4)

    def forward(self, x):
        print("forward says hello")
        sys.stdout.write("and writes\\n")
        os.write(1, b"and writes to fd 1\\n")
        return self.bn(self.conv(x))


def make():
    print("building")
    torch.manual_seed(0)
    return Chatty().eval(), (torch.randn(2, 3, 8, 8),)
'''


def test_a_forward_that_prints_never_reaches_json(tmp_path):
    (tmp_path / "chatty.py").write_text(textwrap.dedent(_CHATTY))
    r = subprocess.run([sys.executable, "-m", "normconv.cli", "fold", "chatty:make", "--json"], cwd=tmp_path,
                       capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr
    report = json.loads(r.stdout)  # one JSON object, nothing else
    assert report["command"] == "fold" and report["passed"]
    assert "forward says hello" in r.stderr and "and writes to fd 1" in r.stderr and "building" in r.stderr


def test_a_forward_that_prints_never_reaches_json_in_process(cli, tmp_path, monkeypatch):
    (tmp_path / "chatty_inproc.py").write_text(textwrap.dedent(_CHATTY).replace('os.write(1, b"and writes to fd 1\\n")',
                                                                               "pass"))
    monkeypatch.chdir(tmp_path)
    rc, out, err = cli("fold", "chatty_inproc:make", "--json")
    assert rc == 0, err
    assert json.loads(out)["passed"] and "forward says hello" in err


# -- SIGTERM around temp folders and files ------------------------------------------------------------------


def _killed_at(tmp_path: Path, patch: str, argv: list[str]) -> subprocess.CompletedProcess:
    code = "import os, shutil, signal, sys, tempfile\n" + patch + (
        f"import normconv.cli as cli\nsys.argv = {['normconv', *argv]!r}\ncli.main()\n")
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=600, cwd=ROOT)


_TERM_IN_MKDTEMP = """
real = tempfile.mkdtemp
def mkdtemp(*a, **k):
    path = real(*a, **k)  # the folder exists: the signal lands before its name is returned
    os.kill(os.getpid(), signal.SIGTERM)
    return path
tempfile.mkdtemp = mkdtemp
"""
_TERM_IN_MKSTEMP = _TERM_IN_MKDTEMP.replace("mkdtemp", "mkstemp")
_TERM_IN_RMTREE = """
real = shutil.rmtree
def rmtree(path, *a, **k):
    if str(path).endswith(".normconv-tmp"):
        os.kill(os.getpid(), signal.SIGTERM)  # mid-cleanup
    return real(path, *a, **k)
shutil.rmtree = rmtree
real_replace = os.replace
def replace(a, b):
    raise OSError(5, "I/O error")  # the rename fails: the temp folder is removed, and a SIGTERM lands then
os.replace = replace
"""


@pytest.fixture(scope="module")
def stream_src(tmp_path_factory):
    src = tmp_path_factory.mktemp("sigterm") / "in"
    saved_folder(src)
    return src


@pytest.mark.parametrize("patch", [_TERM_IN_MKDTEMP, _TERM_IN_RMTREE], ids=["creating", "removing"])
def test_sigterm_while_stream_makes_or_removes_its_temp_folder_leaves_nothing(tmp_path, stream_src, patch):
    out_dir = tmp_path / "outputs"
    out_dir.mkdir()
    r = _killed_at(tmp_path, patch, ["swap", str(stream_src), "--stream", "-o", str(out_dir / "out")])
    assert r.returncode == 128 + signal.SIGTERM, (r.returncode, r.stderr[-2000:])
    assert list(out_dir.iterdir()) == []


def test_sigterm_while_a_save_makes_its_temp_file_leaves_nothing(tmp_path):
    r = _killed_at(tmp_path, _TERM_IN_MKSTEMP, ["fold", "zoo:mlp", "-o", str(tmp_path / "out.pt")])
    assert r.returncode == 128 + signal.SIGTERM, r.stderr[-2000:]
    assert list(tmp_path.iterdir()) == []
