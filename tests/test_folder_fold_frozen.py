"""``fold`` of a Hugging Face folder whose BatchNorms are a class of the model's own (DETR's DetrFrozenBatchNorm2d:
weight, bias and running statistics as buffers, eps 1e-5 in its forward, no ``eps`` / ``num_features`` /
``affine`` attributes) written as a folder: each frozen BatchNorm is left as the identity. Before, the in-memory
fold did all the work and then refused the folder (exit 2: '... is now Identity (was DetrFrozenBatchNorm2d)'),
though ``fold --stream`` and ``-o x.pt2`` of the same folder work."""

from __future__ import annotations

import torch

from test_stream_fold_frozen import _detr


def test_fold_detr_frozen_batchnorms_to_a_folder(cli, tmp_path):
    from transformers import DetrForObjectDetection

    src, out = tmp_path / "in", tmp_path / "out"
    model = _detr(src)
    code, _, err = cli("fold", src, "-o", out)
    assert code == 0, err
    loaded = DetrForObjectDetection.from_pretrained(out).eval()
    frozen = [m for m in loaded.modules() if type(m).__name__ == "DetrFrozenBatchNorm2d"]
    assert len(frozen) == 6
    assert all(torch.equal(m.weight, torch.ones_like(m.weight)) and not m.running_mean.any() for m in frozen)
    for batch in (1, 3):  # batch sizes the verification did not use
        x = torch.randn(batch, 3, 32, 32, generator=torch.Generator().manual_seed(batch))
        with torch.no_grad():
            ref, got = model(pixel_values=x), loaded(pixel_values=x)
        for k in ("logits", "pred_boxes"):
            assert float((got[k] - ref[k]).abs().max() / ref[k].abs().max()) < 1e-5, (batch, k)
