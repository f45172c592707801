"""Coverage sweep: every model type in transformers' auto-model mappings, built tiny, through normconv's public API.

    python benchmarks/coverage_transformers.py                      # the whole sweep (long: hours on 2 cores), resumable
    python benchmarks/coverage_transformers.py --limit 20 --timeout 60
    python benchmarks/coverage_transformers.py --types bert,gpt2,vit --rerun
    python benchmarks/coverage_transformers.py --report-only         # COVERAGE.md from the cache alone

Each model type is built offline from its config class's defaults, shrunk (hidden <= 64, 2 layers, 4 heads, vocab
128, 32 px images), with random weights, in a forked child (one at a time, killed past its time limit). Then
inspect / fold / swap (exact, ``approximate`` as a fallback verdict) / canonicalize / export (ONNX, opset 20) run
through ``normconv.*``. The verdicts are computed here, outside the passes:

- sites: norm calls inspect reports against forward hooks on the norm modules (class name contains "Norm", which
  covers torch's own), innermost ones only; a hooked module inspect does not name is *missed*, a module site
  inspect names that no hook saw is *false*;
- rewrites: the returned model against the original on fresh inputs of a second shape (batch 1, shorter sequence);
- export, at each of opsets 17, 20 and 23: the ONNX in onnxruntime (CPU) against the original torch model on the
  example inputs, and one fused norm op in the graph per site inspect reports (batchnorms may fold away); where
  normconv fails otherwise, plain ``torch.onnx.export(dynamo=True)`` of the same model and inputs runs too: if it
  fails as well (or its onnxruntime output differs from torch), that opset is n/a, not normconv's failure.

Results go to benchmarks/results/coverage.jsonl (one JSON object per model type; a type already there is skipped
unless --rerun) and COVERAGE.md at the repo root is rewritten from the whole cache after each type.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import sys
import tempfile
import time
import traceback
import warnings
from collections import Counter, defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
CACHE = ROOT / "benchmarks" / "results" / "coverage.jsonl"
OUT_MD = ROOT / "COVERAGE.md"
VISION_MARK = "<!-- vision sweep: benchmarks/coverage_vision.py writes from here on -->"
COMMANDS = ("inspect", "fold", "swap", "canonicalize", "deepnorm", "export")
EXPORT_OPSETS = (17, 20, 23)  # export is ok only if ok at each: normconv's lowest and highest opsets, and the default

# common architectures first, so a partial sweep is a diverse one; the rest follow alphabetically
PRIORITY = ["bert", "gpt2", "llama", "t5", "vit", "resnet", "whisper", "wav2vec2", "opt", "mistral", "convnext",
            "bart", "roberta", "gemma", "qwen2", "phi", "falcon", "gpt_neox", "deit", "swin", "clip", "mobilevit",
            "dinov2", "olmo", "levit", "mamba", "bit", "distilbert", "electra", "albert", "mobilenet_v2",
            "efficientnet", "regnet", "segformer", "beit", "hubert", "mt5", "pegasus", "marian", "mbart", "gptj",
            "bloom", "codegen", "qwen3", "gemma2", "phi3", "deberta", "deberta-v2", "xlm-roberta", "poolformer"]

VOCAB = 128
HIDDEN = 64
FFN = 128
HEADS = 4
KV_HEADS = 2
LAYERS = 2
SEQ, SEQ2 = 16, 12
BATCH, BATCH2 = 2, 1


# ---------------------------------------------------------------------------------------------------------------
# which model types, and which class for each


def mappings() -> dict[str, list[tuple[str, str]]]:
    """model_type -> [(mapping name, class name)], the base-model mapping first."""
    from transformers.models.auto import modeling_auto as ma

    names = ["MODEL_MAPPING_NAMES"] + sorted(n for n in dir(ma) if n.startswith("MODEL_FOR_")
                                             and n.endswith("_MAPPING_NAMES"))
    out: dict[str, list[tuple[str, str]]] = defaultdict(list)
    for n in names:
        for mtype, cls in getattr(ma, n).items():
            for c in (cls if isinstance(cls, (tuple, list)) else (cls,)):
                out[mtype].append((n.replace("_MAPPING_NAMES", ""), c))
    return dict(out)


def ordered_types(all_types) -> list[str]:
    first = [t for t in PRIORITY if t in all_types]
    return first + sorted(t for t in all_types if t not in set(first))


# ---------------------------------------------------------------------------------------------------------------
# tiny configs

_HIDDEN_KEYS = {"hidden_size", "d_model", "n_embd", "n_embed", "embed_dim", "dim", "model_dim", "hidden_dim",
                "word_embed_proj_dim", "projection_dim", "d_embed", "embedding_size", "encoder_hidden_size",
                "text_embed_dim", "vision_embed_dim", "emb_dim", "embedding_dim", "hidden_channels", "d_inner",
                "out_hidden_size"}
_LAYER_KEYS = {"num_hidden_layers", "n_layer", "n_layers", "num_layers", "encoder_layers", "decoder_layers",
               "num_decoder_layers", "num_encoder_layers", "depth", "num_blocks", "text_layers", "vision_layers"}
_POS_KEYS = {"max_position_embeddings", "n_positions", "max_seq_len", "max_sequence_length", "n_ctx",
             "max_target_positions", "max_text_positions"}


def _shrink(d: dict, gentle: bool = False) -> dict:
    """A config dict with its sizes shrunk (recursively into sub-config dicts); ``gentle``: only the depth, vocab
    and experts (the fallback for models whose shapes are tied together in ways the full shrink breaks)."""
    out = dict(d)
    for k, v in d.items():
        if isinstance(v, dict) and ("model_type" in v or k.endswith("_config") or k in ("encoder", "decoder")):
            out[k] = _shrink(v, gentle)
            continue
        if k in ("out_features", "out_indices") and v is not None:
            out[k] = None  # backbone stages: let the config pick from the (fewer) stages left
            continue
        if isinstance(v, bool) or v is None:
            continue
        if gentle and k not in _LAYER_KEYS | {"vocab_size", "depths", "layer_types", "num_experts", "num_local_experts",
                                              "n_routed_experts", "num_experts_per_tok"} \
                and not k.endswith("_token_id") and not k.endswith("token_index"):
            continue
        if isinstance(v, int):
            if k in _HIDDEN_KEYS and v > HIDDEN:
                out[k] = HIDDEN
            elif k in _LAYER_KEYS and v > LAYERS:
                out[k] = LAYERS
            elif k in ("num_key_value_heads", "n_head_kv", "num_kv_heads", "multi_query_group_num") and v > KV_HEADS:
                out[k] = KV_HEADS
            elif "heads" in k and not k.startswith("n_heads_per") and v > HEADS:
                out[k] = HEADS
            elif k == "n_head" and v > HEADS:
                out[k] = HEADS
            elif k in ("head_dim", "kv_channels", "d_kv", "attention_head_size", "qk_rope_head_dim",
                       "qk_nope_head_dim", "v_head_dim") and v > HIDDEN // HEADS:
                out[k] = HIDDEN // HEADS
            elif ("intermediate" in k or "ffn" in k or k in ("d_ff", "n_inner", "inner_dim", "dim_feedforward",
                                                            "mlp_dim", "hidden_dim_ffn")) and v > FFN:
                out[k] = FFN
            elif k == "vocab_size" and v > VOCAB:
                out[k] = VOCAB
            elif (k.endswith("_token_id") or k.endswith("token_index")) and v >= VOCAB:
                out[k] = VOCAB - 1 - (sum(map(ord, k)) % 8)
            elif k in _POS_KEYS and v > 128:
                out[k] = 128
            elif k == "max_source_positions" and v > 16:
                out[k] = 16
            elif k == "image_size" and v > 32:
                out[k] = 32
            elif k == "patch_size" and v > 4:
                out[k] = 4
            elif k in ("num_experts", "num_local_experts", "n_routed_experts", "moe_num_experts") and v > 4:
                out[k] = 4
            elif k in ("num_experts_per_tok", "top_k", "moe_topk") and v > 2:
                out[k] = 2
        elif isinstance(v, list) and v and all(isinstance(x, int) and not isinstance(x, bool) for x in v):
            if k in ("hidden_sizes", "embed_dims", "dims", "num_channels_per_stage", "channels", "widths",
                     "embed_dim", "hidden_size"):
                out[k] = [min(x, 32 * 2 ** i) for i, x in enumerate(v)]
            elif k in ("depths", "num_layers", "layers", "block_repeats", "num_blocks"):
                out[k] = [1 for _ in v]
            elif k == "conv_dim":
                out[k] = [min(x, 32) for x in v]
            elif k in ("num_heads", "num_attention_heads", "heads") :
                out[k] = [min(x, 2 ** i) for i, x in enumerate(v)]
            elif k == "image_size":
                out[k] = [min(x, 32) for x in v]
            elif k.endswith("_token_id"):
                out[k] = [x if x < VOCAB else VOCAB - 1 for x in v]
        elif isinstance(v, list) and k in ("layer_types", "attention_types_list", "block_types") and len(v) > LAYERS:
            out[k] = _fewer(v, LAYERS)
    # per-layer lists (layer_types, mlp_layer_types, ...) follow the layer count they were written for
    for lk in _LAYER_KEYS & d.keys():
        if isinstance(d[lk], int) and out[lk] != d[lk]:
            for k, v in d.items():
                if isinstance(v, list) and len(v) == d[lk] and ("type" in k or "layer" in k or "pattern" in k):
                    out[k] = _fewer(v, out[lk])
            # per-layer overrides keyed by layer index (Gemma 4's per_layer_config) follow the layers kept
            if isinstance(d.get("per_layer_config"), dict):
                types = d.get("layer_types")
                kept = _kept(types, out[lk]) if isinstance(types, list) and len(types) == d[lk] else range(out[lk])
                new_index = {old: new for new, old in enumerate(kept)}
                out["per_layer_config"] = {f"{new_index[int(i)]:02d}": _shrink(c, gentle)
                                           for i, c in d["per_layer_config"].items() if int(i) in new_index}
    return out


def _kept(v: list, n: int) -> list[int]:
    """The indices of n entries of a per-layer list: each distinct value's first while room allows (a hybrid keeps
    both kinds), then the earliest others."""
    firsts = sorted({x: i for i, x in reversed(list(enumerate(v)))}.values())[:n] if all(
        isinstance(x, (str, int, float, bool)) for x in v) else []
    return sorted(firsts + [i for i in range(len(v)) if i not in firsts][:n - len(firsts)])


def _fewer(v: list, n: int) -> list:
    """n entries of a per-layer list (those of _kept)."""
    return [v[i] for i in _kept(v, n)]


def _mrope_default(mtype: str) -> list[int] | None:
    """The multimodal rotary sections (t, h, w) the model's code falls back to when its config names none
    (Qwen2-VL: ``rope_parameters.get("mrope_section", [16, 24, 24])``, sized for 128-wide heads); None if none."""
    import importlib
    import inspect
    import re

    try:
        src = inspect.getsource(importlib.import_module(f"transformers.models.{mtype}.modeling_{mtype}"))
    except Exception:  # noqa: BLE001 - no module of that name: no default to find
        return None
    found = re.search(r"""["']mrope_section["']\s*,\s*\[([\d,\s]+)\]""", src)
    return [int(x) for x in found.group(1).split(",") if x.strip()] if found else None


def _head_dim(d: dict) -> None:
    """A head_dim the default config leaves None (Ministral, HunYuan: their code reads it as is) set to
    hidden_size // num_attention_heads, as every checkpoint of theirs sets it; in place, sub-configs too."""
    for v in d.values():
        if isinstance(v, dict):
            _head_dim(v)
    if "head_dim" in d and d["head_dim"] is None and d.get("hidden_size") and d.get("num_attention_heads"):
        d["head_dim"] = d["hidden_size"] // d["num_attention_heads"]


def _fit_mrope(d: dict, default: list[int] | None) -> None:
    """Scale every rope config's mrope_section (or the code's default) to half the tiny head width, in place."""
    for v in d.values():
        if isinstance(v, dict):
            _fit_mrope(v, default)
    rope = d.get("rope_parameters") or d.get("rope_scaling")
    section = (rope or {}).get("mrope_section") or ("vocab_size" in d and default)  # the default: text configs
    if not isinstance(rope, dict) or not section or "hidden_size" not in d:
        return
    head = d.get("head_dim") or d["hidden_size"] // (d.get("num_attention_heads") or HEADS)
    half = int(head * rope.get("partial_rotary_factor", d.get("partial_rotary_factor", 1.0))) // 2
    scaled = [max(1, x * half // sum(section)) for x in section]
    scaled[-1] += half - sum(scaled)
    rope["mrope_section"] = scaled


def tiny_config(mtype: str, gentle: bool = False):
    from transformers import CONFIG_MAPPING

    cls = CONFIG_MAPPING[mtype]
    d = cls().to_dict()
    d = _shrink(d, gentle)
    _fit_mrope(d, _mrope_default(mtype))
    _head_dim(d)
    for k in ("transformers_version", "model_type", "architectures"):
        d.pop(k, None)
    return cls.from_dict(d)  # use_cache as the config defaults it: what users build (normconv runs without a cache)


def build(mtype: str, maps, gentle: bool = False):
    import torch
    import transformers

    cfg = tiny_config(mtype, gentle)
    errors = []
    for mapping, cname in maps[mtype]:
        cls = getattr(transformers, cname, None)
        if cls is None:
            errors.append(f"{cname}: not exported by transformers")
            continue
        try:
            torch.manual_seed(0)
            model = cls(cfg).eval()
            return model, mapping, cname
        except Exception as exc:  # noqa: BLE001 - the sweep records every reason
            errors.append(f"{cname}: {type(exc).__name__}: {_first_line(exc)}")
        break  # one class per type: the base model, else the first mapping that has the type
    raise RuntimeError("; ".join(errors) or "no class")


# ---------------------------------------------------------------------------------------------------------------
# inputs


def example_inputs(model, batch: int, seq: int, seed: int, max_image: int = 64):
    """kwargs for the model's forward, from its config and signature; None if none can be made."""
    import torch

    from normconv.io.hf_inputs import grid_patches
    from normconv.io.inputs import forward_params

    cfg = model.config
    params = forward_params(model)
    g = torch.Generator().manual_seed(seed)
    kw = {}
    if "pixel_values" in params:
        ch = getattr(cfg, "num_channels", None) or getattr(getattr(cfg, "vision_config", None), "num_channels", 3) or 3
        size = getattr(cfg, "image_size", None) or getattr(getattr(cfg, "vision_config", None), "image_size", 32)
        size = size[0] if isinstance(size, (list, tuple)) else size
        size = size if isinstance(size, int) and size <= max_image else 32
        kw["pixel_values"] = torch.randn(batch, ch, size, size, generator=g)
    elif "input_values" in params:
        kw["input_values"] = torch.randn(batch, 4000 + 400 * seq, generator=g)
    elif "input_features" in params:
        if "whisper" in cfg.model_type or hasattr(cfg, "max_source_positions") and hasattr(cfg, "num_mel_bins"):
            kw["input_features"] = torch.randn(batch, cfg.num_mel_bins, 2 * cfg.max_source_positions, generator=g)
        else:
            feat = (getattr(cfg, "input_feat_per_channel", None) or getattr(cfg, "num_mel_bins", None)
                    or getattr(cfg, "feature_size", 80)) * (getattr(cfg, "input_channels", 1) or 1)
            kw["input_features"] = torch.randn(batch, 4 * seq, feat, generator=g)
    elif {"hidden_states", "grid_thw"} <= set(params) and getattr(cfg, "patch_size", None):
        kw["hidden_states"], kw["grid_thw"] = grid_patches(cfg, batch, seq, g)
    if "image_grid_thw" in params and "pixel_values" in kw and getattr(getattr(cfg, "vision_config", None),
                                                                       "temporal_patch_size", None):
        kw["pixel_values"], kw["image_grid_thw"] = grid_patches(cfg.vision_config, batch, seq, g)
    if "input_ids" in params and ("pixel_values" not in kw or "text" in str(type(cfg)).lower()
                                  or hasattr(cfg, "text_config")):
        ids = _token_ids(cfg, (batch, seq), g)
        if ids is not None:
            kw["input_ids"] = ids
    if not kw:
        return None
    dec = "decoder_input_ids" in params and (getattr(cfg, "is_encoder_decoder", False) or "input_features" in kw)
    if dec:
        vocab = getattr(cfg, "vocab_size", None) or VOCAB
        kw["decoder_input_ids"] = torch.randint(0, min(vocab, 100), (batch, max(seq // 2, 1)), generator=g)
    return kw


def input_repairs(model, kw: dict) -> list[dict]:
    """Other spellings of the same inputs, tried in order when the model rejects the first: mono audio as
    (B, 1, T) (codecs), a clip of frames (B, T, C, H, W) (video models), token ids beside the pixels (captioning /
    VQA models whose config has no text_config), image tokens for the image features (VLMs: as normconv makes
    them for a folder given without inputs), the language model alone (a VLM whose image tokens cannot be placed)."""
    import torch

    from normconv.io.hf_inputs import image_tokens
    from normconv.io.inputs import forward_params

    cfg, out = model.config, []
    params = forward_params(model)
    if "input_values" in kw and kw["input_values"].dim() == 2:
        out.append({**kw, "input_values": kw["input_values"].unsqueeze(1)})
    if "pixel_values" in kw and kw["pixel_values"].dim() == 4:
        frames = getattr(cfg, "num_frames", None) or getattr(getattr(cfg, "vision_config", None), "num_frames", None) or 2
        out.append({**kw, "pixel_values": kw["pixel_values"].unsqueeze(1).expand(-1, frames, -1, -1, -1).contiguous()})
    if "input_ids" not in kw and "input_ids" in params:
        ids = _token_ids(cfg, (next(iter(kw.values())).shape[0], SEQ), torch.Generator().manual_seed(7))
        if ids is not None:
            out.append({**kw, "input_ids": ids})
    if "pixel_values" in kw and (tokens := image_tokens(model, kw)) is not None:
        out.append({**kw, **tokens})
    if "input_ids" in kw and hasattr(cfg, "text_config"):
        # the language model alone (a VLM whose vision tower this config leaves out, or whose image tokens
        # could not be placed)
        out.append({k: v for k, v in kw.items() if k not in ("pixel_values", "image_grid_thw", "pixel_attention_mask",
                                                              "image_sizes", "input_features")})
    return out


def _token_ids(cfg, shape: tuple[int, int], g):
    """Token ids of ``shape`` within the (text) vocabulary, above the usual special ids; None without a vocab."""
    import torch

    vocab = getattr(cfg, "vocab_size", None) or getattr(getattr(cfg, "text_config", None), "vocab_size", None)
    if not vocab:
        return None
    hi = min(vocab, 100)
    return torch.randint(3 if hi > 8 else 0, hi, shape, generator=g)


def runnable_inputs(model, x1: dict, x2: dict, limited=lambda fn: fn()) -> tuple[dict, dict, object, object]:
    """(x1, x2, outputs on x1, outputs on x2) for the first spelling of the inputs (as made, then each of
    input_repairs) the model runs at both shapes; raises the first spelling's error when none runs."""
    first_error = None

    def spellings():
        yield x1, x2
        yield from zip(input_repairs(model, x1), input_repairs(model, x2))  # made only once the first fails

    for r1, r2 in spellings():
        try:
            ref1 = limited(lambda: forward(model, r1))
            ref2 = limited(lambda: forward(model, r2))
            return r1, r2, ref1, ref2
        except Exception as exc:  # noqa: BLE001 - the inputs as made give the error worth reporting
            first_error = first_error or exc
    raise first_error


# ---------------------------------------------------------------------------------------------------------------
# checks made outside normconv


def flat_tensors(out):
    import torch

    if isinstance(out, torch.Tensor):
        return [out]
    if hasattr(out, "to_tuple"):
        out = out.to_tuple()
    if isinstance(out, dict):
        out = list(out.values())
    if isinstance(out, (list, tuple)):
        return [t for o in out for t in flat_tensors(o)]
    return []


def forward(model, kw):
    """The model's output leaves on ``kw``; random ops draw the same numbers in every call (ViT-MAE's masking), so
    two models are compared on the same draws."""
    import torch

    with torch.no_grad(), torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        return flat_tensors(model(**kw))


def close(a, b, atol=1e-4, rtol=1e-3):
    """(ok, max abs error) over the floating leaves; a different structure is not ok."""
    import torch

    if len(a) != len(b) or not a:
        return False, float("inf")
    worst = 0.0
    ok = True
    for x, y in zip(a, b):
        x, y = torch.as_tensor(x), torch.as_tensor(y)
        if x.shape != y.shape:
            return False, float("inf")
        if not x.is_floating_point():
            ok = ok and bool(torch.equal(x, y.to(x.dtype)))
            continue
        x, y = x.double(), y.double()
        fin = torch.isfinite(x) & torch.isfinite(y)
        if not torch.equal(torch.isfinite(x), torch.isfinite(y)):
            return False, float("inf")
        if fin.any():
            err = (x[fin] - y[fin]).abs()
            worst = max(worst, float(err.max()))
            ok = ok and bool(torch.allclose(x[fin], y[fin], atol=atol, rtol=rtol))
    return ok, worst


def site_calls(sites: list[dict]) -> Counter:
    """owner module -> norm calls inspect reports: one site per call node, and a site's "calls" is its module's
    call count (a module shared at several places: several sites, or one site called several times)."""
    nodes, module_calls = Counter(), Counter()
    for s in sites:
        o = s.get("owner") or s.get("target")
        nodes[o] += 1
        module_calls[o] = max(module_calls[o], s.get("calls") or 1)
    return Counter({o: max(n, module_calls[o]) for o, n in nodes.items()})


def norm_named(model):
    """``is_norm(module)``: its class name, less the architecture's own prefix (RobertaPreLayerNormSelfOutput is
    "SelfOutput"), contains "Norm"."""
    config = getattr(model, "config", None)
    prefix = type(config).__name__.removesuffix("Config") if config is not None else ""

    def is_norm(m):
        n = type(m).__name__
        n = n[len(prefix):] if prefix and n.startswith(prefix) else n
        # not norms: "NoLayerNorm"/"NoNorm" layers (wav2vec2's conv layer, MobileBERT's affine), weight norm
        return "Norm" in n and not any(s in n for s in ("NoLayerNorm", "NoNorm", "WeightNorm"))
    return is_norm


def norm_hooks(model, kw):
    """Calls per innermost norm-named module (``norm_named``), counted by forward hooks."""
    is_norm = norm_named(model)
    names = {}
    for name, m in model.named_modules():
        if is_norm(m) and ".parametrizations." not in f".{name}." and \
                not any(is_norm(c) for c in m.modules() if c is not m):
            names[m] = name
    calls: Counter = Counter()
    handles = [m.register_forward_hook(lambda mod, i, o, n=n: calls.update([n])) for m, n in names.items()]
    try:
        forward(model, kw)
    finally:
        for h in handles:
            h.remove()
    return dict(calls), {n for n in names.values()}


class Timeout(Exception):
    pass


def _alarm(signum, frame):
    raise Timeout("timed out")


def _first_line(exc) -> str:
    s = str(exc).strip().splitlines()
    return (s[0] if s else type(exc).__name__)[:300]


def classify(exc) -> tuple[str, str]:
    from normconv.errors import NormconvError, VerificationError

    if isinstance(exc, Timeout):
        return "failed", "timeout"
    if isinstance(exc, VerificationError):
        return "failed", "VerificationError: " + _first_line(exc)
    if isinstance(exc, NormconvError):
        return "refused", _first_line(exc)
    return "failed", f"{type(exc).__name__}: {_first_line(exc)}"


# ---------------------------------------------------------------------------------------------------------------
# one model type (in a forked child)


def run_type(mtype: str, maps, timeout: float) -> dict:
    import torch

    import normconv

    warnings.filterwarnings("ignore")
    torch.set_num_threads(1)
    rec: dict = {"type": mtype, "built": False}
    sites = None  # inspect's, when it runs
    constants = 0  # norms of parameters inspect lists apart (each may export as a norm op on a constant)
    t0 = time.time()
    signal.signal(signal.SIGALRM, _alarm)

    def limited(fn):
        signal.alarm(max(1, int(timeout)))
        try:
            return fn()
        finally:
            signal.alarm(0)

    for gentle in (False, True):  # the tiny config; if it cannot build or run, only depth / vocab shrunk
        rec.pop("build_error", None)
        rec.pop("forward_error", None)
        rec["built"] = False
        try:
            model, mapping, cname = limited(lambda: build(mtype, maps, gentle))
        except Exception as exc:  # noqa: BLE001
            rec["build_error"] = f"{type(exc).__name__}: {_first_line(exc)}" if not isinstance(exc, RuntimeError) \
                else _first_line(exc)
            rec.setdefault("tiny_error", rec["build_error"])
            continue
        rec.update(built=True, cls=cname, mapping=mapping, params=sum(p.numel() for p in model.parameters()),
                   config="depth-only shrink" if gentle else "tiny")
        x1 = example_inputs(model, BATCH, SEQ, 0, 1024 if gentle else 64)
        x2 = example_inputs(model, BATCH2, SEQ2, 1, 1024 if gentle else 64)
        if x1 is None:
            rec["build_error"] = "no example inputs for forward(" + ", ".join(
                __import__("normconv.io.inputs", fromlist=["x"]).forward_params(model)[:4]) + ")"
            rec["built"] = False
            return rec
        try:
            x1, x2, ref1, ref2 = runnable_inputs(model, x1, x2, limited)
            calls, _ = limited(lambda: norm_hooks(model, x1))
            break
        except Exception as exc:  # noqa: BLE001
            rec["forward_error"] = f"{type(exc).__name__}: {_first_line(exc)}"
            rec.setdefault("tiny_error", rec["forward_error"])
        finally:  # the inputs the model ran on (or the first spelling, when none ran)
            rec["inputs"] = {k: list(v.shape) for k, v in x1.items()}
    if not rec["built"] or "forward_error" in rec:
        return rec
    rec["hook_calls"] = sum(calls.values())
    rec["hook_modules"] = len(calls)
    res: dict = {}

    # inspect
    try:
        rep = limited(lambda: normconv.inspect(model, x1)).to_json()
        sites = rep["sites"]
        constants = len(rep.get("extra", {}).get("weight_standardizations", []))
        owners = site_calls(sites)
        rec["site_calls"] = sum(owners.values())
        rec["post_norm_sites"] = sum(1 for s in sites if s.get("placement") == "post-norm")
        rec["sites"] = len(sites)
        # a norm-named module inspect lists as a near miss (not a norm, with the reason) is explained, not missed
        # so is one listed as a norm of a parameter (SEW-D's LayerNorm on its relative position embeddings)
        near = {m["target"] for m in rep.get("extra", {}).get("near_misses", [])} | \
            {w["target"] for w in rep.get("extra", {}).get("weight_standardizations", [])}
        explained = sorted(n for n in calls if n not in owners and n in near)
        missed = sorted(n for n in calls if n not in owners and n not in near)
        rec["explained"] = explained[:8]
        false = sorted(s.get("owner") or s.get("target") for s in sites
                       if s.get("source") == "module" and (s.get("owner") or s.get("target")) not in calls)
        rec["missed"], rec["false"] = missed[:8], false[:8]
        rec["n_missed"], rec["n_false"] = len(missed), len(false)
        # per hooked module, its calls are its site calls (a site inside no norm-named module, a norm written inline,
        # counts in the totals but is no module's)
        miscounted = sorted(n for n, c in calls.items() if n in owners and owners[n] != c)
        rec["miscounted"] = [f"{n}: {owners[n]} site calls, {calls[n]} hooked" for n in miscounted[:8]]
        if missed or false or miscounted:
            res["inspect"] = ("failed", f"sites vs hooks: {len(missed)} missed, {len(false)} false, "
                                        f"{len(miscounted)} miscounted"
                              + (f" (e.g. {(missed or false or miscounted)[0]})"))
        else:
            res["inspect"] = ("ok", f"{len(sites)} sites" + (f", {len(explained)} norm-named modules listed apart (near "
                                                             f"misses, norms of parameters; e.g. {explained[0]})"
                                                             if explained else ""))
    except Exception as exc:  # noqa: BLE001
        res["inspect"] = classify(exc)

    def rewrite(name, fn):
        try:
            new, rep = limited(fn)
            applied = _applied(rep)
            ok, err = close(ref2, limited(lambda: forward(new, x2)))
            if not ok:
                return "failed", f"second shape differs (max abs {err:.3g})"
            return "ok", f"{applied} applied"
        except Exception as exc:  # noqa: BLE001
            return classify(exc)

    res["fold"] = rewrite("fold", lambda: normconv.fold(model, x1))
    res["swap"] = rewrite("swap", lambda: normconv.swap(model, x1))
    if res["swap"][0] == "refused":
        try:
            new, rep = limited(lambda: normconv.swap(model, x1, approximate=True))
            v = rep.validation[0] if rep.validation else None
            drift = f" (approximate: max abs drift {v.max_abs_error:.3g})" if v is not None else " (approximate ok)"
            res["swap"] = ("refused", res["swap"][1] + drift)
            rec["swap_approx"] = "ok"
        except Exception as exc:  # noqa: BLE001
            rec["swap_approx"] = "/".join(classify(exc))
    res["canonicalize"] = rewrite("canonicalize", lambda: normconv.canonicalize(model, x1))
    res["deepnorm"] = deepnorm_verdict(normconv, model, x1, x2, ref2, limited)

    # export at each opset, then onnxruntime here against torch; fused norm ops counted against inspect's sites
    # norms with equal parameters (a fresh init: ones / zeros) on one input are one op to the ONNX optimizer, which
    # merges them (GPT-NeoX's parallel attention / MLP norms): each norm gets its own values before export
    emodel = distinct_norms(model)
    eref = limited(lambda: forward(emodel, x1)) if emodel is not model else ref1
    if not all(bool(torch.isfinite(t).all()) for t in eref if t.is_floating_point()):
        emodel, eref = model, ref1  # the perturbation overflowed an untrained model (ALIGN's EfficientNet): as built
    per_opset = export_verdicts(emodel, x1, eref, sites, limited, constants)
    rec["export_opsets"] = {str(o): list(v) for o, v in per_opset.items()}
    res["export"] = export_verdict(per_opset)
    rec["results"] = {k: list(v) for k, v in res.items()}
    rec["commit"] = _commit()
    rec["seconds"] = round(time.time() - t0, 1)
    return rec


def _applied(rep) -> int:
    """Sites a rewrite's report says it applied."""
    return sum(1 for s in rep.sites if getattr(s, "applied", False))


def deepnorm_verdict(normconv, model, x1, x2, ref2, limited) -> tuple[str, str]:
    """DeepNorm changes what the model computes, so the verdict outside the pass is its identity instance:
    alpha = 1 with no beta must leave the model equal to the original on the second shape, at the same sites
    the default (the paper's alpha, beta on init) rewrites; the default run must pass normconv's own check."""
    try:
        _, rep = limited(lambda: normconv.deepnorm(model, x1))
        applied = _applied(rep)
        same, rep1 = limited(lambda: normconv.deepnorm(model, x1, alpha=1.0, beta_mode="none"))
        applied1 = _applied(rep1)
        if applied1 != applied:
            return "failed", f"alpha=1 rewrote {applied1} sites, the default {applied}"
        ok, err = close(ref2, limited(lambda: forward(same, x2)))
        if not ok:
            return "failed", f"alpha=1 instance differs from the original on the second shape (max abs {err:.3g})"
        return "ok", f"{applied} applied ({rep.extra.get('arch')})"
    except Exception as exc:  # noqa: BLE001
        return classify(exc)


def _commit() -> str:
    """The normconv commit a record was swept with (records from several commits can share the cache)."""
    import subprocess

    try:
        return subprocess.run(["git", "-C", str(ROOT), "rev-parse", "--short", "HEAD"], capture_output=True,
                              text=True, timeout=10).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return "?"
def _export_inputs(model, kw: dict) -> dict:
    """The inputs normconv's export takes, for plain export too: token ids get an all-ones attention_mask where the
    forward has one, and use_cache=False goes where the model would return a KV cache (what a user passes to
    export an LM: a DynamicCache output fails any export)."""
    import torch

    from normconv.io.inputs import forward_params, without_kv_cache
    from normconv.verify import Inputs

    kw = dict(without_kv_cache(model, Inputs((), kw)).kwargs)
    if "input_ids" in kw and "attention_mask" in forward_params(model) and "attention_mask" not in kw:
        return {**kw, "attention_mask": torch.ones_like(kw["input_ids"])}
    return kw


def _ort_matches(path: str, kw: dict, ref) -> tuple[bool, str]:
    """(ok, detail): onnxruntime CPU on the file against torch's outputs ``ref``."""
    import onnxruntime as ort
    import torch

    sess = ort.InferenceSession(path, providers=["CPUExecutionProvider"])
    missing = [i.name for i in sess.get_inputs() if i.name not in kw]
    if missing:
        return False, f"ONNX input {missing[0]} not among the example inputs"
    outs = sess.run(None, {i.name: kw[i.name].numpy() for i in sess.get_inputs()})
    n = min(len(outs), len(ref))
    ok, err = close(ref[:n], [torch.from_numpy(o) for o in outs[:n]], atol=1e-3, rtol=1e-3)
    return ok, (f"{n} outputs match" if ok else f"onnxruntime differs from torch (max abs {err:.3g})")


def fused_vs_sites(path: str, sites: list[dict] | None, constants: int = 0) -> tuple[bool, str]:
    """Fused norm ops in the ONNX graph against inspect's sites: one per non-batchnorm site, at most one per
    batchnorm (the others folded)."""
    import onnx_ir as ir

    from normconv.onnx.export import fused_norms

    fused = Counter(fused_norms(ir.load(path)))
    if sites is None:
        return True, f"fused {sum(fused.values())} (inspect gave no sites)"
    # a call whose result reaches no output is dead code the exporter drops (inspect's export plan names each
    # such call's node; a module's sites share their plans, so count distinct entries per target)
    dead = {(s["target"], s["kind"], p["reason"]) for s in sites for p in s.get("plan", [])
            if p.get("pass") == "export" and "reaches no model output" in p.get("reason", "")}
    kinds = Counter(s["kind"] for s in sites) - Counter(kind for _, kind, _ in dead)
    want = sum(v for k, v in kinds.items() if k != "batchnorm")
    got = sum(v for k, v in fused.items() if k != "batchnorm")
    # a norm of a parameter (listed apart by inspect, not a site) may be exported as a norm op on a constant
    extra = min(max(got - want, 0), constants)
    ok = got - extra == want and fused["batchnorm"] <= kinds["batchnorm"]
    return ok, f"fused {got - extra} of {want} norm sites" + (f" (+{fused['batchnorm']} BatchNormalization)"
                                                       if fused["batchnorm"] else "") + \
        (f" ({len(dead)} dead: reach no output)" if dead else "") + \
        (f" (+{extra} on parameters)" if extra else "")


def plain_export_fails(model, kw: dict, opset: int, limited) -> str | None:
    """Why plain ``torch.onnx.export(model, dynamo=True, opset_version=opset)`` of the same model and inputs fails
    (an export error, or onnxruntime differing from torch), or None if it works."""
    import torch

    from normconv.onnx.export import _one_line

    kw = _export_inputs(model, kw)
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "plain.onnx")

        def run():
            with torch.no_grad():
                prog = torch.onnx.export(model, (), kwargs=kw, dynamo=True, opset_version=opset,
                                         external_data=False, verbose=False)
            prog.save(path)

        try:
            limited(run)
            ok, why = limited(lambda: _ort_matches(path, kw, forward(model, kw)))
        except Timeout:
            return "timeout"
        except Exception as exc:  # noqa: BLE001 - the reason is the verdict
            return _one_line(exc)
    return None if ok else why


def distinct_norms(model):
    """A copy whose norm modules' weights are perturbed (seeded, 5%), or the model itself when it has none."""
    import copy

    import torch

    is_norm = norm_named(model)

    def weights(m):
        return [w for mod in m.modules() if is_norm(mod)
                for w in [getattr(mod, "weight", None)] if isinstance(w, torch.Tensor) and w.is_floating_point()]

    if not weights(model):
        return model
    new = copy.deepcopy(model)
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for w in weights(new):
            w.add_(0.05 * torch.randn(w.shape, generator=g).to(w.dtype))
    return new


def export_verdicts(model, kw: dict, ref, sites: list[dict] | None, limited,
                    constants: int = 0) -> dict[int, tuple[str, str]]:
    """opset -> (status, detail): normconv.export, onnxruntime against torch, fused ops against sites; where
    normconv fails, plain torch.onnx.export decides whether the failure is normconv's (failed) or not (n/a)."""
    import normconv

    out: dict[int, tuple[str, str]] = {}
    for opset in EXPORT_OPSETS:
        with tempfile.TemporaryDirectory() as tmp:
            path = os.path.join(tmp, "m.onnx")
            try:
                limited(lambda: normconv.export(model, kw, path, opset=opset, baseline=False, repeats=1))
                ok, why = limited(lambda: _ort_matches(path, _export_inputs(model, kw), ref))
                if ok:
                    fused_ok, fused = fused_vs_sites(path, sites, constants)
                    ok, why = fused_ok, (f"{why}, {fused}" if fused_ok else fused)
                v = ("ok", why) if ok else ("failed", why)
            except Exception as exc:  # noqa: BLE001
                v = classify(exc)
        # an unfused site is normconv's failure whatever plain export does; any other failure is excused only
        # when plain export fails too
        if v[0] != "ok" and not v[1].startswith("fused "):
            plain = plain_export_fails(model, kw, opset, limited)
            if plain is not None:
                v = ("n/a", f"plain torch.onnx.export fails too ({plain})")
        out[opset] = v
    return out


def export_verdict(per_opset: dict[int, tuple[str, str]]) -> tuple[str, str]:
    """One verdict from the opsets': the worst of failed > refused > n/a > ok, with the opsets it holds at."""
    order = ("failed", "refused", "n/a", "ok")
    worst = min((v[0] for v in per_opset.values()), key=order.index)
    if worst == "ok":
        return "ok", "opsets " + "/".join(map(str, per_opset)) + ": " + "; ".join(sorted({v[1] for v in
                                                                                         per_opset.values()}))
    bad = [f"opset {o}: {v[1]}" for o, v in per_opset.items() if v[0] == worst]
    good = [str(o) for o, v in per_opset.items() if v[0] == "ok"]
    return worst, "; ".join(bad) + (f" (ok at {'/'.join(good)})" if good else "")


def run_in_child(mtype: str, maps, timeout: float) -> dict:
    """run_type in a forked child, killed past 8x the per-command limit; its record through a pipe."""
    r, w = os.pipe()
    t0 = time.time()
    pid = os.fork()
    if pid == 0:
        os.close(r)
        try:
            rec = run_type(mtype, maps, timeout)
        except BaseException as exc:  # noqa: BLE001
            rec = {"type": mtype, "built": False, "build_error": f"sweep crashed: {type(exc).__name__}: "
                                                              f"{_first_line(exc)}",
                   "trace": traceback.format_exc()[-2000:]}
        with os.fdopen(w, "w") as f:
            f.write(json.dumps(rec, default=str))
        os._exit(0)
    os.close(w)
    data = b""
    deadline = t0 + 8 * timeout
    import select

    with os.fdopen(r, "rb") as f:
        while True:
            left = deadline - time.time()
            if left <= 0:
                os.kill(pid, signal.SIGKILL)
                os.waitpid(pid, 0)
                return {"type": mtype, "built": False, "build_error": f"whole type timed out ({8 * timeout:.0f} s)",
                        "seconds": round(time.time() - t0, 1)}
            ready, _, _ = select.select([f], [], [], min(left, 5))
            if ready:
                chunk = os.read(f.fileno(), 1 << 16)
                if not chunk:
                    break
                data += chunk
    _, status = os.waitpid(pid, 0)
    try:
        return json.loads(data.decode())
    except ValueError:
        return {"type": mtype, "built": False, "build_error": f"child died (status {status})",
                "seconds": round(time.time() - t0, 1)}


# ---------------------------------------------------------------------------------------------------------------
# COVERAGE.md


def load_cache() -> dict[str, dict]:
    recs = {}
    if CACHE.exists():
        for line in CACHE.read_text().splitlines():
            if line.strip():
                rec = json.loads(line)
                recs[rec["type"]] = rec
    return recs


def verdict(command: str, rec: dict) -> tuple[str, str]:
    """The cached (status, detail) with three readings made here: inspect's site calls must equal the hooked
    calls (in records older than the per-module count), a rewrite that had nothing to rewrite ("0 applied", or swap's "has no layernorm") is n/a, and an export
    "refusal" that is the exporter's own exception ("cannot export ...: SomeError") is a failure."""
    v = rec.get("results", {}).get(command)
    if not v:
        return "-", ""
    status, why = v
    # records made before the per-module count ("miscounted") are judged by the totals
    if command == "inspect" and status == "ok" and "miscounted" not in rec and \
            rec.get("site_calls") != rec.get("hook_calls"):
        return "failed", f"site calls != hooked calls ({rec.get('site_calls')} vs {rec.get('hook_calls')})"
    if status == "ok" and why == "0 applied":
        return "n/a", "nothing to rewrite"
    if status == "refused" and command == "swap" and "has no layernorm to swap" in why:
        return "n/a", "no LayerNorm"
    if status == "refused" and command == "deepnorm" and why.startswith(("pre-LN model", "no post-LN residual")) \
            and not rec.get("post_norm_sites"):  # a post-norm site inspect placed must not go unrewritten
        return "n/a", why.split(":")[0]
    if status == "refused" and "Timeout: timed out" in why:  # the per-command limit, wrapped by normconv
        return "failed", "timeout"
    if status == "refused" and command == "export" and why.startswith("cannot export"):
        return "failed", why
    return status, why


def _cell(command: str, rec: dict) -> str:
    status, why = verdict(command, rec)
    if status == "-":
        return "-"
    why = why.replace("|", "\\|").replace("\n", " ")
    if len(why) > 90:
        why = why[:87] + "..."
    return {"ok": "ok", "refused": "refused", "failed": "**FAILED**", "n/a": "n/a"}[status] + (f": {why}" if why else "")


def write_md(recs: dict[str, dict], total_types: int) -> None:
    import transformers

    order = ordered_types(recs)
    built = [recs[t] for t in order if recs[t].get("built") and "results" in recs[t]]
    lines = ["# Coverage: transformers' model types through normconv", "",
             f"Generated by `benchmarks/coverage_transformers.py` (transformers {transformers.__version__}, ONNX opsets "
             f"{', '.join(map(str, EXPORT_OPSETS))}, "
             f"CPU, random weights, tiny configs: hidden <= {HIDDEN}, {LAYERS} layers, {HEADS} heads, vocab "
             f"{VOCAB}, 32 px images).", "",
             f"**Swept {len(recs)} of the {total_types} model types** in the auto-model mappings; "
             f"{len(built)} built and ran a forward on their example inputs (the rest: see *Not built / no "
             "forward*, each with its reason)."
             + (" The types not swept were not run (the sweep is resumable: `python benchmarks/coverage_transformers.py` "
                "continues from `benchmarks/results/coverage.jsonl`)." if len(recs) < total_types else ""), "",
             "Verdicts are computed outside normconv: *sites* = norm calls inspect reports / calls seen by forward "
             "hooks on innermost modules whose class name contains `Norm`; a rewrite is *ok* only if the returned "
             f"model matches the original on fresh inputs of a second shape (batch {BATCH2}, seq {SEQ2}); export "
             "is *ok* only if onnxruntime (CPU) matches torch. *refused* = NormconvError with its reason (for swap, "
             "the `approximate` fallback's drift is appended); **FAILED** = any other error, a verification error, "
             "or a verdict that does not hold.", "", "## Totals", "",
             "| command | ok | n/a (nothing to rewrite) | refused | failed |", "|---|---|---|---|---|"]
    for c in COMMANDS:
        cnt = Counter(verdict(c, r)[0] for r in built)
        lines.append(f"| {c} | {cnt['ok']} | {cnt['n/a']} | {cnt['refused']} | {cnt['failed']} |")
    approx = sum(1 for r in built if r.get("swap_approx") == "ok")
    lines += ["", f"swap refused exactly but succeeded with `approximate=True`: {approx}.",
              f"Types that did not build / had no inputs / failed their own forward: "
              f"{sum(1 for r in recs.values() if not r.get('built'))} / "
              f"{sum(1 for r in recs.values() if r.get('built') and 'forward_error' in r)}.", ""]
    stale = [r["type"] for r in built if _stale(r)]
    commits = Counter(r.get("commit", "?") for r in built if not _stale(r))
    lines += [f"Records by the commit they were swept with: {', '.join(f'{c} ({n})' for c, n in commits.most_common())}"
              + (f"; {len(stale)} older records lack today's columns (deepnorm, per-opset export: `-` in the table; "
                 f"`--stale` reruns them): {', '.join(stale[:12])}{' ...' if len(stale) > 12 else ''}" if stale else "")
              + ".", ""]
    lines += ["## Failures grouped by cause", ""]
    if not any(verdict(c, r)[0] == "failed" for c in COMMANDS for r in built):
        lines += ["None: no command failed on any type that built and ran.", ""]
    for c in COMMANDS:
        groups = defaultdict(list)
        for r in built:
            v = verdict(c, r)
            if v[0] == "failed":
                key = re.sub(r"\d+ vs \d+", "n vs m", v[1].split(" (e.g.")[0]) if c == "inspect" else v[1]
                key = re.sub(r"\b[A-Z]\w*(Model|For\w+)\b", "<Model>", re.sub(r"0x[0-9a-f]+", "0x..", key))
                groups[key[:160]].append(r["type"])
        if not groups:
            continue
        lines.append(f"### {c}")
        lines.append("")
        for key, types in sorted(groups.items(), key=lambda kv: -len(kv[1])):
            lines.append(f"- {len(types)} x `{key}`: {', '.join(types[:12])}{' ...' if len(types) > 12 else ''}")
        lines.append("")
    lines += ["## Refusals grouped by reason", ""]
    for c in COMMANDS:
        groups = defaultdict(list)
        for r in built:
            v = verdict(c, r)
            if v[0] == "refused":
                key = v[1].split(" (approximate")[0]
                # the reason, also when the 300-character first line cut it before ". Pass"
                m = re.search(r"cannot be swapped exactly; \S+: (.*?)(?: \(and \d+ more\))?(?:\. Pass|$)", key)
                key = "not exact: " + m.group(1) if m else key.split(";")[0]
                key = re.sub(r"\b[A-Z]\w*(Model|For\w+)\b", "<Model>", re.sub(r"0x[0-9a-f]+", "0x..", key))
                groups[key[:160]].append(r["type"])
        if groups:
            lines.append(f"### {c}")
            lines.append("")
            for key, types in sorted(groups.items(), key=lambda kv: -len(kv[1])):
                lines.append(f"- {len(types)} x `{key}`: {', '.join(types[:12])}{' ...' if len(types) > 12 else ''}")
            lines.append("")
    skipped = [r for r in (recs[t] for t in order) if not r.get("built") or "forward_error" in r]
    if skipped:
        lines += ["## Not built / no forward", "", "| type | reason |", "|---|---|"]
        for r in skipped:
            why = (r.get("build_error") or r.get("forward_error") or "").replace("|", "\\|")[:160]
            lines.append(f"| {r['type']} | {why} |")
        lines.append("")
    lines += ["## Per model type", "",
              "| type | class | sites / hooks | " + " | ".join(COMMANDS) + " | s |",
              "|---|---|---|" + "---|" * len(COMMANDS) + "---|"]
    for r in built:
        sites = f"{r.get('site_calls', '?')} / {r.get('hook_calls', '?')}"
        cells = " | ".join(_cell(c, r) for c in COMMANDS)
        cls = r.get("cls", "") + (" (depth-only shrink)" if r.get("config") == "depth-only shrink" else "")
        lines.append(f"| {r['type']} | {cls} | {sites} | {cells} | {r.get('seconds', '')} |")
    # the vision sweep's section (benchmarks/coverage_vision.py) is that sweep's to write: kept as it is
    old = OUT_MD.read_text() if OUT_MD.exists() else ""
    kept = old[old.index(VISION_MARK):] if VISION_MARK in old else ""
    OUT_MD.write_text("\n".join(lines) + "\n" + ("\n" + kept if kept else ""))


def _stale(rec: dict) -> bool:
    """A record swept before the sweep had all of today's columns (it built and ran, yet a verdict is missing)."""
    return bool(rec.get("results")) and (any(c not in rec["results"] for c in COMMANDS) or "export_opsets" not in rec)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--limit", type=int, default=None, help="at most N model types (after --types)")
    ap.add_argument("--types", default=None, help="comma-separated model types (default: all)")
    ap.add_argument("--timeout", type=float, default=60.0, help="seconds per command (the type: 8x)")
    ap.add_argument("--jobs", type=int, default=1, help="only 1 is supported (one model at a time)")
    ap.add_argument("--rerun", action="store_true", help="run types already in the cache again")
    ap.add_argument("--stale", action="store_true",
                    help="also run cached types whose record lacks a command column or the per-opset export verdicts")
    ap.add_argument("--report-only", action="store_true", help="write COVERAGE.md from the cache and stop")
    args = ap.parse_args(argv)
    if args.jobs != 1:
        ap.error("--jobs: only 1 is supported")
    warnings.filterwarnings("ignore")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
    import transformers  # noqa: F401 - imported once here, before the children fork

    try:  # a broken install would fail every command of every type and write those verdicts to the cache
        import normconv.passes  # noqa: F401
    except ImportError as exc:
        sys.exit(f"coverage: normconv does not import ({exc}); reinstall with pip install -e . and run again")

    maps = mappings()
    recs = load_cache()
    if args.report_only:
        write_md(recs, len(maps))
        return 0
    types = [t.strip() for t in args.types.split(",")] if args.types else ordered_types(maps)
    unknown = [t for t in types if t not in maps]
    if unknown:
        ap.error("unknown model types: " + ", ".join(unknown))
    todo = [t for t in types if args.rerun or t not in recs or (args.stale and _stale(recs[t]))]
    if args.limit is not None:
        todo = todo[:args.limit]
    CACHE.parent.mkdir(parents=True, exist_ok=True)
    for i, t in enumerate(todo, 1):
        rec = run_in_child(t, maps, args.timeout)
        recs[t] = rec
        with CACHE.open("a") as f:
            f.write(json.dumps(rec, default=str) + "\n")
        summary = " ".join(f"{c}={rec.get('results', {}).get(c, ['-'])[0]}" for c in COMMANDS) \
            if rec.get("results") else (rec.get("build_error") or rec.get("forward_error", ""))[:120]
        print(f"[{i}/{len(todo)}] {t} ({rec.get('seconds', '?')} s): {summary}", flush=True)
        write_md(recs, len(maps))
    write_md(recs, len(maps))
    return 0


if __name__ == "__main__":
    sys.exit(main())
