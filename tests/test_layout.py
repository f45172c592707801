"""The architecture as tests: every module has a place in the layer table, imports run one way between places and
never in a circle, no pass imports another pass, passes hold passes only, no module outgrows 600 lines, nothing
branches on message text, and the top-level Python API reads like the command line."""

from __future__ import annotations

import ast
import pathlib
import re

import pytest
import torch
import torch.nn as nn

import normconv
from normconv.models import get

ROOT = pathlib.Path(__file__).resolve().parent.parent
FOLDERS = (("normconv", "normconv"), ("passes", "normconv.passes"), ("models", "normconv.models"))

# The rooms, from the top floor down: a module may import its own room and any room on a lower floor (a higher
# number may import a lower one). Every module of normconv, normconv.passes (passes/) and normconv.models
# (models/) must fall in one room (the longest prefix that names it): a new module is placed here on purpose.
LAYERS = {
    "normconv.cli": 6,  # the command line: flags -> commands -> render
    "normconv.api": 5,  # the Python API: the commands on a model you hold
    "normconv.commands": 4,  # one module per command
    "normconv.stream": 3.5,  # the streaming commands (checkpoints larger than memory)
    "normconv.engine": 3,  # the one door: passes -> verify -> write; precision policy; plans as data
    "normconv.passes": 2,  # pure passes, one per file (the folder passes/)
    "normconv.onnx": 2,  # torch -> ONNX, ONNX rewrites, onnxruntime validation
    "normconv.graph": 1,  # capture, detection, residual stream, headroom
    "normconv.io": 0.4,  # what users have -> (model, inputs); what normconv writes, atomically
    "normconv.io.load": 0.4,  # every model format -> Loaded
    "normconv.io.write": 0.36,  # output paths, temp files, atomic save
    "normconv.io.hf_folder": 0.35,  # what a Hugging Face folder means: its weights, paths inside it, valid headers
    "normconv.io.hf_output": 0.35,  # a rewrite in the architecture a Hugging Face config describes, as a folder
    "normconv.io.hf_inputs": 0.34,  # inputs made from a Hugging Face config
    "normconv.io.inputs": 0.33,  # example inputs: -i, calibration, masks, caches
    "normconv.io.pickles": 0.31,  # reading files without running their code
    "normconv.io.archive": 0.305,  # zip archives checked from their directory before any member is inflated
    "normconv.io.config_size": 0.306,  # the size a Hugging Face config describes: its numbers, else counted on meta
    "normconv.io.ledger": 0.302,  # every file the run read, checked by every write
    "normconv.io.outputs": 0.3,  # torch-only output forms, one writer per format
    "normconv.io.pickled": 0.295,  # a model as torch.save pickles it: does it, what loading it imports
    "normconv.io.dims": 0.29,  # dynamic dimensions of written models: found, named, checked
    "normconv.io.checksum": 0.2855,  # CRC-32s by ISA-L; a zip's member CRC-32s filled in after torch.save
    "normconv.io.durable": 0.285,  # fsync before a rename, the disk's write-back started early
    "normconv.io.time_limit": 0.284,  # a time limit on a library call normconv cannot stop otherwise
    "normconv.libc": 0.01,  # the C library's calls (madvise, sync_file_range, renameat2, malloc_trim): one lookup
    "normconv.kinds": 0.28,  # one file per norm kind: what normconv knows about it
    "normconv.match": 0.26,  # the op vocabulary of both graph dialects (below the kinds, which read calls with it)
    "normconv.verify": 0.2,  # comparisons, the second shape
    "normconv.verify.guard": 0.19,  # guarded forwards: a model left as it was
    "normconv.selections": 0.18,  # discrete selections recorded and replayed
    "normconv.clone": 0.15,  # tensor-sharing copies
    "normconv.report": 0.1,  # the report, sites, decision codes
    "normconv.nn": 0.1,  # modules normconv inserts
    "normconv.options": 0.05,  # the options every command shares
    "normconv.errors": 0,
    "normconv.quiet": 0,
    "normconv.models": 0,  # the zoo (models/): plain torch
}
# the package's own front door: lazy attribute lookup only
UNPLACED = {"normconv", "normconv.cli.__main__"}


def _modules():
    for folder, package in FOLDERS:
        for path in sorted((ROOT / folder).rglob("*.py")):
            rel = path.relative_to(ROOT / folder).with_suffix("")
            yield ".".join([package, *[p for p in rel.parts if p != "__init__"]]), path


def _room(module: str) -> str | None:
    names = [p for p in LAYERS if module == p or module.startswith(p + ".")]
    return max(names, key=len) if names else None


def _imports(path: pathlib.Path, name: str, lazy: bool = True, packages: bool = False) -> set[str]:
    """The normconv modules a file imports (``lazy``: also inside functions; ``packages``: also the __init__ of each
    package an import passes through, which Python runs first)."""
    found = set()
    tree = ast.parse(path.read_text())
    nodes = ast.walk(tree) if lazy else tree.body
    for node in nodes:
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.add(node.module)
            found.update(f"{node.module}.{a.name}" for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level:  # relative: resolve against the package
            parts = name.split(".")
            base = parts[: len(parts) - node.level + (1 if path.name == "__init__.py" else 0)]
            mod = ".".join(base + ([node.module] if node.module else []))
            found.add(mod)
            found.update(f"{mod}.{a.name}" for a in node.names)
        elif isinstance(node, ast.Import):
            found.update(a.name for a in node.names)
    known = {m for m, _ in _modules()}
    if packages:  # importing a.b.c runs the __init__ of a.b first (a package the importer is not inside of)
        found |= {".".join(m.split(".")[:i]) for m in found for i in range(2, m.count(".") + 1)}
    return {m for m in found if m in known and m != name and not name.startswith(m + ".")}


def test_every_module_has_a_room():
    unplaced = [m for m, _ in _modules() if m not in UNPLACED and _room(m) is None]
    assert not unplaced, "modules with no room in LAYERS (place them on purpose):\n" + "\n".join(unplaced)


def test_imports_run_one_way():
    wrong = []
    for name, path in _modules():
        room = _room(name)
        if room is None:
            continue
        for imported in _imports(path, name):
            target = _room(imported)
            if target is None or target == room:
                continue
            if LAYERS[target] >= LAYERS[room]:
                wrong.append(f"{name} ({room}) imports {imported} ({target})")
    assert not wrong, "imports against the architecture:\n" + "\n".join(wrong)


def _cycle(graph: dict[str, set[str]]) -> list[str] | None:
    color: dict[str, int] = {}
    stack: list[str] = []

    def visit(v: str) -> list[str] | None:
        color[v] = 1
        stack.append(v)
        for w in sorted(graph.get(v, ())):
            if color.get(w) == 1:
                return stack[stack.index(w):] + [w]
            if color.get(w) is None:
                found = visit(w)
                if found:
                    return found
        stack.pop()
        color[v] = 2
        return None

    for v in sorted(graph):
        if color.get(v) is None:
            found = visit(v)
            if found:
                return found
    return None


def test_no_module_imports_in_a_circle():
    """Module by module, lazy imports included (io.py and hf_inputs.py imported each other through a function-level
    import, which a room-by-room check cannot see). A package's __init__ may import its own modules."""
    graph = {name: {m for m in _imports(path, name, packages=True) if not m.startswith(name + ".")}
             for name, path in _modules()}
    circle = _cycle(graph)
    assert circle is None, "import circle: " + " -> ".join(circle)


def test_no_pass_imports_another_pass():
    passes = {m for m, p in _modules() if m.startswith("normconv.passes.") and m != "normconv.passes.base"}
    wrong = [f"{name} imports {m}" for name, path in _modules() if name in passes
             for m in _imports(path, name) if m in passes]
    assert not wrong, "\n".join(wrong)


def test_passes_hold_passes_only():
    """No pass reads flags, knows output paths or writes files."""
    banned = ("typer", "normconv.io", "normconv.cli", "normconv.commands", "normconv.engine", "check_output_path",
              "open(", "sys.argv")
    for path in (ROOT / "passes").glob("*.py"):
        text = path.read_text()
        hits = [b for b in banned if b in text]
        assert not hits, f"{path.name} does command work: {hits}"


def test_no_module_over_600_lines():
    long = [f"{p.relative_to(ROOT)}: {n}" for name, p in _modules()
            if not name.startswith("normconv.models") and (n := len(p.read_text().splitlines())) > 600]
    assert not long, "modules over 600 lines:\n" + "\n".join(long)


def test_few_files_at_the_top():
    top = sorted(p.name for p in (ROOT / "normconv").glob("*.py"))
    assert len(top) <= 10, f"{len(top)} files at normconv/'s top level: {top}"


# code that decides by what a message says: the text is for people, decisions read codes
_TEXT_BRANCHES = re.compile(
    r"(\.reason|\.problem|\.message|str\((exc|e|err|error|whole)\))\s*(\.startswith|\.endswith|\.split\(|==|!=)"
    r"|\bin\s+(str\((exc|e|err|error|whole)\)|\w+\.(reason|problem|message)\b)")


def test_nothing_branches_on_message_text():
    hits = []
    for name, path in _modules():
        for i, line in enumerate(path.read_text().splitlines(), 1):
            code = line.split("#", 1)[0]
            if _TEXT_BRANCHES.search(code):
                hits.append(f"{path.relative_to(ROOT)}:{i}: {line.strip()}")
    assert not hits, "branches on message text (branch on a code):\n" + "\n".join(hits)


def test_package_imports_without_cycles():
    """Each package imports on its own, in a fresh interpreter (a cycle fails at import time)."""
    import subprocess
    import sys

    for module in ("normconv.kinds", "normconv.match", "normconv.io.pickles", "normconv.io.inputs",
                   "normconv.io.hf_inputs", "normconv.io.outputs", "normconv.io.write", "normconv.io.load",
                   "normconv.graph.detect", "normconv.onnx.export", "normconv.passes.swap_norm",
                   "normconv.stream.checkpoint", "normconv.stream.blocks", "normconv.stream.meeting",
                   "normconv.stream.writer", "normconv.stream.onepass", "normconv.stream.swap",
                   "normconv.stream.fold", "normconv.engine.door", "normconv.commands.export", "normconv.api",
                   "normconv.cli"):
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

    conf = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    dirs = conf.get("package-dir", {})

    def folder(name: str) -> pathlib.Path:
        for prefix in sorted(dirs, key=len, reverse=True):  # longest mapped prefix wins, as in setuptools
            if name == prefix or name.startswith(prefix + "."):
                return ROOT / dirs[prefix] / name[len(prefix):].lstrip(".").replace(".", "/")
        return ROOT / name.replace(".", "/")

    listed = {folder(n).resolve() for n in conf["packages"]}
    found = {p.parent.resolve() for top in {folder(n) for n in conf["packages"]} for p in top.rglob("__init__.py")
             if "__pycache__" not in p.parts}
    assert found - listed == set(), f"packages missing from pyproject: {sorted(map(str, found - listed))}"
    assert all((d / "__init__.py").exists() for d in listed)
