"""``verify.forward_guard`` on what its fast paths could miss: buffers saved as one flat copy per (dtype, device) and
compared bit for bit, training flags set past nn.Module.__setattr__ where the class keeps torch's own."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn

from normconv.verify import forward_guard


class Stats(nn.Module):
    """Buffers of three dtypes, one shared with another module, one NaN, one -0.0."""

    def __init__(self, shared: torch.Tensor):
        super().__init__()
        self.register_buffer("mean", torch.tensor([1.0, float("nan"), -0.0]))
        self.register_buffer("low", torch.tensor([0.5, 2.0], dtype=torch.float16))
        self.register_buffer("count", torch.tensor(3))
        self.register_buffer("mask", torch.tensor([True, False]))
        self.register_buffer("shared", shared)
        self.register_buffer("strided", torch.arange(12.0).reshape(3, 4).t())  # not contiguous


def pair():
    shared = torch.ones(4)
    model = nn.Sequential(Stats(shared), Stats(shared))
    return model, {k: v.clone() for k, v in model.state_dict().items()}


def bits_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    if a.is_floating_point():
        as_int = {2: torch.int16, 4: torch.int32, 8: torch.int64}[a.element_size()]
        return a.dtype == b.dtype and torch.equal(a.view(as_int), b.view(as_int))
    return torch.equal(a, b)


def test_an_unchanged_nan_is_not_a_change():
    model, before = pair()
    with forward_guard(model) as guard:
        pass
    assert guard.mutated == {}  # torch.equal(nan, nan) is False: compared as bits it is the same value
    assert all(bits_equal(v, model.state_dict()[k]) for k, v in before.items())


@pytest.mark.parametrize("write", [
    lambda m: m[0].mean.data.copy_(torch.zeros(3)),  # through .data: no version bump
    lambda m: m[1].mean[2].neg_(),  # -0.0 -> 0.0: equal as numbers, not as bits
    lambda m: m[0].low.mul_(3),
    lambda m: m[1].count.add_(1),
    lambda m: m[0].mask.logical_not_(),
    lambda m: m[1].shared.add_(1),  # both modules' buffer
    lambda m: m[0].strided.mul_(2),
    lambda m: m[1]._buffers.__setitem__("count", torch.tensor(9)),  # re-bound
], ids=["data", "negative-zero", "float16", "int64", "bool", "shared", "strided", "rebound"])
def test_every_kind_of_write_is_named_and_undone(write):
    model, before = pair()
    objects = {k: v for k, v in model.named_buffers(remove_duplicate=False)}
    with forward_guard(model) as guard:
        write(model)
    assert len(guard.mutated) >= 1
    after = model.state_dict()
    assert all(bits_equal(v, after[k]) for k, v in before.items())
    assert all(model.get_buffer(k) is v for k, v in objects.items())  # the original objects, put back


def test_flags_are_set_and_put_back_past_and_through_a_custom_setattr():
    class Logged(nn.Linear):
        sets: list = []

        def __setattr__(self, name, value):
            if name == "training":
                Logged.sets.append(value)
            super().__setattr__(name, value)

    model = nn.Sequential(nn.Linear(2, 2), Logged(2, 2), nn.Dropout(0.5))
    model.train()
    model[0].eval()
    Logged.sets.clear()
    seen = []
    with forward_guard(model):
        seen = [m.training for m in model.modules()]
        model[0].training = True  # a forward that flips a flag
    assert seen == [False] * 4
    assert [m.training for m in model.modules()] == [True, False, True, True]
    assert Logged.sets == [False, True]  # the class's own __setattr__ ran both ways
