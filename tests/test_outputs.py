"""Every output loads where normconv is not installed (issue 14): each command's -o file is loaded in a fresh
interpreter where `import normconv` fails, run, and compared with what normconv computed."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn as nn

ROOT = Path(__file__).resolve().parents[1]

# a fresh interpreter without normconv: the module is blocked before anything is unpickled
_LOAD = r"""
import sys, json
sys.modules["normconv"] = None
import torch
try:
    import normconv
    raise SystemExit("normconv importable")
except ImportError:
    pass
path, x_path, out_path = sys.argv[1:4]
if path.endswith(".pt2"):
    m = torch.export.load(path).module()
else:
    m = torch.load(path, weights_only=False)
    m.eval()
inputs = torch.load(x_path)
with torch.no_grad():
    y = m(*inputs["args"], **inputs["kwargs"])
if not isinstance(y, torch.Tensor):
    y = y[0]
torch.save(y, out_path)
print(type(m).__name__)
"""


def load_without_normconv(path: Path, args, kwargs=None, tmp: Path | None = None) -> torch.Tensor:
    tmp = tmp or path.parent
    torch.save({"args": tuple(args), "kwargs": dict(kwargs or {})}, tmp / "x.pt")
    env = dict(os.environ, PYTHONPATH=str(ROOT))  # tests.fixtures importable, as the user's own code would be
    r = subprocess.run([sys.executable, "-c", _LOAD, str(path), str(tmp / "x.pt"), str(tmp / "y.pt")],
                       capture_output=True, text=True, env=env, cwd=str(tmp), timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    return torch.load(tmp / "y.pt")


def _run(cli, *args):
    code, out, err = cli(*args, "--json")
    assert code == 0, err
    return json.loads(out)


def _reference(rep_model_spec):
    from normconv.io.load import load

    loaded = load(rep_model_spec)
    return loaded


CASES = [  # command, factory, extra flags, the normconv class the rewrite inserts in memory
    ("swap", "tests.fixtures.deploy_models:ln_mlp", ["--approximate"], "RMSNorm"),
    ("canonicalize", "tests.fixtures.deploy_models:rms_mlp", [], "RMSNorm"),
    ("fold", "tests.fixtures.deploy_models:deconv", [], "ChannelShift"),
    # the forward reads its norm's .weight: the stand-in for the swapped norm has one (it failed to run as written)
    ("swap", "tests.fixtures.deploy_models:reads_norm_weight", [], "BiasAfterNorm"),
]


@pytest.mark.parametrize("command,spec,flags,inserted", CASES, ids=[c[0] + "-" + c[3] for c in CASES])
def test_each_command_output_loads_with_torch_alone(cli, tmp_path, command, spec, flags, inserted):
    from normconv.commands import canonicalize, deepnorm, fold, swap
    from normconv.io.load import load
    from normconv.verify import run

    commands = {"fold": fold.fold, "canonicalize": canonicalize.canonicalize, "swap": swap.swap,
                "deepnorm": deepnorm.deepnorm}
    loaded = load(spec)
    # in memory the rewrite uses normconv's module: the output must not
    _, model = commands[command](loaded, **({"approximate": True} if "--approximate" in flags else {}))
    assert any(type(m).__name__ == inserted and type(m).__module__.startswith("normconv.nn") for m in model.modules())
    expected = run(model, loaded.inputs)
    for suffix in (".pt", ".pt2"):
        out = tmp_path / f"{command}{suffix}"
        rep = _run(cli, command, spec, "-o", out, *flags)
        assert rep["output"] == str(out)
        assert not any("needs normconv" in n for n in rep["notes"])
        got = load_without_normconv(out, loaded.inputs.args, loaded.inputs.kwargs, tmp_path)
        torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)
        assert out.stat().st_mode & 0o777 == 0o666 & ~_umask()


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def test_normconv_modules_is_an_opt_in_that_says_loading_needs_normconv(cli, tmp_path):
    out = tmp_path / "swap.pt"
    rep = _run(cli, "swap", "tests.fixtures.deploy_models:ln_mlp", "--approximate", "-o", out, "--normconv-modules")
    assert any("normconv.nn.rmsnorm.RMSNorm" in n and "needs normconv" in n for n in rep["notes"])
    globs = torch.serialization.get_unsafe_globals_in_checkpoint(str(out))
    assert "normconv.nn.rmsnorm.RMSNorm" in globs
    default = tmp_path / "default.pt"
    _run(cli, "swap", "tests.fixtures.deploy_models:ln_mlp", "--approximate", "-o", default)
    assert not [g for g in torch.serialization.get_unsafe_globals_in_checkpoint(str(default)) if "normconv" in g]


def test_deepnorm_output_loads_with_torch_alone_and_trains(cli, tmp_path, hf_folders):
    from normconv.commands.deepnorm import deepnorm
    from normconv.io.load import load
    from normconv.passes import deepnorm as dn
    from normconv.verify import run

    loaded = load(str(hf_folders["bert"]))
    _, model = deepnorm(loaded)
    expected = run(model, loaded.inputs)
    out = tmp_path / "bert_dn.pt"
    rep = _run(cli, "deepnorm", hf_folders["bert"], "-o", out)
    assert rep["output"] == str(out)
    assert not [g for g in torch.serialization.get_unsafe_globals_in_checkpoint(str(out)) if "normconv" in g]
    got = load_without_normconv(out, loaded.inputs.args, loaded.inputs.kwargs, tmp_path)
    torch.testing.assert_close(got, expected.last_hidden_state, atol=1e-5, rtol=1e-5)
    # the torch-only hooks keep gradients flowing (DeepNorm is for training) and a second run is refused
    back = torch.load(out, weights_only=False).train()
    back(**loaded.inputs.kwargs).last_hidden_state.sum().backward()
    assert back.encoder.layer[0].attention.self.value.weight.grad is not None
    assert dn.already_applied(back)


def test_float32norm_is_written_as_a_graph_module(tmp_path):
    from normconv.nn.modules import Float32Norm
    from normconv.nn.rmsnorm import make_rmsnorm
    from normconv.io.outputs import normconv_parts, torch_only
    from normconv.verify import Inputs

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8).half(), Float32Norm(make_rmsnorm((8,), 1e-6, torch.rand(8)), torch.float32))
    x = torch.randn(3, 8).half()
    portable = torch_only(model, Inputs((x,), {}))
    assert normconv_parts(model) and not normconv_parts(portable)
    assert type(model[1].norm).__module__.startswith("normconv")  # the user's copy is untouched
    # the same keys, and the stand-in's own ``weight``: its norm's Parameter under the name the replaced module had
    # (model code reads its norm's .weight), one tensor under both names
    assert set(portable.state_dict()) == set(model.state_dict()) | {"1.weight"}
    assert portable[1].weight is portable[1].norm.weight
    torch.save(portable, tmp_path / "m.pt")
    got = load_without_normconv(tmp_path / "m.pt", (x,), None, tmp_path)
    assert got.dtype == torch.float16
    torch.testing.assert_close(got, model(x), atol=0, rtol=0)


def test_messages_agree_with_what_happened(cli, tmp_path):
    # approximate swap: drift, never FAILED with exit 0
    code, out, err = cli("swap", "zoo:bert", "--approximate", "-o", tmp_path / "a.pt")  # post-LN: not exact
    assert code == 0, err
    assert "FAIL" not in out.replace(str(tmp_path), "") and "expected drift" in out and "wrote" in out, out
    # no -o: say nothing was written
    code, out, _ = cli("fold", "tests.fixtures.deploy_models:deconv")
    assert code == 0 and "nothing was written" in out
    # canonicalize no-ops (already native) are not counted as skips of the swap
    code, out, _ = cli("swap", "zoo:gpt")
    assert code == 0 and "5 applied, 0 skipped" in out and "already native" not in out


# -- a Hugging Face folder in, a folder out (where its config still describes the model) ----------------------


def test_hf_folder_output_loads_with_from_pretrained(cli, hf_folders, tmp_path):
    """fold on BERT (no BatchNorm: weights as they are) writes a folder from_pretrained reads, same outputs."""
    import transformers

    out = tmp_path / "bert_out"
    code, stdout, stderr = cli("fold", hf_folders["bert"], "-o", out)
    assert code == 0, stderr
    assert (out / "config.json").is_file() and list(out.glob("*.safetensors"))
    assert not [p for p in tmp_path.iterdir() if p.name.endswith(".normconv-tmp")]
    original = transformers.AutoModel.from_pretrained(hf_folders["bert"]).eval()
    written = transformers.AutoModel.from_pretrained(out).eval()
    ids = torch.randint(0, original.config.vocab_size, (2, 8))
    with torch.no_grad():
        torch.testing.assert_close(written(ids).last_hidden_state, original(ids).last_hidden_state)


def test_hf_folder_output_carries_a_swap_in_the_config_architecture(cli, hf_folders, tmp_path):
    """swap turns LayerNorm into RMSNorm in memory; GPT-2's config cannot say RMSNorm, so the folder keeps its
    LayerNorms carrying the swap's weights (issue 30: folder in, folder out, as --stream writes it), and says so."""
    import transformers

    out = tmp_path / "gpt2_rms"
    code, stdout, stderr = cli("swap", hf_folders["gpt2"], "-o", out)
    assert code == 0, stderr
    ids = torch.randint(0, 100, (2, 8))
    original = transformers.AutoModelForCausalLM.from_pretrained(hf_folders["gpt2"]).eval()
    written = transformers.AutoModelForCausalLM.from_pretrained(out).eval()
    assert type(written.transformer.h[0].ln_1) is torch.nn.LayerNorm
    with torch.no_grad():
        torch.testing.assert_close(written(ids).logits, original(ids).logits, atol=1e-4, rtol=1e-4)
    code, stdout, stderr = cli("swap", hf_folders["gpt2"], "-o", tmp_path / "gpt2_rms.pt2")
    assert code == 0, stderr


def test_writing_a_pt2_prints_nothing_on_stderr(tmp_path):
    """torch warns about the temp file's name when it saves a .pt2: normconv's output is normconv's alone."""
    out = tmp_path / "mlp.pt2"
    r = subprocess.run([sys.executable, "-m", "normconv.cli", "fold", "zoo:mlp", "-o", str(out)], capture_output=True,
                       text=True, timeout=300, cwd=tmp_path)
    assert r.returncode == 0 and out.is_file(), r.stderr
    assert r.stderr == "", r.stderr


def test_a_pt2_whose_dynamic_export_fails_is_written_with_its_dimensions_pinned(tmp_path, monkeypatch):
    """torch.export's symbolic reasoning can fail where a static export does not (timm's CPU-bone: an inequality
    sympy cannot decide): the .pt2 is tried again with the batch alone dynamic, then written with every dimension
    pinned, each listed with its code, and the notes say so."""
    from normconv.io import outputs
    from normconv.verify import Inputs

    real = outputs.export_program
    calls = []

    def dynamic_fails(model, inputs, shapes, pinned=frozenset()):
        calls.append(shapes is not None)
        if shapes is not None:
            raise NotImplementedError("The inequality, Eq(-6*x + 192, 0) cannot be decided")
        return real(model, inputs, shapes, pinned)

    monkeypatch.setattr(outputs, "export_program", dynamic_fails)
    model = nn.Sequential(nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4)).eval()
    x = torch.randn(2, 3, 8, 8)
    info: dict = {}
    path = tmp_path / "m.pt2"
    outputs.write_pt2(model, str(path), Inputs((x,)), info=info)
    assert calls == [True, True, False]  # dynamic, the batch alone dynamic, static
    codes = {d["name"]: d.get("code") for d in info["dynamic_dims"]}
    assert codes == {"batch": "refused-by-export", "input_dim1": "one-size-only", "height": "refused-by-export",
                     "width": "refused-by-export"}, info["dynamic_dims"]
    assert any("every dimension pinned" in n for n in info["notes"])
    program = torch.export.load(str(path)).module()
    torch.testing.assert_close(program(x), model(x))


def test_a_pinned_batch_keeps_the_example_s_size_not_the_widened_trace_s(tmp_path):
    """An example of batch 1 is traced at batch 2 (torch.export specializes a size of 1). Where that trace
    specializes the batch (a branch on the batch size: Dim.AUTO keeps one branch; timm's MobileViT pinned it after
    its check at batch 1 failed), the program would be static at 2: the example's own batch is traced instead, and
    the .pt2 runs on the example."""
    from normconv.io import outputs
    from normconv.verify import Inputs

    class BatchBranch(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(4, 4)

        def forward(self, x):
            y = self.lin(x)
            if x.shape[0] == 2:  # the same value either way; torch.export keeps one branch and guards on it
                return y * 2
            return y + y

    torch.manual_seed(0)
    model = BatchBranch().eval()
    x = torch.randn(1, 4)
    info: dict = {}
    path = tmp_path / "m.pt2"
    outputs.write_pt2(model, str(path), Inputs((x,)), info=info)
    ep = torch.export.load(str(path))
    assert [tuple(n.meta["val"].shape) for n in ep.graph.nodes if n.op == "placeholder"][-1] == (1, 4)
    torch.testing.assert_close(ep.module()(x), model(x))


def batch_one():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 8), nn.LayerNorm(8)).eval(), torch.randn(1, 5, 8)


@pytest.mark.parametrize("suffix", [".pt2", ".onnx"])
def test_a_batch_1_example_is_reported_at_1_and_checked_at_a_second_batch(cli, tmp_path, suffix):
    """The trace of a batch-1 example runs at batch 2, but the report gives the example's own batch, and the second
    size the dimension is checked at is another batch (2), not the example's 1 again."""
    out = tmp_path / f"m{suffix}"
    command = ("swap", "--to", "rmsnorm", "--approximate") if suffix == ".pt2" else ("export",)
    code, stdout, stderr = cli(*command, "test_outputs:batch_one", "-o", out, "--json")
    assert code == 0, stderr
    report = json.loads(stdout)
    dims = report["extra"].get("dynamic_dims") or report["extra"]["outputs"][out.name]["dynamic_dims"]
    batch = {d["name"]: d for d in dims}["batch"]
    assert batch["example"] == 1 and batch["checked"] == [1, 2] and batch["min"] == 1
