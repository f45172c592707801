"""``fold --stream`` sees the frozen BatchNorms the in-memory fold finds by what they compute (DETR's
DetrFrozenBatchNorm2d: four buffers, eps in its forward), and writes each as the identity; before, it reported
"the model has no BatchNorm; it is unchanged" (exit 0) on a model the in-memory fold folds 6 in."""

from __future__ import annotations

import warnings

import pytest
import torch

import normconv


def _detr(folder):
    transformers = pytest.importorskip("transformers")
    warnings.filterwarnings("ignore")
    cfg = transformers.DetrConfig(
        use_timm_backbone=False, use_pretrained_backbone=False,
        backbone_config=dict(model_type="resnet", embedding_size=16, hidden_sizes=[16, 32], depths=[1, 1],
                             layer_type="basic", out_features=["stage2"]),
        d_model=32, encoder_layers=1, decoder_layers=1, encoder_attention_heads=4, decoder_attention_heads=4,
        encoder_ffn_dim=64, decoder_ffn_dim=64, num_queries=10, num_labels=5)
    torch.manual_seed(0)
    model = transformers.DetrForObjectDetection(cfg).eval()
    with torch.no_grad():  # statistics as trained ones look
        for m in model.modules():
            if hasattr(m, "running_var"):
                m.running_var.uniform_(0.5, 2)
                m.running_mean.normal_(0, 0.5)
                m.weight.normal_(1, 0.3)
                m.bias.normal_(0, 0.1)
    model.save_pretrained(folder)
    return model


def test_stream_fold_folds_detr_frozen_batchnorms(tmp_path):
    src, out = tmp_path / "in", tmp_path / "out"
    model = _detr(src)
    report = normconv.stream_fold(src, out)
    assert report.passed and report.extra["folded"] == 6
    assert all(s.applied for s in report.sites) and not any("no BatchNorm" in n for n in report.notes)
    assert_folded_detr(model, out)


def assert_folded_detr(model, out) -> None:
    """The folder ``out`` holds ``model`` (``_detr``) with its 6 frozen BatchNorms folded: each the identity, and the
    outputs the same, judged by their scale, at batch sizes the verification did not use."""
    from transformers import DetrForObjectDetection

    loaded = DetrForObjectDetection.from_pretrained(out).eval()
    frozen = [m for m in loaded.modules() if type(m).__name__ == "DetrFrozenBatchNorm2d"]
    assert len(frozen) == 6 and all(torch.equal(m.weight, torch.ones_like(m.weight)) and not m.running_mean.any()
                                    for m in frozen)
    for batch in (1, 3):
        x = torch.randn(batch, 3, 32, 32, generator=torch.Generator().manual_seed(batch))
        with torch.no_grad():
            ref, got = model(pixel_values=x), loaded(pixel_values=x)
        for k in ("logits", "pred_boxes"):
            assert float((got[k] - ref[k]).abs().max() / ref[k].abs().max()) < 1e-5, (batch, k)
