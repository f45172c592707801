"""normconv's promises, tried as a hostile or careless user would: nothing from a file runs without an opt-in,
nothing the user gave is changed or overwritten, and a check that compared nothing is not a pass.
Each test fails without the fix it names."""

from __future__ import annotations

import io
import json
import os
import shutil
import signal
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest
import torch
import torch.nn as nn

import normconv
from normconv.errors import NormconvError
from normconv.io.load import load
from normconv.io.write import save
from normconv.models import ZOO, get

ROOT = Path(__file__).resolve().parent.parent


def _one_line_error(cli, *args, match: str, code: int = 2) -> str:
    rc, out, err = cli(*args)
    assert rc == code, (rc, out, err)
    lines = [line for line in err.strip().splitlines() if line]
    assert len(lines) == 1 and lines[0].startswith("error: ") and match in lines[0], err
    assert "Traceback" not in out + err
    return lines[0]


def _console(*args, cwd, env=None, timeout=300):
    exe = shutil.which("normconv", path=os.path.dirname(sys.executable)) or shutil.which("normconv")
    if exe is None:
        pytest.skip("the normconv console script is not installed")
    return subprocess.run([exe, *map(str, args)], cwd=cwd, capture_output=True, text=True, timeout=timeout,
                          stdin=subprocess.DEVNULL, env=env)


# -- code never runs without an opt-in -----------------------------------------------------------------------


class _RunsCode:
    """Unpickling this calls os.system: what a hostile file would do."""

    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def _hostile_pt2(tmp_path: Path) -> tuple[Path, Path]:
    """A real .pt2 whose example-inputs pickle runs code when unpickled with weights_only=False."""
    marker = tmp_path / "pwned"
    model = nn.Sequential(nn.Linear(4, 4), nn.LayerNorm(4)).eval()
    good = tmp_path / "good.pt2"
    torch.export.save(torch.export.export(model, (torch.randn(2, 4),)), good)
    buf = io.BytesIO()
    torch.save(((_RunsCode(marker),), {}), buf)
    bad = tmp_path / "bad.pt2"
    with zipfile.ZipFile(good) as src, zipfile.ZipFile(bad, "w") as dst:
        for item in src.infolist():
            data = buf.getvalue() if item.filename.endswith("sample_inputs/model.pt") else src.read(item)
            dst.writestr(item, data)
    return bad, marker


def test_pt2_pickles_go_through_weights_only(cli, tmp_path):
    bad, marker = _hostile_pt2(tmp_path)
    line = _one_line_error(cli, "inspect", bad, match="refusing to load")
    assert "system" in line and "--trust-pickle" in line  # the global it would import is named
    assert not marker.exists(), "the archive's pickle ran code"


def test_hf_folder_with_remote_code_is_refused_without_a_prompt(tmp_path):
    from hf_tiny import TINY

    model, _ = TINY["bert"]()
    folder = tmp_path / "remote"
    model.save_pretrained(folder)
    config = json.loads((folder / "config.json").read_text())
    config["auto_map"] = {"AutoModel": "modeling_evil.EvilModel"}
    (folder / "config.json").write_text(json.dumps(config))
    (folder / "modeling_evil.py").write_text(f"open({str(tmp_path / 'pwned')!r}, 'w').close()\n")
    r = _console("inspect", folder, cwd=tmp_path)  # stdin closed: a prompt would hang or fail, not pass
    assert r.returncode == 2, r.stderr
    assert r.stderr.count("\n") == 1 and "--trust-remote-code" in r.stderr and "auto_map" in r.stderr
    assert not (tmp_path / "pwned").exists()


def test_current_folder_never_shadows_installed_packages(tmp_path):
    """A rich.py / onnx.py / typer.py where the user runs normconv is not imported; a factory there still is."""
    marker = tmp_path / "shadowed"
    for name in ("rich", "onnx", "typer", "onnxruntime"):
        (tmp_path / f"{name}.py").write_text(f"open({str(marker)!r}, 'a').write({name!r})\n")
    (tmp_path / "mymodel.py").write_text(
        "import torch\n"
        "def build():\n"
        "    return torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.LayerNorm(8)), (torch.randn(2, 8),)\n")
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    r = _console("inspect", "zoo:mlp", "--json", cwd=tmp_path, env=env)
    assert r.returncode == 0, r.stderr
    r = _console("inspect", "mymodel:build", "--json", cwd=tmp_path, env=env)
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout)["extra"]["counts"] == {"layernorm": 1}
    assert not marker.exists(), f"imported from the current folder: {marker.read_text()}"


class _UserClass(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, x):
        return self.lin(x)


@pytest.mark.parametrize("text", ["garbage, not a model\n", "hello world\n", '{"a": 1}\n', "import torch\n" * 200,
                                  "température é\n" * 100])
def test_a_text_file_is_not_called_a_pickle(cli, tmp_path, text):
    """Text of any kind (a script, JSON, notes) is named as text before torch.load sees it: a file starting with
    'e' used to end in "KeyError: 101" (pickle's opcode table)."""
    path = tmp_path / "notes.pt"
    path.write_text(text, encoding="utf-8")
    line = _one_line_error(cli, "fold", path, "-o", tmp_path / "out.pt", match="neither a zip archive nor a pickle")
    assert "it is text" in line and "package.module:factory" in line and "Error" not in line
    assert sorted(p.name for p in tmp_path.iterdir()) == ["notes.pt"]


def test_old_format_pickle_refusal_lists_its_globals(cli, tmp_path):
    path = tmp_path / "legacy.pt"
    torch.save(_UserClass(), path, _use_new_zipfile_serialization=False)
    line = _one_line_error(cli, "inspect", path, "-i", "x:2,4", match="refusing to unpickle")
    assert "_UserClass" in line and "could not be listed" not in line


# -- the user's files and models are never harmed ------------------------------------------------------------


def test_output_over_an_input_is_refused(cli, tmp_path):
    weights = tmp_path / "w.pt"
    from tests.fixtures.user_models import small_net

    torch.save(small_net().state_dict(), weights)
    before = weights.read_bytes()
    _one_line_error(cli, "fold", "tests.fixtures.user_models:small_net", "--weights", weights, "-i", "x:2,3,8,8",
                    "-o", weights, match="refusing to overwrite")
    assert weights.read_bytes() == before


def test_output_inside_the_input_folder_is_refused(cli, hf_folders, tmp_path):
    folder = tmp_path / "bert"
    shutil.copytree(hf_folders["bert"], folder)
    config = (folder / "config.json").read_bytes()
    _one_line_error(cli, "fold", folder, "-o", folder / "config.json", match="inside the input folder")
    assert (folder / "config.json").read_bytes() == config


def _state(model: nn.Module) -> dict[str, bytes]:
    return {k: v.detach().reshape(-1).clone().view(torch.uint8).numpy().tobytes() if v.numel() else b""
            for k, v in model.state_dict(keep_vars=True).items()}


COMMANDS = {
    "fold": lambda m, x: normconv.fold(m, x, eval_mode=True),
    "canonicalize": lambda m, x: normconv.canonicalize(m, x),
    "swap": lambda m, x: normconv.swap(m, x, approximate=True),
    "deepnorm": lambda m, x: normconv.deepnorm(m, x),
    "inspect": lambda m, x: normconv.inspect(m, x),
}


@pytest.mark.parametrize("name", sorted(ZOO))
def test_no_command_changes_a_training_mode_model(name):
    """Every zoo model, saved in training mode (BN statistics live), through every command: the user's model is
    bit-identical afterwards, flags included, whether the command succeeds or refuses."""
    z = get(name)
    model = z.build().train()
    inputs = z.example_inputs()
    before, flags = _state(model), [m.training for m in model.modules()]
    for command, call in COMMANDS.items():
        try:
            call(model, inputs)
        except NormconvError:
            pass  # a refusal is fine (no LayerNorm to swap, no post-LN site): the model must still be untouched
        assert _state(model) == before, f"{command} changed {name}"
        assert [m.training for m in model.modules()] == flags, f"{command} changed {name}'s modes"


def test_fold_eval_of_a_training_mode_file_equals_model_eval(cli, tmp_path):
    """Before: the example-input check ran a training-mode forward and moved the running statistics."""
    z = get("resnet")
    model = z.build()
    with torch.no_grad():  # statistics that differ from the defaults
        for m in model.modules():
            if isinstance(m, nn.BatchNorm2d):
                m.running_mean.uniform_(-1, 1)
                m.running_var.uniform_(0.5, 2)
    model.train()
    src, out = tmp_path / "train.pt", tmp_path / "folded.pt"
    torch.save(model, src)
    data = src.read_bytes()
    rc, stdout, stderr = cli("fold", src, "--eval", "-o", out, "-i", "x:2,3,32,32")
    assert rc == 0, stderr
    assert src.read_bytes() == data
    folded = torch.load(out, weights_only=False)
    x = z.example_inputs()[0]
    with torch.no_grad():
        torch.testing.assert_close(folded.eval()(x), model.eval()(x), atol=1e-4, rtol=1e-4)


def test_interrupted_write_leaves_nothing(tmp_path, monkeypatch):
    loaded = load("zoo:mlp")
    real = torch.save

    def interrupted(obj, f, *a, **kw):
        real(obj, f, *a, **kw)  # the temp file is full size when the user hits Ctrl-C
        raise KeyboardInterrupt

    monkeypatch.setattr(torch, "save", interrupted)
    with pytest.raises(KeyboardInterrupt):
        save(loaded, loaded.model, tmp_path / "out.pt")
    assert list(tmp_path.iterdir()) == []


def test_sigterm_during_a_write_leaves_nothing(tmp_path):
    out = tmp_path / "out.pt"
    code = (
        "import os, signal, sys, torch\n"
        "import normconv.cli as cli\n"
        "real = torch.save\n"
        "def slow(*a, **k):\n"
        "    real(*a, **k)\n"
        "    os.kill(os.getpid(), signal.SIGTERM)\n"
        "torch.save = slow\n"
        f"sys.argv = ['normconv', 'fold', 'zoo:mlp', '-o', {str(out)!r}]\n"
        "cli.main()\n")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert r.returncode == 128 + signal.SIGTERM, r.stderr
    assert list(tmp_path.iterdir()) == []
    assert r.stderr.strip().splitlines()[-1] == "error: terminated (SIGTERM)"
    # --json: stdout is still one object, as for every other failure (it was empty)
    r = subprocess.run([sys.executable, "-c", code.replace("'-o',", "'--json', '-o',")], capture_output=True,
                       text=True, timeout=300)
    obj = json.loads(r.stdout)
    assert r.returncode == 143 and obj == {"passed": False, "error": "terminated (SIGTERM)", "code": "terminated",
                                            "exit_code": 143}, r.stderr
    assert list(tmp_path.iterdir()) == []


def test_stale_temp_files_of_a_killed_run_are_removed(tmp_path):
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    stale = tmp_path / f".out.pt.{dead.pid}.abc123.normconv-tmp"
    stale.write_bytes(b"x" * 1000)
    mine = tmp_path / "unrelated.normconv-tmp"
    mine.write_bytes(b"keep")
    loaded = load("zoo:mlp")
    save(loaded, loaded.model, tmp_path / "out.pt")
    assert not stale.exists() and mine.exists() and (tmp_path / "out.pt").is_file()


def test_output_errors_are_the_users_situation(cli, tmp_path, monkeypatch):
    parent_file = tmp_path / "afile"
    parent_file.write_text("")
    _one_line_error(cli, "fold", "zoo:mlp", "-o", parent_file / "out.pt", match="is a file, not a folder")

    def disk_full(*a, **k):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(torch, "save", disk_full)
    _one_line_error(cli, "fold", "zoo:mlp", "-o", tmp_path / "out.pt", match="no space left")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["afile"]


class _FullFile:
    """A file on a device with no room left: every write raises ENOSPC."""

    def __init__(self, path, mode="r", *a, **k):
        self.f = open(path, mode, *a, **k)

    def write(self, b):
        raise OSError(28, "No space left on device")

    def __getattr__(self, name):
        return getattr(self.f, name)


def test_export_disk_full_is_one_line_and_leaves_nothing(cli, tmp_path, monkeypatch):
    import normconv.io.outputs as outputs

    monkeypatch.setattr(outputs, "open", _FullFile, raising=False)  # the writer the ONNX file goes through
    _one_line_error(cli, "export", "zoo:mlp", "-o", tmp_path / "m.onnx", "--no-baseline", match="no space left")
    assert list(tmp_path.iterdir()) == []


# -- a check must prove something --------------------------------------------------------------------------


class _WritesBuffer(nn.Module):
    """Returns nothing: writes its result into a buffer."""

    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(3, 4, 3)
        self.bn = nn.BatchNorm2d(4)
        self.register_buffer("result", torch.zeros(2, 4, 6, 6))

    def forward(self, x):
        self.result.copy_(self.bn(self.conv(x)))


class _ReturnsNothing(nn.Module):
    def __init__(self):
        super().__init__()
        self.bn = nn.BatchNorm1d(4)

    def forward(self, x):
        self.bn(x)


def test_a_model_that_writes_a_buffer_is_checked_on_what_it_wrote():
    model = _WritesBuffer().eval()
    with torch.no_grad():
        model.bn.running_mean.uniform_(-1, 1)
    folded, report = normconv.fold(model, torch.randn(2, 3, 8, 8))
    v = report.validation[0]
    assert v.passed and len(v.outputs) == 1 and "buffer result" in v.outputs[0].name
    assert torch.count_nonzero(model.result) == 0  # the check's own forward left the user's buffer alone


def test_nothing_compared_is_not_a_pass():
    with pytest.raises(normconv.VerificationError, match="nothing compared"):
        normconv.fold(_ReturnsNothing().eval(), torch.randn(2, 4))


def _zero_head():
    """torchvision's ViT as built: the classifier head is zero-initialized, so every output is 0 for any input."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.LayerNorm(8), nn.Linear(8, 3)).eval()
    nn.init.zeros_(model[2].weight)
    nn.init.zeros_(model[2].bias)
    return model


@pytest.mark.parametrize("command", ["fold", "canonicalize", "swap"])
def test_all_zero_outputs_are_nothing_compared(command):
    # any rewrite (a wrong one too) matches 0 == 0: the check proved nothing, so it is not a pass
    with pytest.raises(normconv.VerificationError, match=r"nothing compared \(every output is 0 on the example "
                                                        r"inputs.*; nothing written"):
        getattr(normconv, command)(_zero_head(), torch.randn(2, 4))


def test_all_zero_outputs_exit_1_and_write_nothing(cli, tmp_path):
    path = tmp_path / "zero.pt"
    torch.save(_zero_head(), path)
    out = tmp_path / "out.pt"
    code, _, err = cli("swap", path, "--trust-pickle", "--input-shape", "input:2,4", "-o", out)
    assert code == 1 and "nothing compared (every output is 0" in err and not out.exists()


def test_a_second_shape_whose_outputs_are_all_zero_is_replaced_by_one_that_compares():
    # batch 1 cycles the example's first row; through a final ReLU that row can give all zeros (found by
    # hypothesis in CI): the second-shape check moves to batch + 1 instead of failing or comparing nothing
    model = nn.Sequential(nn.Linear(3, 3), nn.BatchNorm1d(3), nn.ReLU()).eval()
    with torch.no_grad():
        model[0].weight.copy_(torch.eye(3))
        model[0].bias.zero_()
    x = torch.ones(4, 3)
    x[0] = -1.0
    folded, report = normconv.fold(model, x)
    second = report.validation[1]
    assert second.passed and "(5, 3)" in second.label and second.max_abs_error < 1e-5
    assert torch.count_nonzero(folded(x[:1])) == 0  # batch 1 would have compared nothing


class _BatchBranch(nn.Module):
    """BatchNorm only when batch > 1: one capture sees one path."""

    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(3, 4, 3)
        self.bn = nn.BatchNorm2d(4)

    def forward(self, x):
        y = self.conv(x)
        return self.bn(y) if x.shape[0] > 1 else y


def test_rewrite_checked_at_a_second_shape():
    model = _BatchBranch().eval()
    with torch.no_grad():
        model.bn.running_mean.uniform_(-1, 1)
        model.bn.running_var.uniform_(0.5, 2)
    with pytest.raises(normconv.VerificationError, match="second shape"):
        normconv.fold(model, torch.randn(2, 3, 8, 8))


def test_second_shape_is_reported_where_dimensions_are_free():
    z = get("gpt")
    _, report = normconv.swap(z.build().eval(), z.example_inputs())
    labels = [v.label for v in report.validation]
    assert len(labels) == 2 and "second shape" in labels[1] and report.passed


@pytest.mark.parametrize("command", ["inspect", "fold", "canonicalize", "export"])
def test_every_command_works_on_a_pt2(cli, tmp_path, command):
    z = get("resnet")
    model = z.build().eval()
    path = tmp_path / "resnet.pt2"
    torch.export.save(torch.export.export(model, tuple(z.example_inputs())), path)
    data = path.read_bytes()
    out = tmp_path / ("out.onnx" if command == "export" else "out.pt2")
    args = [command, path] + ([] if command == "inspect" else ["-o", out])
    rc, stdout, stderr = cli(*args, *(["--no-baseline", "--repeats", "0"] if command == "export" else []))
    assert rc == 0, stderr
    assert path.read_bytes() == data
    if command in ("fold", "canonicalize"):  # the written program runs and equals the original
        rewritten = torch.export.load(out).module()
        x = z.example_inputs()[0]
        with torch.no_grad():
            torch.testing.assert_close(rewritten(x), model(x), atol=1e-4, rtol=1e-4)
    if command == "fold":  # the program's functional convs were lifted to modules and every BN folded into them
        report = json.loads(cli(command, path, "-o", tmp_path / "again.pt2", "--json")[1])
        assert [s["applied"] for s in report["sites"] if s["pass"] == "fold"] == [True] * 8
        assert not any("batch_norm" in str(n.target) for n in torch.export.load(out).graph.nodes)


def test_pt2_exported_in_training_mode_is_read_as_such(cli, tmp_path):
    model = nn.Sequential(nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4)).train()
    path = tmp_path / "train.pt2"
    torch.export.save(torch.export.export(model, (torch.randn(2, 3, 8, 8),)), path)
    _one_line_error(cli, "fold", path, match="training mode")


# -- flags and odd models ----------------------------------------------------------------------------------


def test_empty_dimension_is_an_error(cli):
    _one_line_error(cli, "inspect", "tests.fixtures.user_models:small_net", "-i", "x:1,,3", match="single commas")


def test_input_larger_than_memory_is_refused_before_allocating(cli):
    _one_line_error(cli, "inspect", "tests.fixtures.user_models:small_net", "-i", "x:100000,100000,100000",
                    match="GiB")


def test_dtype_offers_float_types_only(cli):
    _one_line_error(cli, "inspect", "zoo:mlp", "--dtype", "int64", match="float dtype")


def test_factory_calling_sys_exit_is_an_error(cli, tmp_path, monkeypatch):
    (tmp_path / "exits.py").write_text("import sys\ndef build():\n    sys.exit(0)\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    _one_line_error(cli, "inspect", "exits:build", match="sys.exit")


@pytest.mark.parametrize("source, why", [("def ok(:\n", "SyntaxError: "),
                                         ("raise ValueError('boom at import')\n", "ValueError: boom at import")])
def test_factory_module_failing_at_import_is_a_user_error(cli, tmp_path, monkeypatch, source, why):
    """A module that fails to import with anything but ImportError (its own SyntaxError, a raise at import) is the
    user's mistake: exit 2 naming the module and the error (was exit 3, internal error)."""
    (tmp_path / "broken_at_import.py").write_text(source)
    monkeypatch.syspath_prepend(str(tmp_path))
    line = _one_line_error(cli, "inspect", "broken_at_import:ok", "-i", "2,16",
                           match="cannot import 'broken_at_import' for broken_at_import:ok: ")
    assert why in line


class _KeywordOnly(nn.Module):
    def __init__(self):
        super().__init__()
        self.ln = nn.LayerNorm(8)

    def forward(self, *, x):
        return self.ln(x)


def test_keyword_only_forward_gets_keywords(tmp_path, monkeypatch):
    (tmp_path / "kwonly.py").write_text(
        "from tests.test_trust import _KeywordOnly\ndef build():\n    return _KeywordOnly()\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    loaded = load("kwonly:build", input_shapes=["x:2,8"])
    assert loaded.inputs.args == () and set(loaded.inputs.kwargs) == {"x"}
    assert normconv.inspect(loaded.model, loaded.inputs).extra["counts"] == {"layernorm": 1}


def test_truncated_pt2_and_torchscript_say_one_line(cli, tmp_path):
    model = nn.Sequential(nn.Linear(4, 4)).eval()
    good = tmp_path / "m.pt2"
    torch.export.save(torch.export.export(model, (torch.randn(2, 4),)), good)
    cut = tmp_path / "cut.pt2"
    cut.write_bytes(good.read_bytes()[: good.stat().st_size // 2])
    _one_line_error(cli, "inspect", cut, match="not a torch.export program")
    ts = tmp_path / "scripted.pt"
    torch.jit.save(torch.jit.script(model), ts)
    _one_line_error(cli, "inspect", ts, match="TorchScript")


def test_second_shape_of_an_image_model_changes_the_image_size():
    # batch alone would leave every spatial size as the capture saw it (a reshape baked to 32x32 goes unnoticed)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU(), nn.AdaptiveAvgPool2d(1),
                          nn.Flatten(), nn.Linear(8, 4)).eval()
    _, report = normconv.fold(model, torch.randn(2, 3, 32, 32))
    assert [v.label for v in report.validation] == ["torch", "torch, second shape ((1, 3, 64, 64):float32)"]
    fixed = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), nn.Flatten(), nn.Linear(8 * 32 * 32, 4))
    _, report = normconv.fold(fixed.eval(), torch.randn(2, 3, 32, 32))  # takes 32x32 only: the batch changes
    assert report.validation[1].label == "torch, second shape ((1, 3, 32, 32):float32)"


class _SkipNet(nn.Module):
    """Three stride-2 convs down, nearest upsampling back, each level joined to its skip: a side must be a multiple
    of 8 (the skips' sizes must match)."""

    def __init__(self):
        super().__init__()
        self.down = nn.ModuleList(nn.Sequential(nn.Conv2d(4, 4, 3, 2, 1), nn.BatchNorm2d(4)) for _ in range(3))
        self.up = nn.ModuleList(nn.Conv2d(8, 4, 1) for _ in range(3))

    def forward(self, x):
        skips = []
        for d in self.down:
            skips.append(x)
            x = d(x)
        for u, s in zip(self.up, reversed(skips)):
            x = u(torch.cat([nn.functional.interpolate(x, scale_factor=2.0), s], 1))
        return x


@pytest.mark.parametrize("side,other", [(8, 16), (40, 48), (24, 32), (224, 192)])
def test_the_second_image_size_keeps_every_stride_the_example_fits(side, other):
    # moved by the largest power of two dividing the side (at most 32): a multiple of 8 stays one, so the skips of a
    # stride-8 net still meet; a small example's check stays small (8 -> 16, where +32 made 40: 25x the pixels)
    torch.manual_seed(0)
    model = _SkipNet().eval()
    _, report = normconv.fold(model, torch.randn(1, 4, side, side))
    assert report.validation[1].label == f"torch, second shape ((2, 4, {other}, {other}):float32)"
    assert report.passed


class _WindowToImage(nn.Module):
    """Swin's set_shift_and_window_size: the forward shrinks its window to an image smaller than it, and keeps
    that window for later calls."""

    def __init__(self):
        super().__init__()
        self.conv, self.bn, self.window = nn.Conv2d(3, 4, 3, padding=1), nn.BatchNorm2d(4), 80

    def forward(self, x):
        self.window = min(self.window, x.shape[-1])
        y = self.bn(self.conv(x))
        return y[..., : self.window, : self.window].mean((-2, -1))


@pytest.mark.parametrize("command", ["fold", "canonicalize", "export"])
def test_the_checks_at_a_second_shape_leave_the_model_and_the_result_as_they_were(command, tmp_path):
    torch.manual_seed(0)
    model = _WindowToImage().eval()
    x = torch.randn(1, 3, 96, 96)  # the second shape is 64 x 64: smaller than the window
    if command == "export":
        normconv.export(model, x, tmp_path / "m.onnx")
        new = None
    else:
        new, report = getattr(normconv, command)(model, x)
        assert report.validation[-1].label.startswith("torch, second shape ((2, 3, 64, 64)")
    assert model.window == 80  # the user's model: its forward never ran at the second shape
    if new is not None:
        assert new.window == 80  # nor did the result's, which is returned as the original was
        torch.testing.assert_close(new(x), model(x), atol=1e-5, rtol=1e-4)


class _RandomMasking(nn.Module):
    """MAE-style random masking in the forward: every call draws new noise."""

    def __init__(self):
        super().__init__()
        self.conv, self.bn = nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4)

    def forward(self, x):
        y = self.bn(self.conv(x))
        keep = torch.rand(y.shape[0], 1, *y.shape[2:]) > 0.5
        return y * keep


def test_random_ops_draw_the_same_numbers_in_the_original_and_the_rewrite():
    model = _RandomMasking().eval()
    with torch.no_grad():
        model.bn.running_mean.uniform_(-1, 1)
    x = torch.randn(2, 3, 8, 8)
    torch.manual_seed(123)
    state = torch.get_rng_state()
    folded, report = normconv.fold(model, x)
    assert report.passed and report.validation[0].max_abs_error < 1e-5
    assert sum(s.applied for s in report.sites) == 1
    assert torch.equal(torch.get_rng_state(), state)  # the caller's random stream is left where it was


def test_every_test_the_readme_s_guarantees_name_exists():
    """The README's promises section names the tests that hold each promise: every one of them exists."""
    import re

    text = (ROOT / "README.md").read_text()
    section = text[text.index("## Guarantees"):text.index("## How it works")]
    files = re.findall(r"`(tests/test_\w+\.py)`", section)
    names = set(re.findall(r"`(test_\w+)`", section))
    assert len(files) >= 8 and len(names) >= 10
    assert all((ROOT / f).is_file() for f in files), files
    sources = "".join(p.read_text() for p in (ROOT / "tests").glob("test_*.py"))
    assert [n for n in names if f"def {n}(" not in sources] == []
