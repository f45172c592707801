"""The walks behind a model's norms (graph/residual/walk.py) share what they follow back: each (value, axis) of the
stream is followed once however many norms read it, so the analysis is linear in depth (it was quadratic: each of
GPT-2 355M's 49 norms walked the whole stream behind it), and the shared walk finds what each walk alone finds."""

from __future__ import annotations

import importlib

import pytest
import torch
import torch.nn as nn

from normconv.graph.capture import capture
from normconv.graph.detect import find_norms
from normconv.verify import Inputs

walk_module = importlib.import_module("normconv.graph.residual.walk")
writers_module = importlib.import_module("normconv.graph.residual.writers")
streams_module = importlib.import_module("normconv.graph.residual.streams")


class _Block(nn.Module):
    def __init__(self, d):
        super().__init__()
        self.ln, self.up, self.down = nn.LayerNorm(d), nn.Linear(d, 2 * d), nn.Linear(2 * d, d)

    def forward(self, x):
        return x + self.down(torch.relu(self.up(self.ln(x))))


class _PreLN(nn.Module):
    def __init__(self, depth, d=16, vocab=11):
        super().__init__()
        self.emb = nn.Embedding(vocab, d)
        self.blocks = nn.ModuleList(_Block(d) for _ in range(depth))
        self.ln_f, self.head = nn.LayerNorm(d), nn.Linear(d, vocab)

    def forward(self, ids):
        x = self.emb(ids)
        for b in self.blocks:
            x = b(x)
        return self.head(self.ln_f(x))


def _captured(depth):
    torch.manual_seed(depth)
    return capture(_PreLN(depth).eval(), Inputs((torch.randint(0, 11, (2, 5)),), {}))


def _counted(monkeypatch):
    calls = {"source": 0, "writer": 0}
    source, writer = walk_module.source, streams_module.writer

    def counted_source(*a, **k):
        calls["source"] += 1
        return source(*a, **k)

    def counted_writer(*a, **k):
        calls["writer"] += 1
        return writer(*a, **k)

    monkeypatch.setattr(walk_module, "source", counted_source)
    monkeypatch.setattr(streams_module, "writer", counted_writer)
    return calls


def test_the_swap_analysis_follows_each_stream_value_once(monkeypatch):
    from normconv.passes import swap_norm

    calls = _counted(monkeypatch)
    seen = {}
    for depth in (4, 16):
        cap = _captured(depth)
        calls.update(source=0, writer=0)
        a = swap_norm.analyze(cap, find_norms(cap), "rmsnorm")
        assert sum(p.exact for p in a.plans) == depth + 1  # every norm of a pre-LN stack swaps exactly
        seen[depth] = dict(calls)
    # 4x the depth: about 4x the work (9 -> 33 source calls; each walk alone: 25 -> 289)
    assert seen[16]["source"] <= 5 * seen[4]["source"], seen
    assert seen[16]["writer"] <= 5 * seen[4]["writer"], seen
    assert seen[16]["writer"] == 16 + 1  # each block's down projection and the embedding, judged once


@pytest.mark.parametrize("depth", [1, 3])
def test_the_shared_walks_find_what_each_walk_alone_finds(depth):
    cap = _captured(depth)
    sites = [s for s in find_norms(cap) if s.kind == "layernorm"]
    shared = walk_module.walks(cap, sites)
    alone = [walk_module.walk(cap, s) for s in sites]
    assert len(shared) == len(sites) == depth + 1
    for (v1, l1), (v2, l2) in zip(shared, alone):
        assert v1 == v2 and [(x.name, [n.name for n in p], a) for x, p, a in l1] == \
            [(x.name, [n.name for n in p], a) for x, p, a in l2]
    assert len(shared[-1][1]) == depth + 1  # the last norm reads every writer: the embedding and each block's
