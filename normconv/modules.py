"""Small modules normconv inserts into models. They live here so a saved model that contains them loads
without --trust-pickle (io allowlists normconv.modules for the weights-only unpickler)."""

from __future__ import annotations

import torch
import torch.nn as nn


class Float32Norm(nn.Module):
    """A native norm run in a wider dtype between two casts: ``norm(x.to(compute)).to(out or x.dtype)``.

    Reproduces norms that compute in float32 and apply their scale there before casting back (Gemma),
    and mixed-dtype norms (half input, float32 weight) whose output dtype is not the input's.
    """

    def __init__(self, norm: nn.Module, compute_dtype: torch.dtype, out_dtype: torch.dtype | None = None):
        super().__init__()
        self.norm = norm
        self.compute_dtype = compute_dtype
        self.out_dtype = out_dtype  # None: cast back to the input's dtype

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.norm(x.to(self.compute_dtype))
        return y.to(x.dtype if self.out_dtype is None else self.out_dtype)
