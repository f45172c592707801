"""The inputs normconv makes for a Hugging Face folder it is given without inputs: a ViT at its own image size, a
vision-language model with one image token per image feature (LLaVA; Qwen2-VL's flattened patches, grid and
token types), the language model alone where image tokens cannot be counted, and text that holds no special id."""

from __future__ import annotations

import json
import warnings

import pytest
import torch

from normconv.io.hf_inputs import hf_example_inputs

from hf_tiny import tiny_llava

pytest.importorskip("transformers")


def _tiny(cls, cfg):
    warnings.filterwarnings("ignore")
    torch.manual_seed(0)
    return cls(cfg).eval()


def _vit224():
    from transformers import ViTConfig, ViTModel

    return _tiny(ViTModel, ViTConfig(hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64,
                                     image_size=224, patch_size=32))


def _llava():
    return tiny_llava()[0]


def _qwen2_vl():
    from transformers import Qwen2VLConfig, Qwen2VLModel

    text = dict(vocab_size=100, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=2, rope_parameters={"rope_type": "default", "rope_theta": 10000.0,
                                                         "mrope_section": [1, 1, 2]})
    vision = dict(depth=2, embed_dim=32, hidden_size=32, num_heads=4, patch_size=4, spatial_merge_size=2,
                  temporal_patch_size=2, in_channels=3)
    cfg = Qwen2VLConfig(text_config=text, vision_config=vision, image_token_id=5, video_token_id=6,
                        vision_start_token_id=7)
    return _tiny(Qwen2VLModel, cfg)


def _mistral3():
    from transformers import Mistral3Config, Mistral3Model

    vision = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=4, image_size=32,
                  patch_size=8, head_dim=8)
    text = dict(vocab_size=100, hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=4,
                num_key_value_heads=2, head_dim=8)
    return _tiny(Mistral3Model, Mistral3Config(vision_config=vision, text_config=text, image_token_index=5,
                                               spatial_merge_size=2))


def test_vision_model_gets_pixels_at_its_own_image_size():
    model = _vit224()
    inputs = hf_example_inputs(model)
    assert inputs.kwargs["pixel_values"].shape == (2, 3, 224, 224)  # a ViT's position embeddings fit one size
    model(**inputs.kwargs)  # raised "Input image size (32*32) doesn't match model (224*224)" before


@pytest.mark.parametrize("build", [_llava, _qwen2_vl, _mistral3], ids=["llava", "qwen2_vl", "mistral3"])
def test_vlm_gets_one_image_token_per_feature(build):
    model = build()
    inputs = hf_example_inputs(model)
    kw = inputs.kwargs
    image_token = model.config.image_token_id if hasattr(model.config, "image_token_id") else 5
    n_image = int((kw["input_ids"] == image_token).sum())
    with torch.no_grad():
        features = model.get_image_features(**{k: kw[k] for k in ("pixel_values", "image_grid_thw", "image_sizes")
                                               if k in kw})
    pooled = features.pooler_output
    pooled = [pooled] if isinstance(pooled, torch.Tensor) else pooled
    assert n_image == sum(t.numel() for t in pooled) // model.config.text_config.hidden_size > 0
    if build is _mistral3:  # a Pixtral tower needs each image's size: given, as the whole image
        assert kw["image_sizes"].tolist() == [[32, 32], [32, 32]]
    if "image_grid_thw" in kw:  # M-RoPE: the token types mark exactly the image tokens
        assert torch.equal(kw["mm_token_type_ids"].bool(), kw["input_ids"] == image_token)
    with torch.no_grad():
        out = model(**kw)  # the model takes them: features and tokens match
    assert out.last_hidden_state.shape[:2] == kw["input_ids"].shape


def test_vlm_without_countable_features_runs_its_language_model(monkeypatch):
    model = _llava()

    def broken(*a, **k):
        raise RuntimeError("no vision tower here")

    monkeypatch.setattr(model, "get_image_features", broken)
    kw = hf_example_inputs(model).kwargs
    assert set(kw) == {"input_ids"}  # no pixels without their tokens: the model would reject them
    assert not (kw["input_ids"] == 5).any()


def test_text_holds_no_special_id():
    from transformers import LlamaConfig, LlamaModel

    cfg = LlamaConfig(vocab_size=12, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                      num_attention_heads=2, bos_token_id=1, eos_token_id=2, pad_token_id=3)
    ids = hf_example_inputs(_tiny(LlamaModel, cfg), batch=8, seq=64).kwargs["input_ids"]
    assert not torch.isin(ids, torch.tensor([1, 2, 3])).any() and ids.max() < 12


@pytest.mark.parametrize("build,parts", [(_vit224, ("layers.0.", "layers.1.")), (_llava, ("vision_tower", "language_model"))],
                         ids=["vit224", "llava"])
def test_inspect_runs_on_a_saved_folder_without_inputs(tmp_path, cli, build, parts):
    build().save_pretrained(tmp_path / "m")
    code, out, err = cli("inspect", str(tmp_path / "m"), "--json")
    assert code == 0, err
    names = [s["target"] for s in json.loads(out)["sites"]]
    assert all(any(p in n for n in names) for p in parts), names  # each part's norms were run and found


def test_dual_encoder_gets_pixels_and_text():
    from transformers import CLIPConfig, CLIPModel

    cfg = CLIPConfig(text_config=dict(vocab_size=100, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                      num_attention_heads=4, max_position_embeddings=32),
                     vision_config=dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                        num_attention_heads=4, image_size=32, patch_size=8), projection_dim=16)
    model = _tiny(CLIPModel, cfg)
    kw = hf_example_inputs(model).kwargs
    assert {"pixel_values", "input_ids"} <= set(kw)  # no image token: the two towers each get theirs
    with torch.no_grad():
        assert model(**kw).logits_per_image.shape == (2, 2)


def _whisper():
    from transformers import WhisperConfig, WhisperModel

    return _tiny(WhisperModel, WhisperConfig(vocab_size=100, d_model=32, encoder_layers=1, decoder_layers=1,
                                             encoder_attention_heads=4, decoder_attention_heads=4,
                                             encoder_ffn_dim=64, decoder_ffn_dim=64, num_mel_bins=16,
                                             max_source_positions=8, max_target_positions=16,
                                             decoder_start_token_id=1, pad_token_id=0, eos_token_id=2,
                                             bos_token_id=1))


def _wav2vec2():
    from transformers import Wav2Vec2Config, Wav2Vec2Model

    return _tiny(Wav2Vec2Model, Wav2Vec2Config(hidden_size=32, num_hidden_layers=1, num_attention_heads=4,
                                               intermediate_size=64, conv_dim=(16, 16), conv_stride=(5, 4),
                                               conv_kernel=(10, 8), num_conv_pos_embeddings=16,
                                               num_conv_pos_embedding_groups=4))


def test_speech_models_get_audio():
    whisper = hf_example_inputs(_whisper()).kwargs
    # Whisper's encoder takes exactly its window: mel bins x 2 * max_source_positions, then decoder ids
    assert whisper["input_features"].shape == (2, 16, 16) and whisper["decoder_input_ids"].shape == (2, 8)
    assert hf_example_inputs(_wav2vec2()).kwargs["input_values"].shape == (2, 16000)  # one second at 16 kHz


@pytest.mark.parametrize("build", [_whisper, _wav2vec2], ids=["whisper", "wav2vec2"])
def test_inspect_runs_on_a_saved_speech_folder(tmp_path, cli, build):
    model = build()
    model.save_pretrained(tmp_path / "m")
    code, out, err = cli("inspect", str(tmp_path / "m"), "--json")
    assert code == 0, err  # was "no example inputs: pass --input-shape"
    n_norms = sum(isinstance(m, (torch.nn.LayerNorm, torch.nn.GroupNorm)) for m in model.modules())
    assert len(json.loads(out)["sites"]) == n_norms


def _speecht5(cls_name):
    import transformers

    cfg = transformers.SpeechT5Config(
        vocab_size=99, hidden_size=32, encoder_layers=1, decoder_layers=1, encoder_attention_heads=4,
        decoder_attention_heads=4, encoder_ffn_dim=64, decoder_ffn_dim=64, conv_dim=(16, 16), conv_stride=(5, 2),
        conv_kernel=(10, 3), num_conv_pos_embeddings=16, num_conv_pos_embedding_groups=4,
        speech_decoder_prenet_units=32, num_mel_bins=8, speech_decoder_postnet_units=32,
        speech_decoder_postnet_layers=2, speaker_embedding_dim=16, mask_time_prob=0.0, max_text_positions=128,
        max_speech_positions=400)
    return _tiny(getattr(transformers, cls_name), cfg)


@pytest.mark.parametrize("cls_name", ["SpeechT5ForTextToSpeech", "SpeechT5ForSpeechToSpeech"])
def test_a_spectrogram_decoder_gets_frames(tmp_path, cli, cls_name):
    # SpeechT5's speech decoder takes mel frames (decoder_input_values); none were made, and every command on its
    # folder was refused: "the model rejected its example inputs ... must be Tensor, not NoneType"
    model = _speecht5(cls_name)
    frames = hf_example_inputs(model).kwargs["decoder_input_values"]
    assert frames.shape == (2, 8, 8)  # (batch, seq // 2, num_mel_bins)
    model.save_pretrained(tmp_path / "m")
    code, out, err = cli("inspect", str(tmp_path / "m"), "--json")
    assert code == 0, err
    assert any(s["kind"] == "batchnorm" for s in json.loads(out)["sites"])  # the decoder's postnet was run


def test_video_model_gets_a_clip(tmp_path, cli):
    from transformers import VideoMAEConfig, VideoMAEModel

    model = _tiny(VideoMAEModel, VideoMAEConfig(hidden_size=32, num_hidden_layers=1, num_attention_heads=4,
                                                intermediate_size=64, image_size=32, patch_size=8, num_frames=4,
                                                tubelet_size=2))
    assert hf_example_inputs(model).kwargs["pixel_values"].shape == (2, 4, 3, 32, 32)  # (B, T, C, H, W)
    model.save_pretrained(tmp_path / "m")
    code, out, err = cli("inspect", str(tmp_path / "m"), "--json")
    assert code == 0, err
    assert len(json.loads(out)["sites"]) == sum(isinstance(m, torch.nn.LayerNorm) for m in model.modules())


def test_an_image_model_whose_config_names_frames_gets_images(tmp_path, cli):
    """Perceiver's config has num_frames (for its multimodal variant) and its image classifier takes images: the
    clip made from the config is rejected, so the first frame of each is given instead (inspect refused it);
    VideoMAE above keeps its clip."""
    from transformers import PerceiverConfig, PerceiverForImageClassificationLearned

    model = _tiny(PerceiverForImageClassificationLearned, PerceiverConfig(
        d_model=32, d_latents=32, num_latents=8, num_blocks=1, num_self_attends_per_block=1, num_self_attention_heads=2,
        num_cross_attention_heads=2, image_size=16, num_labels=3))
    assert hf_example_inputs(model).kwargs["pixel_values"].dim() == 5  # what the config says
    model.save_pretrained(tmp_path / "m")
    code, out, err = cli("inspect", str(tmp_path / "m"), "--json")
    assert code == 0, err
    assert "pixel_values=(2, 3, 16, 16)" in json.loads(out)["extra"]["inputs"]


@pytest.mark.parametrize("cls", ["GPT2ForSequenceClassification", "LlamaForSequenceClassification"])
def test_a_model_that_takes_one_sample_gets_batch_1(tmp_path, cli, cls):
    """A decoder classifier whose config defines no pad token refuses any batch above 1 ("Cannot handle batch sizes
    > 1 if no padding token is defined"): every command refused the folder (exit 2); it now gets batch 1, and its
    second shape is batch 1 and one token shorter."""
    import transformers

    config = {"GPT2ForSequenceClassification": transformers.GPT2Config(n_embd=32, n_layer=2, n_head=4, vocab_size=100,
                                                                        num_labels=3),
              "LlamaForSequenceClassification": transformers.LlamaConfig(
                  hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, vocab_size=100, num_labels=3)}[cls]
    model = _tiny(getattr(transformers, cls), config)
    assert model.config.pad_token_id is None
    model.save_pretrained(tmp_path / "m")
    code, out, err = cli("fold", str(tmp_path / "m"), "-o", str(tmp_path / "out.pt"), "--json")
    assert code == 0, err
    labels = [v["label"] for v in json.loads(out)["validation"]]
    assert any("second shape (input_ids=(1, 15)" in label for label in labels), labels
    with torch.no_grad():  # the written model, on a sample neither shape used
        ids = torch.randint(0, 100, (1, 11))
        torch.testing.assert_close(torch.load(tmp_path / "out.pt", weights_only=False)(input_ids=ids).logits,
                                   model(input_ids=ids).logits)


def _forecaster(name: str):
    import transformers

    small = dict(d_model=16, encoder_layers=1, decoder_layers=1, encoder_attention_heads=2, decoder_attention_heads=2,
                 encoder_ffn_dim=32, decoder_ffn_dim=32, prediction_length=4, context_length=8, lags_sequence=[1, 2, 3],
                 num_time_features=2)
    if name == "patchtst":  # BatchNorm in every encoder layer (its default norm_type)
        cfg = transformers.PatchTSTConfig(num_input_channels=3, context_length=32, patch_length=8, patch_stride=8,
                                          d_model=16, num_attention_heads=2, num_hidden_layers=2, ffn_dim=32,
                                          prediction_length=8)
        return _tiny(transformers.PatchTSTForPrediction, cfg)
    if name == "patchtsmixer":
        cfg = transformers.PatchTSMixerConfig(num_input_channels=3, context_length=32, patch_length=8, patch_stride=8,
                                              d_model=16, num_layers=2, prediction_length=8, norm_mlp="BatchNorm")
        return _tiny(transformers.PatchTSMixerForPrediction, cfg)
    if name == "timesfm":  # a univariate series, no channel axis
        return _tiny(transformers.TimesFmModelForPrediction, transformers.TimesFmConfig(
            hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2, head_dim=8,
            context_length=64, horizon_length=8, patch_length=32))
    if name == "informer":
        return _tiny(transformers.InformerForPrediction, transformers.InformerConfig(**small))
    return _tiny(transformers.TimeSeriesTransformerForPrediction, transformers.TimeSeriesTransformerConfig(
        **small, input_size=3, num_static_real_features=2, num_static_categorical_features=1, cardinality=[5],
        embedding_dimension=[2]))


@pytest.mark.parametrize("name", ["patchtst", "patchtsmixer", "timesfm", "informer", "time_series_transformer"])
def test_forecasters_get_a_history(tmp_path, cli, name):
    """A forecaster takes ``past_values`` of its config's context length (and, with lags, time features, an observed
    mask and static features): every command refused its folder ("no example inputs", exit 2)."""
    model = _forecaster(name)
    inputs = hf_example_inputs(model)
    assert inputs is not None and inputs.kwargs["past_values"].shape[:2] == {
        "patchtst": (2, 32), "patchtsmixer": (2, 32), "timesfm": (2, 64)}.get(name, (2, 11))  # context (+ largest lag)
    with torch.no_grad():
        model(**inputs.kwargs)
    for m in model.modules():  # statistics away from the identity, as training leaves them
        if isinstance(m, torch.nn.BatchNorm1d):
            m.running_mean.uniform_(-1, 1), m.running_var.uniform_(0.5, 2)
    model.save_pretrained(tmp_path / "m")
    code, out, err = cli("fold", str(tmp_path / "m"), "-o", str(tmp_path / "out"), "--json")
    assert code == 0, err
    report = json.loads(out)
    assert report["passed"] and any("second shape" in v["label"] for v in report["validation"])
    if name == "patchtst":  # the BatchNorm before each feed-forward is folded into its first linear
        assert sum(s["applied"] for s in report["sites"]) == 2


@pytest.mark.parametrize("size", [1_000_000, -224], ids=["huge", "negative"])
def test_a_config_asking_for_impossible_inputs_is_one_line(tmp_path, cli, size):
    from transformers import ConvNextConfig, ConvNextModel

    _tiny(ConvNextModel, ConvNextConfig(hidden_sizes=[8, 16, 32, 64], depths=[1, 1, 1, 1])).save_pretrained(
        tmp_path / "m")
    config = tmp_path / "m" / "config.json"
    config.write_text(json.dumps({**json.loads(config.read_text()), "image_size": size}))  # ConvNeXt loads any
    before = {p.name: p.read_bytes() for p in (tmp_path / "m").iterdir()}
    code, out, err = cli("inspect", str(tmp_path / "m"))
    # was "internal error" (exit 3) from the allocator asked for 24 TB
    assert code == 2 and err.startswith("error: cannot make example inputs from the model's config: pixel_values")
    assert "--input-shape pixel_values:" in err and len(err.strip().splitlines()) == 1
    assert {p.name: p.read_bytes() for p in (tmp_path / "m").iterdir()} == before  # the folder is left as it was


def test_a_config_without_a_position_limit_gets_full_length_text(tmp_path, cli):
    # XLNet's config says max_position_embeddings = -1 (relative positions, no limit): the ids were made at
    # min(16, -1) tokens, a negative size, and every command on its folder ended in an internal error (exit 3)
    from transformers import XLNetConfig, XLNetLMHeadModel

    model = _tiny(XLNetLMHeadModel, XLNetConfig(vocab_size=99, d_model=32, n_layer=2, n_head=4, d_inner=64))
    assert model.config.max_position_embeddings == -1
    assert hf_example_inputs(model).kwargs["input_ids"].shape == (2, 16)
    model.save_pretrained(tmp_path / "m")
    code, out, err = cli("inspect", str(tmp_path / "m"), "--json")
    assert code == 0, err
    assert sum(s["kind"] == "layernorm" for s in json.loads(out)["sites"]) == 4


def _pix2struct(full: bool):
    from transformers import Pix2StructConfig, Pix2StructForConditionalGeneration, Pix2StructVisionConfig, \
        Pix2StructVisionModel

    vision = dict(hidden_size=32, patch_embed_hidden_size=48, d_ff=64, d_kv=8, num_hidden_layers=2,
                  num_attention_heads=4, seq_len=64)
    if not full:
        return _tiny(Pix2StructVisionModel, Pix2StructVisionConfig(**vision))
    text = dict(vocab_size=99, hidden_size=32, d_ff=64, d_kv=8, num_layers=1, num_heads=4)
    return _tiny(Pix2StructForConditionalGeneration, Pix2StructConfig(text_config=text, vision_config=vision))


@pytest.mark.parametrize("full", [False, True], ids=["vision", "image-to-text"])
def test_pix2struct_gets_flattened_patches(tmp_path, cli, full):
    # Pix2Struct takes (batch, patches, row + column + patch values): none were made ("no example inputs")
    model = _pix2struct(full)
    kw = hf_example_inputs(model).kwargs
    patches = kw["flattened_patches"]
    assert patches.shape == (2, 16, 50) and int(patches[..., :2].max()) < 64  # indices within seq_len
    with torch.no_grad():
        model(**kw)
    model.save_pretrained(tmp_path / "m")
    code, out, err = cli("inspect", str(tmp_path / "m"), "--json")
    assert code == 0, err
    assert sum(s["kind"] == "rmsnorm" for s in json.loads(out)["sites"]) >= 5


def test_a_captioner_with_flat_text_fields_gets_pixels_and_text(tmp_path, cli):
    # GIT's config has a vision_config but its text model's fields flat (no text_config): it got pixels alone and
    # every command was refused ("You must specify exactly one of input_ids or inputs_embeds")
    from transformers import GitConfig, GitForCausalLM

    model = _tiny(GitForCausalLM, GitConfig(
        vocab_size=99, hidden_size=32, num_hidden_layers=1, num_attention_heads=4, intermediate_size=64,
        max_position_embeddings=80, bos_token_id=1, eos_token_id=2, pad_token_id=0,
        vision_config=dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=4,
                           image_size=32, patch_size=8)))
    kw = hf_example_inputs(model).kwargs
    assert kw["pixel_values"].shape == (2, 3, 32, 32) and kw["input_ids"].shape == (2, 16)
    model.save_pretrained(tmp_path / "m")
    code, out, err = cli("inspect", str(tmp_path / "m"), "--json")
    assert code == 0, err
    assert sum(s["kind"] == "layernorm" for s in json.loads(out)["sites"]) >= 6  # both towers were run
