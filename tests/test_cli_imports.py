"""The command line imports what a command uses when it runs it: ``import normconv.cli`` and ``normconv --version``
import neither torch nor the ONNX stack nor transformers, and a torch command on a zoo model does not import the
ONNX stack or transformers (each costs seconds on a 2-core machine; issue 32). Checked in fresh interpreters."""

from __future__ import annotations

import json
import subprocess
import sys

HEAVY = ("transformers", "onnx", "onnxruntime", "onnxscript", "onnx_ir", "sympy")


def _imported(code: str) -> tuple[list[str], str]:
    """Run ``code`` in a fresh interpreter; the heavy modules it left in sys.modules (and its stdout before them)."""
    probe = code + "\nimport json, sys\nprint('\\nIMPORTED=' + json.dumps(sorted(m for m in %r + ('torch',) " \
                   "if m in sys.modules)))\n" % (HEAVY,)
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    before, _, found = done.stdout.rpartition("IMPORTED=")
    return json.loads(found), before


def test_import_cli_is_light():
    found, _ = _imported("import normconv.cli")
    assert found == []


def test_version_imports_nothing_heavy():
    found, printed = _imported(
        "import sys\nfrom normconv.cli import main\nsys.argv = ['normconv', '--version']\n"
        "try:\n    main()\nexcept SystemExit as e:\n    assert not e.code, e.code")
    assert found == []
    assert printed.startswith("normconv ")


def test_fold_on_a_torch_model_imports_no_onnx_nor_transformers(tmp_path):
    out = tmp_path / "folded.pt"
    found, _ = _imported(
        f"from normconv.cli import app\n"
        f"try:\n    app(['fold', 'zoo:resnet', '-o', {str(out)!r}, '--json'], standalone_mode=False)\n"
        f"except SystemExit as e:\n    assert not e.code, e.code")
    assert out.exists()
    # torch, and none of the ONNX stack or transformers; nor sympy (0.6 s): a symbolic trace's shape propagation
    # skips torch's memory-format query, whose symbolic-shape helpers import it
    assert found == ["torch"]


def test_inspect_and_swap_on_torch_models_import_no_sympy(tmp_path):
    for argv in (["inspect", "zoo:resnet", "--json"], ["swap", "zoo:gpt", "--to", "rmsnorm", "-o",
                                                        str(tmp_path / "s.pt"), "--json"]):
        found, printed = _imported(
            f"from normconv.cli import app\n"
            f"try:\n    app({argv!r}, standalone_mode=False)\n"
            f"except SystemExit as e:\n    assert not e.code, e.code")
        assert found == ["torch"], argv
        assert '"command"' in printed  # the command ran and reported


def test_export_help_lists_its_defaults_without_the_exporter():
    found, printed = _imported(
        "from normconv.cli import app\n"
        "try:\n    app(['export', '--help'], standalone_mode=False)\nexcept SystemExit:\n    pass")
    assert found == []
    assert "default 23" in printed  # the opset default comes from normconv.onnx.defaults
