"""Small modules normconv inserts into models. They live here so a saved model that contains them loads
without --trust-pickle (io allowlists normconv.nn.modules for the weights-only unpickler)."""

from __future__ import annotations

from typing import Any

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


class MovedDimNorm(nn.Module):
    """A native norm over dims that are not the trailing ones (NAFNet's / ConvNeXt's LayerNorm2d normalizes dim 1 of
    (N, C, H, W)): ``norm(x.movedim(dims, trailing)).movedim(trailing, dims)``, the same statistics per position.
    It exports as one LayerNormalization (RMSNorm op) between two Transposes."""

    def __init__(self, norm: nn.Module, dims: tuple[int, ...]):
        super().__init__()
        self.norm = norm
        self.dims = tuple(dims)  # negative, in order

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        last = tuple(range(-len(self.dims), 0))
        return self.norm(x.movedim(self.dims, last)).movedim(last, self.dims)


# DeepNorm hooks: torch.save(model) keeps them with the modules they are registered on


class BranchScale:
    """Forward hook: the sublayer's last output times ``factor`` (1/alpha); a tuple output scales element 0."""

    def __init__(self, factor: float):
        self.factor = factor

    def __call__(self, module: nn.Module, args: Any, output: Any) -> Any:
        if isinstance(output, tuple):
            return (output[0] * self.factor,) + tuple(output[1:])
        return output * self.factor


class InputScale:
    """Forward pre-hook on a norm: its input times ``factor`` (alpha)."""

    def __init__(self, factor: float):
        self.factor = factor

    def __call__(self, module: nn.Module, args: tuple) -> tuple:
        return (args[0] * self.factor,) + tuple(args[1:])


class ChannelShift(nn.Module):
    """``y = x + bias`` per channel (dim 1): the shift of a BatchNorm folded into a bias-free ConvTranspose,
    kept out of the conv because torch's CPU ConvTranspose with a bias is 3-12x slower than without."""

    def __init__(self, shift: torch.Tensor):
        super().__init__()
        self.bias = nn.Parameter(shift.detach().clone())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.bias.reshape(1, -1, *([1] * (x.dim() - 2)))


class BiasAfterNorm(nn.Module):
    """``y = norm(x) + bias``: a norm's bias kept as an add after a bias-free norm (swap's LayerNorm -> RMSNorm where
    the bias has no linear to fold into: LN_{g,b}(x) = RMSNorm_g(x) + b on a zero-mean stream)."""

    def __init__(self, norm: nn.Module, bias: torch.Tensor):
        super().__init__()
        self.norm = norm
        self.bias = nn.Parameter(bias.detach().clone(), requires_grad=bias.requires_grad)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.norm(x) + self.bias

