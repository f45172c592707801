"""Loading every model format, saving atomically, and the one-line errors every bad input gets (exit 2)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import pytest
import torch
import torch.nn as nn

from normconv.errors import NormconvError
from normconv.io.inputs import parse_input_shapes
from normconv.io.load import load
from normconv.io.write import save
from normconv.verify import compare, run
from tests.fixtures.user_models import small_net

FACTORY = "tests.fixtures.user_models:small_net"
X = "x:2,3,8,8"


def _expect_error(cli, *args, match: str):
    code, out, err = cli(*args)
    assert code == 2, (code, out, err)
    lines = [line for line in err.strip().splitlines() if line]
    assert len(lines) == 1 and lines[0].startswith("error: "), err
    assert match in lines[0], lines[0]
    assert "Traceback" not in err + out
    return lines[0]


# -- formats -----------------------------------------------------------------------------------------------


def test_zoo_spec_loads_model_and_inputs():
    loaded = load("zoo:resnet")
    assert loaded.fmt == "zoo" and not loaded.model.training
    assert loaded.inputs is not None and loaded.inputs.args[0].shape[0] >= 1


def test_factory_with_inputs_tuple():
    loaded = load("tests.fixtures.user_models:small_net_with_inputs")
    assert loaded.fmt == "factory" and loaded.inputs.args[0].shape == (2, 3, 8, 8)


@pytest.mark.parametrize("suffix", [".pt", ".safetensors"])
def test_factory_with_weights(tmp_path, suffix):
    model = small_net()
    with torch.no_grad():
        model.conv.weight.mul_(3.0)  # weights differ from what the factory builds
    path = tmp_path / f"w{suffix}"
    if suffix == ".pt":
        torch.save(model.state_dict(), path)
    else:
        from safetensors.torch import save_file

        save_file(model.state_dict(), str(path))
    loaded = load(FACTORY, weights=str(path), input_shapes=[X])
    assert torch.equal(loaded.model.conv.weight, model.conv.weight)


def test_full_pickle_needs_opt_in_and_names_globals(tmp_path, cli):
    path = tmp_path / "model.pt"
    torch.save(small_net(), path)
    line = _expect_error(cli, "inspect", path, "-i", X, match="refusing to unpickle")
    assert "SmallNet" in line and "--trust-pickle" in line
    loaded = load(str(path), input_shapes=[X], trust_pickle=True)
    assert type(loaded.model).__name__ == "SmallNet" and loaded.fmt == "pickle"


def test_pt2_program_carries_its_inputs(tmp_path):
    model, x = small_net(), torch.randn(2, 3, 8, 8)
    path = tmp_path / "model.pt2"
    torch.export.save(torch.export.export(model, (x,)), str(path))
    loaded = load(str(path))
    assert loaded.fmt == "pt2" and loaded.inputs.args[0].shape == x.shape
    assert compare(model(x), run(loaded.model, loaded.inputs)).passed


def test_hf_folder_loads_offline_with_inputs_from_config(hf_folders):
    for name, folder in hf_folders.items():
        loaded = load(str(folder))
        assert loaded.fmt == "hf" and "input_ids" in loaded.inputs.kwargs, name


def test_input_shape_parsing_positional_and_dtype():
    inputs = parse_input_shapes(small_net(), ["x:1,3,4,4:float16"])
    assert inputs.args[0].shape == (1, 3, 4, 4) and inputs.args[0].dtype == torch.float16


def test_token_ids_are_integers_unless_a_dtype_says_otherwise(cli, hf_folders):
    """-i input_ids:1,64 (no :int64) made float ids, and every command said 'the model rejected its example inputs'."""
    from hf_tiny import tiny_bert

    model, _ = tiny_bert()
    inputs = parse_input_shapes(model, ["input_ids:2,7"])
    ids = inputs.kwargs.get("input_ids", inputs.args[0] if inputs.args else None)
    assert ids.dtype == torch.int64 and ids.shape == (2, 7) and int(ids.max()) < model.config.vocab_size
    assert parse_input_shapes(model, ["input_ids:2,7:int32"]).args[0].dtype == torch.int32
    code, _, err = cli("inspect", hf_folders["bert"], "-i", "input_ids:1,9")
    assert code == 0, err


def test_dtype_flag_casts_model_and_inputs():
    loaded = load("zoo:resnet", dtype="float64")
    assert next(loaded.model.parameters()).dtype == torch.float64
    assert loaded.inputs.args[0].dtype == torch.float64


# -- saving ------------------------------------------------------------------------------------------------


def test_save_is_atomic_and_roundtrips(tmp_path):
    loaded = load(FACTORY, input_shapes=[X])
    out = save(loaded, loaded.model, tmp_path / "out.pt")
    assert out.exists() and [p.name for p in tmp_path.iterdir()] == ["out.pt"]  # no temp file left
    again = torch.load(out, weights_only=False)
    assert compare(run(loaded.model, loaded.inputs), run(again, loaded.inputs)).passed


def test_save_pt2_by_suffix(tmp_path):
    loaded = load(FACTORY, input_shapes=[X])
    out = save(loaded, loaded.model, tmp_path / "out.pt2")
    assert load(str(out)).fmt == "pt2"


def test_save_refuses_to_overwrite_input(tmp_path):
    path = tmp_path / "model.pt2"
    torch.export.save(torch.export.export(small_net(), (torch.randn(2, 3, 8, 8),)), str(path))
    before = path.read_bytes()
    loaded = load(str(path))
    with pytest.raises(NormconvError, match="refusing to overwrite the input"):
        save(loaded, loaded.model, path)
    assert path.read_bytes() == before
    save(loaded, loaded.model, path, in_place=True)  # explicit in-place is allowed


def test_failed_save_leaves_nothing(tmp_path):
    loaded = load(FACTORY)  # no inputs: a .pt2 cannot be exported
    with pytest.raises(NormconvError, match="--input-shape"):
        save(loaded, loaded.model, tmp_path / "out.pt2")
    assert list(tmp_path.iterdir()) == []


# -- bad inputs: one line, exit 2 --------------------------------------------------------------------------


def test_missing_file(cli):
    _expect_error(cli, "inspect", "no/such/model.pt", match="no such file")


def test_file_that_is_not_a_model(cli, tmp_path):
    path = tmp_path / "notes.pt"
    path.write_text("hello, I am not a model\n")
    _expect_error(cli, "inspect", path, match="not a model file")


def test_truncated_file(cli, tmp_path):
    path = tmp_path / "cut.pt"
    torch.save(small_net().state_dict(), path)
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])
    _expect_error(cli, "inspect", path, match="truncated or corrupt")


def test_state_dict_without_factory(cli, tmp_path):
    path = tmp_path / "sd.pt"
    torch.save(small_net().state_dict(), path)
    _expect_error(cli, "inspect", path, match="state_dict")


def test_wrong_input_shape(cli):
    _expect_error(cli, "inspect", FACTORY, "-i", "x:2,5,8,8", match="rejected its example inputs")


def test_missing_inputs_names_the_flag(cli):
    line = _expect_error(cli, "inspect", FACTORY, match="--input-shape")
    assert "forward takes: x" in line


def test_bad_input_shape_syntax(cli):
    _expect_error(cli, "inspect", FACTORY, "-i", "x:2,three", match="dimensions must be integers")
    _expect_error(cli, "inspect", FACTORY, "-i", "y:2,3,8,8", match="forward takes: x")


def test_uncapturable_model(cli):
    # rotation needs the whole graph: refused, naming each method's failure
    line = _expect_error(cli, "rotate", "tests.fixtures.user_models:through_numpy", "-i", "x:2,4",
                         match="cannot capture a graph")
    assert "symbolic_trace failed" in line and "torch.export failed" in line
    # canonicalize runs by parts, and says so
    code, out, err = cli("canonicalize", "tests.fixtures.user_models:through_numpy", "-i", "x:2,4", "--json")
    assert code == 0, err
    assert any("rewritten by parts" in n for n in __import__("json").loads(out)["notes"])
    # inspect falls back to its parts: the LayerNorm captured alone
    code, out, err = cli("inspect", "tests.fixtures.user_models:through_numpy", "-i", "x:2,4", "--json")
    assert code == 0, err
    report = __import__("json").loads(out)
    assert [s["target"] for s in report["sites"]] == ["ln"] and report["extra"]["capture"].startswith("parts")


def test_a_shape_without_a_name_is_the_only_inputs(cli):
    inputs = parse_input_shapes(small_net(), ["1,3,4,4:float16"])
    assert inputs.args[0].shape == (1, 3, 4, 4) and inputs.args[0].dtype == torch.float16
    code, out, err = cli("inspect", FACTORY, "-i", "2,3,8,8", "--json")
    assert code == 0, err
    _expect_error(cli, "inspect", FACTORY, "-i", "2,3,8,8", "-i", "x:2,3,8,8",
                  match="a shape without a name is for one input given once")


def test_value_branching_model_is_captured_as_the_example_takes_it(cli):
    code, out, err = cli("inspect", "tests.fixtures.user_models:data_dependent", "-i", "x:2,4", "--json")
    assert code == 0, err
    report = __import__("json").loads(out)
    assert [s["target"] for s in report["sites"]] == ["ln"]
    assert "draft_export" in report["extra"]["capture_failures"]["torch.export"]


def test_unknown_zoo_model_lists_choices(cli):
    line = _expect_error(cli, "inspect", "zoo:nope", match="unknown zoo model")
    assert "resnet" in line


def test_factory_that_is_not_a_module(cli):
    _expect_error(cli, "inspect", "tests.fixtures.user_models:not_a_module", match="not a torch.nn.Module")


def test_factory_attribute_that_is_not_callable(cli, tmp_path, monkeypatch):
    """A module attribute that is neither a module nor a function is said to be so; it was never called (the line
    said "returned a int")."""
    (tmp_path / "notcallable_mod.py").write_text("notcallable = 3\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    _expect_error(cli, "inspect", "notcallable_mod:notcallable",
                  match="notcallable_mod:notcallable is not callable: it is an int, not a torch.nn.Module")


def test_folder_without_config(cli, tmp_path):
    _expect_error(cli, "inspect", tmp_path, match="without config.json")


def test_real_console_script_exit_codes(tmp_path):
    """The installed entry point, not just the in-process app: --version, --help, a bad input."""
    exe = [sys.executable, "-m", "normconv.cli"]
    assert subprocess.run(exe + ["--version"], capture_output=True, text=True).stdout.startswith("normconv ")
    bad = subprocess.run(exe + ["inspect", str(tmp_path / "nope.pt")], capture_output=True, text=True)
    assert bad.returncode == 2 and bad.stderr.strip().startswith("error: no such file")
    good = subprocess.run(exe + ["inspect", "zoo:mlp", "--json"], capture_output=True, text=True)
    assert good.returncode == 0, good.stderr
    assert json.loads(good.stdout)["command"] == "inspect"


def test_torch_nn_only_pickle_loads_without_opt_in(tmp_path):
    """Only torch.nn / normconv classes inside: the weights-only unpickler with an allowlist, no code runs."""
    model = torch.nn.Sequential(torch.nn.Conv2d(3, 4, 3), torch.nn.BatchNorm2d(4), torch.nn.ReLU()).eval()
    path = tmp_path / "seq.pt"
    torch.save(model, path)
    loaded = load(str(path), input_shapes=["input:1,3,8,8"])
    assert torch.equal(loaded.model[0].weight, model[0].weight)


def test_saved_pickle_carries_example_inputs(tmp_path):
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.LayerNorm(4)).eval()
    loaded = load("tests.fixtures.user_models:small_net", input_shapes=[X])
    loaded.model = model
    from normconv.verify import Inputs

    out = save(loaded, model, tmp_path / "m.pt", inputs=Inputs((torch.randn(3, 4),)))
    again = load(str(out))
    assert again.inputs is not None and again.inputs.args[0].shape == (3, 4)
    assert not hasattr(model, "_normconv_example_inputs")  # the caller's model is left as it was


def test_inserted_modules_keep_the_replaced_modules_mode():
    """A pass that swaps a module for a new one must not hand back a half-training model."""
    import torch.nn as nn

    from normconv.engine.run import apply_passes
    from normconv.report import PassResult

    def replace_bn(model, cap):
        model.bn = nn.Identity()  # born with training=True
        return PassResult(model, True)

    replace_bn.name, replace_bn.by_parts = "replace_bn", False
    model = apply_passes(small_net(), load(FACTORY, input_shapes=[X]).inputs, [replace_bn]).model
    assert not any(m.training for m in model.modules())


def test_float32norm_model_reloads_without_opt_in(tmp_path):
    """Modules normconv inserts (normconv.nn.modules, normconv.nn.rmsnorm) are on the weights-only allowlist."""
    from normconv.nn.modules import Float32Norm
    from normconv.nn.rmsnorm import make_rmsnorm

    model = torch.nn.Sequential(Float32Norm(make_rmsnorm(8, 1e-6, torch.rand(8)), torch.float32)).eval()
    path = tmp_path / "m.pt"
    torch.save(model, path)
    loaded = load(str(path), input_shapes=["input:2,8:float16"])
    assert isinstance(loaded.model[0], Float32Norm) and loaded.model[0].norm.weight.shape == (8,)


@pytest.mark.parametrize("command,model", [
    (["fold"], "zoo:resnet"),
    (["canonicalize"], "zoo:hf_style_norms"),
    (["swap", "--to", "rmsnorm"], "zoo:gpt"),
    # torch-only DeepNorm hooks are fx code (torch runs it on load): normconv's modules chain without trust
    (["deepnorm", "--normconv-modules"], "zoo:bert"),
])
def test_every_commands_output_chains_into_the_next(cli, tmp_path, command, model):
    """A model normconv wrote loads again with no --trust-pickle and no --input-shape, in eval mode."""
    out = tmp_path / "out.pt"
    code, _, err = cli(*command, model, "-o", out)
    assert code == 0, err
    code, stdout, err = cli("inspect", out, "--json")
    assert code == 0, err
    again = load(str(out))
    assert not any(m.training for m in again.model.modules())


def test_console_script_imports_a_factory_from_the_current_folder(tmp_path):
    """`normconv inspect mymodel:build` in the user's project folder finds mymodel.py, as `python -m` would."""
    exe = shutil.which("normconv", path=os.path.dirname(sys.executable)) or shutil.which("normconv")
    if exe is None:
        pytest.skip("the normconv console script is not installed")
    (tmp_path / "mymodel.py").write_text(
        "import torch\n"
        "def build():\n"
        "    return torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.LayerNorm(8)), (torch.randn(2, 8),)\n")
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    r = subprocess.run([exe, "inspect", "mymodel:build", "--json"], cwd=tmp_path, env=env, capture_output=True,
                       text=True)
    assert r.returncode == 0, r.stderr
    assert [s["kind"] for s in json.loads(r.stdout)["sites"]] == ["layernorm"]


@pytest.mark.parametrize("activation", ["relu", "gelu"])
def test_torch_s_own_transformer_layer_loads_without_opt_in(tmp_path, activation):
    """nn.TransformerEncoderLayer pickles its activation (torch.nn.functional.relu, torch._C._nn.gelu): torch's own
    functional ops, allowlisted like torch.nn's classes (was refused, naming every class, without --trust-pickle)."""
    layer = nn.TransformerEncoderLayer(16, 2, 32, activation=activation, batch_first=True).eval()
    path = tmp_path / "layer.pt"
    torch.save(layer, path)
    loaded = load(str(path), input_shapes=["2,5,16"])
    x = torch.randn(2, 5, 16)
    assert loaded.fmt == "pickle" and torch.equal(loaded.model(x), layer(x))


def test_a_name_a_trusted_module_merely_imported_is_refused(tmp_path, cli):
    """torch.nn.modules.module imports collections.namedtuple: the name torch.nn.modules.module.namedtuple passes the
    allowlist's prefix rule, and torch's weights_only unpickler, matching an object by where it is defined, still
    refuses it (the rule normconv relies on when it allowlists by prefix)."""
    import zipfile

    path, forged = tmp_path / "a.pt", tmp_path / "forged.pt"
    torch.save({"a": 1}, path)
    with zipfile.ZipFile(path) as src, zipfile.ZipFile(forged, "w", zipfile.ZIP_STORED) as dst:
        for info in src.infolist():
            data = src.read(info)
            if info.filename.endswith("/data.pkl"):
                data = b"\x80\x02ctorch.nn.modules.module\nnamedtuple\nq\x00."
            dst.writestr(info, data)
    line = _expect_error(cli, "inspect", forged, "-i", X, match="refusing to unpickle")
    assert "torch.nn.modules.module.namedtuple" in line
