"""Exact LN -> RMSNorm past writers that are not Linear / Embedding: a parameter added to the stream (position
embedding, class token joined with cat), a conv patch embedding reached through flatten / transpose, an in-place
add_, a layer scale (lambda * W x), a scalar multiplication, a constant-scale LayerNorm writing the stream, a norm
module whose forward is one functional norm (OLMo), MobileViT's patch unfolding; and refusals that name the op when
no weights-only rewrite exists (grouped conv, a gate, a LayerNorm writer with a varying scale, Swin's patch-merging
cat, the stream returned as an output)."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import normconv
from normconv.errors import NormconvError
from normconv.verify import Inputs, run

D = 32


def _randomize(model, seed=0):
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name.lower() or name.split(".")[-1] in ("cls", "pos", "cls_token", "position_embeddings"):
                p.add_(0.5 * torch.randn(p.shape, generator=g))
    return model


class Block(nn.Module):
    """scale: None | "layer" (lambda * W x, DINOv2 / BEiT layer scale) | "gate" (sigmoid(W' x) * W x: no rewrite)."""

    def __init__(self, inplace=False, scale=None):
        super().__init__()
        self.inplace, self.scale = inplace, scale
        self.ln1, self.ln2 = nn.LayerNorm(D), nn.LayerNorm(D)
        self.qkv, self.proj = nn.Linear(D, 3 * D), nn.Linear(D, D)
        self.fc1, self.fc2 = nn.Linear(D, 64), nn.Linear(64, D)
        self.lambda1, self.lambda2 = nn.Parameter(torch.randn(D)), nn.Parameter(torch.randn(1, 1, D))
        self.gate = nn.Linear(D, D)

    def forward(self, x):
        b, n, _ = x.shape
        q, k, v = self.qkv(self.ln1(x)).reshape(b, n, 3, 4, D // 4).permute(2, 0, 3, 1, 4)
        a = F.scaled_dot_product_attention(q, k, v).transpose(1, 2).reshape(b, n, D)
        a = self.proj(a)
        if self.scale == "layer":
            a = a * self.lambda1
        x = x + a
        h = self.ln2(x)
        g = torch.sigmoid(self.gate(h))
        h = self.fc2(F.gelu(self.fc1(h)))
        if self.scale == "layer":
            h = self.lambda2 * F.dropout(h, 0.1, self.training)  # the scale on the left, through a dropout
        elif self.scale == "gate":
            h = g * h
        return x.add_(h) if self.inplace else x + h


class ViT(nn.Module):
    """Pre-LN ViT: conv patches -> flatten/transpose, class token by cat, learned position embedding (Parameters).
    embed_scale multiplies the patches by a number; emb_norm puts a LayerNorm between the embeddings and the blocks."""

    def __init__(self, groups=1, inplace=False, scale=None, embed_scale=None, emb_norm=False):
        super().__init__()
        self.patch = nn.Conv2d(4, D, 8, 8, groups=groups)
        self.cls = nn.Parameter(torch.randn(1, 1, D))
        self.pos = nn.Parameter(torch.randn(1, 17, D))
        self.embed_scale = embed_scale
        self.register_buffer("temperature", torch.tensor([0.5]))  # a one-element buffer, also a scalar
        self.emb_norm = nn.LayerNorm(D) if emb_norm else None
        self.blocks = nn.Sequential(Block(inplace, scale), Block(inplace, scale))
        self.norm, self.head = nn.LayerNorm(D), nn.Linear(D, 10)

    def forward(self, x):
        x = self.patch(x).flatten(2).transpose(1, 2)
        if self.embed_scale is not None:
            x = x * self.embed_scale / self.temperature
        x = torch.cat([self.cls.expand(x.shape[0], -1, -1), x], dim=1) + self.pos
        if self.emb_norm is not None:
            x = self.emb_norm(x)
        return self.head(self.norm(self.blocks(x))[:, 0])


class InterpolatedPosViT(ViT):
    """The position embedding of a 2x2 grid resized bicubically to the 4x4 patch grid (DINOv2 / Pixio / LW-DETR
    at another resolution), the class token copied per image with repeat (RF-DETR)."""

    def __init__(self):
        super().__init__()
        self.pos = nn.Parameter(torch.randn(1, D, 2, 2))

    def forward(self, x):
        x = self.patch(x)
        x = x + F.interpolate(self.pos, size=x.shape[-2:], mode="bicubic", align_corners=False)
        x = x.flatten(2).transpose(1, 2)
        x = torch.cat([self.cls.repeat(x.shape[0], 1, 1), x], dim=1)
        return self.head(self.norm(self.blocks(x))[:, 0])


class SlicedPosViT(ViT):
    """DINOv2's interpolate_pos_encoding: one position table sliced into its class part and its patch grid, the
    grid resized bicubically, both joined by cat: two ways from one parameter into the stream."""

    def __init__(self):
        super().__init__()
        self.pos = nn.Parameter(torch.randn(1, 1 + 4, D))

    def forward(self, x):
        x = self.patch(x).flatten(2).transpose(1, 2)
        grid = self.pos[:, 1:].reshape(1, 2, 2, D).permute(0, 3, 1, 2)
        grid = F.interpolate(grid, size=(4, 4), mode="bicubic", align_corners=False)
        pos = torch.cat([self.pos[:, :1], grid.permute(0, 2, 3, 1).reshape(1, 16, D)], dim=1)
        x = torch.cat([self.cls.expand(x.shape[0], -1, -1), x], dim=1) + pos
        return self.head(self.norm(self.blocks(x))[:, 0])


def _main(out):
    for key in ("logits", "last_hidden_state"):
        if hasattr(out, key):
            return getattr(out, key)
    return out


def _exact(model, x, x2):
    new, report = normconv.swap(model, x)
    assert not any(isinstance(m, nn.LayerNorm) for m in new.modules())
    assert any(isinstance(m, nn.RMSNorm) for m in new.modules())
    ref, out = run(model, Inputs((x2,))), run(new, Inputs((x2,)))  # a second batch size / length, checked here
    ref, out = _main(ref), _main(out)
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-4)
    assert torch.equal(out.argmax(-1), ref.argmax(-1))
    return new


@pytest.mark.parametrize("inplace", [False, True])
def test_handwritten_vit_swaps_exactly(inplace):
    torch.manual_seed(0)
    model = _randomize(ViT(inplace=inplace)).eval()
    new = _exact(model, torch.randn(2, 4, 32, 32), torch.randn(5, 4, 32, 32))
    # the writers were centered along the hidden axis: conv over output channels, parameters along D
    assert new.patch.weight.double().mean(0).abs().max() < 1e-6 and new.patch.bias.double().mean().abs() < 1e-6
    assert new.pos.double().mean(-1).abs().max() < 1e-6 and new.cls.double().mean(-1).abs().max() < 1e-6
    assert model.pos.double().mean(-1).abs().max() > 1e-3  # the user's model is untouched


def test_a_bicubic_position_embedding_and_a_repeated_class_token_swap_exactly():
    torch.manual_seed(0)
    model = _randomize(InterpolatedPosViT()).eval()
    _exact(model, torch.randn(2, 4, 32, 32), torch.randn(3, 4, 32, 32))


def test_a_position_table_sliced_into_two_ways_into_the_stream_swaps_exactly():
    torch.manual_seed(0)
    model = _randomize(SlicedPosViT()).eval()
    _exact(model, torch.randn(2, 4, 32, 32), torch.randn(3, 4, 32, 32))


class MaskedViT(ViT):
    """ViT-MAE's random masking: half of the patch tokens kept by gather, the index one per token and copied to every
    feature by repeat or expand; or the tokens padded to a block length with zero rows (PEGASUS-X: F.pad); "mixed"
    gathers each feature from another token, which mixes rows (no weights-only rewrite)."""

    def __init__(self, how):
        super().__init__()
        self.how = how

    def forward(self, x):
        x = self.patch(x).flatten(2).transpose(1, 2) + self.pos[:, 1:]
        b, n, d = x.shape
        if self.how == "pad":
            x = F.pad(x, (0, 0, 0, 3))
        elif self.how == "mixed":
            x = torch.gather(x, 1, torch.randint(0, n, (b, n // 2, d), device=x.device))
        else:
            idx = torch.argsort(torch.rand(b, n, device=x.device), dim=1)[:, : n // 2].unsqueeze(-1)
            x = torch.gather(x, 1, idx.repeat(1, 1, d) if self.how == "repeat" else idx.expand(-1, -1, d))
        x = torch.cat([self.cls.expand(b, -1, -1), x], dim=1)
        return self.head(self.norm(self.blocks(x))[:, 0])


@pytest.mark.parametrize("how", ["repeat", "expand", "pad"])
def test_tokens_gathered_or_padded_along_the_sequence_swap_exactly(how):
    torch.manual_seed(0)
    _exact(_randomize(MaskedViT(how)).eval(), torch.randn(2, 4, 32, 32), torch.randn(3, 4, 32, 32))


def test_gather_mixing_rows_per_feature_is_refused_by_name():
    torch.manual_seed(0)
    with pytest.raises(NormconvError, match="stream writer gather is gather"):
        normconv.swap(_randomize(MaskedViT("mixed")).eval(), torch.randn(2, 4, 32, 32))


class MaxPooledStage(nn.Module):
    """Hiera's stage change: the projected stream max-pooled over query positions (max(...).values): a maximum of
    centered rows is not centered, and no weights make it so."""

    def __init__(self):
        super().__init__()
        self.emb, self.proj, self.block = nn.Embedding(50, D), nn.Linear(D, D), Block()

    def forward(self, ids):
        h = self.proj(self.emb(ids))
        b, n, d = h.shape
        return self.block(h.view(b, 2, n // 2, d).max(dim=1).values)


@pytest.mark.parametrize("keyword", [False, True])  # symbolic_trace (getattr .values) / torch.export (getitem 0)
def test_writer_that_is_one_output_of_max_is_named_as_such(keyword):
    ids = torch.randint(0, 50, (2, 8))
    with pytest.raises(NormconvError, match=r"stream writer \w+ is output (0|values) of max \(max\w*\), not a linear"):
        normconv.swap(_randomize(MaxPooledStage()).eval(), Inputs((), {"ids": ids}) if keyword else ids)


def test_grouped_conv_writer_is_refused_by_name():
    torch.manual_seed(0)
    model = ViT(groups=2).eval()
    with pytest.raises(NormconvError, match="patch is a grouped conv"):
        normconv.swap(model, torch.randn(2, 4, 32, 32))


def tiny_hf_vit() -> nn.Module:
    """HF ViTForImageClassification (hidden 32, 2 layers, 32 px, patch 8) with every weight, the position
    embeddings and the class token random: centering / rotating them is visible."""
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    cfg = transformers.ViTConfig(hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64,
                                 image_size=32, patch_size=8, num_labels=10)
    model = _randomize(transformers.ViTForImageClassification(cfg)).eval()
    with torch.no_grad():
        model.vit.embeddings.position_embeddings.normal_()
        model.vit.embeddings.cls_token.normal_()
    return model


def test_hf_vit_swaps_exactly():
    _exact(tiny_hf_vit(), torch.randn(2, 3, 32, 32), torch.randn(3, 3, 32, 32))


# ---------------------------------------------------------------------------------------------------------
# multiplications on the stream path: layer scale folded, scalars passed through, a gate refused


def test_layer_scale_is_folded_into_its_writer():
    torch.manual_seed(0)
    model = _randomize(ViT(scale="layer")).eval()
    new = _exact(model, torch.randn(2, 4, 32, 32), torch.randn(5, 4, 32, 32))
    blk, old = new.blocks[0], model.blocks[0]
    # lambda * (W x + b) = (diag(lambda) W) x + lambda b, centered; lambda becomes ones (same structure, loadable)
    assert torch.equal(blk.lambda1, torch.ones(D)) and torch.equal(blk.lambda2, torch.ones(1, 1, D))
    want = old.lambda1.detach().double()[:, None] * old.proj.weight.detach().double()
    torch.testing.assert_close(blk.proj.weight.double(), want - want.mean(0), atol=1e-6, rtol=1e-5)
    lost = set(model.state_dict()) - set(new.state_dict())
    assert lost and all(k.endswith("bias") and ("ln" in k or "norm" in k) for k in lost)  # only the norms' biases
    assert not torch.equal(model.blocks[0].lambda1, torch.ones(D))  # the user's model is untouched


def test_scalar_multiplications_pass_through():
    torch.manual_seed(0)
    model = _randomize(ViT(embed_scale=D ** 0.5)).eval()
    _exact(model, torch.randn(2, 4, 32, 32), torch.randn(5, 4, 32, 32))


def test_gate_on_the_stream_is_refused_by_name():
    torch.manual_seed(0)
    model = ViT(scale="gate").eval()
    with pytest.raises(NormconvError, match=r"multiplies .* computed from the input and varying along the hidden "
                                            r"axis \(a gate\)"):
        normconv.swap(model, torch.randn(2, 4, 32, 32))


# ---------------------------------------------------------------------------------------------------------
# a LayerNorm writing the stream: exact when its scale is constant, refused in words otherwise


def test_layernorm_writer_with_constant_scale_swaps_exactly():
    torch.manual_seed(0)
    model = _randomize(ViT(emb_norm=True)).eval()
    with torch.no_grad():
        model.emb_norm.weight.fill_(1.7)
        model.emb_norm.bias.zero_()
    _exact(model, torch.randn(2, 4, 32, 32), torch.randn(5, 4, 32, 32))


def test_layernorm_writer_with_varying_scale_is_refused_in_words():
    torch.manual_seed(0)
    model = _randomize(ViT(emb_norm=True)).eval()
    x = torch.randn(2, 4, 32, 32)
    # emb_norm itself reads a centered stream: exact, its bias kept as an add (no linear reads it); the blocks' stream
    # it writes cannot be centered
    _, report = normconv.swap(model, x, partial=True)
    assert [s.target for s in report.sites if s.applied] == ["emb_norm"]
    assert report.sites[0].code == "exact-bias-kept" and report.extra["exact"]
    with torch.no_grad():
        model.emb_norm.bias.zero_()
    with pytest.raises(NormconvError, match=r"emb_norm is a LayerNorm whose scale g varies .*: mean\(g \* n\) "
                                            r"depends on the input unless g is constant, so no weights-only rewrite"):
        normconv.swap(model, x)


class RawStream(nn.Module):
    """Returns the residual stream itself next to the normed output (a base model's hidden states)."""

    def __init__(self):
        super().__init__()
        self.emb, self.block, self.norm = nn.Embedding(50, D), Block(), nn.LayerNorm(D)

    def forward(self, ids):
        x = self.block(self.emb(ids))
        return x, self.norm(x.mean(1))  # the pooled norm reads the stream through a mean over tokens


def test_stream_returned_as_output_is_refused_by_name():
    # named in the model's terms (a residual add in block), never a graph node's name (add_1)
    with pytest.raises(NormconvError, match="the stream at a residual add in block is also read by the model's output, "
                                            "which is not a LayerNorm"):
        normconv.swap(RawStream().eval(), torch.randint(0, 50, (2, 8)))


class PoolingHead(nn.Module):
    """SigLIP's attention-pooling head: a pre-LN block whose stream starts at the pooling projection, with no norm
    after its residual add (the pooled output is the raw stream)."""

    def __init__(self):
        super().__init__()
        self.emb, self.pool, self.ln = nn.Embedding(50, D), nn.Linear(D, D), nn.LayerNorm(D)
        self.mlp = nn.Sequential(nn.Linear(D, 2 * D), nn.GELU(), nn.Linear(2 * D, D))

    def forward(self, ids):
        h = self.pool(self.emb(ids).mean(1))
        return h + self.mlp(self.ln(h))


def test_writer_carried_on_to_the_output_by_a_residual_add_is_named():
    with pytest.raises(NormconvError, match=r"stream writer pool is also read by a residual add in the model's forward, "
                                            r"which carries it on to the model's output, not a LayerNorm"):
        normconv.swap(_randomize(PoolingHead()).eval(), torch.randint(0, 50, (2, 8)))


class UnreadProbe(nn.Module):
    """A debugging probe left in the forward: a module reads the stream and nothing reads its result."""

    def __init__(self):
        super().__init__()
        self.emb, self.block, self.norm = nn.Embedding(50, D), Block(), nn.LayerNorm(D)
        self.probe, self.head = nn.Linear(D, 3), nn.Linear(D, 5)

    def forward(self, ids):
        x = self.block(self.emb(ids))
        self.probe(x)  # result unused: centering the stream changes nothing anyone reads
        return self.head(self.norm(x))


def test_a_module_whose_result_nothing_reads_is_no_reader_of_the_stream():
    model = _randomize(UnreadProbe().eval())
    ids = torch.randint(0, 50, (2, 8))
    new, report = normconv.swap(model, ids)
    assert report.passed and sum(s.applied for s in report.sites) == 3
    with torch.no_grad():
        torch.testing.assert_close(new(ids), model(ids), atol=1e-5, rtol=1e-5)


class Unfold(nn.Module):
    """MobileViT's patch unfolding: conv -> bilinear resize -> (B, C, H, W) -> (B*C*h, p, w, p) -> ... ->
    (B*p*p, N, C): the hidden (channel) axis is merged with others on the way and split out again."""

    def __init__(self):
        super().__init__()
        self.conv, self.block, self.norm, self.head = nn.Conv2d(4, D, 3, padding=1), Block(), nn.LayerNorm(D), \
            nn.Linear(D, 10)

    def forward(self, x):
        x = F.interpolate(self.conv(x), size=(8, 8), mode="bilinear", align_corners=False)
        b, c, h, w = x.shape
        x = x.reshape(b * c * 4, 2, 4, 2).transpose(1, 2).reshape(b, c, 16, 4).transpose(1, 3).reshape(b * 4, 16, c)
        return self.head(self.norm(self.block(x)).mean(1))  # the final norm's bias folds through the mean


def test_patch_unfolding_reshapes_are_followed():
    torch.manual_seed(0)
    model = _randomize(Unfold()).eval()
    new = _exact(model, torch.randn(2, 4, 6, 6), torch.randn(3, 4, 10, 10))
    assert new.conv.weight.double().mean(0).abs().max() < 1e-6


class PatchMerge(nn.Module):
    """Swin's patch merging: four strided C-wide slices of the stream joined into one 4C row, then LayerNorm(4C)."""

    def __init__(self):
        super().__init__()
        self.emb, self.block = nn.Linear(4, D), Block()
        self.norm, self.reduce = nn.LayerNorm(4 * D), nn.Linear(4 * D, 10)

    def forward(self, x):  # x: (B, 16, 4) tokens of a 4 x 4 grid
        x = self.block(self.emb(x)).view(x.shape[0], 4, 4, D)
        x = torch.cat([x[:, 0::2, 0::2], x[:, 1::2, 0::2], x[:, 0::2, 1::2], x[:, 1::2, 1::2]], -1)
        return self.reduce(self.norm(x.view(x.shape[0], -1, 4 * D)))


def test_patch_merging_cat_along_the_hidden_axis_is_refused_by_name():
    with pytest.raises(NormconvError, match=r"the stream is joined along its hidden axis by cat \(patch merging"):
        normconv.swap(PatchMerge().eval(), torch.randn(2, 16, 4))


# ---------------------------------------------------------------------------------------------------------
# Hugging Face models the coverage sweep refused


def _hf(builder, randomize=()):
    pytest.importorskip("transformers")
    from tests import hf_tiny

    model, inputs = getattr(hf_tiny, builder)()
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if any(k in name for k in randomize):  # norms and scales away from their 1 / 0 initialization
                p.copy_(torch.randn(p.shape, generator=g) * 0.5 + (1.0 if p.dim() and "bias" not in name else 0.0))
    return model, inputs


def _hf_exact(model, inputs, **second):
    new, report = normconv.swap(model, inputs)
    assert not any(isinstance(m, nn.LayerNorm) for m in new.modules())
    assert any(isinstance(m, nn.RMSNorm) for m in new.modules())
    x2 = {k: (v[:, :12] if k in second.get("cut", ()) else v) for k, v in inputs.kwargs.items()}
    args2 = tuple(torch.cat([a, a[:1]]) for a in inputs.args)  # a second batch size
    ref, out = run(model, Inputs(args2, x2)), run(new, Inputs(args2, x2))
    torch.testing.assert_close(_main(out), _main(ref), atol=1e-5, rtol=1e-4)
    return new, report


def test_hf_dinov2_layer_scale_swaps_exactly():
    model, inputs = _hf("tiny_dinov2", ("lambda1", "norm1", "norm2"))
    new, _ = _hf_exact(model, inputs)
    assert torch.equal(new.encoder.layer[0].layer_scale1.lambda1, torch.ones(32))


def test_hf_falcon_inplace_add_and_matmul_linears_swap_exactly():
    model, inputs = _hf("tiny_falcon", ("input_layernorm",))
    new, report = _hf_exact(model, inputs, cut=("input_ids",))
    # the LayerNorm biases went into the FalconLinears (x @ W.T) after them, as new bias parameters
    assert new.h[0].self_attention.query_key_value.bias is not None


def test_hf_olmo_inline_layernorm_module_is_swapped():
    model, inputs = _hf("tiny_olmo")
    new, report = _hf_exact(model, inputs, cut=("input_ids",))
    assert not any(type(m).__name__ == "OlmoLayerNorm" for m in new.modules())


def test_hf_mbart_scaled_embedding_swaps_exactly():
    model, inputs = _hf("tiny_mbart", ("layers.0.self_attn_layer_norm", "layers.0.final_layer_norm"))
    _hf_exact(model, inputs, cut=("input_ids",))


def test_hf_bloom_embedding_layernorm():
    # at initialization (scale ones, bias zeros) the embedding LayerNorm is a zero-mean writer: exact
    model, inputs = _hf("tiny_bloom")
    _hf_exact(model, inputs, cut=("input_ids",))
    # trained, its scale varies: refused in words (h.0.input_layernorm is the first site reading the stream)
    model, inputs = _hf("tiny_bloom", ("word_embeddings_layernorm.weight",))
    with pytest.raises(NormconvError, match="h.0.input_layernorm: stream writer word_embeddings_layernorm is a "
                                            "LayerNorm whose scale g varies .*unless g is constant"):
        normconv.swap(model, inputs)
    # a constant scale and a bias: the bias is centered as the stream's writer and stays an add after the RMSNorm
    model, inputs = _hf("tiny_bloom", ("word_embeddings_layernorm.bias",))
    _hf_exact(model, inputs, cut=("input_ids",))



class DataFormatLayerNorm(nn.LayerNorm):
    """ConvNeXt / DINOv3-ConvNeXt LayerNorm: an nn.LayerNorm subclass whose forward, for channels_first, permutes
    NCHW to NHWC and back around the norm (replacing that module whole would drop the permutes)."""

    def __init__(self, d, data_format):
        super().__init__(d)
        self.data_format = data_format

    def forward(self, x):
        if self.data_format == "channels_first":
            return super().forward(x.permute(0, 2, 3, 1)).permute(0, 3, 1, 2)
        return super().forward(x)


def test_norm_subclass_computing_only_the_norm_is_swapped():
    torch.manual_seed(0)
    model = _randomize(nn.Sequential(nn.Linear(8, 8), DataFormatLayerNorm(8, "channels_last"))).eval()
    new, report = normconv.swap(model, torch.randn(2, 3, 8))
    assert report.passed and isinstance(new[1], nn.RMSNorm)
    x2 = torch.randn(5, 7, 8)
    with torch.no_grad():
        assert torch.allclose(new(x2), model(x2), atol=1e-5)


def test_norm_subclass_normalizing_channels_first_is_swapped_whole():
    """Its forward permutes the channels last and back around the norm: the module is replaced by
    MovedDimNorm(RMSNorm), which makes the same permutes (tests/test_swap_channels_first.py: what it refuses)."""
    from normconv.nn.modules import MovedDimNorm

    torch.manual_seed(0)
    model = _randomize(nn.Sequential(nn.Conv2d(8, 8, 1), DataFormatLayerNorm(8, "channels_first"),
                                     nn.Conv2d(8, 4, 1))).eval()
    x = torch.randn(2, 8, 6, 6)
    new, report = normconv.swap(model, x)
    assert report.passed and isinstance(new[1], MovedDimNorm) and isinstance(model[1], DataFormatLayerNorm)
    x2 = torch.randn(3, 8, 5, 7)
    with torch.no_grad():
        assert torch.allclose(new(x2), model(x2), atol=1e-5)


class CastBackLayerNorm(nn.LayerNorm):
    """ESM-C: an nn.LayerNorm subclass whose forward casts the result back to the input's dtype."""

    def forward(self, x):
        return super().forward(x).to(x.dtype)


def test_norm_subclass_casting_back_to_its_input_dtype_is_swapped():
    torch.manual_seed(0)
    model = _randomize(nn.Sequential(nn.Linear(8, 8), CastBackLayerNorm(8), nn.Linear(8, 4))).eval()
    new, report = normconv.swap(model, torch.randn(2, 3, 8))
    assert report.passed and isinstance(new[1], nn.RMSNorm)
    x2 = torch.randn(5, 7, 8)
    with torch.no_grad():
        assert torch.allclose(new(x2), model(x2), atol=1e-5)


# ---------------------------------------------------------------------------------------------------------
# a per-token factor on the stream: exact when it comes from the inputs (a padding mask), refused when weights make it


class MaskedTokens(nn.Module):
    """Token embeddings zeroed at padding (``embeds * mask[..., None]``, a (B, S, 1) factor), then pre-LN blocks;
    ``gate``: the factor is sigmoid(w . e) instead, computed from the embeddings by a weight."""

    def __init__(self, gate=False, vocab=50):
        super().__init__()
        self.gate = nn.Linear(D, 1) if gate else None
        self.embed, self.ln, self.fc, self.ln_f = nn.Embedding(vocab, D), nn.LayerNorm(D), nn.Linear(D, D), \
            nn.LayerNorm(D)

    def forward(self, input_ids, attention_mask):
        e = self.embed(input_ids)
        h = e * (torch.sigmoid(self.gate(e)) if self.gate is not None else attention_mask[..., None].to(e.dtype))
        h = h + self.fc(self.ln(h))
        return self.ln_f(h)


def _tokens(batch, seq, seed):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, 50, (batch, seq), generator=g)
    mask = torch.ones_like(ids)
    mask[0, seq // 2:] = 0
    return {"input_ids": ids, "attention_mask": mask}


def test_a_padding_mask_on_the_stream_passes_through():
    torch.manual_seed(0)
    model = _randomize(MaskedTokens()).eval()
    new, report = normconv.swap(model, _tokens(2, 6, 0))
    assert report.passed and [s.target for s in report.sites if s.applied] == ["ln", "ln_f"]
    assert new.embed.weight.double().mean(-1).abs().max() < 1e-6  # the writer behind the mask was centered
    x2 = _tokens(3, 9, 1)
    torch.testing.assert_close(run(new, Inputs((), x2)), run(model, Inputs((), x2)), atol=1e-5, rtol=1e-4)


def test_a_per_token_factor_made_by_weights_is_refused_by_name():
    torch.manual_seed(0)
    model = MaskedTokens(gate=True).eval()
    with pytest.raises(NormconvError, match=r"multiplies embed by sigmoid, a per-token factor that parameters compute"):
        normconv.swap(model, _tokens(2, 6, 0))


# ---------------------------------------------------------------------------------------------------------
# nn.MultiheadAttention kept whole by symbolic_trace (torchvision's ViT): its out_proj writes the stream, and its
# packed in_proj reads the norm's output as one linear


class TVEncoderBlock(nn.Module):
    """torchvision.models.vision_transformer.EncoderBlock."""

    def __init__(self, heads=4):
        super().__init__()
        self.ln_1, self.ln_2 = nn.LayerNorm(D), nn.LayerNorm(D)
        self.self_attention = nn.MultiheadAttention(D, heads, batch_first=True)
        self.mlp = nn.Sequential(nn.Linear(D, 64), nn.GELU(), nn.Linear(64, D))

    def forward(self, input):
        x = self.ln_1(input)
        x, _ = self.self_attention(x, x, x, need_weights=False)
        x = x + input
        return x + self.mlp(self.ln_2(x))


class TVViT(nn.Module):
    """torchvision.models.VisionTransformer's layout: conv patches, class token joined by cat, position embedding,
    encoder blocks, final LayerNorm, head on the class token."""

    def __init__(self, layers=2):
        super().__init__()
        self.conv_proj = nn.Conv2d(3, D, 8, 8)
        self.class_token = nn.Parameter(torch.randn(1, 1, D))
        self.pos_embedding = nn.Parameter(torch.randn(1, 17, D))
        self.layers = nn.Sequential(*(TVEncoderBlock() for _ in range(layers)))
        self.ln, self.head = nn.LayerNorm(D), nn.Linear(D, 10)

    def forward(self, x):
        x = self.conv_proj(x).reshape(x.shape[0], D, -1).permute(0, 2, 1)
        x = torch.cat([self.class_token.expand(x.shape[0], -1, -1), x], dim=1) + self.pos_embedding
        return self.head(self.ln(self.layers(x))[:, 0])


def test_multihead_attention_module_writes_and_reads_the_stream_exactly():
    torch.manual_seed(0)
    model = _randomize(TVViT()).eval()
    new, report = normconv.swap(model, torch.randn(2, 3, 32, 32))
    assert report.passed and sum(s.applied for s in report.sites) == 5
    assert normconv.inspect(model, torch.randn(2, 3, 32, 32)).extra["capture"] == "symbolic_trace"  # MHA a leaf
    for i in range(2):
        old, blk = model.layers[i].self_attention, new.layers[i].self_attention
        assert blk.out_proj.weight.double().mean(0).abs().max() < 1e-6  # the writer was centered
        b = model.layers[i].ln_1.bias.detach().double()  # ln_1's bias went into the packed in_proj
        want = old.in_proj_bias.detach().double() + old.in_proj_weight.detach().double() @ b
        torch.testing.assert_close(blk.in_proj_bias.double(), want, atol=1e-6, rtol=1e-6)
    x2 = torch.randn(5, 3, 32, 32)
    torch.testing.assert_close(run(new, Inputs((x2,))), run(model, Inputs((x2,))), atol=1e-5, rtol=1e-4)


class BOSAtMaskedTokens(nn.Module):
    """Pocket-TTS: a BOS embedding chosen at masked positions with torch.where, the token embeddings elsewhere."""

    def __init__(self, how="vector"):
        super().__init__()
        self.how = how
        self.emb, self.bos = nn.Embedding(50, D), nn.Parameter(torch.randn(D))
        self.blocks = nn.Sequential(Block(), Block())
        self.norm, self.head = nn.LayerNorm(D), nn.Linear(D, 5)

    def forward(self, ids):
        x = self.emb(ids)
        mask = (ids == 0).unsqueeze(-1)
        if self.how == "zero":
            x = torch.where(mask, 0.0, x)
        elif self.how == "vector":  # the (D,) vector broadcast from the right (Pocket-TTS)
            x = torch.where(mask, self.bos, x)
        else:  # x used as a shape template: no read of its values
            x = torch.where(mask, self.bos.expand_as(x), x)
        return self.head(self.norm(self.blocks(x)))


@pytest.mark.parametrize("how", ["vector", "expand_as", "zero"])
def test_a_per_token_choice_of_stream_writers_swaps_exactly(how):
    torch.manual_seed(0)
    model = _randomize(BOSAtMaskedTokens(how)).eval()
    ids = torch.randint(0, 50, (2, 8))
    ids[:, 0] = 0
    new, report = normconv.swap(model, ids)
    assert report.passed
    ids2 = torch.randint(0, 50, (3, 7))
    ids2[:, :2] = 0
    with torch.no_grad():
        torch.testing.assert_close(new(ids2), model(ids2), atol=1e-5, rtol=1e-4)


class BufferPositions(nn.Module):
    """A position table kept in a buffer, added to the token embeddings (persistent or not)."""

    def __init__(self, persistent, how="slice"):
        super().__init__()
        self.how = how  # index_select: M2M100 / Speech2Text; index: CTRL's table[positions] + 0
        self.emb = nn.Embedding(50, D)
        self.register_buffer("pos", torch.randn(1, 16, D), persistent=persistent)
        self.blocks = nn.Sequential(Block(), Block())
        self.norm, self.head = nn.LayerNorm(D), nn.Linear(D, 5)

    def forward(self, ids):
        if self.how == "index_select":
            pos = self.pos[0].index_select(0, torch.arange(ids.shape[1])).unsqueeze(0)
        elif self.how == "index":
            pos = self.pos[0][torch.arange(ids.shape[1]).unsqueeze(0)] + 0
        else:
            pos = self.pos[:, : ids.shape[1]]
        return self.head(self.norm(self.blocks(self.emb(ids) + pos)))


@pytest.mark.parametrize("how", ["slice", "index_select", "index"])
def test_a_saved_buffer_writer_is_centered_and_an_unsaved_one_refused_in_words(how):
    torch.manual_seed(0)
    ids = torch.randint(0, 50, (2, 8))
    model = _randomize(BufferPositions(True, how)).eval()
    new, report = normconv.swap(model, ids)
    assert report.passed and "pos" in new.state_dict()
    ids2 = torch.randint(0, 50, (3, 11))
    with torch.no_grad():
        torch.testing.assert_close(new(ids2), model(ids2), atol=1e-5, rtol=1e-4)
    # persistent=False: a state_dict save drops the buffer and the model rebuilds it uncentered on load
    with pytest.raises(NormconvError, match=r"stream writer .* is the buffer pos, which the model does not save "
                                            r"\(persistent=False"):
        normconv.swap(_randomize(BufferPositions(False, how)).eval(), ids)
