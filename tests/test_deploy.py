"""Outputs that deploy (issue 30): dynamic dimensions by default in ONNX and .pt2, a standard ONNX file by default
(onnx.checker full_check, OpenVINO), a Hugging Face folder back as a folder, --overwrite, and messages whose claims
hold (a "loads with torch alone" pickle loads where normconv and transformers cannot be imported)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import onnx
import pytest
import torch

import normconv

ROOT = Path(__file__).resolve().parents[1]


def _json(cli, *args):
    code, out, err = cli(*args, "--json")
    assert code == 0, err
    return json.loads(out)


def _ort(path):
    import onnxruntime as ort

    return ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])


# -- ONNX: the README's main job ------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def llama_onnx(tmp_path_factory):
    """`normconv export zoo:llama -o llama.onnx`, the README's first command, with every default."""
    from typer.testing import CliRunner

    from normconv.cli import app

    out = tmp_path_factory.mktemp("llama") / "llama.onnx"
    r = CliRunner().invoke(app, ["export", "zoo:llama", "-o", str(out), "--json"], catch_exceptions=False)
    assert r.exit_code == 0, r.stderr
    return out, json.loads(r.stdout)


def test_default_export_takes_batch_1_and_other_lengths(llama_onnx):
    from normconv.models import get

    path, report = llama_onnx
    model = get("llama").build().eval()
    sess = _ort(path)
    assert [i.shape for i in sess.get_inputs()] == [["batch", "sequence"]]
    for shape in ((1, 16), (1, 5), (3, 31)):
        ids = torch.randint(0, 100, shape)
        got = sess.run(None, {"input_ids": ids.numpy()})[0]
        with torch.no_grad():
            torch.testing.assert_close(torch.from_numpy(got), model(ids), atol=1e-4, rtol=1e-4)
    dims = {d["name"]: d for d in report["extra"]["dynamic_dims"]}
    # each dimension checked at two more sizes (io.dims.candidates): one up, then by half
    assert set(dims) == {"batch", "sequence"} and dims["batch"]["checked"] == [2, 3, 1]
    assert dims["batch"]["min"] == 1 and dims["sequence"]["checked"] == [16, 17, 24]
    # the second size of each dimension is a validation of its own, against the original model
    assert any("second shape (batch = 1)" in v["label"] and v["passed"] for v in report["validation"])


def test_default_export_is_standard_onnx(llama_onnx):
    path, report = llama_onnx
    onnx.checker.check_model(str(path), full_check=True)  # raises on anything the checker rejects
    model = onnx.load(str(path))
    assert {o.domain for o in model.opset_import} <= {"", "ai.onnx"}
    assert [o.version for o in model.opset_import if o.domain in ("", "ai.onnx")] == [23]
    assert sum(n.op_type == "RMSNormalization" for n in model.graph.node) == 5
    assert report["extra"]["target"] == "onnx" and report["extra"]["checker"].startswith("passed")
    runtimes = " ".join(report["extra"]["runtimes"])
    assert "onnxruntime" in runtimes and "TensorRT 10.15" in runtimes and "OpenVINO" in runtimes


def test_default_export_runs_in_openvino_cpu(llama_onnx):
    ov = pytest.importorskip("openvino")
    from normconv.models import get

    path, _ = llama_onnx
    core = ov.Core()
    compiled = core.compile_model(core.read_model(str(path)), "CPU", {"INFERENCE_PRECISION_HINT": "f32"})
    model = get("llama").build().eval()
    for shape in ((2, 16), (1, 7)):
        ids = torch.randint(0, 100, shape)
        got = compiled({"input_ids": ids.numpy()})[0]
        with torch.no_grad():
            np.testing.assert_allclose(got, model(ids).numpy(), atol=1e-4, rtol=1e-4)


def test_ort_target_stays_one_flag_away_and_is_said_not_standard(cli, tmp_path):
    rep = _json(cli, "export", "zoo:llama", "-o", tmp_path / "ort.onnx", "--target", "ort", "--repeats", "0")
    assert rep["extra"]["checker"].startswith("skipped") and "onnx.checker rejects" in rep["extra"]["checker"]
    assert any("not TensorRT" in r for r in rep["extra"]["runtimes"])


def test_static_pins_every_dimension(cli, tmp_path):
    out = tmp_path / "static.onnx"
    rep = _json(cli, "export", "zoo:resnet", "-o", out, "--static", "--repeats", "0")
    assert rep["extra"]["dynamic_axes"] == {} and not rep["extra"]["dynamic_dims"]
    assert [i.shape for i in _ort(out).get_inputs()] == [[2, 3, 32, 32]]
    code, _, err = cli("export", "zoo:resnet", "-o", tmp_path / "x.onnx", "--static", "--dynamic")
    assert code == 2 and "contradict" in err


def test_image_height_and_width_are_dynamic_and_named(cli, tmp_path):
    out = tmp_path / "resnet.onnx"
    rep = _json(cli, "export", "zoo:resnet", "-o", out, "--repeats", "0")
    assert [i.shape for i in _ort(out).get_inputs()] == [["batch", 3, "height", "width"]]
    assert {d["name"] for d in rep["extra"]["dynamic_dims"] if "pinned" not in d} == {"batch", "height", "width"}
    assert [(d["inputs"], d["code"]) for d in rep["extra"]["dynamic_dims"] if "pinned" in d] == \
        [(["x[1]"], "one-size-only")]  # the channels: static, as the model takes 3 only


def test_plain_column_only_with_baseline(cli, tmp_path):
    code, out, err = cli("export", "zoo:mlp", "-o", tmp_path / "m.onnx", "--repeats", "0")
    assert code == 0, err
    ops = out.split("export plan")[0]
    assert "| op " in ops and "| plain" not in ops and "--baseline adds" in out
    code, out, err = cli("export", "zoo:mlp", "-o", tmp_path / "m.onnx", "--repeats", "0", "--baseline")
    assert code == 0 and "| plain" in out.split("export plan")[0], err


# -- .pt2: dynamic too, and an HF model's program runs on the tensors it takes ------------------------------


def test_pt2_output_is_dynamic_and_static_pins_it(cli, tmp_path):
    from normconv.models import get

    rep = _json(cli, "swap", "zoo:gpt", "-o", tmp_path / "gpt.pt2")
    assert {d["name"] for d in rep["extra"]["dynamic_dims"]} == {"batch", "sequence"}
    program = torch.export.load(str(tmp_path / "gpt.pt2")).module()
    model = get("gpt").build().eval()
    ids = torch.randint(0, 100, (1, 9))
    with torch.no_grad():
        torch.testing.assert_close(program(ids), model(ids), atol=1e-4, rtol=1e-4)
    _json(cli, "swap", "zoo:gpt", "-o", tmp_path / "static.pt2", "--static")
    with pytest.raises(Exception):
        torch.export.load(str(tmp_path / "static.pt2")).module()(ids)


def test_dynamic_pt2_in_stays_dynamic_out(cli, tmp_path):
    _json(cli, "fold", "zoo:resnet", "-o", tmp_path / "a.pt2")
    rep = _json(cli, "canonicalize", tmp_path / "a.pt2", "-o", tmp_path / "b.pt2")
    assert {d["name"] for d in rep["extra"]["dynamic_dims"] if "pinned" not in d} == {"batch", "height", "width"}
    out = torch.export.load(str(tmp_path / "b.pt2")).module()(torch.randn(1, 3, 64, 48))
    assert out.shape[0] == 1


_PLAIN_TORCH = r"""
import sys
sys.modules["normconv"] = None
sys.modules["transformers"] = None
import torch
path, x_path = sys.argv[1:3]
x = torch.load(x_path)
m = torch.export.load(path).module() if path.endswith(".pt2") else torch.load(path, weights_only=False)
with torch.no_grad():
    y = m(*x["args"], **x["kwargs"])
print(type(y).__name__, sorted(y) if isinstance(y, dict) else "")
"""


def _load_plain(path: Path, args=(), kwargs=None) -> subprocess.CompletedProcess:
    """Load and run ``path`` in a fresh interpreter where neither normconv nor transformers can be imported."""
    torch.save({"args": tuple(args), "kwargs": dict(kwargs or {})}, path.parent / "x.pt")
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    return subprocess.run([sys.executable, "-c", _PLAIN_TORCH, str(path), str(path.parent / "x.pt")],
                          capture_output=True, text=True, env=env, cwd=str(path.parent), timeout=300)


def test_hf_pt2_runs_on_its_tensors_without_transformers(cli, tmp_path, hf_folders):
    rep = _json(cli, "fold", hf_folders["gpt2"], "-o", tmp_path / "gpt2.pt2")
    assert any("returns its outputs as a dict" in n for n in rep["notes"])
    ids = torch.randint(0, 100, (1, 7))
    r = _load_plain(tmp_path / "gpt2.pt2", (), {"input_ids": ids})  # the tensors the model took, no use_cache
    assert r.returncode == 0, r.stderr[-2000:]
    assert "dict ['logits']" in r.stdout


# -- messages whose claims hold ------------------------------------------------------------------------------


def test_pickle_load_claims_are_true(cli, tmp_path, hf_folders):
    # torch's classes only: "loads with torch alone", and it does
    spec = "tests.fixtures.deploy_models:torch_mlp"
    rep = _json(cli, "swap", spec, "--approximate", "-o", tmp_path / "mlp.pt")
    assert any("it loads with torch alone" in n for n in rep["notes"])
    r = _load_plain(tmp_path / "mlp.pt", (torch.randn(3, 16),))
    assert r.returncode == 0, r.stderr[-2000:]
    # the zoo's own classes are normconv's: said so, never "torch alone"
    rep = _json(cli, "swap", "zoo:gpt", "-o", tmp_path / "gpt.pt")
    assert any("needs torch and normconv importable" in n for n in rep["notes"])
    # a Hugging Face model pickled: the note names transformers, and without it the load indeed fails
    rep = _json(cli, "swap", hf_folders["gpt2"], "-o", tmp_path / "gpt2.pt")
    assert not any("loads with torch alone" in n for n in rep["notes"])
    assert any("needs torch and transformers" in n for n in rep["notes"])
    ids = torch.randint(0, 100, (1, 7))
    r = _load_plain(tmp_path / "gpt2.pt", (ids,))
    assert r.returncode != 0 and "transformers" in r.stderr


def test_rotate_refusal_on_t5_names_modules(cli, hf_folders):
    code, _, err = cli("rotate", hf_folders["t5"])
    assert code == 2
    assert "dropout_" not in err and "the output of encoder.final_layer_norm is returned by the model" in err, err


# -- a Hugging Face folder in, a folder out ------------------------------------------------------------------


def _outputs(folder, ids):
    import transformers

    m = transformers.AutoModelForCausalLM.from_pretrained(folder).eval()
    with torch.no_grad():
        return m(ids).logits


@pytest.mark.parametrize("command", ["swap", "rotate", "canonicalize"])
def test_folder_in_folder_out_loads_with_from_pretrained(cli, hf_folders, tmp_path, command):
    source = hf_folders["gpt2" if command == "swap" else "llama"]
    out = tmp_path / "out"
    rep = _json(cli, command, source, "-o", out)
    assert rep["output"] == str(out) and (out / "config.json").is_file()
    assert any(v["label"].startswith("from_pretrained(written folder)") and v["passed"] for v in rep["validation"])
    assert not [p for p in tmp_path.iterdir() if p.name.endswith(".normconv-tmp")]
    ids = torch.randint(0, 100, (2, 9))
    torch.testing.assert_close(_outputs(out, ids), _outputs(source, ids), atol=1e-4, rtol=1e-4)
    mask = os.umask(0)
    os.umask(mask)
    # every file as open() makes it (save_pretrained leaves its weights 0600: unreadable to a serving user)
    assert {p.name: p.stat().st_mode & 0o777 for p in out.iterdir()} == {p.name: 0o666 & ~mask for p in out.iterdir()}
    assert any(p.suffix == ".safetensors" for p in out.iterdir())


def test_folder_refused_before_any_work_naming_the_form_that_works(cli, hf_folders, tmp_path):
    code, _, err = cli("deepnorm", hf_folders["bert"], "-o", tmp_path / "dn")
    lines = err.strip().splitlines()
    assert code == 2 and len(lines) == 1 and "dn.pt" in lines[0] and "Hugging Face folder" in lines[0]
    code, _, err = cli("rotate", hf_folders["gpt2"], "-o", tmp_path / "rot")
    assert code == 2 and "rot.pt2" in err
    assert list(tmp_path.iterdir()) == []


def test_overwrite_replaces_a_folder_atomically_never_the_input(cli, hf_folders, tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    (out / "stale.txt").write_text("old")
    code, _, err = cli("fold", hf_folders["bert"], "-o", out)
    assert code == 2 and "--overwrite" in err and (out / "stale.txt").exists()
    code, _, err = cli("fold", hf_folders["bert"], "-o", out, "--overwrite")
    assert code == 0, err
    assert (out / "config.json").is_file() and not (out / "stale.txt").exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]  # no temp or old folder left beside it
    # a file over a folder with --overwrite too; never the input itself, nor a folder holding it
    rep = _json(cli, "fold", "zoo:mlp", "-o", out, "--overwrite")
    assert Path(rep["output"]).is_file()
    code, _, err = cli("fold", hf_folders["bert"], "-o", hf_folders["bert"].parent, "--overwrite")
    assert code == 2 and "inside it" in err


# -- one answer per model, whatever form it comes in ----------------------------------------------------------


@pytest.mark.parametrize("name,command", [("resnet", "fold"), ("gpt", "inspect"), ("llama", "canonicalize")])
def test_same_model_same_sites_in_every_form(cli, tmp_path, name, command):
    """The zoo model, its pickle and its .pt2 (written unchanged) give the same sites under the same module names
    (a .pt2's calls are named through the nn_module_stack the program kept, not layer_norm_3) and decisions."""
    forms = {"zoo": f"zoo:{name}"}
    for suffix in (".pt", ".pt2"):
        out = tmp_path / f"{name}{suffix}"
        _json(cli, "canonicalize", f"zoo:{name}", "-o", out, "--static")  # nothing to canonicalize: the model as is
        forms[suffix] = out
    answers = {}
    for form, spec in forms.items():
        rep = _json(cli, command, spec)
        answers[form] = sorted((s.get("pass", ""), s["target"], s.get("applied", s.get("kind"))) for s in rep["sites"]
                               if s.get("pass", command) != "lift")  # a .pt2's functional convs lifted to modules first
    assert answers["zoo"] == answers[".pt"] == answers[".pt2"], answers


def test_dynamic_dimensions_are_checked_on_validations_own_session(tmp_path, monkeypatch):
    """The file is loaded into onnxruntime twice (emitted graph, default optimizations), not a third time for the
    dimensions' second sizes; the second sizes are still checked against torch."""
    from typer.testing import CliRunner

    from normconv.cli import app
    from normconv.onnx import validate

    made = []
    real = validate.session

    def counted(*a, **k):
        made.append(a[1:3])
        return real(*a, **k)

    monkeypatch.setattr(validate, "session", counted)
    out = tmp_path / "gpt.onnx"
    r = CliRunner().invoke(app, ["export", "zoo:gpt", "-o", str(out), "--json"], catch_exceptions=False)
    assert r.exit_code == 0, r.stderr
    rep = json.loads(r.stdout)
    assert made == [("CPUExecutionProvider", "disabled"), ("CPUExecutionProvider", "default")]
    second = [v for v in rep["validation"] if "second shape" in v["label"]]
    assert {d["name"] for d in rep["extra"]["dynamic_dims"]} == {"batch", "sequence"} and len(second) >= 2
    assert all(v["passed"] for v in second)


class _CeilPad(torch.nn.Module):
    """NASNet's size arithmetic in Python: ``math.ceil`` of a symbolic width is a node torch.export cannot save."""

    def __init__(self):
        super().__init__()
        self.conv, self.bn = torch.nn.Conv2d(3, 4, 3, padding=1), torch.nn.BatchNorm2d(4)

    def forward(self, x):
        import math

        y = self.bn(self.conv(x))
        return torch.nn.functional.pad(y, (0, math.ceil(x.shape[-1] / 3) * 3 - x.shape[-1]))


def test_a_pt2_torch_export_cannot_save_dynamic_is_written_static_and_says_why(tmp_path):
    from normconv.api import _loaded
    from normconv.commands.fold import fold
    from normconv.options import Options

    torch.manual_seed(0)
    model = _CeilPad().eval()
    with torch.no_grad():
        model.bn.running_mean.normal_()
        model.bn.running_var.uniform_(0.5, 2.0)
    x = torch.randn(2, 3, 16, 16)
    out = tmp_path / "folded.pt2"
    report, _ = fold(_loaded(model, (x,)), Options(output=str(out)))  # was: exit 2, "SerializeError ... ceil"
    notes = " ".join(report.notes)
    assert "torch.export cannot save the program with dynamic dimensions (SerializeError" in notes
    assert "could not keep them dynamic" in notes and "lets no input dimension vary" not in notes
    program = torch.export.load(str(out)).module()
    other = torch.randn(2, 3, 16, 16)
    with torch.no_grad():
        torch.testing.assert_close(program(other), model(other), atol=1e-5, rtol=1e-5)


def _tiny_gptj():
    from transformers import GPTJConfig, GPTJForCausalLM

    torch.manual_seed(0)
    cfg = GPTJConfig(vocab_size=128, n_embd=32, n_layer=2, n_head=4, n_positions=64, rotary_dim=4, use_cache=False)
    return GPTJForCausalLM(cfg).eval(), None


@pytest.mark.parametrize("name", ["gpt2", "gpt_neox", "opt", "gpt_neo", "gptj"])
def test_folder_swap_with_trained_norm_biases_keeps_the_architecture(cli, tmp_path, name):
    """Trained weights give the final norm a bias, and the LM head beside it has no bias parameter (GPT-2, GPT-NeoX,
    OPT, GPT-Neo): the folder keeps that bias on its LayerNorm (exact on the zero-mean stream) instead of a head bias
    config.json has no place for; GPT-J's head has one, and takes it. The folder loads with from_pretrained and holds
    the input's tensor names, and --stream writes the same bytes (GPT-Neo's causal mask and GPT-J's sin/cos table,
    buffers computed on the CPU, meet meta weights in its capture: it retries with every tensor on meta)."""
    from hf_tiny import TINY, TINY_PRE_LN, _randomized
    from safetensors.torch import load_file

    model, _ = {**TINY, **TINY_PRE_LN, "gptj": _tiny_gptj}[name]()
    _randomized(model)
    assert type(model).__name__.endswith("ForCausalLM") or type(model).__name__ == "GPT2LMHeadModel"
    source = tmp_path / "in"
    model.save_pretrained(source)
    out, streamed = tmp_path / "out", tmp_path / "streamed"
    rep = _json(cli, "swap", source, "--to", "rmsnorm", "-o", out)
    assert rep["extra"]["exact"] and rep["passed"]
    assert any(v["label"].startswith("from_pretrained(written folder)") and v["passed"] for v in rep["validation"])
    for shape in ((2, 9), (1, 17)):
        ids = torch.randint(0, 100, shape)
        torch.testing.assert_close(_outputs(out, ids), _outputs(source, ids), atol=1e-4, rtol=1e-4)
    written, given = load_file(out / "model.safetensors"), load_file(source / "model.safetensors")
    untied = {"lm_head.weight"} if model.config.tie_word_embeddings else set()  # the centered embedding's old twin
    assert set(written) == set(given) | untied
    _json(cli, "swap", source, "--to", "rmsnorm", "--stream", "-o", streamed)
    again = load_file(streamed / "model.safetensors")
    assert set(again) == set(written) and all(torch.equal(again[k], written[k]) for k in written)


def test_folder_form_refuses_a_tensor_the_architecture_has_no_place_for():
    """A rewrite holding a tensor the original lacks (a bias added to a linear) is refused before anything is
    written, naming it, instead of being dropped and failing the from_pretrained proof afterwards."""
    from hf_tiny import TINY_PRE_LN

    from normconv.clone import clone_sharing_tensors
    from normconv.errors import NormconvError
    from normconv.io.hf_output import folder_form

    model, _ = TINY_PRE_LN["gpt_neox"]()
    rewritten = clone_sharing_tensors(model)
    rewritten.lm_head.bias = torch.nn.Parameter(torch.ones(rewritten.lm_head.out_features))
    with pytest.raises(NormconvError, match="lm_head.bias is a tensor the architecture has no place for"):
        folder_form(model, rewritten)
    assert model.lm_head.bias is None
    form, _ = folder_form(model, clone_sharing_tensors(model))  # nothing new: the same tensors
    assert set(form.state_dict()) == set(model.state_dict())


@pytest.mark.parametrize("name,dtype", [("gpt_neox", "bfloat16"), ("gpt2", "float16"), ("gpt_neox", "large")])
def test_folder_check_uses_the_references_taken_before_a_disposable_original_was_rewritten(cli, tmp_path, monkeypatch,
                                                                                           name, dtype):
    """A model normconv loaded itself is rewritten in place when its own rounding is not measured (half precision, or
    float32 past rounding.BUDGET_BYTES: "large" lowers the budget to 0). The folder's from_pretrained check then
    compares with the door's references, taken before: it re-ran the rewritten original at the second shape, whose
    LayerNorms still added the biases now folded into their readers (23% of the output's scale: exit 1)."""
    from hf_tiny import TINY, TINY_PRE_LN, _randomized

    from normconv.engine import rounding

    model, _ = {**TINY, **TINY_PRE_LN}[name]()
    _randomized(model)
    if dtype == "large":
        monkeypatch.setattr(rounding, "BUDGET_BYTES", 0)
    else:
        model = model.to(getattr(torch, dtype))
    source, out = tmp_path / "in", tmp_path / "out"
    model.save_pretrained(source)
    rep = _json(cli, "swap", source, "--to", "rmsnorm", "-o", out)
    checks = [v for v in rep["validation"] if v["label"].startswith("from_pretrained(written folder)")]
    assert len(checks) == 2 and all(v["passed"] for v in checks)
    ids = torch.randint(0, 100, (1, 15))
    ref, got = _outputs(source, ids).float(), _outputs(out, ids).float()
    assert (got - ref).abs().max() <= (0.05 if dtype != "large" else 1e-4) * ref.abs().max()


@pytest.mark.parametrize("name,dtype", [("gemma", "bfloat16"), ("t5", "float16")])
def test_half_canonicalize_to_a_folder_carries_norms_run_in_float32(cli, tmp_path, name, dtype):
    """canonicalize of a half model makes each hand-written norm a native one run in float32 (Float32Norm: as
    GemmaRMSNorm and T5LayerNorm compute inside); the folder's original classes carry its weights (the folder was
    refused: 'is now Float32Norm')."""
    from hf_tiny import TINY

    model, inputs = TINY[name]()
    with torch.no_grad():
        for n, p in model.named_parameters():
            if "norm" in n:
                p.add_(0.3 * torch.randn(p.shape, generator=torch.Generator().manual_seed(1)))
    model = model.to(getattr(torch, dtype))
    source, out = tmp_path / "in", tmp_path / "out"
    model.save_pretrained(source)
    rep = _json(cli, "canonicalize", source, "-o", out)
    assert [v["passed"] for v in rep["validation"] if v["label"].startswith("from_pretrained(written folder)")] == \
        [True, True]
    assert any(s["applied"] for s in rep["sites"])
    import transformers

    again = getattr(transformers, type(model).__name__).from_pretrained(out).eval()
    with torch.no_grad():
        want, got = model(**inputs.kwargs), again(**inputs.kwargs)
    assert (got[0].float() - want[0].float()).abs().max() <= 0.02 * want[0].float().abs().max()  # half rounding


def test_a_norm_whose_class_makes_its_own_weight_keeps_it_in_the_folder(cli, tmp_path):
    """FalconMamba's weightless RMSNorm holds its weight as a non-persistent buffer (rebuilt, never saved):
    canonicalize makes it a native RMSNorm whose weight is a parameter, and the folder gave the original class that
    parameter too, a key config.json's model does not have (refused: 'the state_dict keys changed')."""
    from transformers import FalconMambaConfig, FalconMambaForCausalLM

    torch.manual_seed(0)
    model = FalconMambaForCausalLM(FalconMambaConfig(vocab_size=128, hidden_size=32, state_size=4, num_hidden_layers=2,
                                                     expand=2, conv_kernel=4, use_cache=False)).eval()
    source, out = tmp_path / "in", tmp_path / "out"
    model.save_pretrained(source)
    rep = _json(cli, "canonicalize", source, "-o", out)
    assert [v["passed"] for v in rep["validation"] if v["label"].startswith("from_pretrained(written folder)")] == \
        [True, True]
    from safetensors.torch import load_file

    assert set(load_file(out / "model.safetensors")) == set(load_file(source / "model.safetensors"))


def test_an_encoder_decoder_whose_embeddings_share_the_head_swaps_exactly(cli, tmp_path):
    """Blenderbot (pre-LN, BART-style): encoder and decoder embeddings are one tensor with the LM head. The swap
    unties each stream's embedding and centers each copy; one tensor was centered once, so the second copy was left
    as it was and the proof refused the swap (exit 1, 6% of the output's scale). A folder holds the copies with
    tie_word_embeddings = false (transformers 5 then gives each embedding its own tensor; normconv asks the
    architecture built so): written, each copy saved under its own key, and loaded back equal (was refused, exit 2)."""
    from transformers import BlenderbotConfig, BlenderbotForConditionalGeneration

    from normconv.io.hf_inputs import hf_example_inputs

    torch.manual_seed(0)
    model = BlenderbotForConditionalGeneration(BlenderbotConfig(
        vocab_size=128, d_model=32, encoder_layers=1, decoder_layers=1, encoder_attention_heads=4,
        decoder_attention_heads=4, encoder_ffn_dim=64, decoder_ffn_dim=64, max_position_embeddings=64)).eval()
    new, report = normconv.swap(model, hf_example_inputs(model))
    assert report.passed and report.extra["exact"]
    source = tmp_path / "in"
    model.save_pretrained(source)
    code, _, err = cli("swap", source, "--to", "rmsnorm", "-o", tmp_path / "out")
    assert code == 0, err
    back = BlenderbotForConditionalGeneration.from_pretrained(tmp_path / "out").eval()
    assert back.config.tie_word_embeddings is False
    for shape in ((1, 5), (3, 9)):
        ids = torch.randint(4, 128, shape)
        dec = torch.randint(4, 128, (shape[0], 3))
        with torch.no_grad():
            ref = model(input_ids=ids, decoder_input_ids=dec).logits
            got = back(input_ids=ids, decoder_input_ids=dec).logits
        assert (ref - got).abs().max() <= 1e-4 * ref.abs().max()


@pytest.mark.parametrize("command", ["swap", "canonicalize"])
def test_a_folder_written_back_keeps_the_users_use_cache(cli, tmp_path, command):
    """normconv runs without a KV cache (use_cache = False on its loaded config); the folder it wrote carried that
    into config.json, so generate() ran without a cache, and FSMT, whose logits depend on it, computed otherwise
    than the source folder (0.0076 of the output's scale through from_pretrained's defaults)."""
    import json as json_

    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(vocab_size=128, n_embd=32, n_layer=2, n_head=4, n_positions=64)).eval()
    assert model.config.use_cache
    source, out = tmp_path / "in", tmp_path / "out"
    model.save_pretrained(source)
    _json(cli, command, source, "-o", out, *(["--to", "rmsnorm"] if command == "swap" else []))
    assert json_.loads((out / "config.json").read_text())["use_cache"] is True


@pytest.mark.parametrize("change,names", [("swap", "lm_head.weight's values"), ("shift", "other values")])
def test_a_folder_transformers_does_not_load_back_is_refused_naming_the_weight(cli, hf_folders, tmp_path,
                                                                                 monkeypatch, change, names):
    """transformers' own round trip changing a weight (PixioBackbone's key renaming swaps its two final LayerNorms):
    refused in one line naming the weight and the .pt2, exit 2, nothing written (before: exit 1, a failed proof)."""
    from transformers import LlamaForCausalLM

    from normconv.io.write import TEMP_SUFFIX

    load = LlamaForCausalLM.from_pretrained.__func__

    def renamed(cls, path, *args, **kwargs):
        model = load(cls, path, *args, **kwargs)
        if TEMP_SUFFIX in str(path):  # the folder normconv wrote, not the source
            with torch.no_grad():
                emb, head = model.model.embed_tokens.weight, model.lm_head.weight
                if change == "swap":
                    saved = emb.clone()
                    emb.copy_(head)
                    head.copy_(saved)
                else:
                    emb.add_(0.5)
        return model

    monkeypatch.setattr(LlamaForCausalLM, "from_pretrained", classmethod(renamed))
    code, _, err = cli("canonicalize", hf_folders["llama"], "-o", tmp_path / "out")
    lines = err.strip().splitlines()
    assert code == 2 and len(lines) == 1, err
    assert "model.embed_tokens.weight" in lines[0] and names in lines[0] and "out.pt2" in lines[0], lines[0]
    assert list(tmp_path.iterdir()) == []


def test_a_channels_first_norm_swapped_to_a_folder(cli, tmp_path):
    """ConvNeXt's stem LayerNorm is channels-first (ConvNextLayerNorm over dim 1 of NCHW): swap --partial makes it an
    RMSNorm, and the folder form measures what the class adds to its weight on a layout it computes on. Before, the
    probe fed it (batch, features) and the command died with an internal error (exit 3)."""
    from transformers import ConvNextConfig, ConvNextForImageClassification

    torch.manual_seed(0)
    model = ConvNextForImageClassification(ConvNextConfig(hidden_sizes=[8, 16], depths=[1, 1], num_stages=2,
                                                          num_labels=3, image_size=32)).eval()
    with torch.no_grad():
        for name, m in model.named_modules():
            if "layernorm" in name.lower() and isinstance(getattr(m, "weight", None), torch.Tensor):
                m.weight.add_(torch.randn_like(m.weight) * 0.2)
                m.bias.add_(torch.randn_like(m.bias) * 0.2)
    source, out = tmp_path / "in", tmp_path / "out"
    model.save_pretrained(source)
    rep = _json(cli, "swap", source, "--to", "rmsnorm", "--partial", "-o", out)
    assert rep["passed"] and any(s["applied"] for s in rep["sites"])
    back = ConvNextForImageClassification.from_pretrained(out).eval()
    for shape in ((2, 3, 32, 32), (1, 3, 64, 48)):
        x = torch.randn(shape)
        with torch.no_grad():
            torch.testing.assert_close(back(x).logits, model(x).logits, atol=1e-4, rtol=1e-4)
