"""Helpers every zoo module shares: seeded construction, deterministic inputs, random norm statistics.

Zoo models must make folding and swapping bugs visible, so norms never keep their identity initialisation:
affine scales are drawn from U(0.5, 1.5), shifts from N(0, 0.2), BatchNorm running means from N(0, 2) and
running variances from U(0.5, 4).
"""

from __future__ import annotations

import functools
from typing import Callable

import torch
import torch.nn as nn

NATIVE_NORM_TYPES: tuple[type[nn.Module], ...] = (
    nn.modules.batchnorm._BatchNorm,
    nn.LayerNorm,
    nn.GroupNorm,
    nn.modules.instancenorm._InstanceNorm,
    nn.RMSNorm,
)


@torch.no_grad()
def random_scale_(t: torch.Tensor) -> None:
    """An affine scale far from 1 per channel, in place."""
    t.uniform_(0.5, 1.5)


@torch.no_grad()
def random_shift_(t: torch.Tensor) -> None:
    """An affine shift away from 0, in place."""
    t.normal_(0.0, 0.2)


@torch.no_grad()
def random_stats_(mean: torch.Tensor, var: torch.Tensor) -> None:
    """BatchNorm running statistics far from (0, 1), in place."""
    mean.normal_(0.0, 2.0)
    var.uniform_(0.5, 4.0)


def randomize_native_norms(model: nn.Module) -> None:
    """Random affine parameters and running statistics on every torch-native norm module of ``model``."""
    for m in model.modules():
        if not isinstance(m, NATIVE_NORM_TYPES):
            continue
        if getattr(m, "weight", None) is not None:
            random_scale_(m.weight)
        if getattr(m, "bias", None) is not None:
            random_shift_(m.bias)
        if getattr(m, "running_mean", None) is not None:
            random_stats_(m.running_mean, m.running_var)


def seeded(seed: int) -> Callable[[Callable[[], nn.Module]], Callable[[], nn.Module]]:
    """Decorate a model factory: build under ``torch.manual_seed(seed)`` (the caller's RNG state is left as it
    was), randomize its native norms, and return it in eval mode."""

    def decorate(factory: Callable[[], nn.Module]) -> Callable[[], nn.Module]:
        @functools.wraps(factory)
        def build() -> nn.Module:
            with torch.random.fork_rng(devices=[]):
                torch.manual_seed(seed)
                model = factory()
                randomize_native_norms(model)
            return model.eval()

        return build

    return decorate


def randn(*shape: int, seed: int = 0) -> torch.Tensor:
    """A float32 standard-normal tensor, the same on every call."""
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


def token_ids(*shape: int, vocab: int, seed: int = 0) -> torch.Tensor:
    """An int64 tensor of token ids in ``[0, vocab)``, the same on every call."""
    return torch.randint(0, vocab, shape, generator=torch.Generator().manual_seed(seed))
