"""``fold --eval`` of a .pt2 exported in training mode: the program's graph computes BatchNorm on batch statistics
itself, which no module flag changes, so fold folded nothing and wrote the program as it was, still computing
batch statistics, with exit 0, where --eval promises the model's eval-mode self; and the refusal without --eval
told the user to pass --eval. A training-mode program is now refused either way (exit 2, one line, nothing
written), naming the way out: export the program again from the model after .eval()."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn


class ConvBN(nn.Module):
    def __init__(self):
        super().__init__()
        self.c, self.bn, self.h = nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), nn.Linear(8, 4)

    def forward(self, x):
        return self.h(torch.relu(self.bn(self.c(x))).mean((2, 3)))


@pytest.mark.parametrize("flags", [(), ("--eval",)], ids=["plain", "eval"])
def test_fold_refuses_a_program_exported_in_training_mode(cli, tmp_path, flags):
    torch.manual_seed(0)
    model = ConvBN().train()
    ep = torch.export.export(model, (torch.randn(4, 3, 16, 16),), dynamic_shapes=({0: torch.export.Dim.AUTO},))
    torch.export.save(ep, tmp_path / "m.pt2")
    out = tmp_path / "f.pt2"
    code, stdout, stderr = cli("fold", tmp_path / "m.pt2", *flags, "-o", out)
    assert code == 2, stdout
    line = stderr.strip()
    assert "\n" not in line and "training mode" in line and "export the program again" in line, stderr
    assert "pass --eval" not in line
    assert not out.exists()


def test_inspect_plans_the_export_refusal_of_a_program_in_training_mode(cli, tmp_path):
    """inspect planned 'one BatchNormalization' / 'one LayerNormalization' (applied) at every site of a program
    exported in training mode, which export refuses whole before any work: its rows now say that refusal."""
    import json

    class Drop(nn.Module):
        def __init__(self):
            super().__init__()
            self.e, self.ln, self.d, self.h = nn.Linear(16, 32), nn.LayerNorm(32), nn.Dropout(0.1), nn.Linear(32, 4)

        def forward(self, x):
            return self.h(self.d(self.ln(self.e(x))))

    torch.manual_seed(0)
    ep = torch.export.export(Drop().train(), (torch.randn(2, 5, 16),))
    torch.export.save(ep, tmp_path / "m.pt2")
    code, out, _ = cli("inspect", tmp_path / "m.pt2", "--json")
    assert code == 0
    (site,) = json.loads(out)["sites"]
    (planned,) = [p for p in site["plan"] if p["pass"] == "export"]
    assert not planned["applied"] and planned["code"] == "program-in-training-mode", planned
    code, _, stderr = cli("export", tmp_path / "m.pt2", "-o", tmp_path / "m.onnx")
    assert code == 2 and planned["reason"] in stderr and not (tmp_path / "m.onnx").exists()


@pytest.mark.parametrize("to", ["frozen-batchnorm", "affine"])
def test_a_batchnorm_swap_refuses_a_program_exported_in_training_mode_as_such(cli, tmp_path, to):
    """swap --to frozen-batchnorm of a training-mode program was refused "bn is never called ... not in one
    batch-norm op alone", a reason that was not the cause: it is now refused as fold refuses it."""
    torch.manual_seed(0)
    ep = torch.export.export(ConvBN().train(), (torch.randn(4, 3, 16, 16),))
    torch.export.save(ep, tmp_path / "m.pt2")
    out = tmp_path / "s.pt2"
    code, stdout, stderr = cli("swap", tmp_path / "m.pt2", "--to", to, "-o", out)
    assert code == 2, stdout
    line = stderr.strip()
    assert "\n" not in line and "training mode" in line and "export the program again" in line, stderr
    assert not out.exists()
