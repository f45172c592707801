"""A norm whose scale is folded away stays readable as the model's own code reads it (Mamba2Block:
``self.norm(x.to(dtype=self.norm.weight.dtype))``), and a model that no longer runs after a rewrite is a failed
rewrite (VerificationError, exit 1), never "cannot capture" (exit 2) or an internal error (exit 3)."""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.nn as nn

from normconv.api import _loaded, rotate, swap
from normconv.errors import VerificationError
from normconv.verify import Inputs


class _Block(nn.Module):
    def __init__(self, d):
        super().__init__()
        self.norm = nn.RMSNorm(d, eps=1e-6)
        self.up, self.down = nn.Linear(d, 2 * d), nn.Linear(2 * d, d)

    def forward(self, x):  # the model reads its norm's weight, as Mamba2Block does (without a cast on the stream)
        if x.dtype != self.norm.weight.dtype:
            x = x.to(self.norm.weight.dtype)
        return x + self.down(torch.relu(self.up(self.norm(x))))


class _ReadsNormWeight(nn.Module):
    def __init__(self, d=16, vocab=50):
        super().__init__()
        self.embed = nn.Embedding(vocab, d)
        self.blocks = nn.ModuleList([_Block(d), _Block(d)])
        self.norm = nn.RMSNorm(d, eps=1e-6)
        self.head = nn.Linear(d, vocab)

    def forward(self, ids):
        h = self.embed(ids)
        for b in self.blocks:
            h = b(h)
        return self.head(self.norm(h))


def _ids(batch, seq, vocab=50):
    return torch.randint(0, vocab, (batch, seq), generator=torch.Generator().manual_seed(batch * 100 + seq))


def _model():
    torch.manual_seed(0)
    m = _ReadsNormWeight().eval()
    with torch.no_grad():
        for mod in m.modules():
            if isinstance(mod, nn.RMSNorm):
                mod.weight.normal_(1.0, 0.3)
    return m


def _same(model, new, call):
    for batch, seq in ((1, 7), (3, 13)):  # shapes the rewrite never saw
        with torch.no_grad():
            ref, got = call(model, _ids(batch, seq)), call(new, _ids(batch, seq))
        assert got.shape == ref.shape
        assert float((got - ref).abs().max() / ref.abs().max()) < 1e-5, (batch, seq)


@pytest.mark.parametrize("command", ["fold-scales", "rotate"])
def test_a_folded_norm_keeps_a_readable_unit_weight(command):
    model = _model()
    inputs = Inputs((_ids(2, 16),), {})
    new, report = swap(model, inputs, fold_scales=True) if command == "fold-scales" else rotate(model, inputs, seed=1)
    assert report.passed
    _same(model, new, lambda m, ids: m(ids))
    for path in ("blocks.0.norm", "blocks.1.norm", "norm"):
        norm = new.get_submodule(path)
        # the scale really went: nothing to compute with, nothing saved, but a weight of ones to read
        assert norm._parameters.get("weight") is None and f"{path}.weight" not in new.state_dict()
        assert norm.weight.dtype == torch.float32 and torch.equal(norm.weight, torch.ones(16))
    assert not torch.equal(new.head.weight, model.head.weight)  # the final norm's scale is in the head now


def test_mamba2_fold_scales_keeps_the_outputs():
    transformers = pytest.importorskip("transformers")
    warnings.filterwarnings("ignore")
    cfg = transformers.Mamba2Config(vocab_size=50, hidden_size=32, num_hidden_layers=2, state_size=8, expand=2,
                                    head_dim=8, num_heads=8, n_groups=1, chunk_size=16, use_cache=False)
    torch.manual_seed(0)
    model = transformers.Mamba2ForCausalLM(cfg).eval()
    with torch.no_grad():
        for n, p in model.named_parameters():
            if "norm" in n and "mixer" not in n:
                p.normal_(1.0, 0.3)
    new, report = swap(model, Inputs((), {"input_ids": _ids(2, 16)}), fold_scales=True)
    assert report.passed
    assert {s.target for s in report.sites if s.pass_name == "fold-scales" and s.applied} >= \
        {"backbone.layers.0.norm", "backbone.layers.1.norm", "backbone.norm_f"}
    _same(model, new, lambda m, ids: m(input_ids=ids, use_cache=False).logits)


def _weight_dropper():
    from normconv.passes.base import Pass
    from normconv.report import PassResult

    class DropWeight(Pass):
        name = "drop-weight"

        def plan(self, cap, norms):
            return []

        def __call__(self, model, cap):  # what the fold did before: the weight gone, which the model reads
            model.blocks[0].norm = nn.RMSNorm(16, eps=1e-6, elementwise_affine=False)
            return PassResult(model, True, ())

    class Nothing(Pass):
        name = "nothing"

        def plan(self, cap, norms):
            return []

        def __call__(self, model, cap):
            return PassResult(model, False, ())

    return DropWeight(), Nothing()


def test_a_rewrite_the_model_cannot_run_is_a_failed_rewrite_not_a_capture_failure():
    from normconv.engine.run import apply_passes

    drop, nothing = _weight_dropper()
    # the next pass's capture meets the model's own AttributeError: the rewrite's fault, said as such
    with pytest.raises(VerificationError, match="as drop-weight rewrote it fails where the original runs "
                                                "\\(AttributeError"):
        apply_passes(_model(), Inputs((_ids(2, 16),), {}), [drop, nothing])


def test_a_rewritten_model_that_fails_its_check_forward_is_not_an_internal_error():
    from normconv.engine.door import rewrite
    from normconv.options import Options

    drop, _ = _weight_dropper()
    model = _model()
    with pytest.raises(VerificationError, match="the rewritten model fails where the original runs"):
        rewrite(_loaded(model, Inputs((_ids(2, 16),), {})), [drop], Options(), command="swap")
