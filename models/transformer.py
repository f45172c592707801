"""Transformer reference models: post-LN encoder (bert), pre-LN decoder (gpt), RMSNorm decoder (llama) and
post-LN encoder-decoder (seq2seq), all hidden 32 with 4 heads and a vocabulary of 100.

One ``Attention`` module (separate q_proj / k_proj / v_proj / out_proj, explicit softmax) serves every model,
so passes that look for attention projections by name (DeepNorm scales v_proj and out_proj) see one layout.
``LlamaDecoderLayer`` and ``LlamaModel`` take a norm factory, so the hand-written RMSNorm models reuse them.
"""

from __future__ import annotations

import math
from typing import Callable

import torch
import torch.nn as nn

from .common import seeded, token_ids

VOCAB = 100
HIDDEN = 32
HEADS = 4
MAX_POSITIONS = 64

# (role, hidden) -> norm module; role is "input", "post_attention" or "final"
NormFactory = Callable[[str, int], nn.Module]


class Attention(nn.Module):
    """Multi-head attention written out: softmax(q k^T / sqrt(d)) v, then out_proj.

    ``forward(x)`` is self-attention, ``forward(x, context)`` cross-attention from ``x`` to ``context``.
    ``causal=True`` masks future positions with a lower-triangular mask built from the scores' shape, so
    the module traces with torch.fx and exports without data-dependent control flow.
    """

    def __init__(self, hidden: int, heads: int, bias: bool = True, causal: bool = False):
        super().__init__()
        self.num_heads = heads
        self.head_dim = hidden // heads
        self.scale = self.head_dim ** -0.5
        self.causal = causal
        self.q_proj = nn.Linear(hidden, hidden, bias=bias)
        self.k_proj = nn.Linear(hidden, hidden, bias=bias)
        self.v_proj = nn.Linear(hidden, hidden, bias=bias)
        self.out_proj = nn.Linear(hidden, hidden, bias=bias)

    def _split_heads(self, x: torch.Tensor) -> torch.Tensor:
        return x.unflatten(-1, (self.num_heads, self.head_dim)).transpose(1, 2)  # (B, T, C) -> (B, H, T, D)

    def forward(self, x: torch.Tensor, context: torch.Tensor | None = None) -> torch.Tensor:
        kv = x if context is None else context
        q = self._split_heads(self.q_proj(x))
        k = self._split_heads(self.k_proj(kv))
        v = self._split_heads(self.v_proj(kv))
        scores = (q @ k.transpose(-2, -1)) * self.scale
        if self.causal:
            keep = scores.new_ones(scores.shape[-2:], dtype=torch.bool).tril()
            scores = scores.masked_fill(~keep, float("-inf"))
        out = scores.softmax(dim=-1) @ v
        return self.out_proj(out.transpose(1, 2).flatten(2))


# -- post-LN encoder / decoder layers (bert, seq2seq) ------------------------------------------------------


class PostLNEncoderLayer(nn.Module):
    """Original-Transformer encoder layer: x = attn_norm(x + attn(x)); x = ffn_norm(x + fc2(gelu(fc1(x)))).

    ``causal=True`` masks the self-attention (the decoder layer below sets it).
    """

    def __init__(self, hidden: int, heads: int, ffn: int, eps: float, causal: bool = False):
        super().__init__()
        self.attn = Attention(hidden, heads, causal=causal)
        self.attn_norm = nn.LayerNorm(hidden, eps=eps)
        self.fc1 = nn.Linear(hidden, ffn)
        self.act = nn.GELU()
        self.fc2 = nn.Linear(ffn, hidden)
        self.ffn_norm = nn.LayerNorm(hidden, eps=eps)

    def ffn(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(self.act(self.fc1(x)))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.attn_norm(x + self.attn(x))
        return self.ffn_norm(x + self.ffn(x))


class PostLNDecoderLayer(PostLNEncoderLayer):
    """Original-Transformer decoder layer: causal self-attention, cross-attention to the encoder output, FFN;
    each sublayer post-LN (``attn_norm``, ``cross_attn_norm``, ``ffn_norm``)."""

    def __init__(self, hidden: int, heads: int, ffn: int, eps: float):
        super().__init__(hidden, heads, ffn, eps, causal=True)
        self.cross_attn = Attention(hidden, heads)
        self.cross_attn_norm = nn.LayerNorm(hidden, eps=eps)

    def forward(self, x: torch.Tensor, memory: torch.Tensor) -> torch.Tensor:
        x = self.attn_norm(x + self.attn(x))
        x = self.cross_attn_norm(x + self.cross_attn(x, memory))
        return self.ffn_norm(x + self.ffn(x))


# -- bert ---------------------------------------------------------------------------------------------------


class BertEncoder(nn.Module):
    """BERT-like post-LN encoder: token + learned position embeddings, embedding LayerNorm, 2 post-LN layers.

    Exercises: LayerNorm right after the embedding sum, post-LN sites (LN(x + f(x))) where the exact
    LayerNorm -> RMSNorm conversion does not apply but DeepNorm does, and BERT's eps 1e-12.
    """

    def __init__(self, vocab: int = VOCAB, hidden: int = HIDDEN, heads: int = HEADS, layers: int = 2,
                 ffn: int = 4 * HIDDEN, max_positions: int = MAX_POSITIONS, eps: float = 1e-12):
        super().__init__()
        self.word_embeddings = nn.Embedding(vocab, hidden)
        self.position_embeddings = nn.Embedding(max_positions, hidden)
        self.embed_norm = nn.LayerNorm(hidden, eps=eps)
        self.layers = nn.ModuleList(PostLNEncoderLayer(hidden, heads, ffn, eps) for _ in range(layers))

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        positions = torch.arange(input_ids.shape[1], device=input_ids.device)
        x = self.embed_norm(self.word_embeddings(input_ids) + self.position_embeddings(positions))
        for layer in self.layers:
            x = layer(x)
        return x


@seeded(106)
def bert() -> nn.Module:
    """BERT-like post-LN encoder, 5 LayerNorm (eps 1e-12)."""
    return BertEncoder()


def bert_inputs() -> tuple:
    return (token_ids(2, 16, vocab=VOCAB, seed=106),)


# -- gpt ----------------------------------------------------------------------------------------------------


class GPTMLP(nn.Module):
    """GPT-2 MLP: proj(gelu_tanh(fc(x)))."""

    def __init__(self, hidden: int):
        super().__init__()
        self.fc = nn.Linear(hidden, 4 * hidden)
        self.act = nn.GELU(approximate="tanh")
        self.proj = nn.Linear(4 * hidden, hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(self.act(self.fc(x)))


class GPTBlock(nn.Module):
    """Pre-LN block: x = x + attn(ln_1(x)); x = x + mlp(ln_2(x))."""

    def __init__(self, hidden: int, heads: int, eps: float):
        super().__init__()
        self.ln_1 = nn.LayerNorm(hidden, eps=eps)
        self.attn = Attention(hidden, heads, causal=True)
        self.ln_2 = nn.LayerNorm(hidden, eps=eps)
        self.mlp = GPTMLP(hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class GPT(nn.Module):
    """GPT-2-like pre-LN decoder with a final ``ln_f`` and an ``lm_head`` tied to ``wte``.

    Exercises: the exact pre-LN LayerNorm -> RMSNorm conversion (every residual writer is an embedding or an
    output projection: wte, wpe, attn.out_proj, mlp.proj), and a tied embedding that must be cloned before
    it is centered.
    """

    def __init__(self, vocab: int = VOCAB, hidden: int = HIDDEN, heads: int = HEADS, layers: int = 2,
                 max_positions: int = MAX_POSITIONS, eps: float = 1e-5):
        super().__init__()
        self.wte = nn.Embedding(vocab, hidden)
        self.wpe = nn.Embedding(max_positions, hidden)
        self.blocks = nn.ModuleList(GPTBlock(hidden, heads, eps) for _ in range(layers))
        self.ln_f = nn.LayerNorm(hidden, eps=eps)
        self.lm_head = nn.Linear(hidden, vocab, bias=False)
        self.lm_head.weight = self.wte.weight

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        positions = torch.arange(input_ids.shape[1], device=input_ids.device)
        x = self.wte(input_ids) + self.wpe(positions)
        for block in self.blocks:
            x = block(x)
        return self.lm_head(self.ln_f(x))


@seeded(107)
def gpt() -> nn.Module:
    """GPT-2-like pre-LN decoder with tied lm_head, 5 LayerNorm (eps 1e-5)."""
    return GPT()


def gpt_inputs() -> tuple:
    return (token_ids(2, 16, vocab=VOCAB, seed=107),)


# -- llama --------------------------------------------------------------------------------------------------


def native_rmsnorm(role: str, hidden: int) -> nn.Module:
    """The llama model's norm factory: torch's nn.RMSNorm for every role."""
    return nn.RMSNorm(hidden, eps=1e-6)


class LlamaMLP(nn.Module):
    """SwiGLU: down_proj(silu(gate_proj(x)) * up_proj(x)), no biases."""

    def __init__(self, hidden: int, intermediate: int):
        super().__init__()
        self.gate_proj = nn.Linear(hidden, intermediate, bias=False)
        self.up_proj = nn.Linear(hidden, intermediate, bias=False)
        self.down_proj = nn.Linear(intermediate, hidden, bias=False)
        self.act = nn.SiLU()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act(self.gate_proj(x)) * self.up_proj(x))


class LlamaDecoderLayer(nn.Module):
    """Llama block: h = x + self_attn(input_layernorm(x)); h + mlp(post_attention_layernorm(h))."""

    def __init__(self, hidden: int, heads: int, intermediate: int, make_norm: NormFactory):
        super().__init__()
        self.input_layernorm = make_norm("input", hidden)
        self.self_attn = Attention(hidden, heads, bias=False, causal=True)
        self.post_attention_layernorm = make_norm("post_attention", hidden)
        self.mlp = LlamaMLP(hidden, intermediate)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x + self.self_attn(self.input_layernorm(x))
        return h + self.mlp(self.post_attention_layernorm(h))


class LlamaModel(nn.Module):
    """A stack of Llama decoder layers and a final ``norm`` over hidden states (B, T, C)."""

    def __init__(self, hidden: int = HIDDEN, heads: int = HEADS, layers: int = 2, intermediate: int = 64,
                 make_norm: NormFactory = native_rmsnorm):
        super().__init__()
        self.layers = nn.ModuleList(LlamaDecoderLayer(hidden, heads, intermediate, make_norm) for _ in range(layers))
        self.norm = make_norm("final", hidden)

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            hidden_states = layer(hidden_states)
        return self.norm(hidden_states)


class LlamaForCausalLM(nn.Module):
    """Llama-like decoder: token embedding, ``LlamaModel``, untied bias-free ``lm_head``.

    Exercises: native nn.RMSNorm pre-norms and final norm (eps 1e-6), bias-free projections, SwiGLU.
    """

    def __init__(self, vocab: int = VOCAB, hidden: int = HIDDEN, heads: int = HEADS, layers: int = 2,
                 make_norm: NormFactory = native_rmsnorm):
        super().__init__()
        self.embed_tokens = nn.Embedding(vocab, hidden)
        self.model = LlamaModel(hidden, heads, layers, make_norm=make_norm)
        self.lm_head = nn.Linear(hidden, vocab, bias=False)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.lm_head(self.model(self.embed_tokens(input_ids)))


@seeded(108)
def llama() -> nn.Module:
    """Llama-like decoder, 5 nn.RMSNorm (eps 1e-6)."""
    return LlamaForCausalLM()


def llama_inputs() -> tuple:
    return (token_ids(2, 16, vocab=VOCAB, seed=108),)


# -- seq2seq ------------------------------------------------------------------------------------------------


def sinusoidal_positions(length: int, dim: int) -> torch.Tensor:
    """The fixed sine/cosine position table of "Attention Is All You Need", shape (length, dim)."""
    position = torch.arange(length, dtype=torch.float32)[:, None]
    freq = torch.exp(torch.arange(0, dim, 2, dtype=torch.float32) * (-math.log(10000.0) / dim))
    table = torch.zeros(length, dim)
    table[:, 0::2] = torch.sin(position * freq)
    table[:, 1::2] = torch.cos(position * freq)
    return table


class Seq2SeqTransformer(nn.Module):
    """Original post-LN encoder-decoder Transformer: 2 encoder and 2 decoder layers, sinusoidal positions,
    embeddings scaled by sqrt(hidden), a Linear generator. forward(src_ids, tgt_ids) -> logits.

    Exercises: post-LN sites in both stacks (DeepNorm's encoder-decoder constants differ per stack) and
    cross-attention projections reading the encoder output.
    """

    def __init__(self, vocab: int = VOCAB, hidden: int = HIDDEN, heads: int = HEADS, layers: int = 2,
                 ffn: int = 4 * HIDDEN, max_positions: int = MAX_POSITIONS, eps: float = 1e-6):
        super().__init__()
        self.embed_scale = math.sqrt(hidden)
        self.src_embed = nn.Embedding(vocab, hidden)
        self.tgt_embed = nn.Embedding(vocab, hidden)
        self.positions = nn.Embedding.from_pretrained(sinusoidal_positions(max_positions, hidden))  # frozen
        self.encoder = nn.ModuleList(PostLNEncoderLayer(hidden, heads, ffn, eps) for _ in range(layers))
        self.decoder = nn.ModuleList(PostLNDecoderLayer(hidden, heads, ffn, eps) for _ in range(layers))
        self.generator = nn.Linear(hidden, vocab)

    def _embed(self, embed: nn.Embedding, ids: torch.Tensor) -> torch.Tensor:
        return embed(ids) * self.embed_scale + self.positions(torch.arange(ids.shape[1], device=ids.device))

    def forward(self, src_ids: torch.Tensor, tgt_ids: torch.Tensor) -> torch.Tensor:
        memory = self._embed(self.src_embed, src_ids)
        for layer in self.encoder:
            memory = layer(memory)
        x = self._embed(self.tgt_embed, tgt_ids)
        for layer in self.decoder:
            x = layer(x, memory)
        return self.generator(x)


@seeded(110)
def seq2seq() -> nn.Module:
    """Post-LN encoder-decoder Transformer, 10 LayerNorm (eps 1e-6)."""
    return Seq2SeqTransformer()


def seq2seq_inputs() -> tuple:
    return (token_ids(2, 12, vocab=VOCAB, seed=110), token_ids(2, 10, vocab=VOCAB, seed=111))
