"""The reference-model zoo: small deterministic models with every kind of normalization users write.

``ZOO`` maps a name to a ``ZooModel``: how to build it, example inputs, and the norm sites it holds by kind
(``norms``) and how many of those are hand-written (``handwritten``). Each model is also importable by name
(``from normconv.models import resnet``) with its inputs (``resnet_inputs()``). The command line reaches
them as ``zoo:NAME``.

Every model builds under a fixed seed in eval mode, float32, with random norm affines and BatchNorm running
statistics far from (0, 1) so folding mistakes show; it traces with ``torch.fx.symbolic_trace`` and exports
with ``torch.export.export(strict=False)``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Mapping

import torch.nn as nn

from .cnn import (conv1d, conv1d_inputs, conv3d, conv3d_inputs, deconv, deconv_inputs, mlp, mlp_inputs, mobilenet,
                  mobilenet_inputs, resnet, resnet_inputs)
from .handwritten import (hf_style_norms, hf_style_norms_inputs, inline_norm, inline_norm_inputs, tutorial_bn,
                          tutorial_bn_inputs, tutorial_ln, tutorial_ln_inputs, tutorial_rms, tutorial_rms_inputs)
from .halfprec import (fp16_overflow, fp16_overflow_inputs, fp16_raw_features, fp16_raw_features_inputs, nafnet_fp16,
                       nafnet_fp16_inputs)
from .transformer import bert, bert_inputs, gpt, gpt_inputs, llama, llama_inputs, seq2seq, seq2seq_inputs
from .unet import unet, unet_inputs


@dataclass(frozen=True)
class ZooModel:
    """A reference model: its builder, example inputs, and the norm sites it is known to hold."""

    name: str
    description: str  # one line
    build: Callable[[], nn.Module]  # deterministic, eval mode, float32
    example_inputs: Callable[[], tuple]  # deterministic positional args for forward
    norms: Mapping[str, int]  # norm sites by kind: batchnorm, layernorm, rmsnorm, groupnorm, instancenorm
    handwritten: int = 0  # how many of those sites are hand-written (module or inline), not torch native


ZOO: dict[str, ZooModel] = {
    z.name: z
    for z in (
        ZooModel("resnet", "ResNet-style CNN: 3 BasicBlocks, strided conv1x1+BN downsample; input (2,3,32,32)",
                 resnet, resnet_inputs, {"batchnorm": 8}),
        ZooModel("mobilenet", "MobileNetV2-style inverted residuals, depthwise convs, BN eps 1e-3; input (2,3,32,32)",
                 mobilenet, mobilenet_inputs, {"batchnorm": 10}),
        ZooModel("conv1d", "Conv1d + BatchNorm1d net with a dilated conv and a biased conv; input (2,4,64)",
                 conv1d, conv1d_inputs, {"batchnorm": 3}),
        ZooModel("conv3d", "Conv3d + BatchNorm3d net; input (2,2,8,16,16)",
                 conv3d, conv3d_inputs, {"batchnorm": 2}),
        ZooModel("deconv", "ConvTranspose2d decoder (groups=2, output_padding=1) + BatchNorm2d; input (2,8,8,8)",
                 deconv, deconv_inputs, {"batchnorm": 3}),
        ZooModel("mlp", "Linear + BatchNorm1d MLP with a BatchNorm1d on the input; input (4,32)",
                 mlp, mlp_inputs, {"batchnorm": 3}),
        ZooModel("bert", "BERT-like post-LN encoder, 2 layers, LayerNorm eps 1e-12; input ids (2,16)",
                 bert, bert_inputs, {"layernorm": 5}),
        ZooModel("gpt", "GPT-2-like pre-LN decoder with final ln_f and lm_head tied to wte; input ids (2,16)",
                 gpt, gpt_inputs, {"layernorm": 5}),
        ZooModel("llama", "Llama-like decoder with nn.RMSNorm pre-norms, SwiGLU, no biases; input ids (2,16)",
                 llama, llama_inputs, {"rmsnorm": 5}),
        ZooModel("unet", "UNet with Conv+GroupNorm+SiLU, skip concatenations, one InstanceNorm2d; input (2,3,32,32)",
                 unet, unet_inputs, {"groupnorm": 5, "instancenorm": 1}),
        ZooModel("seq2seq", "Post-LN encoder-decoder Transformer with cross-attention; inputs ids (2,12), (2,10)",
                 seq2seq, seq2seq_inputs, {"layernorm": 10}),
        ZooModel("tutorial_bn", "CNN with the tutorial's hand-written BatchNorm, stats as buffers; input (2,3,16,16)",
                 tutorial_bn, tutorial_bn_inputs, {"batchnorm": 3}, handwritten=3),
        ZooModel("tutorial_ln", "Pre-LN residual MLP stack with the tutorial's hand-written LayerNorm; input (2,8,32)",
                 tutorial_ln, tutorial_ln_inputs, {"layernorm": 3}, handwritten=3),
        ZooModel("tutorial_rms", "Decoder stack with the tutorial's hand-written float32 RMSNorm; input (2,8,32)",
                 tutorial_rms, tutorial_rms_inputs, {"rmsnorm": 5}, handwritten=5),
        ZooModel("inline_norm", "Inline LayerNorm/RMSNorm in forwards plus F.batch_norm, F.layer_norm; input (2,3,8,8)",
                 inline_norm, inline_norm_inputs, {"batchnorm": 1, "layernorm": 2, "rmsnorm": 1}, handwritten=2),
        ZooModel("hf_style_norms", "Decoder with HF LlamaRMSNorm, GemmaRMSNorm and T5LayerNorm; input ids (2,16)",
                 hf_style_norms, hf_style_norms_inputs, {"rmsnorm": 5}, handwritten=5),
        ZooModel("fp16_overflow", "Pre-norm stack, hand-written RMSNorm/LayerNorm without float32 cast, outlier "
                 "channels of +-300 (x^2 overflows fp16); input (2,8,16)",
                 fp16_overflow, fp16_overflow_inputs, {"rmsnorm": 2, "layernorm": 1}, handwritten=3),
        ZooModel("fp16_raw_features", "Input BatchNorm1d on raw readings (running var 9e6, beyond fp16), GELU, "
                 "Conv1d, LayerNorm; input (2,6,24)",
                 fp16_raw_features, fp16_raw_features_inputs, {"batchnorm": 1, "layernorm": 1}),
        ZooModel("nafnet_fp16", "NAFNet-style restoration net, hand-written channels-first LayerNorm2d without float32 "
                 "cast, channels of +-300 ((x - mean)^2 overflows fp16); input (2,3,16,16)",
                 nafnet_fp16, nafnet_fp16_inputs, {"layernorm": 3}, handwritten=3),
    )
}


def get(name: str) -> ZooModel:
    """The zoo entry called ``name``; ValueError naming the choices if there is none."""
    try:
        return ZOO[name]
    except KeyError:
        raise ValueError(f"unknown zoo model {name!r}; choose from: {', '.join(ZOO)}") from None


__all__ = [
    "ZOO", "ZooModel", "get",
    "resnet", "resnet_inputs", "mobilenet", "mobilenet_inputs", "conv1d", "conv1d_inputs",
    "conv3d", "conv3d_inputs", "deconv", "deconv_inputs", "mlp", "mlp_inputs",
    "bert", "bert_inputs", "gpt", "gpt_inputs", "llama", "llama_inputs", "unet", "unet_inputs",
    "seq2seq", "seq2seq_inputs", "tutorial_bn", "tutorial_bn_inputs", "tutorial_ln", "tutorial_ln_inputs",
    "tutorial_rms", "tutorial_rms_inputs", "inline_norm", "inline_norm_inputs",
    "hf_style_norms", "hf_style_norms_inputs", "fp16_overflow", "fp16_overflow_inputs",
    "fp16_raw_features", "fp16_raw_features_inputs", "nafnet_fp16", "nafnet_fp16_inputs",
]
