"""Small modules normconv inserts into models. They live here so a saved model that contains them loads
without --trust-pickle (io allowlists normconv.nn.modules for the weights-only unpickler)."""

from __future__ import annotations

from typing import Any

import torch
import torch.nn as nn


class NormWrapper(nn.Module):
    """A module standing in for a norm module around the norm it runs (``self.norm``): model code that reads its
    norm's attributes (``self.k_norm.weight.dtype``, HunYuan's attention) reads the inner norm's."""

    @property
    def weight(self):
        return getattr(self.norm, "weight", None)


class Float32Norm(NormWrapper):
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


class MovedDimNorm(NormWrapper):
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


def _channel_view(spatial: int) -> tuple[int, ...]:
    return (1, -1) + (1,) * spatial


class FrozenBatchNorm(nn.Module):
    """torchvision's ``FrozenBatchNorm2d`` for inputs (N, C, *S) with ``spatial`` = len(S) dims: BatchNorm whose
    statistics and affine are fixed buffers (nothing trains, training mode changes nothing), the model's own eps:

        scale = weight * rsqrt(running_var + eps);   y = x * scale + (bias - running_mean * scale)   along dim 1
    """

    def __init__(self, num_features: int, eps: float = 1e-5, spatial: int = 2):
        super().__init__()
        self.num_features, self.eps, self.spatial = num_features, eps, spatial
        self.register_buffer("weight", torch.ones(num_features))
        self.register_buffer("bias", torch.zeros(num_features))
        self.register_buffer("running_mean", torch.zeros(num_features))
        self.register_buffer("running_var", torch.ones(num_features))

    def forward(self, x):  # no annotations: its torch-only form is this forward traced, and must pickle
        view = _channel_view(self.spatial)
        scale = self.weight.reshape(view) * (self.running_var.reshape(view) + self.eps).rsqrt()
        bias = self.bias.reshape(view) - self.running_mean.reshape(view) * scale
        return x * scale + bias

    def extra_repr(self) -> str:
        return f"{self.num_features}, eps={self.eps}"


class ChannelAffine(nn.Module):
    """``y = x * weight + bias`` per channel (dim 1) of an input (N, C, *S) with ``spatial`` = len(S) dims: a
    BatchNorm in eval mode as the Mul and Add every runtime lowers. ``weight`` None: the shift alone."""

    def __init__(self, weight: torch.Tensor | None, bias: torch.Tensor | None, spatial: int = 2):
        super().__init__()
        self.spatial = spatial
        self.weight = nn.Parameter(weight.detach().clone()) if weight is not None else None
        self.bias = nn.Parameter(bias.detach().clone()) if bias is not None else None

    def forward(self, x):  # no annotations: its torch-only form is this forward traced, and must pickle
        view = _channel_view(self.spatial)
        if self.weight is not None:
            x = x * self.weight.reshape(view)
        if self.bias is not None:
            x = x + self.bias.reshape(view)
        return x

    def extra_repr(self) -> str:
        c = (self.weight if self.weight is not None else self.bias)
        return f"{c.numel() if c is not None else 0}, scale={self.weight is not None}, shift={self.bias is not None}"


class BiasAfterNorm(NormWrapper):
    """``y = norm(x) + bias``: a norm's bias kept as an add after a bias-free norm (swap's LayerNorm -> RMSNorm where
    the bias has no linear to fold into: LN_{g,b}(x) = RMSNorm_g(x) + b on a zero-mean stream)."""

    def __init__(self, norm: nn.Module, bias: torch.Tensor):
        super().__init__()
        self.norm = norm
        self.bias = nn.Parameter(bias.detach().clone(), requires_grad=bias.requires_grad)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.norm(x) + self.bias
