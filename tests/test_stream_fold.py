"""fold --stream: the BatchNorms of a sharded Hugging Face folder folded tensor by tensor into the conv before
each, loaded back with from_pretrained (same outputs, each folded BN the identity or a shift), equal to the
in-memory fold, refused (exit 2) where it cannot apply, and leaving nothing on a failure."""

from __future__ import annotations

import json
import warnings

import pytest
import torch
import torch.nn as nn

import normconv
from normconv.errors import NormconvError, VerificationError
from normconv.stream import fold as streaming
from normconv.stream.checkpoint import Checkpoint

BN = nn.modules.batchnorm._BatchNorm


def _resnet(dtype=torch.float32):
    from transformers import ResNetConfig, ResNetForImageClassification

    torch.manual_seed(0)
    cfg = ResNetConfig(embedding_size=16, hidden_sizes=[16, 32], depths=[1, 2], num_channels=3, num_labels=5)
    model = ResNetForImageClassification(cfg).eval()
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():  # statistics and affines far from a fresh BN's (0, 1, 1, 0): the fold is visible
        for m in model.modules():
            if isinstance(m, BN):
                m.running_mean.normal_(0.0, 1.0, generator=g)
                m.running_var.uniform_(0.5, 2.0, generator=g)
                m.weight.normal_(1.0, 0.5, generator=g)
                m.bias.normal_(0.0, 0.5, generator=g)
    return model.to(dtype)


def _saved(folder, dtype=torch.float32):
    warnings.filterwarnings("ignore")
    model = _resnet(dtype)
    model.save_pretrained(folder, max_shard_size="20KB")
    return model


def _logits(model, x):
    with torch.no_grad():
        return model(pixel_values=x).logits


def test_streamed_fold_loads_with_the_same_outputs(tmp_path):
    from transformers import ResNetForImageClassification

    src, out = tmp_path / "in", tmp_path / "out"
    model = _saved(src)
    assert len(list(src.glob("*.safetensors"))) > 1  # several shards, read and written one tensor at a time
    report = normconv.stream_fold(src, out)
    assert report.passed and report.extra["streamed"] and report.extra["folded"] == 11
    assert {v["label"] for v in report.to_json()["validation"]} >= {"torch, streamed, final outputs"}
    assert report.extra["blocks"] and all(b["passed"] for b in report.extra["blocks"])
    loaded = ResNetForImageClassification.from_pretrained(out).eval()
    x = torch.randn(3, 3, 40, 40)  # another batch and image size than the verification's
    assert torch.allclose(_logits(loaded, x), _logits(model, x), atol=1e-5)
    for name, m in loaded.named_modules():
        if isinstance(m, BN):  # every BN is the identity up to its shift: the conv before it carries the scale
            assert torch.equal(m.weight, torch.ones_like(m.weight)) and not m.running_mean.any(), name
            assert torch.allclose(m.running_var + m.eps, torch.ones_like(m.running_var)), name
    assert not any(p.name.startswith(".") or "tmp" in p.name for p in tmp_path.iterdir())


def test_streamed_fold_equals_the_in_memory_fold(tmp_path):
    from transformers import ResNetForImageClassification

    src, out = tmp_path / "in", tmp_path / "out"
    model = _saved(src)
    streaming.fold(src, out)
    loaded = ResNetForImageClassification.from_pretrained(out).eval()
    x = torch.randn(2, 3, 32, 32)
    folded, _ = normconv.fold(model, {"pixel_values": x})
    # the streamed convs carry s = gamma / sqrt(var + eps), as the in-memory fold's do
    conv = "resnet.encoder.stages.1.layers.0.shortcut.convolution.weight"
    assert torch.allclose(loaded.state_dict()[conv], folded.state_dict()[conv], atol=1e-6)
    assert torch.allclose(_logits(loaded, x), _logits(folded, x), atol=1e-5)


def test_bfloat16_checkpoint_stays_bfloat16_and_verifies(tmp_path):
    src, out = tmp_path / "in", tmp_path / "out"
    _saved(src, torch.bfloat16)
    report = streaming.fold(src, out)
    assert report.passed
    ckpt = Checkpoint(out)
    assert {ckpt.get(k).dtype for k in ckpt.weight_map if "num_batches" not in k} == {torch.bfloat16}


def test_cli_stream_fold_writes_a_verified_folder(tmp_path, cli):
    src, out = tmp_path / "in", tmp_path / "out"
    _saved(src)
    code, stdout, stderr = cli("fold", str(src), "--stream", "-o", str(out), "--json")
    assert code == 0, stderr
    report = json.loads(stdout)
    assert report["passed"] and report["extra"]["folded"] == 11
    assert sum(s["applied"] for s in report["sites"]) == 11


def test_cli_stream_fold_refusals_write_nothing(tmp_path, cli):
    src = tmp_path / "in"
    _saved(src)
    code, _, stderr = cli("fold", str(src), "--stream", "--eval", "-o", str(tmp_path / "out"))
    assert code == 2 and "--eval is not supported" in stderr
    code, _, stderr = cli("fold", str(src), "--stream")
    assert code == 2 and "-o" in stderr
    code, _, stderr = cli("fold", str(src), "--stream", "-o", str(src / "sub"))
    assert code == 2 and "input folder" in stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == ["in"]  # (no BatchNorm at all: tests/test_stream_codes.py)


def _corrupt(folder):
    """Scale one folded conv weight by 1.5 in the written shards (what a wrong fold would do)."""
    from safetensors.torch import load_file, save_file

    ckpt = Checkpoint(folder)
    name = next(k for k in ckpt.weight_map if k.endswith("stages.1.layers.0.layer.1.convolution.weight"))
    shard = ckpt.weight_map[name]
    tensors = load_file(str(folder / shard))
    tensors[name] = tensors[name] * 1.5
    save_file(tensors, str(folder / shard), metadata={"format": "pt"})


def test_failed_verification_leaves_nothing(tmp_path):
    src, out = tmp_path / "in", tmp_path / "out"
    _saved(src)
    with pytest.raises(VerificationError, match="fold --stream: block .*nothing written"):
        streaming.fold(src, out, after_rewrite=_corrupt)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["in"]


def test_a_checkpoint_missing_a_batchnorm_tensor_is_refused(tmp_path, cli):
    """A hostile / truncated checkpoint: a BatchNorm's running_var is not in it. One line, exit 2, nothing written."""
    from safetensors.torch import save_file

    src = tmp_path / "in"
    model = _resnet()
    src.mkdir()
    model.config.architectures = [type(model).__name__]
    model.config.save_pretrained(src)
    tensors = {k: v.contiguous() for k, v in model.state_dict().items()
               if not k.endswith("layer.1.normalization.running_var")}
    save_file(tensors, str(src / "model.safetensors"), metadata={"format": "pt"})
    code, _, stderr = cli("fold", str(src), "--stream", "-o", str(tmp_path / "out"))
    assert code == 2 and "has no tensor" in stderr and "running_var" in stderr
    assert len(stderr.strip().splitlines()) == 1
    assert sorted(p.name for p in tmp_path.iterdir()) == ["in"]


def test_the_source_is_read_once_and_the_output_never_loaded(tmp_path, monkeypatch):
    """One pass: every source tensor is read once for the rewrite and the verification (the BatchNorm tensors once
    more, by the plan), and the written output is never read into a model (its bytes are checked by checksum)."""
    src, out = tmp_path / "in", tmp_path / "out"
    _saved(src)
    reads: dict[tuple[str, str], int] = {}
    get = Checkpoint.get

    def counted(self, name, reuse=None):
        reads[(self.folder.name, name)] = reads.get((self.folder.name, name), 0) + 1
        return get(self, name, reuse)

    monkeypatch.setattr(Checkpoint, "get", counted)
    assert streaming.fold(src, out).passed
    assert all(folder == "in" for folder, _ in reads), reads
    assert {name for _, name in reads} == set(Checkpoint(src).weight_map)
    twice = {name for (_, name), n in reads.items() if n == 2}
    assert max(reads.values()) == 2 and all(".normalization." in n for n in twice), reads


def test_a_folded_conv_stored_narrower_is_written_in_the_model_dtype(tmp_path, cli):
    """A float32 ResNet whose first conv is stored float16: its folded weight was rounded back into float16.
    Written in float32 (as from_pretrained loads it), the folder's logits equal the original's at two sizes."""
    from safetensors.torch import load_file, save_file
    from transformers import ResNetForImageClassification

    src, out = tmp_path / "in", tmp_path / "out"
    _resnet().save_pretrained(src)
    key = "resnet.embedder.embedder.convolution.weight"
    sd = load_file(src / "model.safetensors")
    sd[key] = sd[key].half()
    save_file(sd, src / "model.safetensors", metadata={"format": "pt"})
    code, _, err = cli("fold", src, "--stream", "-o", out)
    assert code == 0, err
    assert load_file(out / "model.safetensors")[key].dtype == torch.float32
    ref = ResNetForImageClassification.from_pretrained(str(src)).eval()
    got = ResNetForImageClassification.from_pretrained(str(out)).eval()
    for shape in ((1, 3, 32, 32), (2, 3, 48, 40)):
        x = torch.randn(shape, generator=torch.Generator().manual_seed(3))
        a, b = _logits(ref, x).double(), _logits(got, x).double()
        assert float((a - b).abs().max() / a.abs().max()) < 1e-5
