"""rotate / fold-scales: exact on the zoo's gpt and llama and on tiny Hugging Face decoders (fp32 within rounding,
float64 to 1e-9), Q orthogonal, refusals with reasons, the user's model untouched, the CLI."""

from __future__ import annotations

import json
import warnings

import pytest
import torch
import torch.nn as nn

from normconv.api import rotate, swap
from normconv.errors import NormconvError
from normconv.models import get
from normconv.passes.rotate import hadamard, hadamard_order, rotation
from normconv.verify import Inputs, run

FP32_TOL = dict(atol=1e-4, rtol=1e-4)  # the documented fp32 tolerance of exact passes
FP64_TOL = dict(atol=1e-9, rtol=1e-9)
VOCAB = 100


def _ids(batch=2, seq=16, seed=0):
    return torch.randint(0, VOCAB, (batch, seq), generator=torch.Generator().manual_seed(seed))


def _hf(cls_name, cfg_name, **cfg):
    import transformers

    warnings.filterwarnings("ignore")
    torch.manual_seed(0)
    config = getattr(transformers, cfg_name)(vocab_size=VOCAB, use_cache=False, **cfg)
    return getattr(transformers, cls_name)(config).eval(), Inputs((), {"input_ids": _ids()})


_DEC = dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64,
            max_position_embeddings=64)

HF = {
    "gpt2": lambda: _hf("GPT2LMHeadModel", "GPT2Config", n_embd=32, n_layer=2, n_head=4, n_positions=64,
                        bos_token_id=0, eos_token_id=0),
    "opt": lambda: _hf("OPTForCausalLM", "OPTConfig", hidden_size=32, num_hidden_layers=2, ffn_dim=64,
                       num_attention_heads=4, max_position_embeddings=64, word_embed_proj_dim=32),
    "gpt_neox": lambda: _hf("GPTNeoXForCausalLM", "GPTNeoXConfig", **_DEC),
    "phi": lambda: _hf("PhiForCausalLM", "PhiConfig", **_DEC),
    "llama": lambda: _hf("LlamaForCausalLM", "LlamaConfig", num_key_value_heads=2, **_DEC),
    "mistral": lambda: _hf("MistralForCausalLM", "MistralConfig", num_key_value_heads=2, **_DEC),
    "qwen2": lambda: _hf("Qwen2ForCausalLM", "Qwen2Config", num_key_value_heads=2, **_DEC),
    "gemma": lambda: _hf("GemmaForCausalLM", "GemmaConfig", num_key_value_heads=1, head_dim=8,
                         **{k: v for k, v in _DEC.items() if k != "max_position_embeddings"}),
}


def _randomize_norms(model, seed=0):
    """Trained-looking norms (HF initializes them to 1 / 0, Gemma's w to 0): give the fold something to do."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for m in model.modules():
            w = getattr(m, "weight", None)
            if "norm" in type(m).__name__.lower() and isinstance(w, torch.Tensor) and w.dim() == 1:
                w.copy_(w + 0.3 * torch.randn(w.shape, generator=g, dtype=w.dtype).abs() + 0.1)
                b = getattr(m, "bias", None)
                if isinstance(b, torch.Tensor):
                    b.copy_(0.3 * torch.randn(b.shape, generator=g, dtype=b.dtype))
    return model


def _logits(out):
    return out.logits if hasattr(out, "logits") else out


def _model(name):
    if name.startswith("zoo:"):
        z = get(name[4:])
        return z.build().eval(), Inputs(z.example_inputs())
    return HF[name]()


def _norm_weights(model):
    """The weights the norms compute with (a folded norm's weight of ones is a buffer, there only to be read)."""
    return [m._parameters.get("weight") for m in model.modules() if isinstance(m, (nn.RMSNorm, nn.LayerNorm))]


def _embedding(model):
    return next(m for m in model.modules() if isinstance(m, nn.Embedding))


MODELS = ["zoo:gpt", "zoo:llama", *HF]


# -- exact ----------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", MODELS)
def test_rotation_is_exact_in_fp32(name):
    model, inputs = _model(name)
    _randomize_norms(model)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    new, report = rotate(model, inputs, seed=1)
    ref, out = _logits(run(model, inputs)), _logits(run(new, inputs))
    torch.testing.assert_close(out, ref, **FP32_TOL)
    assert torch.equal(out.argmax(-1), ref.argmax(-1))
    # it really rotated: every norm is a weight-free RMSNorm, the embedding table changed
    assert all(w is None for w in _norm_weights(new)) and not any(isinstance(m, nn.LayerNorm) for m in new.modules())
    assert (_embedding(new).weight - _embedding(model).weight).abs().max() > 1e-3
    assert report.extra["width"] == 32 and report.extra["scales_folded"] >= 3  # phi: one norm per layer
    assert "Hadamard" in report.extra["matrix"]
    # the user's model is bit-identical
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())


# HF Llama / Mistral / Qwen2 / Gemma compute their RMSNorm in float32 even in a float64 model (x.to(float32)):
# canonicalize refuses that downcast as a native norm, so rotate refuses them in float64 (fp32 they pass, above)
FP64_MODELS = ["zoo:gpt", "zoo:llama", "gpt2", "opt", "gpt_neox", "phi"]


@pytest.mark.parametrize("name", FP64_MODELS)
def test_rotation_is_exact_in_float64(name):
    model, inputs = _model(name)
    _randomize_norms(model).double()
    new, _ = rotate(model, inputs, rotation="random", seed=2)
    torch.testing.assert_close(_logits(run(new, inputs)), _logits(run(model, inputs)), **FP64_TOL)


def test_rotated_weights_are_the_formula():
    """zoo:llama: the embedding becomes E Q and q_proj becomes W Q with the Q of rotation(d, seed)."""
    model, inputs = _model("zoo:llama")
    new, _ = rotate(model, inputs, rotation="random", seed=3)
    q, _ = rotation(32, "random", 3)
    emb = model.tok_emb.weight if hasattr(model, "tok_emb") else _embedding(model).weight
    torch.testing.assert_close(_embedding(new).weight.double(), emb.double() @ q, atol=1e-6, rtol=1e-6)


def test_fold_scales_alone_makes_norms_weight_free():
    model, inputs = _model("gemma")  # (1 + w) scales, tied head
    _randomize_norms(model)
    new, report = swap(model, inputs, fold_scales=True)
    torch.testing.assert_close(_logits(run(new, inputs)), _logits(run(model, inputs)), **FP32_TOL)
    assert all(w is None for w in _norm_weights(new)) and report.extra["scales_folded"] == 5
    # the tied head took the final norm's scale: it is untied, the embedding keeps its rows
    assert new.lm_head.weight is not new.model.embed_tokens.weight
    assert torch.equal(new.model.embed_tokens.weight, model.model.embed_tokens.weight)
    assert model.lm_head.weight is model.model.embed_tokens.weight


def test_fold_scales_skips_a_returned_norm_output():
    """A base model returns the final norm's output: its scale cannot move into a linear."""
    from transformers import LlamaConfig, LlamaModel

    torch.manual_seed(0)
    model = LlamaModel(LlamaConfig(vocab_size=VOCAB, num_key_value_heads=2, use_cache=False, **_DEC)).eval()
    inputs = Inputs((), {"input_ids": _ids()})
    _randomize_norms(model)
    new, report = swap(model, inputs, fold_scales=True)
    torch.testing.assert_close(run(new, inputs).last_hidden_state, run(model, inputs).last_hidden_state, **FP32_TOL)
    final = [s for s in report.sites if s.pass_name == "fold-scales" and s.target == "norm"]
    assert final and not final[0].applied and "returned" in final[0].reason
    with pytest.raises(NormconvError, match="returned"):
        rotate(model, inputs)


def test_post_ln_is_refused_with_the_reason():
    z = get("bert")
    with pytest.raises(NormconvError, match="post-LN"):
        rotate(z.build().eval(), Inputs(z.example_inputs()))


def test_rotation_none_only_folds():
    model, inputs = _model("zoo:llama")
    new, report = rotate(model, inputs, rotation="none")
    torch.testing.assert_close(run(new, inputs), run(model, inputs), **FP32_TOL)
    assert torch.equal(_embedding(new).weight, _embedding(model).weight)
    assert all(w is None for w in _norm_weights(new))


# -- Q --------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("d", [1, 2, 4, 12, 20, 24, 32, 48, 96, 768, 1024])
def test_hadamard_matrices_are_hadamard(d):
    h = hadamard(d)
    assert h is not None and set(h.unique().tolist()) <= {-1.0, 1.0}
    torch.testing.assert_close(h @ h.T, d * torch.eye(d, dtype=torch.float64))


def test_llama_7b_mlp_width_has_a_paley_hadamard():
    assert hadamard_order(11008) == (2, 5504)  # 5503 is a prime = 3 mod 4


@pytest.mark.parametrize("d", [36, 52, 100])
def test_sizes_without_a_known_hadamard_fall_back_to_random(d):
    assert hadamard_order(d) is None
    q, how = rotation(d, "hadamard", 0)
    assert "QR" in how
    torch.testing.assert_close(q @ q.T, torch.eye(d, dtype=torch.float64))


# -- the command line ----------------------------------------------------------------------------------------


def test_cli_rotate_writes_a_model_with_the_same_outputs(cli, tmp_path):
    out = tmp_path / "llama_rot.pt"
    code, stdout, stderr = cli("rotate", "zoo:llama", "-o", out, "--seed", "4", "--json")
    assert code == 0, stderr
    report = json.loads(stdout)
    assert report["passed"] and report["extra"]["rotation"] == "hadamard"
    saved = torch.load(out, weights_only=False)
    model, inputs = _model("zoo:llama")
    torch.testing.assert_close(run(saved, inputs), run(model, inputs), **FP32_TOL)


def test_cli_rotate_bad_input(cli, tmp_path):
    code, _, stderr = cli("rotate", "zoo:llama", "--rotation", "givens")
    assert code == 2 and "unknown --rotation" in stderr
    code, _, stderr = cli("rotate", "zoo:bert", "-o", tmp_path / "b.pt")
    assert code == 2 and "post-LN" in stderr and not (tmp_path / "b.pt").exists()
    assert "--partial" not in stderr and "--approximate" not in stderr  # swap's ways out are not rotate's


def test_export_of_the_rotated_model_has_one_op_per_weight_free_norm(tmp_path):
    import onnx

    from normconv.api import export

    model, inputs = _model("zoo:llama")
    new, _ = rotate(model, inputs)
    report = export(new, inputs, str(tmp_path / "rot.onnx"))
    ops = [n.op_type for n in onnx.load(str(tmp_path / "rot.onnx")).graph.node]
    assert sum("Norm" in o for o in ops) == 5 and all(v.passed for v in report.validation)


class _NonLinearReader(nn.Module):
    def __init__(self):
        super().__init__()
        self.norm, self.lin = nn.RMSNorm(16), nn.Linear(16, 16)
        with torch.no_grad():
            self.norm.weight.uniform_(0.5, 2.0)

    def forward(self, x):
        z = self.norm(x)
        return self.lin(z) + torch.tanh(z)


def test_fold_scales_skips_a_norm_read_by_a_non_linear():
    model = _NonLinearReader().eval()
    x = torch.randn(2, 4, 16, generator=torch.Generator().manual_seed(0))
    new, report = swap(model, x, fold_scales=True)
    site = next(s for s in report.sites if s.pass_name == "fold-scales")
    assert not site.applied and "tanh" in site.reason and "not a linear" in site.reason
    assert torch.equal(new.norm.weight, model.norm.weight) and torch.equal(new.lin.weight, model.lin.weight)
    torch.testing.assert_close(run(new, Inputs((x,))), run(model, Inputs((x,))), **FP32_TOL)


def test_cli_swap_fold_scales(cli, tmp_path):
    out = tmp_path / "gpt_flash.pt"
    code, stdout, stderr = cli("swap", "zoo:gpt", "--fold-scales", "-o", out, "--json")
    assert code == 0, stderr
    report = json.loads(stdout)
    assert report["extra"]["exact"] and report["extra"]["scales_folded"] == 5
    saved = torch.load(out, weights_only=False)
    assert all(w is None for w in _norm_weights(saved))
    model, inputs = _model("zoo:gpt")
    torch.testing.assert_close(run(saved, inputs), run(model, inputs), **FP32_TOL)
    code, _, stderr = cli("swap", "zoo:llama", "--to", "layernorm", "--fold-scales")
    assert code == 2 and "--fold-scales" in stderr


# -- vision transformers: conv patch writer, class token joined by cat, position embedding as a Parameter ------


def _vit_rotates_exactly(model, x, dtype=torch.float32, atol=1e-4):
    model = model.to(dtype).eval()
    x = x.to(dtype)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    new, report = rotate(model, x, atol=atol, rtol=atol)
    assert report.passed and any("rotated" in n for n in report.notes)
    with torch.no_grad():
        ref, got = model(x), new(x)
    ref = getattr(ref, "logits", ref)
    got = getattr(got, "logits", got)
    assert (got - ref).abs().max().item() < atol
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())  # the user's model untouched
    return new


@pytest.mark.parametrize("inplace", [False, True])
def test_handwritten_pre_ln_vit_rotates_exactly(inplace):
    from tests.test_swap_writers import ViT, _randomize

    torch.manual_seed(0)
    model = _randomize(ViT(inplace=inplace))
    _vit_rotates_exactly(model, torch.randn(2, 4, 32, 32))
    _vit_rotates_exactly(model, torch.randn(2, 4, 32, 32), torch.float64, atol=1e-9)


def test_hf_vit_rotates_exactly():
    from tests.test_swap_writers import tiny_hf_vit

    _vit_rotates_exactly(tiny_hf_vit(), torch.randn(2, 3, 32, 32))


def test_falcon_rotates_exactly_through_its_matmul_linears(cli, tmp_path):
    """FalconLinear (an nn.Linear subclass) computes x @ W.T (the swap gives it a bias for the norm's, a separate
    add): fold-scales refused it as 'not a linear layer' (exit 2). Rotated from its folder to a .pt2 and in memory:
    the logits of the original, at two shapes."""
    import transformers

    warnings.filterwarnings("ignore")
    torch.manual_seed(0)
    config = transformers.FalconConfig(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                                       use_cache=False)
    model = _randomize_norms(transformers.FalconForCausalLM(config).eval())
    model.save_pretrained(tmp_path / "falcon")
    code, _, stderr = cli("rotate", tmp_path / "falcon", "-o", tmp_path / "f.pt2")
    assert code == 0, stderr
    program = torch.export.load(str(tmp_path / "f.pt2")).module()
    new, report = rotate(model, Inputs((), {"input_ids": _ids()}), seed=1)
    assert report.extra["scales_folded"] >= 3
    for batch, seq in ((1, 7), (3, 13)):
        ids = _ids(batch, seq, seed=5)
        ref = _logits(model(input_ids=ids))
        got = _logits(run(new, Inputs((), {"input_ids": ids})))
        assert float((got - ref).abs().max() / ref.abs().max()) < 1e-5
    ids = _ids()
    ref = _logits(model(input_ids=ids))
    got = program(input_ids=ids)
    got = got["logits"] if isinstance(got, dict) else _logits(got)
    assert float((got - ref).abs().max() / ref.abs().max()) < 1e-5
