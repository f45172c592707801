"""deepnorm on a .pt2 post-LN transformer is refused (a program's norms are aten calls: no module to hook), and its
hint said "run normconv canonicalize first", which cannot help (canonicalize keeps a program's norms as they are, and
deepnorm refuses its output the same way). The hint now says what can: the eager model the program came from."""

from __future__ import annotations

import torch
import torch.nn as nn


class PostLN(nn.Module):
    def __init__(self, d=16):
        super().__init__()
        self.attn, self.ln1 = nn.Linear(d, d), nn.LayerNorm(d)
        self.ffn, self.ln2 = nn.Sequential(nn.Linear(d, 32), nn.GELU(), nn.Linear(32, d)), nn.LayerNorm(d)

    def forward(self, x):
        x = self.ln1(x + self.attn(x))
        return self.ln2(x + self.ffn(x))


def test_the_refusal_of_a_pt2_names_what_helps(cli, tmp_path):
    torch.manual_seed(0)
    path = tmp_path / "postln.pt2"
    torch.export.save(torch.export.export(PostLN().eval(), (torch.randn(2, 7, 16),)), path)
    code, _, err = cli("deepnorm", path, "-o", tmp_path / "dn.pt2")
    assert code == 2 and len(err.strip().splitlines()) == 1, err
    assert "give deepnorm the eager model it was exported from" in err and "canonicalize" not in err
    assert not (tmp_path / "dn.pt2").exists()
