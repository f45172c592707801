"""``clone_sharing_tensors`` copies the module tree without deepcopy's generic machinery (``clone._copy_module``):
the copy must be the one ``copy.deepcopy`` makes with the tensors shared, on every kind of module users bring (the
zoo, Hugging Face models, torch's own containers, hooks, shared submodules, plain tensor attributes, classes with
their own copy rules), and writing into the copy never reaches the user's model."""

from __future__ import annotations

import copy
import functools

import pytest
import torch
import torch.fx as fx
import torch.nn as nn

from normconv.clone import _copy_module, _plain, clone_sharing_tensors
from normconv.models import ZOO, get

from .hf_tiny import tiny_gpt2, tiny_llama, tiny_t5


def _tensor_memo(model: nn.Module) -> dict[int, object]:
    return {id(t): t for t in list(model.parameters()) + list(model.buffers())}


def _same_copy(original: nn.Module, fast: nn.Module, slow: nn.Module) -> None:
    """``fast`` and ``slow`` (deepcopy) are the same copy of ``original``: the same classes, attributes, tensors (the
    original's objects), submodule sharing and hooks, and no module object of the original."""
    mods = [list(m.named_modules(remove_duplicate=False)) for m in (original, fast, slow)]
    assert [n for n, _ in mods[1]] == [n for n, _ in mods[2]] == [n for n, _ in mods[0]]
    ids = {id(m) for _, m in mods[0]}
    for (_, o), (_, f), (_, s) in zip(*mods):
        # (a GraphModule's deepcopy makes a class of its own each time: the same class by name)
        assert type(f).__qualname__ == type(s).__qualname__ == type(o).__qualname__ and id(f) not in ids
        assert sorted(f.__dict__) == sorted(s.__dict__)
        for k, v in s.__dict__.items():
            w = f.__dict__[k]
            if k in ("_parameters", "_buffers"):
                assert {n: id(t) for n, t in w.items()} == {n: id(t) for n, t in v.items()}
                assert {n: id(t) for n, t in w.items()} == {n: id(t) for n, t in o.__dict__[k].items()}
            elif k == "_modules":
                assert list(w) == list(v)
            elif isinstance(v, torch.Tensor):  # a plain tensor attribute: its own copy, equal
                assert w is not o.__dict__[k] and torch.equal(w, v)
            elif isinstance(v, (dict, set, list)):
                assert type(w) is type(v) and len(w) == len(v) and (not v or w is not o.__dict__[k])
                if isinstance(v, dict) and all(callable(x) for x in v.values()):  # hook tables: the same hooks
                    assert list(w.items()) == list(v.items())
            elif isinstance(v, (int, float, str, tuple, torch.dtype, torch.device, type(None))):
                assert type(w) is type(v) and w == v
            elif not isinstance(v, nn.Module):  # other objects (a GraphModule's graph): the same kind
                assert type(w).__qualname__ == type(v).__qualname__
    # shared submodules stay shared, distinct ones distinct
    where = [{id(m): n for n, m in reversed(ms)} for ms in mods]
    first = [[where[k][id(m)] for _, m in mods[k]] for k in range(3)]
    assert first[1] == first[2] == first[0]


CASES = {
    "zoo:" + name: functools.partial(lambda n: (get(n).build().eval(), get(n).example_inputs()), name)
    for name in ZOO
}


class _Hooked(nn.Module):
    """Hooks, one module under two names and in a plain list, a plain tensor attribute, a list, dtype and device
    attributes."""

    def __init__(self):
        super().__init__()
        self.body = nn.Sequential(nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4), nn.ReLU())
        self.body[0].register_forward_hook(lambda mod, a, y: y * 2)
        self.body[1].register_forward_pre_hook(lambda mod, a, kw: (a, kw), with_kwargs=True)
        self.a = self.b = nn.Linear(4, 4)  # one module under two names
        self.scale = torch.tensor([2.0])  # a plain tensor attribute (not a buffer)
        self.sizes = [1, 2, (3, 4)]
        self.friends = [self.a]  # a module held outside _modules too
        self.dtype_attr, self.device_attr = torch.float16, torch.device("cpu")

    def forward(self, x):
        y = self.body(x).mean((2, 3))
        return self.b(self.a(y)) * self.scale + self.friends[0](y)


def _hooked():
    return _Hooked().eval(), (torch.randn(1, 3, 8, 8),)


def _parametrized():
    lin = nn.Linear(4, 4)
    nn.utils.parametrize.register_parametrization(lin, "weight", nn.Identity())
    return nn.Sequential(lin, nn.LayerNorm(4)), (torch.randn(2, 4),)


def _graph_module():
    m = nn.Sequential(nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4))
    return nn.Sequential(fx.symbolic_trace(m), nn.ReLU()), (torch.randn(1, 3, 8, 8),)


CASES.update({
    "hooks, shared module, tensor attribute": _hooked,
    "parametrized (a class with its own copy rules)": _parametrized,
    "fx.GraphModule inside": _graph_module,
    "torch.nn.Transformer": lambda: (nn.Transformer(16, 2, 1, 1, 32, dropout=0.0).eval(),
                                     (torch.randn(5, 2, 16), torch.randn(3, 2, 16))),
    "hf gpt2": tiny_gpt2, "hf llama": tiny_llama, "hf t5": tiny_t5,
})


@pytest.mark.parametrize("case", sorted(CASES))
def test_the_fast_copy_is_deepcopy_s_copy_with_the_tensors_shared(case):
    model, inputs = CASES[case]()
    fast = _copy_module(model, _tensor_memo(model))
    slow = copy.deepcopy(model, _tensor_memo(model))
    _same_copy(model, fast, slow)
    clone = clone_sharing_tensors(model)
    with torch.no_grad():
        if hasattr(inputs, "kwargs"):
            want, got = model(*inputs.args, **inputs.kwargs), clone(*inputs.args, **inputs.kwargs)
        else:
            want, got = model(*inputs), clone(*inputs)
    leaves = [x for x in (want if isinstance(want, (tuple, list)) else [want])]
    first = leaves[0] if isinstance(leaves[0], torch.Tensor) else next(iter(want.values()))
    other = (got if isinstance(got, (tuple, list)) else [got])[0]
    other = other if isinstance(other, torch.Tensor) else next(iter(got.values()))
    assert torch.equal(first, other)


def test_writing_into_the_copy_never_reaches_the_original():
    model, _ = _hooked()
    clone = clone_sharing_tensors(model)
    assert clone.friends[0] is clone.a is clone.b and clone.a is not model.a  # one module, the copy's
    clone.body[0].stride = (2, 2)
    clone.body[0]._forward_hooks.clear()
    clone.sizes.append(9)
    clone.scale.add_(1)
    clone.a.weight = nn.Parameter(torch.zeros(4, 4))  # rebinding in the copy
    assert model.body[0].stride == (1, 1) and len(model.body[0]._forward_hooks) == 1
    assert model.sizes == [1, 2, (3, 4)] and model.scale.item() == 2.0
    assert not torch.equal(model.a.weight, torch.zeros(4, 4)) and torch.equal(clone.b.weight, torch.zeros(4, 4))


def test_only_classes_copied_the_plain_way_take_the_fast_path():
    parametrized = _parametrized()[0][0]
    assert _plain(nn.Conv2d) and _plain(nn.Sequential) and _plain(nn.LayerNorm)
    assert not _plain(type(parametrized)) and not _plain(fx.GraphModule)

    class Slotted(nn.Module):
        __slots__ = ("x",)

    class OwnState(nn.Module):
        def __getstate__(self):
            return super().__getstate__()

    assert not _plain(Slotted) and not _plain(OwnState)
