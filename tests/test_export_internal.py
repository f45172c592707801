"""A bug in normconv's own code while export validates is an internal error (exit 3), not bad input: export wrapped
every exception of its validation phase as "failed while validating" (exit 2), and where the file had dynamic
dimensions it answered any exception of its validator by exporting again with every dimension pinned, writing a
static file plus a note. Only onnxruntime's own refusals (``validate.RuntimeRefusal``, raised around its calls) are
the user's case; the no-kernel refusal keeps its one line (tests/test_export.py)."""

from __future__ import annotations

import json

import onnxruntime as ort
import pytest

import normconv.onnx.validate as validate


def _bug(*args, **kwargs):
    raise NameError("name 'RANDOM_OPS' is not defined")  # stands for any slip in normconv's own code


@pytest.mark.parametrize("where", ["refuse_random", "_min_tolerances", "_like"])
def test_a_bug_in_the_validation_is_an_internal_error_and_nothing_is_written(cli, tmp_path, monkeypatch, where):
    """refuse_random: before the onnxruntime runs; _min_tolerances: inside them (with dynamic dimensions it was
    answered by a static re-export); _like: in the dimension checks' candidate, which pinned the dimension."""
    if where == "_like":  # the first validation's own call passes; the dimension check's calls fail
        real, calls = validate._like, []

        def later(*args, **kwargs):
            calls.append(1)
            return real(*args, **kwargs) if len(calls) <= 2 else _bug()

        monkeypatch.setattr(validate, "_like", later)
    else:
        monkeypatch.setattr(validate, where, _bug)
    out = tmp_path / "m.onnx"
    code, stdout, stderr = cli("export", "zoo:mlp", "-o", out, "--no-baseline", "--json")
    obj = json.loads(stdout)
    assert (code, obj["code"], obj["exit_code"]) == (3, "internal", 3), stderr
    assert "internal error: NameError" in stderr and len(stderr.strip().splitlines()) == 1
    assert list(tmp_path.iterdir()) == []


def test_onnxruntime_refusing_the_file_is_still_one_line_exit_2(cli, tmp_path, monkeypatch):
    """What onnxruntime raises (here: its session refusing the file) stays the user's case: exit 2, one line naming
    onnxruntime's own exception."""
    def refuse(*args, **kwargs):
        raise ort.capi.onnxruntime_pybind11_state.InvalidGraph("[ONNXRuntimeError] : 10 : INVALID_GRAPH : no")

    monkeypatch.setattr(ort, "InferenceSession", refuse)
    out = tmp_path / "m.onnx"
    code, _, stderr = cli("export", "zoo:mlp", "-o", out, "--no-baseline", "--static")
    assert code == 2 and "failed while validating: InvalidGraph" in stderr, stderr
    assert len(stderr.strip().splitlines()) == 1 and list(tmp_path.iterdir()) == []
