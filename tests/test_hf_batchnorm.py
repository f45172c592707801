"""BatchNorm conversions on Hugging Face CNNs built tiny from their configs (random weights, torch.export captures):
ResNet, RegNet, MobileNetV1 / V2, EfficientNet, and DETR's backbone with its frozen BatchNorm."""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.nn as nn

import bn_styles as B
import normconv
from normconv.nn.modules import FrozenBatchNorm
from normconv.verify import Inputs

pytest.importorskip("transformers")


def _image(batch: int = 2, size: int = 32) -> torch.Tensor:
    return torch.randn(batch, 3, size, size, generator=torch.Generator().manual_seed(0))


def _build(name: str) -> nn.Module:
    import transformers as t

    warnings.filterwarnings("ignore")
    torch.manual_seed(0)
    resnet = dict(embedding_size=8, hidden_sizes=[8, 16], depths=[1, 1], layer_type="basic")
    model = {
        "resnet": lambda: t.ResNetModel(t.ResNetConfig(**resnet)),
        "regnet": lambda: t.RegNetModel(t.RegNetConfig(embedding_size=8, hidden_sizes=[8, 16], depths=[1, 1],
                                                       groups_width=4)),
        "mobilenetv1": lambda: t.MobileNetV1Model(t.MobileNetV1Config(depth_multiplier=0.25, image_size=32)),
        "mobilenetv2": lambda: t.MobileNetV2Model(t.MobileNetV2Config(depth_multiplier=0.25, image_size=32)),
        "efficientnet": lambda: t.EfficientNetModel(t.EfficientNetConfig(width_coefficient=0.1, depth_coefficient=0.1,
                                                                         image_size=32, hidden_dim=128)),
        "detr": lambda: t.DetrModel(t.DetrConfig(
            use_timm_backbone=False, use_pretrained_backbone=False, backbone=None,
            backbone_config=t.ResNetConfig(**resnet, out_features=["stage2"]), d_model=16, encoder_layers=1,
            decoder_layers=1, encoder_attention_heads=2, decoder_attention_heads=2, encoder_ffn_dim=32,
            decoder_ffn_dim=32, num_queries=5)),
    }[name]()
    return B.randomize(model).eval()


CNNS = ["resnet", "regnet", "mobilenetv1", "mobilenetv2", "efficientnet"]


@pytest.mark.parametrize("name", CNNS)
def test_hf_cnn_to_frozen_batchnorm_is_exact(name):
    model = _build(name)
    count = sum(isinstance(m, nn.BatchNorm2d) for m in model.modules())
    new, report = normconv.swap(model, Inputs((_image(),)), to="frozen-batchnorm")
    assert report.passed and report.extra["exact"] and report.extra["converted"] == count
    assert sum(isinstance(m, FrozenBatchNorm) for m in new.modules()) == count
    assert not any(isinstance(m, nn.BatchNorm2d) for m in new.modules())
    # the example and a second shape; MobileNetV1's TF padding branches on the input's size: checked across too
    assert len([v for v in report.validation if "across a branch on sizes" not in v.label
                and not v.label.startswith("training mode")]) == 2
    assert all(v.passed for v in report.validation if not v.drift)
    # in training mode a frozen BatchNorm keeps its statistics where the original took the batch's: said, measured
    assert report.extra["training_mode"]["code"] == "eval-only"
    assert report.extra["training_mode"]["causes"] == ["frozen-statistics"]


def test_detr_frozen_backbone_is_found_and_converted_back():
    model = _build("detr")
    x = Inputs((_image(),))
    report = normconv.inspect(model, x)
    frozen = [s for s in report.sites if s["module_type"] == "DetrFrozenBatchNorm2d"]
    assert len(frozen) == 6 and all(s["kind"] == "batchnorm" and s["source"] == "handwritten" for s in frozen)
    new, report = normconv.swap(model, x, to="batchnorm")
    assert report.passed and report.extra["converted"] == 6
    bns = [m for m in new.modules() if isinstance(m, nn.BatchNorm2d)]
    assert len(bns) == 6 and all(m.eps == 1e-5 for m in bns)  # DETR's own eps
    with pytest.raises(normconv.NormconvError, match="already frozen"):
        normconv.swap(model, x, to="frozen-batchnorm")


def test_hf_resnet_groupnorm_drift_and_recalibration():
    model = _build("resnet")
    x = Inputs((_image(),))
    new, report = normconv.swap(model, x, to="groupnorm")
    assert report.passed and not report.extra["exact"] and report.extra["converted"] == 6
    assert not any(isinstance(m, nn.BatchNorm2d) for m in new.modules())
    data = _image(16)
    recal, report = normconv.recalibrate(model, data, batch_size=8, example_inputs=x)
    assert report.passed and len(report.extra["statistics"]) == 18
    assert all(int(m.num_batches_tracked) == 2 for m in recal.modules() if isinstance(m, nn.BatchNorm2d))


def test_hf_mobilenet_affine_leaves_no_batchnorm():
    model = _build("mobilenetv2")
    new, report = normconv.swap(model, Inputs((_image(),)), to="affine")
    assert report.passed and not any(isinstance(m, nn.BatchNorm2d) for m in new.modules())
    assert report.extra["folded"] + report.extra["converted"] == 52


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_a_half_precision_vision_folder_gets_pixels_in_its_dtype(cli, tmp_path, dtype):
    """A float16 / bfloat16 checkpoint of a vision model: the example pixels made from its config are in the model's
    dtype (float32 pixels into half convs: every in-memory command refused the folder, 'the model rejected its
    example inputs'). fold writes a .pt2 that runs at another image size; float16 exports to ONNX, validated."""
    import json

    from hf_tiny import _randomized

    model = _randomized(_build("resnet").eval()).to(dtype)
    src = tmp_path / "in"
    model.save_pretrained(src)
    code, out, err = cli("fold", src, "-o", tmp_path / "f.pt2", "--json")
    assert code == 0, err
    rep = json.loads(out)
    assert rep["passed"] and any(s["applied"] for s in rep["sites"])
    program = torch.export.load(tmp_path / "f.pt2").module()
    x = _image(1, 64).to(dtype)
    with torch.no_grad():
        got, ref = program(pixel_values=x)["last_hidden_state"].float(), model(x).last_hidden_state.float()
    assert (got - ref).abs().max() <= 0.05 * ref.abs().max()
    if dtype == torch.float16:
        code, _, err = cli("export", src, "-o", tmp_path / "f.onnx")
        assert code == 0, err
