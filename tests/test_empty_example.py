"""Sweep B, finding 6: an example input with an empty dimension (a factory's (0, 6, 16)) crashed canonicalize and
swap with exit 3 (ZeroDivisionError in the second shape's resize), where ``--input-shape 0,6,16`` is refused as
"dimensions must be positive". Now such an example is refused the same way wherever it comes from: a factory, a
pickle's carried example, the API (one line, exit 2), and nothing is written."""

from __future__ import annotations

import sys
import textwrap

import pytest
import torch
import torch.nn as nn

import normconv
from normconv.errors import Code, NormconvError
from normconv.io.outputs import INPUTS_ATTR
from tests.trust_helpers import one_line_error

_FACTORY = '''
import torch
import torch.nn as nn


def make():
    return nn.Sequential(nn.Linear(16, 16), nn.LayerNorm(16)).eval(), (torch.randn(0, 6, 16),)
'''


@pytest.fixture
def empty(tmp_path, monkeypatch):
    (tmp_path / "emptybatch.py").write_text(textwrap.dedent(_FACTORY))
    monkeypatch.chdir(tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path))
    yield tmp_path
    sys.modules.pop("emptybatch", None)


@pytest.mark.parametrize("command", [["canonicalize"], ["swap", "--to", "rmsnorm"], ["inspect"]])
def test_a_factory_s_empty_example_is_refused_in_one_line(cli, empty, command):
    out = empty / "out.pt"
    args = [command[0], "emptybatch:make", *command[1:]] + ([] if command[0] == "inspect" else ["-o", out])
    one_line_error(cli, *args, match=("(0, 6, 16)", "dimensions must be positive"))
    assert not out.exists()


def test_a_pickle_s_carried_empty_example_is_refused(cli, empty):
    model = nn.Sequential(nn.Linear(16, 16), nn.LayerNorm(16)).eval()
    model.__dict__[INPUTS_ATTR] = {"args": (torch.randn(2, 0, 16),), "kwargs": {}}  # as normconv's own .pt carries
    torch.save(model, empty / "m.pt")
    one_line_error(cli, "canonicalize", empty / "m.pt", "--trust-pickle", "-o", empty / "out.pt",
                   match=("(2, 0, 16)", "dimensions must be positive"))
    assert not (empty / "out.pt").exists()


def test_the_api_refuses_an_empty_example_as_bad_input():
    model = nn.Sequential(nn.Linear(16, 16), nn.LayerNorm(16)).eval()
    with pytest.raises(NormconvError) as info:
        normconv.canonicalize(model, (torch.randn(0, 6, 16),))
    assert info.value.code is Code.BAD_INPUT and "dimensions must be positive" in info.value.message
