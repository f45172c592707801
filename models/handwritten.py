"""Norms written by hand, the way tutorials and model repositories write them, and the models that use them.

Nothing here is a torch norm module: detection has to recognize each site by what it computes.
- ``BatchNorm``, ``LayerNorm``, ``RMSNorm``: the classes of the (Chinese) normalization tutorials users
  copy (d2l-style BatchNorm with ``moving_mean`` / ``moving_var``; LayerNorm with ``x.var(unbiased=False)``;
  RMSNorm with float32 statistics), kept as written except that BatchNorm keeps its statistics as buffers and
  branches on ``self.training``.
- ``LlamaRMSNorm``, ``T5LayerNorm``, ``GemmaRMSNorm``: the three Hugging Face RMSNorm spellings.
- ``InlineNormNet``: norms computed inline in a block's forward, plus functional F.layer_norm / F.batch_norm.
"""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from .common import randn, random_scale_, random_shift_, random_stats_, seeded, token_ids
from .transformer import HIDDEN, VOCAB, LlamaForCausalLM, LlamaModel

# -- the tutorial classes -----------------------------------------------------------------------------------


def batch_norm(X, gamma, beta, moving_mean, moving_var, eps, momentum, training):
    """The tutorial's batch_norm function; the mode comes from ``training`` instead of torch.is_grad_enabled()."""
    if not training:
        # inference: normalize with the moving statistics
        X_hat = (X - moving_mean) / torch.sqrt(moving_var + eps)
    else:
        assert len(X.shape) in (2, 4)
        if len(X.shape) == 2:  # fully connected layer
            mean = X.mean(dim=0)
            var = ((X - mean) ** 2).mean(dim=0)
        else:  # convolutional layer: statistics per channel over (N, H, W)
            mean = X.mean(dim=(0, 2, 3), keepdim=True)
            var = ((X - mean) ** 2).mean(dim=(0, 2, 3), keepdim=True)
        X_hat = (X - mean) / torch.sqrt(var + eps)
        moving_mean = (1.0 - momentum) * moving_mean + momentum * mean.detach()
        moving_var = (1.0 - momentum) * moving_var + momentum * var.detach()
    Y = gamma * X_hat + beta  # scale and shift
    return Y, moving_mean, moving_var


class BatchNorm(nn.Module):
    """The tutorial's BatchNorm.

    :param num_features: outputs of a fully connected layer or output channels of a convolutional layer.
    :param num_dims: 2 for a fully connected layer and 4 for a convolutional layer.
    """

    def __init__(self, num_features, num_dims):
        super().__init__()
        if num_dims == 2:
            shape = (1, num_features)
        else:
            shape = (1, num_features, 1, 1)
        self.gamma = nn.Parameter(torch.ones(shape))
        self.beta = nn.Parameter(torch.zeros(shape))
        # buffers (not plain attributes) so they move with .to() and are saved in the state_dict
        self.register_buffer("moving_mean", torch.zeros(shape))
        self.register_buffer("moving_var", torch.ones(shape))

    def forward(self, X):
        Y, moving_mean, moving_var = batch_norm(
            X, self.gamma, self.beta, self.moving_mean,
            self.moving_var, eps=1e-5, momentum=0.1, training=self.training)
        if self.training:  # an eval model never writes its buffers, so it traces to the inference branch
            self.moving_mean, self.moving_var = moving_mean, moving_var
        return Y


class LayerNorm(nn.Module):
    """The tutorial's LayerNorm over the last dimension."""

    def __init__(self, hidden_size, eps=1e-6):
        super().__init__()
        self.hidden_size = hidden_size
        self.eps = eps

        self.gamma = nn.Parameter(torch.ones(hidden_size))
        self.beta = nn.Parameter(torch.zeros(hidden_size))

    def forward(self, x):  # [B, S, H]
        mean = x.mean(dim=-1, keepdim=True)  # [B, S, 1]
        variance = x.var(dim=-1, keepdim=True, unbiased=False)  # [B, S, 1]

        x_normalized = (x - mean) / torch.sqrt(variance + self.eps)
        output = self.gamma * x_normalized + self.beta

        return output


class RMSNorm(nn.Module):
    """The tutorial's RMSNorm: statistics in float32, the scale applied after casting back."""

    def __init__(self, hidden_size, eps=1e-6):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.variance_epsilon = eps

    def forward(self, hidden_states):
        input_dtype = hidden_states.dtype
        hidden_states = hidden_states.to(torch.float32)
        variance = hidden_states.pow(2).mean(-1, keepdim=True)
        hidden_states = hidden_states * torch.rsqrt(variance + self.variance_epsilon)
        return self.weight * hidden_states.to(input_dtype)


# -- the Hugging Face spellings -----------------------------------------------------------------------------


class LlamaRMSNorm(RMSNorm):
    """transformers' LlamaRMSNorm: the very code the tutorial's RMSNorm copies (float32 compute,
    ``self.weight * hidden_states.to(input_dtype)``); its own class so reports name it as HF does."""


class T5LayerNorm(nn.Module):
    """transformers' T5LayerNorm: RMSNorm without mean subtraction; variance in float32, the normalized
    states cast to the weight's dtype only when that is half precision."""

    def __init__(self, hidden_size, eps=1e-6):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.variance_epsilon = eps

    def forward(self, hidden_states):
        variance = hidden_states.to(torch.float32).pow(2).mean(-1, keepdim=True)
        hidden_states = hidden_states * torch.rsqrt(variance + self.variance_epsilon)

        # convert into half-precision if necessary. HF reads self.weight.dtype; the stored parameter is read
        # here so that torch.fx sees a Python bool instead of a Proxy it cannot branch on.
        if self._parameters["weight"].dtype in [torch.float16, torch.bfloat16]:
            hidden_states = hidden_states.to(self.weight.dtype)

        return self.weight * hidden_states


class GemmaRMSNorm(nn.Module):
    """transformers' GemmaRMSNorm: float32 compute, scale ``(1 + weight)`` with weight initialised to zeros,
    the product cast back with ``type_as``."""

    def __init__(self, dim: int, eps: float = 1e-6):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.zeros(dim))

    def _norm(self, x):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)

    def forward(self, x):
        output = self._norm(x.float())
        # Llama does x.to(float16) * w whilst Gemma is (x * w).to(float16)
        output = output * (1.0 + self.weight.float())
        return output.type_as(x)


# -- inline and functional norms ----------------------------------------------------------------------------


class ConvBNStem(nn.Module):
    """Conv2d, then ``F.batch_norm`` in inference mode with statistics held as buffers, then ReLU."""

    def __init__(self, cin: int, cout: int):
        super().__init__()
        self.conv = nn.Conv2d(cin, cout, 3, padding=1, bias=False)
        self.bw = nn.Parameter(torch.ones(cout))
        self.bb = nn.Parameter(torch.zeros(cout))
        self.register_buffer("rm", torch.zeros(cout))
        self.register_buffer("rv", torch.ones(cout))

    def forward(self, x):
        return F.relu(F.batch_norm(self.conv(x), self.rm, self.rv, self.bw, self.bb, False, 0.0, 1e-3))


class InlineLayerNormBlock(nn.Module):
    """Pre-norm residual MLP whose LayerNorm is computed inline with parameters the block owns."""

    def __init__(self, hidden: int):
        super().__init__()
        self.ln_weight = nn.Parameter(torch.ones(hidden))
        self.ln_bias = nn.Parameter(torch.zeros(hidden))
        self.fc1 = nn.Linear(hidden, 2 * hidden)
        self.fc2 = nn.Linear(2 * hidden, hidden)

    def forward(self, x):
        mu = x.mean(-1, keepdim=True)
        xc = x - mu
        var = (xc * xc).mean(-1, keepdim=True)
        h = xc * torch.rsqrt(var + 1e-5) * self.ln_weight + self.ln_bias
        return x + self.fc2(F.gelu(self.fc1(h)))


class InlineRMSNormBlock(nn.Module):
    """Pre-norm residual MLP whose RMSNorm is computed inline (``/ sqrt`` form) with a block-owned scale."""

    def __init__(self, hidden: int):
        super().__init__()
        self.scale = nn.Parameter(torch.ones(hidden))
        self.fc1 = nn.Linear(hidden, 2 * hidden)
        self.fc2 = nn.Linear(2 * hidden, hidden)

    def forward(self, x):
        h = x / torch.sqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * self.scale
        return x + self.fc2(F.silu(self.fc1(h)))


class InlineNormNet(nn.Module):
    """Image (N, 3, H, W) -> conv + F.batch_norm stem -> tokens (N, H*W, 32) -> inline-LayerNorm block ->
    inline-RMSNorm block -> F.layer_norm -> mean over tokens -> Linear.

    Exercises: norm sites that are not modules (inline subgraphs and functional calls) whose parameters
    live on the enclosing block or the root, which only a graph rewrite can replace.
    """

    def __init__(self, hidden: int = HIDDEN, num_classes: int = 10):
        super().__init__()
        self.hidden = hidden
        self.stem = ConvBNStem(3, hidden)
        self.ln_block = InlineLayerNormBlock(hidden)
        self.rms_block = InlineRMSNormBlock(hidden)
        self.w = nn.Parameter(torch.ones(hidden))
        self.b = nn.Parameter(torch.zeros(hidden))
        self.head = nn.Linear(hidden, num_classes)

    def forward(self, img):
        x = self.stem(img).flatten(2).transpose(1, 2)
        x = self.rms_block(self.ln_block(x))
        x = F.layer_norm(x, (self.hidden,), self.w, self.b, 1e-4)
        return self.head(x.mean(1))


# -- models -------------------------------------------------------------------------------------------------


class TutorialBNNet(nn.Module):
    """conv -> BatchNorm(num_dims=4) -> relu twice, global mean, Linear -> BatchNorm(num_dims=2) -> relu,
    Linear head.

    Exercises: a hand-written inference-mode BatchNorm (``(X - moving_mean) / sqrt(moving_var + eps)`` then
    ``gamma * X_hat + beta``) with (1, C, 1, 1) and (1, C) shaped parameters, after a conv and a Linear.
    """

    def __init__(self, num_classes: int = 10):
        super().__init__()
        self.conv1 = nn.Conv2d(3, 8, 3, padding=1, bias=False)
        self.bn1 = BatchNorm(8, num_dims=4)
        self.conv2 = nn.Conv2d(8, 16, 3, stride=2, padding=1)
        self.bn2 = BatchNorm(16, num_dims=4)
        self.fc1 = nn.Linear(16, 32)
        self.bn3 = BatchNorm(32, num_dims=2)
        self.fc2 = nn.Linear(32, num_classes)

    def forward(self, x):
        x = F.relu(self.bn1(self.conv1(x)))
        x = F.relu(self.bn2(self.conv2(x)))
        x = F.relu(self.bn3(self.fc1(x.mean((2, 3)))))
        return self.fc2(x)


class ResidualMLPBlock(nn.Module):
    """Pre-LN residual MLP: x + fc2(gelu(fc1(ln(x)))) with the tutorial LayerNorm."""

    def __init__(self, hidden: int):
        super().__init__()
        self.ln = LayerNorm(hidden)
        self.fc1 = nn.Linear(hidden, 4 * hidden)
        self.act = nn.GELU()
        self.fc2 = nn.Linear(4 * hidden, hidden)

    def forward(self, x):
        return x + self.fc2(self.act(self.fc1(self.ln(x))))


class TutorialLNStack(nn.Module):
    """Two pre-LN residual MLP blocks and a final tutorial LayerNorm over (B, S, H).

    Exercises: a hand-written LayerNorm (``x.var(unbiased=False)``, ``/ sqrt``, gamma/beta) in pre-norm and
    final-norm positions, eps 1e-6 from the constructor default.
    """

    def __init__(self, hidden: int = HIDDEN, layers: int = 2):
        super().__init__()
        self.blocks = nn.ModuleList(ResidualMLPBlock(hidden) for _ in range(layers))
        self.norm = LayerNorm(hidden)

    def forward(self, x):
        for block in self.blocks:
            x = block(x)
        return self.norm(x)


def _randomize_handwritten(model: nn.Module) -> nn.Module:
    """Random affine parameters and far-from-(0, 1) statistics on every hand-written or inline norm."""
    for m in model.modules():
        if isinstance(m, BatchNorm):
            random_stats_(m.moving_mean, m.moving_var)
            random_scale_(m.gamma)
            random_shift_(m.beta)
        elif isinstance(m, LayerNorm):
            random_scale_(m.gamma)
            random_shift_(m.beta)
        elif isinstance(m, (RMSNorm, T5LayerNorm)):
            random_scale_(m.weight)
        elif isinstance(m, GemmaRMSNorm):
            with torch.no_grad():
                m.weight.normal_(0.0, 0.1)  # small offsets around the zero init: scale 1 + w
        elif isinstance(m, ConvBNStem):
            random_stats_(m.rm, m.rv)
            random_scale_(m.bw)
            random_shift_(m.bb)
        elif isinstance(m, InlineLayerNormBlock):
            random_scale_(m.ln_weight)
            random_shift_(m.ln_bias)
        elif isinstance(m, InlineRMSNormBlock):
            random_scale_(m.scale)
        elif isinstance(m, InlineNormNet):
            random_scale_(m.w)
            random_shift_(m.b)
    return model


@seeded(112)
def tutorial_bn() -> nn.Module:
    """CNN with the tutorial's hand-written BatchNorm, 3 sites (eps 1e-5)."""
    return _randomize_handwritten(TutorialBNNet())


def tutorial_bn_inputs() -> tuple:
    return (randn(2, 3, 16, 16, seed=112),)


@seeded(113)
def tutorial_ln() -> nn.Module:
    """Pre-LN residual MLP stack with the tutorial's hand-written LayerNorm, 3 sites (eps 1e-6)."""
    return _randomize_handwritten(TutorialLNStack())


def tutorial_ln_inputs() -> tuple:
    return (randn(2, 8, 32, seed=113),)


def tutorial_rmsnorm(role: str, hidden: int) -> nn.Module:
    """The tutorial_rms model's norm factory: the tutorial RMSNorm for every role."""
    return RMSNorm(hidden, eps=1e-5)


@seeded(114)
def tutorial_rms() -> nn.Module:
    """Llama-style decoder stack on hidden states with the tutorial's hand-written RMSNorm, 5 sites (eps 1e-5).

    Exercises: float32-upcast RMSNorm (``h.to(float32)`` ... ``weight * h.to(input_dtype)``) as pre-norms and
    final norm of a decoder.
    """
    return _randomize_handwritten(LlamaModel(make_norm=tutorial_rmsnorm))


def tutorial_rms_inputs() -> tuple:
    return (randn(2, 8, 32, seed=114),)


@seeded(115)
def inline_norm() -> nn.Module:
    """Inline LayerNorm and RMSNorm in block forwards plus F.batch_norm and F.layer_norm; input (2, 3, 8, 8)."""
    return _randomize_handwritten(InlineNormNet())


def inline_norm_inputs() -> tuple:
    return (randn(2, 3, 8, 8, seed=115),)


def hf_style_rmsnorm(role: str, hidden: int) -> nn.Module:
    """The hf_style_norms model's norm factory: LlamaRMSNorm before attention, GemmaRMSNorm before the MLP,
    T5LayerNorm as the final norm."""
    if role == "input":
        return LlamaRMSNorm(hidden, eps=1e-5)
    if role == "post_attention":
        return GemmaRMSNorm(hidden, eps=1e-6)
    return T5LayerNorm(hidden, eps=1e-6)


@seeded(116)
def hf_style_norms() -> nn.Module:
    """Llama-like decoder whose norms are the three Hugging Face hand-written RMSNorm spellings, 5 sites.

    Exercises: LlamaRMSNorm (eps 1e-5), GemmaRMSNorm with its ``1 + weight`` scale (eps 1e-6) and a final
    T5LayerNorm (eps 1e-6), all computing statistics in float32.
    """
    return _randomize_handwritten(LlamaForCausalLM(make_norm=hf_style_rmsnorm))


def hf_style_norms_inputs() -> tuple:
    return (token_ids(2, 16, vocab=VOCAB, seed=116),)
