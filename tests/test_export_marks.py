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


def test_a_pt2_whose_dynamic_export_fails_is_written_with_the_batch_alone_free_and_the_users_tensor_unmarked(
        tmp_path):
    from normconv.io.outputs import WRITERS

    torch.manual_seed(0)
    model = NoSymbolicSizes().eval()
    x = torch.randn(2, 3, 8, 8)
    info: dict = {}
    WRITERS["pt2"](model, str(tmp_path / "m.pt2"), Inputs((x,)), info=info)
    codes = {d["name"]: d.get("code") for d in info["dynamic_dims"]}
    assert codes["batch"] is None and codes["height"] == codes["width"] == "refused-by-export", info
    assert not any(hasattr(x, m) for m in MARKS), {m: getattr(x, m, None) for m in MARKS}
    program = torch.export.load(str(tmp_path / "m.pt2")).module()
    with torch.no_grad():
        torch.testing.assert_close(program(x), model(x))
        other = torch.randn(3, 3, 8, 8)  # the batch stays free
        torch.testing.assert_close(program(other), model(other))


class ImageList(nn.Module):
    """A detector's calling convention: ``forward(images: list[Tensor])``."""

    def __init__(self):
        super().__init__()
        self.conv, self.bn = nn.Conv2d(3, 4, 3, padding=1), nn.BatchNorm2d(4)

    def forward(self, images):
        return torch.stack([self.bn(self.conv(x[None])).mean((2, 3))[0] for x in images])


def _image_list():
    torch.manual_seed(0)
    model = ImageList().eval()
    with torch.no_grad():
        model.bn.running_mean.normal_(0, 0.5), model.bn.running_var.uniform_(0.5, 2)
    return model, ([torch.randn(3, 8, 8), torch.randn(3, 8, 8)],)


def test_an_input_that_is_a_list_of_tensors_exports_its_structure(tmp_path, cli):
    """torch.export wants ``dynamic_shapes`` in the inputs' own structure: a list input gets a list of specs (its
    tensors static), not None (which torch.export refuses, hiding the model's own reason behind it)."""
    import onnxruntime as ort

    model, (images,) = _image_list()
    shapes = io_dims.export_shapes(model, Inputs((images,)))
    assert shapes == {"images": [None, None]}
    for out in ("m.pt2", "m.onnx"):
        code, _, stderr = cli("fold" if out.endswith(".pt2") else "export", "test_export_marks:_image_list", "-o",
                              tmp_path / out)
        assert code == 0, stderr
    fresh = [torch.randn(3, 8, 8), torch.randn(3, 8, 8)]
    with torch.no_grad():
        expected = model(fresh)
        torch.testing.assert_close(torch.export.load(str(tmp_path / "m.pt2")).module()(fresh), expected)
    session = ort.InferenceSession(str(tmp_path / "m.onnx"))
    feeds = {i.name: x.numpy() for i, x in zip(session.get_inputs(), fresh)}
    torch.testing.assert_close(torch.from_numpy(session.run(None, feeds)[0]), expected, atol=1e-5, rtol=1e-4)


class DictInput(nn.Module):
    """One positional input that is a dict of tensors (a batch as data loaders give it)."""

    def __init__(self):
        super().__init__()
        self.conv, self.bn = nn.Conv2d(3, 4, 1), nn.BatchNorm2d(4)

    def forward(self, batch):
        return self.bn(self.conv(batch["image"])) * batch["scale"]


def _dict_input():
    torch.manual_seed(0)
    model = DictInput().eval()
    with torch.no_grad():
        model.bn.running_var.uniform_(0.5, 2)
    return model, ({"image": torch.randn(1, 3, 8, 8), "scale": torch.randn(1, 4, 1, 1)},)


def test_an_input_that_is_a_dict_of_tensors_exports(tmp_path, cli):
    """torch.onnx.export takes a last positional dict as the keyword inputs ("missing a required argument: 'batch'"):
    the export passes its documented escape, an empty dict after it; the ONNX inputs are the dict's leaves, named as
    torch.onnx names them, and fed from it."""
    import onnxruntime as ort

    code, _, stderr = cli("export", "test_export_marks:_dict_input", "-o", tmp_path / "d.onnx")
    assert code == 0, stderr
    model, _ = _dict_input()
    session = ort.InferenceSession(str(tmp_path / "d.onnx"))
    assert [i.name for i in session.get_inputs()] == ["batch_image", "batch_scale"]
    fresh = {"image": torch.randn(1, 3, 8, 8), "scale": torch.randn(1, 4, 1, 1)}
    (got,) = session.run(None, {"batch_image": fresh["image"].numpy(), "batch_scale": fresh["scale"].numpy()})
    with torch.no_grad():
        torch.testing.assert_close(torch.from_numpy(got), model(fresh), atol=1e-5, rtol=1e-4)
