"""LongT5 builds its default attention mask only when not compiling, so under torch.export a forward given token
ids without a mask fails (None has no shape): every command refused it. Capture retries with the all-ones mask a
Hugging Face model assumes for no mask, says so, and the rewrites are still verified on the inputs as given."""

from __future__ import annotations

import torch
import torch.nn as nn

from normconv.api import inspect, swap


class MaskOnlyWhenEager(nn.Module):
    """LongT5's encoder: ``if attention_mask is None and not compiling: attention_mask = ones``, then its shape."""

    def __init__(self, d=16, vocab=50):
        super().__init__()
        self.embed, self.ln, self.fc, self.out_ln = nn.Embedding(vocab, d), nn.LayerNorm(d), nn.Linear(d, d), \
            nn.LayerNorm(d)

    def forward(self, input_ids, attention_mask=None):
        if attention_mask is None and not torch.compiler.is_compiling():
            attention_mask = torch.ones_like(input_ids)
        blocks = attention_mask.shape[1] // 2  # None under torch.export: AttributeError
        h = self.embed(input_ids) * attention_mask[..., None]
        h = h + self.fc(self.ln(h)) * blocks
        return self.out_ln(h)


def test_a_model_that_needs_a_mask_under_export_is_captured_with_one():
    torch.manual_seed(0)
    model, ids = MaskOnlyWhenEager().eval(), torch.randint(0, 50, (2, 6))
    rep = inspect(model, {"input_ids": ids}).to_json()
    assert [s["target"] for s in rep["sites"]] == ["ln", "out_ln"]
    assert "all-ones attention_mask" in rep["extra"]["capture_failures"]["torch.export"]
    new, report = swap(model, {"input_ids": ids}, to="rmsnorm")
    assert report.passed and [s.target for s in report.sites if s.applied] == ["ln", "out_ln"]
    other = torch.randint(0, 50, (3, 8))
    with torch.no_grad():
        torch.testing.assert_close(new(input_ids=other), model(input_ids=other), atol=1e-5, rtol=1e-4)
