"""swap --to ... on a .pt2 (torch.export.save of a program): the module an exported program's graph lifts is a holder
its graph reads (``getattr(self, "1").running_mean`` into ``aten.batch_norm``), never called. Replacing the holder
alone left the graph reading tensors the replacement lacks: exit 3 for every target but batchnorm. Now the graph calls
the replacement in place of the op; a holder read otherwise is refused with its code."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn

import normconv
from normconv.errors import Code, NormconvError
from normconv.graph.capture import capture
from normconv.graph.detect import find_norms
from normconv.passes.convert_batchnorm import ConvertWhy, plan
from normconv.verify import Inputs


def _program(model: nn.Module, x: torch.Tensor) -> torch.export.ExportedProgram:
    return torch.export.export(model, (x,), dynamic_shapes=({0: torch.export.Dim("batch")},))


def _conv_bn() -> nn.Module:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(3, 4, 3, padding=1, bias=False), nn.BatchNorm2d(4), nn.ReLU())
    model[1].running_mean.normal_()
    model[1].running_var.uniform_(0.5, 2.0)
    return model.eval()


@pytest.mark.parametrize("to", ["frozen-batchnorm", "affine", "groupnorm", "instancenorm", "batchnorm"])
def test_swap_of_a_pt2_calls_the_replacement_from_its_graph(cli, tmp_path, to):
    model, x = _conv_bn(), torch.randn(2, 3, 16, 16)
    src, out = tmp_path / "m.pt2", tmp_path / "out.pt2"
    torch.export.save(_program(model, x), src)
    code, _, stderr = cli("--quiet", "swap", src, "--to", to, "-o", out)
    assert code == 0, stderr
    new = torch.export.load(str(out)).module()
    for shape in ((2, 3, 16, 16), (5, 3, 16, 16)):
        y = torch.randn(shape)
        with torch.no_grad():
            ref, got = model(y), new(y)
        if to in ("frozen-batchnorm", "affine", "batchnorm"):  # exact (batchnorm: the holder becomes a module)
            torch.testing.assert_close(got, ref, atol=1e-5, rtol=1e-5)
        else:  # approximate: the target's own computation on the conv's output
            norm = nn.GroupNorm(2, 4) if to == "groupnorm" else nn.InstanceNorm2d(4, affine=True)
            norm.load_state_dict({"weight": model[1].weight, "bias": model[1].bias})
            with torch.no_grad():
                torch.testing.assert_close(got, torch.relu(norm(model[0](y))), atol=1e-5, rtol=1e-5)


def test_a_holder_read_by_more_than_its_batch_norm_is_refused_with_its_code():
    """The forward reads the BatchNorm's running mean itself too: the graph reads the holder in two ops, so no
    replacement of it is the same model; refused in one line (the API raises NormconvError), the model unchanged."""

    class M(nn.Module):
        def __init__(self):
            super().__init__()
            self.c, self.b = nn.Conv2d(3, 4, 1), nn.BatchNorm2d(4)

        def forward(self, x):
            return self.b(self.c(x)) + self.b.running_mean.reshape(1, -1, 1, 1)

    x = torch.randn(2, 3, 8, 8)
    program = _program(M().eval(), x).module()
    with pytest.raises(NormconvError) as info:
        normconv.swap(program, x, to="frozen-batchnorm")
    assert info.value.code is Code.REFUSED and "never called" in str(info.value)
    cap = capture(program, Inputs((x,)))
    assert [s.code for s in plan(cap, find_norms(cap), "affine")] == [ConvertWhy.READ_BY_GRAPH]
