"""The lockstep forwards' calls of one kept linear weight made as one product (stream.meeting): the calls of every
forward holding the weight meet and get their own rows, bias added, as the product alone gives them; forwards whose
flows differ (a weight called twice by one, never by another, a forward that fails) never wait for ever; the
streamed swap of a bf16 model makes the four forwards' calls of an unchanged weight one product and verifies."""

from __future__ import annotations

import threading

import pytest
import torch
import torch.nn as nn

from normconv.stream import meeting as mt
from normconv.stream.blocks import lockstep
from normconv.verify import Inputs


def _bf16_linear(cols, rows, bias, seed):
    g = torch.Generator().manual_seed(seed)
    lin = nn.Linear(cols, rows, bias=bias)
    with torch.no_grad():
        lin.weight.copy_(torch.randn(rows, cols, generator=g))
        if bias:
            lin.bias.copy_(torch.randn(rows, generator=g))
    return lin.to(torch.bfloat16)


def _run(meet, calls_of, runs=4, timeout=60.0):
    """``runs`` threads as the lockstep runs them (start / done; no lockstep meetings), thread k making the calls
    ``calls_of(k)`` -> [(module, input)], in order; returns each thread's outputs and whether every thread ended."""
    outs: list[list[torch.Tensor]] = [[] for _ in range(runs)]
    errors: list[BaseException] = []

    def work(k):
        meet.start(k)
        try:
            for m, x in calls_of(k):
                outs[k].append(meet.linear(m, x, torch.float32))
        except BaseException as exc:  # noqa: BLE001
            errors.append(exc)
        finally:
            meet.done(k)

    threads = [threading.Thread(target=work, args=(k,), daemon=True) for k in range(runs)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout)
    assert not errors, errors
    return outs, not any(t.is_alive() for t in threads)


def _products(monkeypatch) -> list[int]:
    """A list that gets, for each product the meetings make from now on, how many calls it serves."""
    sizes: list[int] = []
    settle = mt.Meeting._settle

    def counted(self):
        waiting = dict(self.open)
        settle(self)
        sizes.extend(len(c.rows) for k, c in waiting.items() if k not in self.open)

    monkeypatch.setattr(mt.Meeting, "_settle", counted)
    return sizes


@pytest.mark.parametrize("slice_bytes", [1 << 20, 64 * 4 * 5])  # one slice; 5 rows of 64 a slice, the last short
def test_calls_of_one_weight_meet_and_each_gets_its_rows_and_its_bias(monkeypatch, slice_bytes):
    monkeypatch.setattr(mt, "SLICE_BYTES", slice_bytes)
    shared = _bf16_linear(64, 48, False, 0)  # held by all four (unchanged by a rewrite)
    own = [_bf16_linear(64, 48, True, 1), _bf16_linear(64, 48, True, 2)]  # one per model (two runs each)
    own[1].weight = own[0].weight  # the same weight, another bias (a folded norm bias): one product, two biases
    g = torch.Generator().manual_seed(3)
    xs = [torch.randn(2, 16 if k % 2 == 0 else 15, 64, generator=g) for k in range(4)]
    meet = mt.Meeting(4)
    meet.hold({mt.weight_key(shared.weight): frozenset(range(4)), mt.weight_key(own[0].weight): frozenset(range(4))})
    products = []
    share = mt.Meeting._share
    monkeypatch.setattr(mt.Meeting, "_share", lambda self, call, w, to: products.append(id(call)) or
                        share(self, call, w, to))
    outs, ended = _run(meet, lambda k: [(shared, xs[k]), (own[k // 2], xs[k])])
    assert ended
    assert len(set(products)) == 2  # two products: every run's call of each weight in one
    for k in range(4):
        for m, got in zip((shared, own[k // 2]), outs[k]):
            want = nn.functional.linear(xs[k], m.weight.float(), None if m.bias is None else m.bias.float())
            assert got.shape == want.shape and got.dtype == torch.float32
            torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-5)
            torch.testing.assert_close(got, mt.Meeting(0).linear(m, xs[k], torch.float32), rtol=1e-6, atol=1e-5)


def test_forwards_whose_calls_differ_never_wait_for_ever():
    """Run 0 calls the weight twice, run 1 once, run 2 never (it fails before), run 3 calls another weight the
    others hold too: every thread ends, every output is the product alone."""
    a, b = _bf16_linear(32, 24, True, 4), _bf16_linear(32, 24, False, 5)
    meet = mt.Meeting(4)
    meet.hold({mt.weight_key(a.weight): frozenset(range(4)), mt.weight_key(b.weight): frozenset(range(4))})
    x = torch.randn(3, 32, generator=torch.Generator().manual_seed(6))
    calls = {0: [(a, x), (a, x * 2)], 1: [(a, x)], 2: [], 3: [(b, x), (a, x)]}
    outs, ended = _run(meet, lambda k: calls[k])
    assert ended
    for k, made in calls.items():
        assert len(outs[k]) == len(made)
        for (m, xin), got in zip(made, outs[k]):
            torch.testing.assert_close(got, mt.Meeting(0).linear(m, xin, torch.float32), rtol=1e-6, atol=1e-5)


def test_in_the_lockstep_the_blocks_meet_and_the_outputs_are_the_plain_forwards(monkeypatch):
    """Four forwards in lockstep (two models sharing a weight, two shapes each) with the meeting as their waits: the
    calls of each weight in each block meet (never alone), and each forward's output is its plain forward's."""

    class Block(nn.Module):
        def __init__(self, lin):
            super().__init__()
            self.lin = lin

        def forward(self, x):
            return torch.tanh(self.lin(x))

    class Net(nn.Module):
        def __init__(self, lins):
            super().__init__()
            self.layers = nn.ModuleList(Block(lin) for lin in lins)

        def forward(self, x):
            for layer in self.layers:
                x = layer(x)
            return x

    shared = [_bf16_linear(16, 16, True, 10 + i) for i in range(3)]
    other = _bf16_linear(16, 16, True, 20)
    first = Net(shared)
    second = Net([shared[0], other, shared[2]])  # block 1 of the second model changed
    meet = mt.Meeting(4)
    sides = (frozenset({0, 1}), frozenset({2, 3}))
    for model in (first, second):
        for m in model.modules():
            if type(m) is nn.Linear:
                m.forward = lambda x, m=m: meet.linear(m, x, torch.float32)
    sizes = _products(monkeypatch)

    def enter(i):
        holders: dict = {}
        for side, model in enumerate((first, second)):
            holders.setdefault(mt.weight_key(model.layers[i].lin.weight), set()).update(sides[side])
        meet.hold({k: frozenset(v) for k, v in holders.items()})

    g = torch.Generator().manual_seed(7)
    shapes = [Inputs(args=(torch.randn(2, 5, 16, generator=g),)), Inputs(args=(torch.randn(1, 4, 16, generator=g),))]
    runs = [(first, s) for s in shapes] + [(second, s) for s in shapes]
    got = lockstep(runs, enter, lambda i, outs: None, meet)
    assert got is not None
    assert sorted(sizes) == [2, 2, 4, 4]  # blocks 0 and 2: all four; block 1: each model's two shapes
    for (model, inputs), (out, _) in zip(runs, got):
        x = inputs.args[0]
        with torch.no_grad():  # the plain forward, each weight cast
            for layer in model.layers:
                x = torch.tanh(nn.functional.linear(x, layer.lin.weight.float(), layer.lin.bias.float()))
        torch.testing.assert_close(out, x, rtol=1e-6, atol=1e-6)


def test_the_streamed_swap_of_a_bf16_opt_makes_the_four_calls_of_a_weight_one_product(tmp_path, monkeypatch):
    from tests.test_stream import _opt, _saved

    from normconv.stream import swap as streaming

    src, out = tmp_path / "in", tmp_path / "out"
    _saved(lambda: _opt().to(torch.bfloat16), src)  # OPT: nn.Linear layers, kept as stored
    sizes = _products(monkeypatch)
    report = streaming.swap(src, out)
    assert report.passed
    assert sizes and 4 in sizes and 1 not in sizes  # no forward's call went alone


def test_a_product_failing_in_one_forward_raises_in_every_call_of_it_and_none_waits(monkeypatch):
    """A slice that fails (out of memory, say) in the thread computing it: that thread raises its error, every other
    call of the product raises too (from it), and every thread ends."""
    monkeypatch.setattr(mt, "SLICE_BYTES", 32 * 4 * 2)  # 12 slices of 2 rows: every thread takes some
    lin = _bf16_linear(32, 24, True, 8)
    meet = mt.Meeting(4)
    meet.hold({mt.weight_key(lin.weight): frozenset(range(4))})
    x = torch.randn(3, 32, generator=torch.Generator().manual_seed(9))
    cast = mt._cast
    failed = []

    def fails_once(rows, to):
        if not failed:
            failed.append(rows.shape)
            raise MemoryError("no memory for a slice")
        return cast(rows, to)

    monkeypatch.setattr(mt, "_cast", fails_once)
    errors: list[BaseException] = []

    def work(k):
        meet.start(k)
        try:
            meet.linear(lin, x, torch.float32)
        except BaseException as exc:  # noqa: BLE001
            errors.append(exc)
        finally:
            meet.done(k)

    threads = [threading.Thread(target=work, args=(k,), daemon=True) for k in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not any(t.is_alive() for t in threads)
    assert len(errors) == 4 and sum(isinstance(e, MemoryError) for e in errors) == 1
    assert all(isinstance(e.__cause__, MemoryError) for e in errors if not isinstance(e, MemoryError))
