"""Example inputs for a Hugging Face model, made from its config when the user gives none.

One spelling per kind of model:

- text: token ids (``batch x seq``), decoder ids for an encoder-decoder, an all-ones mask where BERT-likes want one;
- vision: pixels at the model's own image size (a ViT's position embeddings fit one size only); a clip of the
  config's ``num_frames`` for a video model (VideoMAE, ViViT, TimeSformer);
- vision-language (a config with a ``text_config`` and an image token): the pixels, then token ids that hold one
  image token per feature the vision tower makes of them, then text. Qwen2-VL-style towers take flattened
  patches with an ``image_grid_thw``; M-RoPE models also get ``mm_token_type_ids`` (text 0, image 1). Where the
  image tokens cannot be counted, the language model alone is run (token ids, no pixels);
- flattened patches (Pix2Struct): ``seq`` patches with their row / column indices;
- dual encoders (CLIP, SigLIP: a text and a vision config, no image token): pixels and token ids side by side;
- time series: a history of the config's ``context_length`` (``past_values``; with lags, time features and an
  observed mask where the model takes them: TimeSeriesTransformer, Informer, Autoformer);
- speech: a second of waveform, or filterbank features (Whisper's fixed window), with decoder ids where the
  model is an encoder-decoder; a decoder that takes spectrogram frames (``decoder_input_values``: SpeechT5's
  text- and speech-to-speech) gets ``seq // 2`` frames of the config's ``num_mel_bins``.

Token ids are drawn away from every id the config names (``*_token_id``, ``*_token_index``), so text never holds
a stray image or end-of-text token.
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.nn as nn

from normconv.errors import NormconvError
from normconv.io.inputs import HF_BATCH, HF_SEQ_LEN, forward_params
from normconv.verify import Inputs

_DEFAULT_IMAGE = 32  # pixels per side for a model whose config names no image size (a CNN takes any)
_PIXEL_KEYS = ("pixel_values", "image_grid_thw", "image_sizes")  # what the language model alone goes without
_AUDIO_SAMPLES = 16000  # one second at the 16 kHz that speech models are trained on
_MAX_VALUES = 2 ** 28  # the largest example input made from a config (1 GiB of float32: 2 x 3 x 4096 x 4096 fits)


def hf_example_inputs(model: nn.Module, batch: int = HF_BATCH, seq: int = HF_SEQ_LEN) -> Inputs | None:
    """Inputs a Hugging Face model takes, built from its config (see the module docstring); None if none fit."""
    config = getattr(model, "config", None)
    if config is None:
        return None
    g = torch.Generator().manual_seed(0)
    params = forward_params(model)
    kwargs: dict[str, Any] = _pixels(config, params, batch, seq, g) if "pixel_values" in params else \
        _series(config, params, batch, g) if "past_values" in params else \
        _patches(config, batch, seq, g) if "flattened_patches" in params else _audio(config, params, batch, seq, g)
    text = getattr(config, "text_config", None)
    vocab = getattr(text if text is not None else config, "vocab_size", None)
    # pixels alone: no text, unless the config has a vision tower beside its text (GIT: a vision_config, the text
    # model's fields flat), whose forward wants both
    vlm = text is not None or getattr(config, "vision_config", None) is not None
    takes_text = bool("input_ids" in params and vocab and (not kwargs or vlm))
    if not kwargs and not takes_text:
        return None
    if takes_text:
        seq = min(seq, _position_limit(config) or seq)
        kwargs["input_ids"] = _token_ids(config, vocab, (batch, seq), g)
    if takes_text and "pixel_values" in kwargs:
        tokens = image_tokens(model, kwargs)
        if tokens:
            kwargs.update(tokens)
        elif _image_token(config) is not None:  # image tokens it could not place: the language model alone
            kwargs = {k: v for k, v in kwargs.items() if k not in _PIXEL_KEYS}
        # no image token at all (CLIP, SigLIP: two towers side by side): pixels and text as they are
    if vocab and getattr(config, "is_encoder_decoder", False) and "decoder_input_ids" in params:
        kwargs["decoder_input_ids"] = _token_ids(config, vocab, (batch, max(seq // 2, 1)), g)  # T5, BART, Whisper
    elif takes_text and "attention_mask" in params and not getattr(config, "is_decoder", False) and \
            getattr(config, "model_type", "") in ("bert", "roberta", "distilbert", "electra", "albert", "deberta"):
        kwargs["attention_mask"] = torch.ones(batch, seq, dtype=torch.long)
    if "decoder_input_values" in params and getattr(config, "is_encoder_decoder", False) and kwargs:
        kwargs["decoder_input_values"] = _decoder_frames(config, batch, seq, g)  # SpeechT5 text / speech to speech
    return Inputs((), kwargs)


def _position_limit(config) -> int | None:
    """The most positions the config says the model embeds (``max_position_embeddings``, GPT-2's ``n_positions``):
    the first that is a positive whole number; XLNet's -1 (relative positions, no limit) and the like are none."""
    limits = (getattr(config, k, None) for k in ("max_position_embeddings", "n_positions"))
    return next((v for v in limits if isinstance(v, int) and not isinstance(v, bool) and v > 0), None)


def _decoder_frames(config, batch: int, seq: int, g: torch.Generator) -> torch.Tensor:
    """A speech decoder's input (``decoder_input_values``): ``seq // 2`` frames of the config's mel bins
    (SpeechT5's spectrogram frames: (batch, frames, num_mel_bins))."""
    bins = getattr(config, "num_mel_bins", None)
    if not isinstance(bins, int):
        raise NormconvError("cannot make example inputs from the model's config: it names no num_mel_bins for "
                            "decoder_input_values; pass --input-shape decoder_input_values:B,T,BINS")
    return _randn("decoder_input_values", (batch, max(seq // 2, 1), bins), g)


def _pixels(config, params: list[str], batch: int, seq: int, g: torch.Generator) -> dict[str, torch.Tensor]:
    """Pixels at the model's own size: (batch, C, H, W), or a Qwen2-VL-style tower's flattened patches of
    ``batch`` images of 1 x m x 2m patch groups (m = spatial_merge_size) with their ``image_grid_thw``."""
    vision = getattr(config, "vision_config", None) or config
    if "image_grid_thw" in params and getattr(vision, "temporal_patch_size", None):
        patches, grid = grid_patches(vision, batch, seq, g)
        return {"pixel_values": patches, "image_grid_thw": grid}
    channels = getattr(vision, "num_channels", None) or 3
    size = getattr(vision, "image_size", None) or getattr(config, "image_size", None) or _DEFAULT_IMAGE
    height, width = (size[0], size[-1]) if isinstance(size, (list, tuple)) else (size, size)
    if isinstance(size, dict):  # {"height": H, "width": W}
        height, width = size.get("height", _DEFAULT_IMAGE), size.get("width", _DEFAULT_IMAGE)
    frames = getattr(vision, "num_frames", None)  # a video model takes a clip: (batch, frames, C, H, W)
    clip = (int(frames),) if isinstance(frames, int) and frames > 0 else ()
    return {"pixel_values": _randn("pixel_values", (batch, *clip, channels, height, width), g)}


def _patches(config, batch: int, seq: int, g: torch.Generator) -> dict[str, torch.Tensor]:
    """Pix2Struct's input: ``seq`` flattened patches, each (row, column, then patch_embed_hidden_size values), the
    row and column a grid's indices within the config's ``seq_len`` (its position tables)."""
    vision = getattr(config, "vision_config", None) or config
    width, positions = getattr(vision, "patch_embed_hidden_size", None), getattr(vision, "seq_len", None)
    if not isinstance(width, int) or not isinstance(positions, int) or positions < 1:
        return {}
    cols = max(1, min(positions, math.isqrt(seq)))
    index = torch.arange(seq)
    grid = torch.stack([(index // cols).clamp(max=positions - 1), index % cols], dim=-1).float()
    values = _randn("flattened_patches", (batch, seq, width), g)
    return {"flattened_patches": torch.cat([grid.expand(batch, seq, 2), values], dim=-1)}


def single_images(inputs: Inputs) -> Inputs | None:
    """The same inputs with each clip's first frame as an image ((batch, frames, C, H, W) -> (batch, C, H, W)), for
    a model whose config names frames it does not take (Perceiver's num_frames serves its multimodal variant);
    None where no input is a clip."""
    pixels = inputs.kwargs.get("pixel_values")
    if not isinstance(pixels, torch.Tensor) or pixels.dim() != 5:
        return None
    return Inputs(inputs.args, {**inputs.kwargs, "pixel_values": pixels[:, 0].contiguous()})


def first_sample(inputs: Inputs) -> Inputs | None:
    """The same inputs at batch 1 (every tensor of the example's batch, first row), for a model that takes one
    sample at a time: a decoder classifier whose config defines no pad token (LlamaForSequenceClassification,
    GPT2ForSequenceClassification: "Cannot handle batch sizes > 1 if no padding token is defined"); None where the
    batch is 1 already."""
    tensors = [t for t in inputs.kwargs.values() if isinstance(t, torch.Tensor) and t.dim()]
    batch = tensors[0].shape[0] if tensors else 1
    if batch <= 1:
        return None
    return Inputs(inputs.args, {k: v[:1].contiguous() if isinstance(v, torch.Tensor) and v.dim() and
                                v.shape[0] == batch else v for k, v in inputs.kwargs.items()})


def grid_patches(vision, batch: int, seq: int, g: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """(flattened patches, grid_thw) of ``batch`` images for a Qwen2-VL-style vision tower (config ``vision``),
    each 1 x (m*k) x (2m) patches: m = spatial_merge_size (the merger groups m x m patches), k = seq // 8, so two
    sequence lengths give two shapes."""
    m = getattr(vision, "spatial_merge_size", 2) or 2
    width = (getattr(vision, "in_channels", 3) or 3) * (getattr(vision, "temporal_patch_size", 1) or 1) \
        * vision.patch_size ** 2
    h, w = m * max(1, seq // 8), 2 * m
    return _randn("pixel_values", (batch * h * w, width), g), torch.tensor([[1, h, w]] * batch)


def _audio(config, params: list[str], batch: int, seq: int, g: torch.Generator) -> dict[str, torch.Tensor]:
    """A speech model's input: one second of 16 kHz waveform (``input_values``: wav2vec2, HuBERT), or filterbank
    features (``input_features``): Whisper's fixed (mel bins x 2 * max_source_positions) window, else
    ``4 * seq`` frames of the config's feature width (Speech2Text: per-channel features x channels)."""
    if "input_values" in params:
        return {"input_values": _randn("input_values", (batch, _AUDIO_SAMPLES), g)}
    if "input_features" not in params:
        return {}
    bins, window = getattr(config, "num_mel_bins", None), getattr(config, "max_source_positions", None)
    if "whisper" in getattr(config, "model_type", "") and bins and window:
        return {"input_features": _randn("input_features", (batch, bins, 2 * window), g)}
    width = (getattr(config, "input_feat_per_channel", None) or bins or getattr(config, "feature_size", None)
             or 80) * (getattr(config, "input_channels", None) or 1)
    return {"input_features": _randn("input_features", (batch, 4 * seq, width), g)}


def _series(config, params: list[str], batch: int, g: torch.Generator) -> dict[str, torch.Tensor]:
    """A forecaster's history (``past_values``) at the config's ``context_length``: PatchTST / PatchTSMixer take
    (batch, context, num_input_channels), TimesFM (batch, context); TimeSeriesTransformer / Informer / Autoformer take the context plus their
    largest lag (``lags_sequence``), ``input_size`` values a step (a univariate series: no last axis), with as many
    time features a step and an all-observed mask."""
    context = getattr(config, "context_length", None)
    lags = getattr(config, "lags_sequence", None)
    if not context:
        return {}
    if not lags:  # a config without channels (TimesFM) takes univariate series: no last axis
        channels = getattr(config, "num_input_channels", None)
        return {"past_values": _randn("past_values", (batch, context) if channels is None else
                                      (batch, context, channels), g)}
    steps, size = context + max(lags), getattr(config, "input_size", 1)
    shape = (batch, steps) if size == 1 else (batch, steps, size)
    out = {"past_values": _randn("past_values", shape, g), "past_observed_mask": torch.ones(shape)}
    features = getattr(config, "num_time_features", 0)
    if "past_time_features" in params:  # zero features a step is a valid (empty) last axis
        out["past_time_features"] = _randn("past_time_features", (batch, steps, features), g) if features \
            else torch.zeros(batch, steps, 0)
    if getattr(config, "num_static_categorical_features", 0) and "static_categorical_features" in params:
        out["static_categorical_features"] = torch.zeros(batch, config.num_static_categorical_features,
                                                         dtype=torch.long)
    if getattr(config, "num_static_real_features", 0) and "static_real_features" in params:
        out["static_real_features"] = _randn("static_real_features", (batch, config.num_static_real_features), g)
    return out


def _randn(name: str, shape: tuple, g: torch.Generator) -> torch.Tensor:
    """Random input ``name`` of ``shape``, whose sizes come from the config: each a positive whole number, and all
    together within _MAX_VALUES (a config that asks for more is refused in one line, not left to the allocator)."""
    if not all(isinstance(d, int) and not isinstance(d, bool) and d > 0 for d in shape) or \
            math.prod(shape) > _MAX_VALUES:
        raise NormconvError(f"cannot make example inputs from the model's config: {name} would be "
                            f"{tuple(shape)}; pass --input-shape {name}:D0,D1,... instead")
    return torch.randn(*shape, generator=g)


def _special_ids(config) -> set[int]:
    """Every token id the config (or its text config) names."""
    ids = set()
    for cfg in (config, getattr(config, "text_config", None)):
        for key, value in (vars(cfg).items() if cfg is not None else ()):
            if key.endswith(("_token_id", "_token_index")):
                ids.update(v for v in (value if isinstance(value, (list, tuple)) else [value]) if isinstance(v, int))
    return ids


def _token_ids(config, vocab: int, shape: tuple[int, int], g: torch.Generator) -> torch.Tensor:
    """Random ids in [0, vocab), none of them a special id of the config (each such draw moved to the next free
    id)."""
    ids = torch.randint(0, vocab, shape, generator=g)
    special = _special_ids(config)
    free = [i for i in range(min(vocab, len(special) + 2)) if i not in special] or [0]
    for s in special:
        ids[ids == s] = free[s % len(free)]
    return ids


def _image_token(config) -> int | None:
    """The id a VLM's config gives its image token, or None."""
    return next((getattr(config, k) for k in ("image_token_id", "image_token_index")
                 if isinstance(getattr(config, k, None), int)), None)


def image_tokens(model: nn.Module, kwargs: dict) -> dict | None:
    """The token ids with one image token per feature the vision tower makes of the pixels put first (the
    spelling a VLM's forward checks), plus ``mm_token_type_ids`` where forward takes them; None where the model
    names no image token or cannot say how many features it makes."""
    config = model.config
    token = _image_token(config)
    hidden = getattr(getattr(config, "text_config", None), "hidden_size", None)
    if token is None or not hidden or not hasattr(model, "get_image_features") or "input_ids" not in kwargs:
        return None
    params = forward_params(model)
    pixels = {k: kwargs[k] for k in _PIXEL_KEYS if k in kwargs}
    px = kwargs.get("pixel_values")
    # each image's (height, width) before padding, tried where forward takes them (Mistral 3's Pixtral tower)
    sizes = {"image_sizes": torch.tensor([list(px.shape[-2:])] * px.shape[0])} if isinstance(px, torch.Tensor) \
        and px.dim() == 4 and "image_sizes" in params and "image_sizes" not in kwargs else None
    out = None
    for extra in [{}] + ([sizes] if sizes else []):
        try:
            with torch.no_grad():
                out = model.get_image_features(**pixels, **extra)
            break
        except Exception:  # noqa: BLE001 - no count, so no image tokens: the caller runs the language model alone
            continue
    if out is None:
        return None
    features = out.get("pooler_output") if hasattr(out, "keys") else out
    features = [features] if isinstance(features, torch.Tensor) else list(features or [])
    count = sum(t.numel() for t in features if isinstance(t, torch.Tensor)) // hidden
    ids = kwargs["input_ids"]
    if not count or count % ids.shape[0]:
        return None
    ids = torch.cat([torch.full((ids.shape[0], count // ids.shape[0]), token, dtype=ids.dtype), ids], dim=1)
    types = {"mm_token_type_ids": (ids == token).int()} if "mm_token_type_ids" in params else {}
    return {"input_ids": ids, **types, **extra}
