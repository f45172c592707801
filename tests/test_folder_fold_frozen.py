"""``fold`` of a Hugging Face folder whose BatchNorms are a class of the model's own (DETR's DetrFrozenBatchNorm2d:
weight, bias and running statistics as buffers, eps 1e-5 in its forward, no ``eps`` / ``num_features`` /
``affine`` attributes) written as a folder: each frozen BatchNorm is left as the identity. Before, the in-memory
fold did all the work and then refused the folder (exit 2: '... is now Identity (was DetrFrozenBatchNorm2d)'),
though ``fold --stream`` and ``-o x.pt2`` of the same folder work."""

from __future__ import annotations

from tests.test_stream_fold_frozen import _detr, assert_folded_detr


def test_fold_detr_frozen_batchnorms_to_a_folder(cli, tmp_path):
    src, out = tmp_path / "in", tmp_path / "out"
    model = _detr(src)
    code, _, err = cli("fold", src, "-o", out)
    assert code == 0, err
    assert_folded_detr(model, out)
