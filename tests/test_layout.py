"""The architecture as tests: imports run one way (cli -> flow/api -> passes, onnx -> graph -> core), passes
hold passes only, and the top-level Python API reads like the command line."""

from __future__ import annotations

import ast
import pathlib

import pytest
import torch
import torch.nn as nn

import normconv
from normconv.models import get

ROOT = pathlib.Path(__file__).resolve().parent.parent
# layer of each package / module: a module may import its own package and anything of a lower layer
# stream: the streaming flow (checkpoint -> passes' edits -> shards), under the api that offers it
LAYERS = {"cli": 4, "api": 3, "flow": 3, "stream": 2.9, "passes": 2, "onnx": 2, "graph": 1,
          # the core, itself ordered: io loads and saves (checks with verify), verify reports (and runs its checks
          # on clones), all raise errors
          "io": 0.3, "outputs": 0.25, "verify": 0.2, "selections": 0.18, "clone": 0.15, "report": 0.1, "nn": 0.1, "errors": 0, "quiet": 0, "models": 0}


def _unit(module: str) -> str:
    """normconv.graph.detect -> graph; normconv.passes.fold_batchnorm -> passes; normconv.io -> io."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else ""


def _modules():
    for folder, package in (("normconv", "normconv"), ("passes", "normconv.passes"), ("models", "normconv.models")):
        for path in (ROOT / folder).rglob("*.py"):
            rel = path.relative_to(ROOT / folder).with_suffix("")
            name = ".".join([package, *[p for p in rel.parts if p != "__init__"]])
            yield name, path


def _imports(path: pathlib.Path, name: str) -> set[str]:
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.add(node.module)
        elif isinstance(node, ast.ImportFrom) and node.level:  # relative: resolve against the package
            base = name.split(".")[: -node.level] if not path.name == "__init__.py" else name.split(".")[: len(
                name.split(".")) - node.level + 1]
            found.add(".".join(base + ([node.module] if node.module else [])))
        elif isinstance(node, ast.Import):
            found.update(a.name for a in node.names)
    return {m for m in found if m == "normconv" or m.startswith("normconv.")}


def test_imports_run_one_way():
    wrong = []
    for name, path in _modules():
        unit = _unit(name)
        if unit not in LAYERS:  # normconv/__init__ (lazy API attribute lookup) and __main__ shims
            continue
        for imported in _imports(path, name):
            target = _unit(imported)
            if target in ("", unit) or target not in LAYERS:
                continue
            if LAYERS[target] >= LAYERS[unit] or (unit, target) in (("onnx", "passes"), ("passes", "onnx")):
                wrong.append(f"{name} imports {imported}")
    assert not wrong, "imports against the architecture:\n" + "\n".join(wrong)


def test_passes_hold_passes_only():
    """No pass reads flags, knows output paths or writes files."""
    banned = ("typer", "normconv.io", "normconv.cli", "normconv.flow", "check_output_path", "open(", "sys.argv")
    for path in (ROOT / "passes").glob("*.py"):
        text = path.read_text()
        hits = [b for b in banned if b in text]
        assert not hits, f"{path.name} does command work: {hits}"


def test_package_imports_without_cycles():
    """Each package imports on its own, in a fresh interpreter (a cycle fails at import time)."""
    import subprocess
    import sys

    for module in ("normconv.graph", "normconv.onnx.export", "normconv.passes.swap_norm", "normconv.flow",
                   "normconv.api", "normconv.cli"):
        r = subprocess.run([sys.executable, "-c", f"import {module}"], capture_output=True, text=True)
        assert r.returncode == 0, f"{module}: {r.stderr.strip().splitlines()[-1]}"


def _state_bytes(model: nn.Module) -> dict[str, bytes]:
    return {k: v.detach().reshape(-1).clone().view(torch.uint8).numpy().tobytes() if v.numel() else b""
            for k, v in model.state_dict(keep_vars=True).items()}


@pytest.mark.parametrize("command", ["fold", "canonicalize", "swap", "deepnorm", "inspect"])
def test_api_reads_like_the_cli_and_never_changes_the_model(command, tmp_path):
    """normconv.<command>(model, inputs): result + report; the user's model is bit-identical afterwards, and
    every tensor the pass did not rewrite is shared with it, not copied."""
    name = {"fold": "resnet", "canonicalize": "tutorial_ln", "swap": "gpt", "deepnorm": "bert",
            "inspect": "llama"}[command]
    z = get(name)
    model, inputs = z.build().eval(), z.example_inputs()
    before = _state_bytes(model)
    flags = [m.training for m in model.modules()]
    result = getattr(normconv, command)(model, inputs)
    assert _state_bytes(model) == before and [m.training for m in model.modules()] == flags
    if command == "inspect":
        assert result.sites and all(s["plan"] for s in result.sites)
        return
    new, report = result
    assert new is not model and report.validation and report.validation[0].outputs
    if command != "deepnorm":
        assert report.passed
        with torch.no_grad():
            out_new, out_old = new(*inputs), model(*inputs)
        torch.testing.assert_close(out_new, out_old, atol=1e-4, rtol=1e-4)
    old = dict(model.named_parameters())
    shared = [k for k, p in new.named_parameters() if k in old and p is old[k]]
    changed = [k for k, p in new.named_parameters() if k in old and p is not old[k]]
    assert shared, "untouched tensors must be shared, not copied"
    for k in changed:  # a tensor the pass replaced is a new tensor; the user's keeps its bytes (checked above)
        assert new.get_parameter(k).data_ptr() != old[k].data_ptr()


def test_export_api_writes_validated_onnx(tmp_path):
    z = get("mlp")
    report = normconv.export(z.build().eval(), z.example_inputs(), tmp_path / "m.onnx", baseline=False, repeats=0)
    assert report.passed and (tmp_path / "m.onnx").is_file()
    assert any(v.label.startswith("onnxruntime") for v in report.validation)


def test_api_refusal_is_a_normconv_error():
    with pytest.raises(normconv.NormconvError, match="torch.nn.Module"):
        normconv.fold("not a model", torch.randn(1))


def test_readme_python_api_block_runs(tmp_path, monkeypatch):
    """The README's Python API example runs as written (in a scratch folder: it writes resnet.onnx)."""
    import re

    text = (ROOT / "README.md").read_text()
    blocks = re.findall(r"```python\n(.*?)```", text, flags=re.S)
    assert blocks, "the README has a Python API example"
    monkeypatch.chdir(tmp_path)
    for block in blocks:
        exec(compile(block, "README.md", "exec"), {"__name__": "readme"})
    assert (tmp_path / "resnet.onnx").is_file()


def test_wheel_ships_every_package():
    """A non-editable install ships only the packages pyproject lists: every folder with an __init__.py must be
    there (normconv.cli, .graph, .onnx and .nn were missing, so `pip install .` gave a tool that could not start)."""
    import tomllib

    root = pathlib.Path(__file__).resolve().parents[1]
    conf = tomllib.loads((root / "pyproject.toml").read_text())["tool"]["setuptools"]
    dirs = conf.get("package-dir", {})

    def folder(name: str) -> pathlib.Path:
        for prefix in sorted(dirs, key=len, reverse=True):  # longest mapped prefix wins, as in setuptools
            if name == prefix or name.startswith(prefix + "."):
                return root / dirs[prefix] / name[len(prefix):].lstrip(".").replace(".", "/")
        return root / name.replace(".", "/")

    listed = {folder(n).resolve() for n in conf["packages"]}
    found = {p.parent.resolve() for top in {folder(n) for n in conf["packages"]} for p in top.rglob("__init__.py")
             if "__pycache__" not in p.parts}
    assert found - listed == set(), f"packages missing from pyproject: {sorted(map(str, found - listed))}"
    assert all((d / "__init__.py").exists() for d in listed)
