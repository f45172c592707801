"""Tiny Hugging Face models built offline from configs (random weights), with their example inputs."""

from __future__ import annotations

import warnings

import torch

from normconv.verify import Inputs

VOCAB = 100


def _ids(batch: int = 2, seq: int = 16, seed: int = 0) -> torch.Tensor:
    return torch.randint(0, VOCAB, (batch, seq), generator=torch.Generator().manual_seed(seed))


def _build(cls, config):
    warnings.filterwarnings("ignore")
    torch.manual_seed(0)
    return cls(config).eval()


def saved_folder(build, folder, spread: float = 0.02, norms: float = 0.0):
    """``build()``'s model in eval mode, every parameter moved by N(0, ``spread``) and, with ``norms``, every
    LayerNorm's gain drawn from N(1, norms) and bias from N(0, norms), saved to ``folder`` by save_pretrained (a
    folder as users have one: no norm at exactly 1 / 0); returns the model."""
    model = _build(lambda _: build(), None)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * spread)
        for m in model.modules():
            if norms and isinstance(m, torch.nn.LayerNorm):
                m.weight.normal_(1.0, norms)
                m.bias.normal_(0.0, norms)
    model.save_pretrained(folder)
    return model


def tiny_bert():
    from transformers import BertConfig, BertModel

    cfg = BertConfig(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                     intermediate_size=64, max_position_embeddings=64)
    ids = _ids()
    return _build(BertModel, cfg), Inputs((), {"input_ids": ids, "attention_mask": torch.ones_like(ids)})


def tiny_gpt2():
    from transformers import GPT2Config, GPT2LMHeadModel

    cfg = GPT2Config(vocab_size=VOCAB, n_embd=32, n_layer=2, n_head=4, n_positions=64, use_cache=False,
                     bos_token_id=0, eos_token_id=0)
    return _build(GPT2LMHeadModel, cfg), Inputs((), {"input_ids": _ids()})


def tiny_openai_gpt():
    """GPT-1: post-LN, Conv1D layers (addmm on x.view(-1, D), viewed back), fused c_attn."""
    from transformers import OpenAIGPTConfig, OpenAIGPTModel

    cfg = OpenAIGPTConfig(vocab_size=VOCAB, n_embd=32, n_layer=2, n_head=2, n_positions=64)
    return _build(OpenAIGPTModel, cfg), Inputs((), {"input_ids": _ids()})


def tiny_deberta_v2():
    """DeBERTa-v2: disentangled attention; the probabilities are viewed (B*H, L, L) before the bmm with v."""
    from transformers import DebertaV2Config, DebertaV2Model

    cfg = DebertaV2Config(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                          intermediate_size=64, max_position_embeddings=64)
    ids = _ids()
    return _build(DebertaV2Model, cfg), Inputs((), {"input_ids": ids, "attention_mask": torch.ones_like(ids)})


def tiny_deberta_v3():
    """DeBERTa-v3's layout (DebertaV2Model with relative attention): ``encoder.LayerNorm`` normalizes the relative
    position embeddings' weight (a parameter no layer takes as its weight) on every forward."""
    from transformers import DebertaV2Config, DebertaV2Model

    cfg = DebertaV2Config(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                          intermediate_size=64, max_position_embeddings=64, relative_attention=True, position_buckets=8,
                          norm_rel_ebd="layer_norm", pos_att_type=["p2c", "c2p"], position_biased_input=False)
    ids = _ids()
    return _build(DebertaV2Model, cfg), Inputs((), {"input_ids": ids, "attention_mask": torch.ones_like(ids)})


def tiny_albert():
    """ALBERT: one post-LN layer whose modules run num_hidden_layers (3) times (cross-layer parameter sharing)."""
    from transformers import AlbertConfig, AlbertModel

    cfg = AlbertConfig(vocab_size=VOCAB, hidden_size=32, embedding_size=16, num_hidden_layers=3,
                       num_attention_heads=2, intermediate_size=64, max_position_embeddings=64)
    return _build(AlbertModel, cfg), Inputs((), {"input_ids": _ids()})


def tiny_llama():
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, intermediate_size=64, max_position_embeddings=64, use_cache=False)
    return _build(LlamaForCausalLM, cfg), Inputs((), {"input_ids": _ids()})


def tiny_t5():
    from transformers import T5Config, T5ForConditionalGeneration

    cfg = T5Config(vocab_size=VOCAB, d_model=32, d_kv=8, d_ff=64, num_layers=2, num_decoder_layers=2, num_heads=4,
                   use_cache=False, decoder_start_token_id=0)
    ids = _ids()
    return _build(T5ForConditionalGeneration, cfg), Inputs((), {"input_ids": ids, "decoder_input_ids": ids[:, :8]})


def tiny_gemma():
    from transformers import GemmaConfig, GemmaForCausalLM

    cfg = GemmaConfig(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=1, head_dim=8, intermediate_size=64, use_cache=False)
    return _build(GemmaForCausalLM, cfg), Inputs((), {"input_ids": _ids()})


def tiny_bart():
    """A post-LN encoder-decoder (BART): DeepNorm's encoder-decoder case, cross-attention included."""
    from transformers import BartConfig, BartModel

    cfg = BartConfig(vocab_size=VOCAB, d_model=32, encoder_layers=2, decoder_layers=2, encoder_attention_heads=4,
                     decoder_attention_heads=4, encoder_ffn_dim=64, decoder_ffn_dim=64, max_position_embeddings=64,
                     use_cache=False)
    ids = _ids()
    return _build(BartModel, cfg), Inputs((), {"input_ids": ids, "decoder_input_ids": ids[:, :8]})


def tiny_mamba():
    """Mamba: each block calls its hand-written RMSNorm on a cast it makes itself (norm(h.to(w.dtype)))."""
    from transformers import MambaConfig, MambaModel

    cfg = MambaConfig(vocab_size=VOCAB, hidden_size=32, state_size=4, num_hidden_layers=2, expand=2, use_cache=False)
    return _build(MambaModel, cfg), Inputs((), {"input_ids": _ids()})


TINY = {"bert": tiny_bert, "gpt2": tiny_gpt2, "llama": tiny_llama, "t5": tiny_t5, "gemma": tiny_gemma}


def _image(batch: int = 2, size: int = 32, seed: int = 0) -> torch.Tensor:
    return torch.randn(batch, 3, size, size, generator=torch.Generator().manual_seed(seed))


def tiny_resnet():
    from transformers import ResNetConfig, ResNetModel

    cfg = ResNetConfig(embedding_size=8, hidden_sizes=[8, 16], depths=[1, 1], layer_type="basic")
    return _build(ResNetModel, cfg), Inputs((_image(),))


def tiny_mobilenetv2():
    from transformers import MobileNetV2Config, MobileNetV2Model

    cfg = MobileNetV2Config(depth_multiplier=0.25, image_size=32)
    return _build(MobileNetV2Model, cfg), Inputs((_image(),))


def tiny_convnext():
    from transformers import ConvNextConfig, ConvNextModel

    cfg = ConvNextConfig(hidden_sizes=[8, 16], depths=[1, 1], num_stages=2)
    return _build(ConvNextModel, cfg), Inputs((_image(),))


TINY_VISION = {"resnet": tiny_resnet, "mobilenetv2": tiny_mobilenetv2, "convnext": tiny_convnext}


def _randomized(model, seed: int = 0):
    """Norms as trained weights leave them: LayerNorm affines and BatchNorm statistics / affines away from (1, 0)."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for m in model.modules():
            if isinstance(m, (torch.nn.LayerNorm, torch.nn.BatchNorm2d)) and m.weight is not None:
                m.weight.copy_(1 + 0.3 * torch.randn(m.weight.shape, generator=g))
                m.bias.copy_(0.3 * torch.randn(m.bias.shape, generator=g))
            if isinstance(m, torch.nn.BatchNorm2d) and m.running_mean is not None:
                m.running_mean.copy_(0.2 * torch.randn(m.running_mean.shape, generator=g))
                m.running_var.copy_(torch.rand(m.running_var.shape, generator=g) + 0.5)
    return model


def tiny_mobilevit():
    """MobileViT: each transformer stage ends in a LayerNorm whose output is folded back into patches (a transpose)."""
    from transformers import MobileViTConfig, MobileViTModel

    cfg = MobileViTConfig(image_size=32, patch_size=2, hidden_sizes=[16, 16, 16], num_attention_heads=2,
                          neck_hidden_sizes=[8, 8, 16, 16, 16, 16, 32], mlp_ratio=2.0)
    return _randomized(_build(MobileViTModel, cfg)), Inputs((_image(),))


def tiny_segformer():
    """Segformer: transformers installs output-capturing hooks (local closures) on its first forward."""
    from transformers import SegformerConfig, SegformerForSemanticSegmentation

    cfg = SegformerConfig(num_encoder_blocks=2, depths=[1, 1], sr_ratios=[2, 1], hidden_sizes=[8, 16],
                          num_attention_heads=[1, 2], patch_sizes=[7, 3], strides=[4, 2], mlp_ratios=[2, 2],
                          decoder_hidden_size=16, num_labels=3)
    return _build(SegformerForSemanticSegmentation, cfg), Inputs((_image(batch=1),))


def tiny_opt():
    from transformers import OPTConfig, OPTForCausalLM

    cfg = OPTConfig(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, ffn_dim=64, num_attention_heads=4,
                    max_position_embeddings=64, word_embed_proj_dim=32, use_cache=False)
    return _build(OPTForCausalLM, cfg), Inputs((), {"input_ids": _ids()})


def tiny_gpt_neo():
    from transformers import GPTNeoConfig, GPTNeoForCausalLM

    cfg = GPTNeoConfig(vocab_size=VOCAB, hidden_size=32, num_layers=2, num_heads=4, max_position_embeddings=64,
                       attention_types=[[["global", "local"], 1]], use_cache=False)
    return _build(GPTNeoForCausalLM, cfg), Inputs((), {"input_ids": _ids()})


def tiny_gpt_neox():
    """GPT-NeoX: parallel residual (x + attn(ln1(x)) + mlp(ln2(x))), untied head."""
    from transformers import GPTNeoXConfig, GPTNeoXForCausalLM

    cfg = GPTNeoXConfig(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                        intermediate_size=64, max_position_embeddings=64, use_cache=False)
    return _build(GPTNeoXForCausalLM, cfg), Inputs((), {"input_ids": _ids()})


# more pre-LN decoders with LayerNorm, for swap
TINY_PRE_LN = {"opt": tiny_opt, "gpt_neo": tiny_gpt_neo, "gpt_neox": tiny_gpt_neox}


def tiny_falcon():
    """Falcon: parallel attention, `mlp_out += attn_out` (an in-place add), FalconLinear computes x @ W.T."""
    from transformers import FalconConfig, FalconModel

    cfg = FalconConfig(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, use_cache=False)
    return _build(FalconModel, cfg), Inputs((), {"input_ids": _ids()})


def tiny_olmo():
    """OLMo: a weight-free LayerNorm module written as F.layer_norm in float32, cast back."""
    from transformers import OlmoConfig, OlmoModel

    cfg = OlmoConfig(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                     num_key_value_heads=2, intermediate_size=64, max_position_embeddings=64, use_cache=False)
    return _build(OlmoModel, cfg), Inputs((), {"input_ids": _ids()})


def tiny_bloom():
    """BLOOM: a LayerNorm right after the word embeddings writes the residual stream."""
    from transformers import BloomConfig, BloomModel

    cfg = BloomConfig(vocab_size=VOCAB, hidden_size=32, n_layer=2, n_head=4, use_cache=False)
    return _build(BloomModel, cfg), Inputs((), {"input_ids": _ids()})


def tiny_mbart():
    """MBart with scale_embedding: the token embedding times sqrt(d_model) (a Python float) writes the stream."""
    from transformers import MBartConfig, MBartModel

    cfg = MBartConfig(vocab_size=VOCAB, d_model=32, encoder_layers=1, decoder_layers=1, encoder_attention_heads=4,
                      decoder_attention_heads=4, encoder_ffn_dim=64, decoder_ffn_dim=64, max_position_embeddings=64,
                      scale_embedding=True, use_cache=False)
    return _build(MBartModel, cfg), Inputs((), {"input_ids": _ids(), "decoder_input_ids": _ids(seq=8, seed=1)})


def tiny_dinov2():
    """DINOv2: layer scale (a per-channel Parameter lambda multiplied after each sublayer's output projection)."""
    from transformers import Dinov2Config, Dinov2Model

    cfg = Dinov2Config(hidden_size=32, num_hidden_layers=2, num_attention_heads=4, mlp_ratio=2, image_size=32,
                       patch_size=8)
    return _build(Dinov2Model, cfg), Inputs((_image(),))


def trained_dinov2():
    """DINOv2 with every LayerNorm's affine randomized: the final LayerNorm's output is the model's output (and its
    CLS token is sliced out of it), so its bias reaches the output through no linear."""
    model, inputs = tiny_dinov2()
    return _randomized(model), inputs


def cached_gpt2():
    """GPT-2 as users build it: the config's default use_cache=True, so a plain forward returns a KV cache."""
    from transformers import GPT2Config, GPT2LMHeadModel

    cfg = GPT2Config(vocab_size=VOCAB, n_embd=32, n_layer=2, n_head=4, n_positions=64, bos_token_id=0,
                     eos_token_id=0)
    return _build(GPT2LMHeadModel, cfg), Inputs((), {"input_ids": _ids()})


def cached_llama():
    """Llama with the config's default use_cache=True."""
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, intermediate_size=64, max_position_embeddings=64)
    return _build(LlamaForCausalLM, cfg), Inputs((), {"input_ids": _ids()})


def tiny_llava():
    """LLaVA (CLIP vision tower, Llama language model) as users build it: use_cache on in its text config, taken
    through forward's **kwargs; its example inputs are the ones normconv makes (one image token per feature)."""
    from transformers import CLIPVisionConfig, LlamaConfig, LlavaConfig, LlavaModel

    from normconv.io.hf_inputs import hf_example_inputs

    vision = CLIPVisionConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                              image_size=32, patch_size=8, projection_dim=32)
    text = LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                       num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128)
    model = _build(LlavaModel, LlavaConfig(vision_config=vision, text_config=text, image_token_index=5))
    return model, hf_example_inputs(model)


def lm_onnx_error(path, model, shapes=((3, 5), (1, 9))) -> float:
    """The largest error of an exported causal LM's logits in onnxruntime against the model's, as a fraction of the
    logits' scale, over token batches of ``shapes`` (other sizes than the example's)."""
    import numpy as np
    import onnxruntime as ort

    sess = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    names = [i.name for i in sess.get_inputs()]
    worst = 0.0
    for shape in shapes:
        ids = torch.randint(0, VOCAB, shape, generator=torch.Generator().manual_seed(1))
        feed = {"input_ids": ids.numpy(), "attention_mask": np.ones(shape, np.int64)}
        got = sess.run(None, {k: v for k, v in feed.items() if k in names})[0]
        with torch.no_grad():
            want = model(input_ids=ids, attention_mask=torch.ones_like(ids)).logits.numpy()
        worst = max(worst, float(np.abs(got - want).max() / np.abs(want).max()))
    return worst
