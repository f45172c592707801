"""torch.export given ``dynamic_shapes`` marks the tensors it was handed (``_dynamo_weak_dynamic_indices``) and leaves
the marks when it fails (torch 2.13); a later static export of the same tensors is then dynamic again and fails the
same way (timm's DLA and torchvision's S3D: an inequality sympy cannot solve, so neither the dynamic file nor its
static fallback was written). Every export normconv makes is handed new tensor objects over the same storage
(``io.dims.unmarked``): the fallback sees no marks, and the user's tensors are never marked."""

from __future__ import annotations

import torch
import torch.nn as nn

import normconv
from normconv.io import dims as io_dims
from normconv.verify import Inputs

MARKS = ("_dynamo_weak_dynamic_indices", "_dynamo_dynamic_indices", "_has_dynamo_dim_marking")


def test_unmarked_gives_new_objects_over_the_same_storage_without_marks():
    x, ids = torch.randn(2, 3, 8, 8), torch.arange(6).reshape(2, 3)
    x._dynamo_weak_dynamic_indices, x._has_dynamo_dim_marking = {0, 2, 3}, True  # as a failed export leaves them
    given = Inputs(([x, x * 2], {"k": x}), {"ids": ids, "flag": False})
    fresh = io_dims.unmarked(given)
    (images, nested), kwargs = fresh.args, fresh.kwargs
    for new, old in ((images[0], x), (nested["k"], x), (kwargs["ids"], ids)):
        assert new is not old and new.data_ptr() == old.data_ptr() and torch.equal(new, old)
        assert not any(hasattr(new, m) for m in MARKS)
    assert kwargs["flag"] is False and isinstance(images, list)
    assert x._dynamo_weak_dynamic_indices == {0, 2, 3}  # the given tensors as they were


class NoSymbolicSizes(nn.Module):
    """Fails any export with free sizes, as DLA's sympy inequality does: only a static program can be made."""

    def __init__(self):
        super().__init__()
        self.conv, self.bn = nn.Conv2d(3, 4, 3, padding=1), nn.BatchNorm2d(4)

    def forward(self, x):
        if isinstance(x.shape[2], torch.SymInt):
            raise RuntimeError("this model takes no symbolic sizes")
        return self.bn(self.conv(x))


def test_a_pt2_whose_dynamic_export_fails_is_written_static_and_the_users_tensor_unmarked(tmp_path):
    from normconv.io.outputs import WRITERS

    torch.manual_seed(0)
    model = NoSymbolicSizes().eval()
    x = torch.randn(2, 3, 8, 8)
    info: dict = {}
    WRITERS["pt2"](model, str(tmp_path / "m.pt2"), Inputs((x,)), info=info)
    assert any("every dimension pinned" in n for n in info["notes"]), info
    assert not any(hasattr(x, m) for m in MARKS), {m: getattr(x, m, None) for m in MARKS}
    program = torch.export.load(str(tmp_path / "m.pt2")).module()
    with torch.no_grad():
        torch.testing.assert_close(program(x), model(x))
