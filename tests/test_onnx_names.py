"""ONNX files named like the model (issue 14): inputs after forward arguments, outputs after ModelOutput fields /
dict keys, dynamic dimensions batch / sequence, and the attention_mask a deployment feeds is an input."""

from __future__ import annotations

import onnx
import pytest


def _io(path):
    g = onnx.load(str(path)).graph
    dims = lambda v: [d.dim_param or d.dim_value for d in v.type.tensor_type.shape.dim]  # noqa: E731
    return {i.name: dims(i) for i in g.input}, {o.name: dims(o) for o in g.output}


@pytest.mark.parametrize("name,outputs", [
    ("gpt2", {"logits": ["batch", "sequence", 100]}),
    ("bert", {"last_hidden_state": ["batch", "sequence", 32], "pooler_output": ["batch", 32]}),
])
def test_hf_export_names(cli, tmp_path, hf_folders, name, outputs):
    out = tmp_path / f"{name}.onnx"
    code, _, err = cli("export", hf_folders[name], "-o", out, "--dynamic", "--no-baseline", "--repeats", "0")
    assert code == 0, err
    ins, outs = _io(out)
    assert ins == {"input_ids": ["batch", "sequence"], "attention_mask": ["batch", "sequence"]}
    assert outs == outputs


def test_dict_output_keys_name_the_outputs(tmp_path):
    import torch

    from normconv.onnx.names import output_names

    assert output_names({"a": torch.ones(1), "b": (torch.ones(1), None, torch.ones(1))}) == ["a", "b_0", "b_2"]
    assert output_names(torch.ones(1)) == ["output"]


def test_hf_inspect_prints_no_expected_symbolic_trace_note(cli, hf_folders):
    code, out, err = cli("inspect", hf_folders["bert"])
    assert code == 0, err
    assert "symbolic_trace failed" not in out + err and "graph by torch.export" in out


def test_user_named_dynamic_dimensions(cli, tmp_path, hf_folders):
    out = tmp_path / "gpt2.onnx"
    code, _, err = cli("export", hf_folders["gpt2"], "-o", out, "--dynamic", "--dim-name", "batch=N",
                       "--dim-name", "sequence=T", "--repeats", "0")
    assert code == 0, err
    ins, outs = _io(out)
    assert ins == {"input_ids": ["N", "T"], "attention_mask": ["N", "T"]} and outs == {"logits": ["N", "T", 100]}
    code, _, err = cli("export", hf_folders["gpt2"], "-o", tmp_path / "x.onnx", "--dim-name", "hidden=H")
    assert code == 2 and "bad --dim-name" in err and not (tmp_path / "x.onnx").exists()
