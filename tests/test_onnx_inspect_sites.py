"""``normconv inspect FILE.onnx`` lists every norm site with its kind, eps, shape and what feeds it (``onnx.sites``):
the norm ops the file holds (ONNX's, onnxruntime's contrib ops, epsilon defaulted by the op's schema) and the norms
written out in elementwise ops (their eps and shape as the fuse rule read them), each once."""

from __future__ import annotations

import json

import numpy as np
from onnx import TensorProto as T, helper as h, numpy_helper as nh

from tests import onnx_in_graphs as G


def _inspect(cli, path) -> dict:
    code, out, err = cli("inspect", path, "--json")
    assert code == 0, err
    return json.loads(out[out.index("{"):])


def _by_target(report: dict) -> dict:
    return {s["target"]: s for s in report["extra"]["norm_sites"]}


def test_written_out_norms_report_their_eps_and_shape(cli, tmp_path):
    ln = _by_target(_inspect(cli, G.save(G.layernorm_torch(17, d=16), tmp_path / "ln.onnx")))
    (site,) = ln.values()
    assert (site["kind"], site["source"], site["shape"], site["fed_by"]) == ("layernorm", "pattern", "16", "input x")
    assert abs(site["eps"] - 1e-5) < 1e-9
    assert [p["code"] for p in site["plan"]] == ["fused-layernorm"]

    gn = _inspect(cli, G.save(G.groupnorm(17, c=8, groups=4), tmp_path / "gn.onnx"))
    # the InstanceNormalization inside torch's GroupNorm spelling is that GroupNorm's, not a site of its own
    assert gn["extra"]["counts"] == {"groupnorm": 1}
    (site,) = gn["extra"]["norm_sites"]
    assert (site["kind"], site["shape"]) == ("groupnorm", "C=8 G=4") and abs(site["eps"] - 1e-5) < 1e-9


def test_norm_ops_the_file_holds_are_sites_with_schema_defaults(cli, tmp_path):
    d = 8
    rng = np.random.default_rng(0)
    inits = [nh.from_array(rng.random(d).astype(np.float32) + 0.5, n) for n in ("s1", "s2", "s3", "b1")]
    nodes = [h.make_node("LayerNormalization", ["x", "s1", "b1"], ["y1"], name="ln_default"),  # epsilon omitted
             h.make_node("LayerNormalization", ["y1", "s2"], ["y2"], name="ln_eps", epsilon=1e-6),
             h.make_node("SkipLayerNormalization", ["y2", "x", "s3"], ["y3"], name="skip", domain="com.microsoft")]
    g = h.make_graph(nodes, "g", [h.make_tensor_value_info("x", T.FLOAT, ["b", "s", d])],
                     [h.make_tensor_value_info("y3", T.FLOAT, ["b", "s", d])], inits)
    m = h.make_model(g, opset_imports=[h.make_opsetid("", 17), h.make_opsetid("com.microsoft", 1)])
    sites = _by_target(_inspect(cli, G.save(m, tmp_path / "ops.onnx")))
    assert list(sites) == ["ln_default", "ln_eps", "skip"]
    assert abs(sites["ln_default"]["eps"] - 1e-5) < 1e-12 and abs(sites["ln_eps"]["eps"] - 1e-6) < 1e-12
    assert sites["skip"]["op"] == "com.microsoft.SkipLayerNormalization" and abs(sites["skip"]["eps"] - 1e-12) < 1e-18
    assert {s["shape"] for s in sites.values()} == {"8"} and sites["ln_eps"]["fed_by"] == "LayerNormalization ln_default"
    assert all(s["source"] == "op" and s["kind"] == "layernorm" for s in sites.values())


def test_batchnorm_site_names_its_conv_and_channels(cli, tmp_path):
    r = _inspect(cli, G.save(G.conv_bn(cout=8), tmp_path / "cb.onnx"))
    (site,) = r["extra"]["norm_sites"]
    assert (site["kind"], site["op"], site["shape"], site["fed_by"]) == ("batchnorm", "BatchNormalization", "C=8",
                                                                         "Conv conv")
    assert [p["code"] for p in site["plan"]] == ["folded"]


def test_norm_inside_a_subgraph_is_a_site(cli, tmp_path):
    r = _inspect(cli, G.save(G.layernorm_in_if(17, d=16), tmp_path / "if.onnx"))
    assert r["extra"]["counts"] == {"layernorm": 1}


def test_human_view_prints_the_site_table(cli, tmp_path):
    code, out, _ = cli("inspect", G.save(G.conv_bn(cout=8), tmp_path / "cb.onnx"))
    assert code == 0
    assert "1 norm sites (1 batchnorm)" in out and "norm sites" in out and "C=8" in out and "Conv conv" in out
