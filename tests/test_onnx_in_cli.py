"""ONNX in through the command line: exit codes, one-line errors, JSON, the input untouched; files made by torch's
two exporters; real ONNX files shipped inside public Python packages (downloaded once per session; skipped with a
reason where the download is impossible)."""

from __future__ import annotations

import json
import subprocess
import sys
import zipfile
from pathlib import Path

import onnx
import pytest
import torch
import torch.nn as nn

from tests import onnx_in_graphs as G

CACHE = Path.home() / ".cache" / "normconv-onnx-wheels"
WHEELS = {"rapidocr-onnxruntime": "rapidocr_onnxruntime", "magika": "magika", "silero-vad": "silero_vad"}


def _json(out: str) -> dict:
    return json.loads(out[out.index("{"):])


def _ops(path) -> dict:
    c: dict = {}
    for n in onnx.load(str(path)).graph.node:
        c[n.op_type] = c.get(n.op_type, 0) + 1
    return c


def test_export_json_and_input_untouched(cli, tmp_path):
    src = G.save(G.layernorm_torch(13), tmp_path / "ln.onnx")
    before = Path(src).read_bytes()
    code, out, _ = cli("export", src, "-o", tmp_path / "out.onnx", "--target", "onnx", "--json")
    assert code == 0 and Path(src).read_bytes() == before
    r = _json(out)
    assert r["passed"] and r["extra"]["fused"] == {"layernorm": 1} and r["extra"]["converted_from"] == 13
    assert [s["code"] for s in r["sites"]] == ["fused-layernorm"]
    assert all(v["outputs"] for v in r["validation"])  # per-output errors
    out_model = onnx.load(str(tmp_path / "out.onnx"))
    assert [i.name for i in out_model.graph.input] == ["x"]
    assert [d.dim_param for d in out_model.graph.input[0].type.tensor_type.shape.dim][:2] == ["batch", "seq"]
    assert out_model.producer_name == "hand-built"


def test_inspect_writes_nothing(cli, tmp_path):
    src = G.save(G.conv_bn(), tmp_path / "cb.onnx")
    code, out, _ = cli("inspect", src, "--json")
    assert code == 0 and sorted(p.name for p in tmp_path.iterdir()) == ["cb.onnx"]
    assert _json(out)["sites"][0]["applied"] and _json(out)["sites"][0]["code"] == "folded"


def test_bad_inputs_exit_2_in_one_line(cli, tmp_path):
    bad = tmp_path / "bad.onnx"
    bad.write_bytes(b"not a protobuf at all \x00\x01")
    code, _, err = cli("fold", bad, "-o", tmp_path / "o.onnx")
    assert code == 2 and err.count("\n") == 1 and "not an ONNX file" in err
    code, _, err = cli("fold", tmp_path / "missing.onnx", "-o", tmp_path / "o.onnx")
    assert code == 2 and "no such file" in err
    src = G.save(G.conv_bn(), tmp_path / "cb.onnx")
    code, _, err = cli("fold", src, "-o", src)
    assert code == 2 and "refusing to overwrite" in err and "this run read it" in err and "--in-place" not in err
    hard = tmp_path / "hard.onnx"  # the input under another name: a hard link (was replaced, exit 0)
    hard.hardlink_to(src)
    code, _, err = cli("fold", src, "-o", hard, "--overwrite")
    assert code == 2 and "under another name" in err and hard.stat().st_ino == Path(src).stat().st_ino
    code, _, err = cli("swap", src)
    assert code == 2 and "inspect, fold and export read ONNX files" in err
    code, _, err = cli("export", src, "-o", tmp_path / "o.onnx", "--dtype", "bfloat16")
    assert code == 2 and "normconv writes float16" in err
    twice = onnx.load(src)  # a value two nodes define: protobuf reads it, ONNX's rules forbid it (was exit 3)
    first = twice.graph.node[0].output[0]
    twice.graph.node.append(onnx.helper.make_node("Identity", [twice.graph.input[0].name], [first]))
    onnx.save(twice, str(tmp_path / "twice.onnx"))
    code, _, err = cli("inspect", tmp_path / "twice.onnx")
    assert code == 2 and err.count("\n") == 1 and "not a valid ONNX model" in err


def test_an_input_without_a_shape_asks_for_it_in_one_line(cli, tmp_path, capfd):
    """An input declared with a type but no shape (unknown rank; onnxruntime loads it): normconv cannot make inputs
    for it, says so in one line naming -i (exit 2) and onnxruntime prints nothing; with -i it runs."""
    proto = G.layernorm_torch(17)
    proto.graph.input[0].type.tensor_type.ClearField("shape")
    src = G.save(proto, tmp_path / "unranked.onnx")
    capfd.readouterr()
    code, _, err = cli("fold", src, "-o", tmp_path / "o.onnx")
    assert code == 2 and len(err.strip().splitlines()) == 1 and "-i x:" in err and "without a shape" in err
    assert capfd.readouterr().err.strip() == "" and not (tmp_path / "o.onnx").exists()
    code, _, err = cli("export", src, "-o", tmp_path / "o.onnx", "-i", "x:2,3,16")
    assert code == 0, err


@pytest.mark.parametrize("command, flags", [("fold", ["--eval"]), ("fold", ["--in-place", "--static"]),
                                            ("export", ["--no-fold"]), ("export", ["--validate", "cuda"]),
                                            ("export", ["--baseline"]), ("inspect", ["--capture", "torch.export"])])
def test_a_flag_an_onnx_input_cannot_honour_is_refused(cli, tmp_path, command, flags):
    """Every flag is obeyed or refused in one line, never dropped (fold took only -i, --atol, --rtol and --overwrite:
    '--dtype float16' wrote a float32 file, exit 0); the input untouched, nothing written."""
    src = G.save(G.conv_bn(), tmp_path / "cb.onnx")
    before = Path(src).read_bytes()
    out = ["-o", str(tmp_path / "o.onnx")] if command != "inspect" else []
    code, _, err = cli(command, src, *out, *flags)
    assert code == 2 and err.count("\n") == 1 and "not supported with it" in err
    assert all(f in err for f in flags if f.startswith("--")) and "an .onnx input" in err
    assert Path(src).read_bytes() == before and sorted(p.name for p in tmp_path.iterdir()) == ["cb.onnx"]


def test_fold_of_an_onnx_file_takes_dtype(cli, tmp_path):
    src = G.save(G.conv_bn(), tmp_path / "cb.onnx")
    code, _, err = cli("fold", src, "-o", tmp_path / "h.onnx", "--dtype", "float16")
    assert code == 0, err
    types = {t.data_type for t in onnx.load(str(tmp_path / "h.onnx")).graph.initializer}
    assert types == {onnx.TensorProto.FLOAT16} and "BatchNormalization" not in _ops(tmp_path / "h.onnx")


def test_one_input_shape_may_leave_out_its_name(cli, tmp_path):
    """As for a torch model (README): a file with one input takes -i D0,D1,...; the same name twice is refused."""
    src = G.save(G.conv_bn(), tmp_path / "cb.onnx")
    name = onnx.load(src).graph.input[0].name
    code, out, err = cli("fold", src, "-o", tmp_path / "o.onnx", "-i", "3,4,10,10", "--json")
    assert code == 0, err
    assert any(f"{name}=(3, 4, 10, 10)" in v["label"] for v in _json(out)["validation"])
    code, _, err = cli("fold", src, "-o", tmp_path / "p.onnx", "-i", f"{name}:1,4,8,8", "-i", "2,4,8,8")
    assert code == 2 and "given twice" in err and not (tmp_path / "p.onnx").exists()


def test_not_verified_exits_1_and_writes_nothing(cli, tmp_path):
    src = G.save(G.layernorm_tf(15), tmp_path / "tf.onnx")
    code, _, err = cli("export", src, "-o", tmp_path / "o.onnx", "--atol", "0", "--rtol", "0")
    assert code == 1 and "nothing written" in err and not (tmp_path / "o.onnx").exists()


def test_a_check_that_compared_nothing_is_said_so(cli, tmp_path):
    """A file whose outputs are all 0 on the inputs drawn (Shrink with lambd past every draw, from the onnx wheel's
    tests): nothing was compared, which is no pass (exit 1) and no difference either: the line says which."""
    import onnx
    from onnx import TensorProto, helper

    graph = helper.make_graph([helper.make_node("Shrink", ["x"], ["y"], lambd=1e6)], "g",
                              [helper.make_tensor_value_info("x", TensorProto.FLOAT, [5])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [5])])
    src = tmp_path / "shrink.onnx"
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]), str(src))
    code, _, err = cli("export", src, "-o", tmp_path / "o.onnx")
    assert code == 1 and "nothing compared" in err and "differs" not in err.splitlines()[-1]
    assert "nothing written" in err and not (tmp_path / "o.onnx").exists()


class _Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv, self.bn = nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8)
        self.ln = nn.LayerNorm(8)

    def forward(self, x):
        y = torch.relu(self.bn(self.conv(x)))
        return self.ln(y.permute(0, 2, 3, 1))


@pytest.mark.parametrize("opset", [11, 14, 16])
def test_torch_legacy_export(tmp_path, opset):
    """torch.onnx legacy (dynamo=False) below 17 writes LayerNorm as primitive ops; BN is left unfolded in
    training-mode-free eval export with do_constant_folding=False."""
    from normconv.onnx import onnx_in

    m = _Block().eval()
    with torch.no_grad():
        m.bn.running_mean.uniform_(-1, 1), m.bn.running_var.uniform_(0.5, 2)
    path = tmp_path / "legacy.onnx"
    torch.onnx.export(m, (torch.randn(1, 3, 16, 16),), str(path), dynamo=False, opset_version=opset,
                      do_constant_folding=False, input_names=["x"], dynamic_axes={"x": {0: "n", 2: "h", 3: "w"}})
    assert _ops(path).get("ReduceMean") == 2 and _ops(path).get("BatchNormalization") == 1
    r = onnx_in.run(str(path), "export", str(tmp_path / "o.onnx"), target="onnx")
    ops = _ops(tmp_path / "o.onnx")
    assert r.passed and ops.get("LayerNormalization") == 1 and "ReduceMean" not in ops
    assert "BatchNormalization" not in ops and r.extra["folded_batchnorm"] == 1


def test_torch_dynamo_export_rms(tmp_path):
    """torch.onnx dynamo at opset 18 decomposes nn.RMSNorm (Pow, ReduceMean, Add, Sqrt, Reciprocal, Mul)."""
    from normconv.onnx import onnx_in

    m = nn.Sequential(nn.Linear(16, 16), nn.RMSNorm(16, eps=1e-6)).eval()
    path = tmp_path / "dyn.onnx"
    torch.onnx.export(m, (torch.randn(2, 5, 16),), str(path), dynamo=True, opset_version=18, external_data=False,
                      dynamic_shapes=({0: torch.export.Dim("batch"), 1: torch.export.Dim("seq")},))
    assert "Sqrt" in _ops(path)
    r = onnx_in.run(str(path), "export", str(tmp_path / "o.onnx"), target="ort")
    ops = _ops(tmp_path / "o.onnx")
    assert r.passed and ops.get("SimplifiedLayerNormalization") == 1 and "Sqrt" not in ops


@pytest.fixture(scope="session")
def real_files():
    """The ONNX files inside rapidocr-onnxruntime, magika and silero-vad wheels (pip download, cached)."""
    CACHE.mkdir(parents=True, exist_ok=True)
    out = {}
    for pkg, prefix in WHEELS.items():
        wheels = sorted(CACHE.glob(f"{prefix}-*.whl"))
        if not wheels:
            r = subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "-q", "-d", str(CACHE), pkg],
                               capture_output=True, text=True, timeout=600)
            wheels = sorted(CACHE.glob(f"{prefix}-*.whl"))
            if r.returncode or not wheels:
                continue
        folder = CACHE / prefix
        with zipfile.ZipFile(wheels[-1]) as z:
            for name in z.namelist():
                if name.endswith(".onnx") and not (folder / name).exists():
                    z.extract(name, folder)
        out.update({p.name: p for p in folder.rglob("*.onnx")})
    return out


def _real(real_files, name):
    if name not in real_files:
        pytest.skip(f"{name}: its package could not be downloaded here (pip download failed)")
    return real_files[name]


@pytest.mark.parametrize("name,folded,fused,opset_out", [
    ("ch_ppocr_mobile_v2.0_cls_infer.onnx", 35, {}, 11),  # PaddleOCR direction classifier: 35 BN after convs
    ("ch_PP-OCRv4_det_infer.onnx", 3, {}, 12),  # detection: BN after Conv, and after ConvTranspose + bias Add
    ("ch_PP-OCRv4_rec_infer.onnx", 6, {"layernorm": 5}, 17),  # recognition: paddle2onnx LayerNorms, opset 12
])
def test_paddleocr(cli, tmp_path, real_files, name, folded, fused, opset_out):
    src = _real(real_files, name)
    before = src.read_bytes()
    code, out, err = cli("export", src, "-o", tmp_path / "o.onnx", "--target", "onnx", "--json")
    assert code == 0, err
    r = _json(out)
    assert r["extra"]["folded_batchnorm"] == folded and r["extra"]["fused"] == fused
    assert r["extra"]["opset"] == opset_out and r["extra"]["checker"].startswith("passed")
    assert len(r["validation"]) == 4 and all(v["max_abs_error"] < 1e-4 for v in r["validation"])
    assert src.read_bytes() == before


def test_magika_jax2tf_layernorms(cli, tmp_path, real_files):
    src = _real(real_files, "model.onnx")
    code, out, err = cli("export", src, "-o", tmp_path / "o.onnx", "--json", "--atol", "1e-2")
    assert code == 0, err
    r = _json(out)
    assert r["extra"]["fused"] == {"layernorm": 2} and r["extra"]["converted_from"] == 15
    ops = _ops(tmp_path / "o.onnx")
    # 4 of its 5 ReduceSums and 2 of its 3 Max are the two LayerNorms; Sqrt and Reciprocal go entirely
    assert ops["LayerNormalization"] == 2 and ops["ReduceSum"] == 1 and ops["Max"] == 1
    assert "Sqrt" not in ops and "Reciprocal" not in ops


def test_silero_stft_magnitude_is_not_a_norm(cli, tmp_path, real_files):
    src = _real(real_files, "silero_vad_op18_ifless.onnx")
    code, out, err = cli("export", src, "-o", tmp_path / "o.onnx", "--json", "--target", "onnx")
    assert code == 0, err
    r = _json(out)
    assert [s["code"] for s in r["sites"]] == ["elementwise-magnitude"] * 2 and not r["extra"]["fused"]
    assert r["extra"]["validated_sizes"][0] != r["extra"]["validated_sizes"][1]


def test_external_data_in_external_data_out(tmp_path):
    """A file whose weights live in an external .data file (as every file past protobuf's 2 GB does): OUT keeps the
    layout (its own sidecar), IN's sidecar is never written, and an -o whose sidecar would be IN's is refused."""
    from normconv.errors import NormconvError
    from normconv.onnx import onnx_in

    (tmp_path / "in").mkdir()
    src = tmp_path / "in" / "m.onnx"
    onnx.save_model(G.conv_bn(), str(src), save_as_external_data=True, location="m.onnx.data", size_threshold=0)
    data = (tmp_path / "in" / "m.onnx.data").read_bytes()
    r = onnx_in.run(str(src), "fold", str(tmp_path / "out.onnx"))
    assert r.passed and r.extra["external_data"] == "out.onnx.data" and (tmp_path / "out.onnx.data").is_file()
    assert (tmp_path / "in" / "m.onnx.data").read_bytes() == data
    assert "BatchNormalization" not in _ops(tmp_path / "out.onnx")
    onnx.save_model(G.conv_bn(), str(tmp_path / "in" / "o2.onnx"), save_as_external_data=True,
                    location="x.onnx.data", size_threshold=0)
    with pytest.raises(NormconvError, match="external data"):  # x.onnx's sidecar would be x.onnx.data: IN's
        onnx_in.run(str(tmp_path / "in" / "o2.onnx"), "fold", str(tmp_path / "in" / "x.onnx"))


def test_overwrite_of_an_external_data_output_by_an_inline_one_leaves_no_stale_sidecar(tmp_path):
    """OUT written before with its tensors in OUT.onnx.data, then replaced (--overwrite) by a file that holds them
    inline: the old sidecar is the replaced file's and goes with it; an OUT.onnx.data the old OUT did not use stays."""
    import onnxruntime

    from normconv.onnx import onnx_in

    src = G.save(G.conv_bn(), tmp_path / "m.onnx")
    out = tmp_path / "o.onnx"
    onnx.save_model(G.conv_bn(), str(out), save_as_external_data=True, location="o.onnx.data", size_threshold=0)
    r = onnx_in.run(src, "fold", str(out), overwrite=True)
    assert r.passed and r.extra["external_data"] is None and not (tmp_path / "o.onnx.data").exists()
    assert any("removed o.onnx.data" in n for n in r.notes)
    assert "BatchNormalization" not in _ops(out)
    onnxruntime.InferenceSession(str(out), providers=["CPUExecutionProvider"])  # loads with no sidecar
    (tmp_path / "o.onnx.data").write_bytes(b"someone else's")  # not the external data of the o.onnx there now
    onnx_in.run(src, "fold", str(out), overwrite=True)
    assert (tmp_path / "o.onnx.data").read_bytes() == b"someone else's"


def test_silero_spox_file_unnamed_dims_that_must_agree(cli, tmp_path, real_files):
    """spox's silero_vad.onnx declares every dynamic dimension unnamed (0): the input's batch (axis 0) and the
    state's (axis 1) must agree, and the model takes 512 samples a chunk. Both batch dimensions run at 1 and 2
    together; the sample dimension at the one size it accepts, said in a note."""
    src = _real(real_files, "silero_vad.onnx")
    code, out, err = cli("export", src, "-o", tmp_path / "o.onnx", "--json", "--target", "onnx")
    assert code == 0, err
    r = _json(out)
    sizes = r["extra"]["validated_sizes"]
    assert [s["('input', 0)"] for s in sizes] == [1, 2] and [s["('state', 1)"] for s in sizes] == [1, 2]
    assert [s["code"] for s in r["sites"]] == ["elementwise-magnitude"] * 2
    assert any("one size only" in n for n in r["notes"])
