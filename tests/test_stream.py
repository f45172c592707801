"""swap --stream: a sharded Hugging Face folder rewritten tensor by tensor, byte-compared with the in-memory swap,
loaded back with from_pretrained, refused (exit 2) where the swap is not exact, and leaving nothing on a failure."""

from __future__ import annotations

import json
import shutil
import threading
import warnings

import pytest
import torch
import torch.nn as nn

import normconv
from normconv.errors import NormconvError, VerificationError
from normconv.io.hf_inputs import hf_example_inputs
from normconv.stream import swap as streaming
from normconv.stream.blocks import block_list, build_on_meta, fill, lockstep, restore, tensor_slots
from normconv.stream.checkpoint import Checkpoint, ShardWriter, model_class, tied_names
from tests.hf_tiny import VOCAB


def _gpt2():
    from transformers import GPT2Config, GPT2LMHeadModel

    return GPT2LMHeadModel(GPT2Config(vocab_size=VOCAB, n_embd=32, n_layer=3, n_head=4, n_positions=64,
                                      use_cache=False, bos_token_id=0, eos_token_id=0))


def _opt():
    from transformers import OPTConfig, OPTForCausalLM

    return OPTForCausalLM(OPTConfig(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=3, ffn_dim=64,
                                    num_attention_heads=4, max_position_embeddings=64, word_embed_proj_dim=32,
                                    use_cache=False, bos_token_id=0, eos_token_id=0, pad_token_id=1))


def _neox():
    from transformers import GPTNeoXConfig, GPTNeoXForCausalLM

    # parallel residual, untied head stored as embed_out (transformers renames it lm_head on load)
    return GPTNeoXForCausalLM(GPTNeoXConfig(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=3,
                                            num_attention_heads=4, intermediate_size=64, max_position_embeddings=64,
                                            use_cache=False, bos_token_id=0, eos_token_id=0))


def _bert():
    from transformers import BertConfig, BertModel

    return BertModel(BertConfig(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                                intermediate_size=64, max_position_embeddings=64))


FAMILIES = {"gpt2": _gpt2, "opt": _opt, "neox": _neox}


def _saved(build, folder, shard="20KB"):
    """A model with random LayerNorm gains and biases (a fresh one has 1 and 0: nothing to fold), saved sharded."""
    warnings.filterwarnings("ignore")
    torch.manual_seed(0)
    model = build().eval()
    with torch.no_grad():
        for m in model.modules():
            if isinstance(m, nn.LayerNorm):
                m.weight.normal_(1.0, 0.2)
                m.bias.normal_(0.0, 0.2)
    model.save_pretrained(folder, max_shard_size=shard)
    (folder / "tokenizer.json").write_text('{"version": "1.0"}')  # a file besides the weights: copied as is
    return model


def _streamed_tensors(folder, model):
    """model state_dict name -> tensor, read shard by shard from a written folder."""
    ckpt = Checkpoint(folder).rename_for(model)
    return {ckpt.name[k]: ckpt.get(k) for k in ckpt.weight_map}


def _shapes(model):
    return [hf_example_inputs(model), hf_example_inputs(model, 1, 11)]


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_stream_equals_the_in_memory_swap_and_loads(tmp_path, family):
    from transformers import AutoModelForCausalLM

    src, out = tmp_path / "in", tmp_path / "out"
    model = _saved(FAMILIES[family], src)
    assert len(list(src.glob("*.safetensors"))) >= 4  # really sharded
    report = normconv.stream_swap(str(src), str(out))
    assert report.passed and report.output == str(out)
    blocks = report.extra["blocks"]
    assert len(blocks) == 2 * 3 and all(b["passed"] for b in blocks)  # every block at both shapes
    assert not list(tmp_path.glob(".*normconv-tmp"))

    # the in-memory swap of the same model: every tensor both have is byte-identical
    swapped, mem = normconv.swap(model, hf_example_inputs(model))
    assert mem.extra["exact"]
    mem_sd = swapped.state_dict()
    streamed = _streamed_tensors(out, swapped)
    common = sorted(set(mem_sd) & set(streamed))
    assert len(common) >= len(mem_sd) - 1
    different = [k for k in common if not torch.equal(mem_sd[k], streamed[k])]
    assert not different, different
    # what only one side has: the LayerNorm biases (0 once folded; a final norm feeding a bias-free head keeps
    # its bias, where the in-memory swap adds that head a bias W b instead)
    for k in sorted(set(streamed) - set(mem_sd)):
        assert k.endswith(".bias"), k
        head = [h for h in set(mem_sd) - set(streamed)]
        if bool(streamed[k].count_nonzero()):
            assert torch.equal(streamed[k], model.state_dict()[k]) and len(head) == 1
            w = mem_sd[head[0].replace(".bias", ".weight")]
            assert torch.allclose(mem_sd[head[0]], (w.double() @ streamed[k].double()).float(), atol=1e-6)
    assert json.loads((out / "tokenizer.json").read_text()) == {"version": "1.0"}

    # from_pretrained loads it, outputs equal the original's at two shapes
    loaded = AutoModelForCausalLM.from_pretrained(str(out)).eval()
    assert not any("rmsnorm" in type(m).__name__.lower() for m in loaded.modules())
    for inputs in _shapes(model):
        with torch.no_grad():
            ref = model(**inputs.kwargs).logits
            got = loaded(**inputs.kwargs).logits
        assert torch.allclose(ref, got, atol=1e-5, rtol=1e-5), (ref - got).abs().max()
    # ... and the module swap README shows (LayerNorm with zero bias -> nn.RMSNorm, same weight) keeps them
    n = _rms_swap(loaded)
    assert n >= 6
    with torch.no_grad():
        for inputs in _shapes(model):
            assert torch.allclose(model(**inputs.kwargs).logits, loaded(**inputs.kwargs).logits, atol=1e-5)


@pytest.mark.parametrize("family", ["gpt2", "opt"])
def test_a_checkpoint_stored_without_its_base_model_prefix_streams(tmp_path, family):
    """The hub's openai-community/gpt2 and facebook/opt-* store the base model's keys (h.0.ln_1.bias, decoder.*),
    not the head model's (transformer.h.0..., model.decoder...): from_pretrained adds the prefix, and so does the
    stream's renaming now (it said 'the checkpoint has no tensor transformer.h.0.ln_1.bias', exit 2). The output keeps
    the stored names and loads with from_pretrained, equal to the original at two shapes."""
    from safetensors.torch import load_file, save_file
    from transformers import AutoModelForCausalLM

    src, out = tmp_path / "in", tmp_path / "out"
    model = _saved(FAMILIES[family], src, shard="10GB")
    base = getattr(model, model.base_model_prefix)
    (src / "model.safetensors").unlink()
    save_file({k: v.contiguous() for k, v in base.state_dict().items()}, str(src / "model.safetensors"),
              metadata={"format": "pt"})
    report = normconv.stream_swap(str(src), str(out))
    assert report.passed and not list(tmp_path.glob(".*normconv-tmp"))
    stored = set(load_file(str(src / "model.safetensors")))
    assert stored <= set(load_file(str(out / "model.safetensors")))  # the stored names kept
    loaded = AutoModelForCausalLM.from_pretrained(str(out)).eval()
    for inputs in _shapes(model):
        with torch.no_grad():
            ref, got = model(**inputs.kwargs).logits, loaded(**inputs.kwargs).logits
        assert torch.allclose(ref, got, atol=1e-5, rtol=1e-5), (ref - got).abs().max()


def _rms_swap(model: nn.Module) -> int:
    """The README's recipe: each LayerNorm whose bias is zero becomes nn.RMSNorm with the same weight and eps."""
    n = 0
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if isinstance(child, nn.LayerNorm) and not bool(child.bias.count_nonzero()):
                rms = nn.RMSNorm(child.normalized_shape, eps=child.eps)
                rms.weight.data.copy_(child.weight.data)
                setattr(parent, name, rms)
                n += 1
    return n


def test_cli_stream_writes_a_verified_folder(tmp_path, cli):
    src, out = tmp_path / "in", tmp_path / "out"
    _saved(_gpt2, src)
    code, stdout, stderr = cli("swap", str(src), "--to", "rmsnorm", "--stream", "-o", str(out), "--json")
    assert code == 0, stderr
    report = json.loads(stdout)
    assert report["passed"] and report["extra"]["streamed"]
    labels = [v["label"] for v in report["validation"]]
    assert any("final outputs" in x for x in labels) and any("second shape" in x for x in labels)
    config = json.loads((out / "config.json").read_text())
    assert config["tie_word_embeddings"] is False  # the centered embedding and the head are two tensors now
    index = json.loads((out / "model.safetensors.index.json").read_text())
    assert "lm_head.weight" in index["weight_map"]


def test_post_ln_model_is_refused_and_nothing_written(tmp_path, cli):
    src, out = tmp_path / "in", tmp_path / "out"
    _saved(_bert, src)
    code, _, stderr = cli("swap", str(src), "--stream", "-o", str(out))
    assert code == 2
    assert "post-LN" in stderr and "cannot be swapped exactly" in stderr and len(stderr.strip().splitlines()) == 1
    assert not out.exists() and sorted(p.name for p in tmp_path.iterdir()) == ["in"]


@pytest.mark.parametrize("where", ["same", "inside"])
def test_output_over_or_inside_the_input_is_refused(tmp_path, cli, where):
    src = tmp_path / "in"
    _saved(_gpt2, src)
    before = sorted(p.name for p in src.iterdir())
    code, _, stderr = cli("swap", str(src), "--stream", "-o", str(src if where == "same" else src / "sub"))
    assert code == 2 and "input folder" in stderr
    assert sorted(p.name for p in src.iterdir()) == before


def test_stream_flags_it_cannot_honour_are_refused(tmp_path, cli):
    src = tmp_path / "in"
    _saved(_gpt2, src)
    code, _, stderr = cli("swap", str(src), "--stream", "--approximate", "-o", str(tmp_path / "out"))
    assert code == 2 and "--approximate is not supported" in stderr
    code, _, stderr = cli("swap", str(src), "--stream")
    assert code == 2 and "-o" in stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == ["in"]


def _corrupt(folder):
    """Add 0.5 to one writer bias in the written shards (what a wrong rewrite would do)."""
    ckpt = Checkpoint(folder)
    name = next(k for k in ckpt.weight_map if k.endswith("mlp.c_proj.bias"))
    shard = ckpt.weight_map[name]
    from safetensors.torch import load_file, save_file

    tensors = load_file(str(folder / shard))
    tensors[name] = tensors[name] + 0.5
    save_file(tensors, str(folder / shard), metadata={"format": "pt"})


def test_failed_verification_leaves_nothing(tmp_path):
    src, out = tmp_path / "in", tmp_path / "out"
    _saved(_gpt2, src)
    with pytest.raises(VerificationError, match="block .*nothing written") as exc:
        streaming.swap(src, out, after_rewrite=_corrupt)
    assert not exc.value.report.passed
    assert sorted(p.name for p in tmp_path.iterdir()) == ["in"]


def test_interrupt_leaves_nothing(tmp_path):
    src, out = tmp_path / "in", tmp_path / "out"
    _saved(_gpt2, src)

    def interrupt(folder):
        assert any(folder.glob("*.safetensors"))  # the rewrite had written its shards
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        streaming.swap(src, out, after_rewrite=interrupt)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["in"]


def test_a_folder_without_safetensors_is_refused(tmp_path):
    src = tmp_path / "in"
    _saved(_gpt2, src)
    for f in src.glob("*.safetensors*"):
        f.unlink()
    with pytest.raises(NormconvError, match="no safetensors weights"):
        streaming.swap(src, tmp_path / "out")


def test_the_order_of_tensors_in_the_shards_does_not_matter(tmp_path):
    """A norm's bias stored before the linear that absorbs it (module order, one unindexed file) gives the same
    bytes as stored after it (save_pretrained's order), and the input files are left byte-identical."""
    import hashlib
    import shutil

    first, second = tmp_path / "sorted", tmp_path / "module_order"
    model = _saved(_gpt2, first)
    second.mkdir()
    shutil.copy(first / "config.json", second / "config.json")
    params = dict(model.named_parameters())  # tied head once, in module order: ln_1.bias before attn.c_attn.bias
    writer = ShardWriter(second / "model.safetensors", [(n, t.dtype, tuple(t.shape)) for n, t in params.items()],
                                {"format": "pt"})
    for n, t in params.items():
        writer.write(n, t.detach())
    writer.check()
    writer.f.close()
    digest = {p: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(tmp_path.rglob("*.safetensors"))}
    streaming.swap(first, tmp_path / "out1")
    streaming.swap(second, tmp_path / "out2")
    assert digest == {p: hashlib.sha256(p.read_bytes()).hexdigest() for p in digest}
    a, b = _streamed_tensors(tmp_path / "out1", model), _streamed_tensors(tmp_path / "out2", model)
    assert sorted(a) == sorted(b)
    assert [k for k in a if not torch.equal(a[k], b[k])] == []
    assert not (tmp_path / "out2" / "model.safetensors.index.json").exists()  # one file in, one file out


def _block_by_block(meta, ckpt, folder, shapes):
    """The stream's building blocks alone (stream.onepass drives them with a rewrite): each block of the meta model
    filled from the checkpoint just before it runs and put back after, the forwards at ``shapes`` in lockstep;
    per shape (outputs, block outputs), or None where the shapes call the blocks differently."""
    aliases = tied_names(meta)
    prefix, blocks = block_list(meta)
    rest = tensor_slots(meta, skip={id(m) for b in blocks for m in b.modules()})
    slots = [tensor_slots(b, f"{prefix}.{i}") for i, b in enumerate(blocks)]
    saved: list = []

    def enter(i):
        saved[:] = fill(slots[i], ckpt, aliases, folder)

    def leave(i, outs):
        restore(saved)
        saved.clear()

    kept = fill(rest, ckpt, aliases, folder)
    try:
        return lockstep([(meta, s) for s in shapes], enter, leave)
    finally:
        restore(saved + kept)


def test_block_by_block_runs_leave_every_parameter_on_meta(tmp_path):
    """Each verification forward loads a block's weights for that block only and leaves nothing loaded, however
    many times (shapes) and through however many loaders the same model runs."""
    src = tmp_path / "in"
    model = _saved(_gpt2, src)
    cls, config = model_class(src)
    meta = build_on_meta(cls, config, torch.float32)
    for inputs in _shapes(model):
        ((out, blocks),) = _block_by_block(meta, Checkpoint(src).rename_for(meta), src, [inputs])
        assert len(blocks) == 3
        assert torch.allclose(out.logits, model(**inputs.kwargs).logits, atol=1e-6)
        assert {p.device.type for p in meta.parameters()} == {"meta"}


def test_lockstep_forwards_share_the_cores_and_give_them_back(tmp_path, monkeypatch):
    """The forwards in lockstep run their products on cores // forwards threads each (at least one), and torch's
    thread count is the caller's again after, a failed forward included."""
    src = tmp_path / "in"
    model = _saved(_gpt2, src)
    cls, config = model_class(src)
    meta = build_on_meta(cls, config, torch.float32)
    shapes = _shapes(model)
    before = torch.get_num_threads()
    seen: list[int] = []
    hook = block_list(meta)[1][0].register_forward_pre_hook(lambda m, a: seen.append(torch.get_num_threads()))
    try:
        for cores in (4, 1):
            torch.set_num_threads(cores)
            seen.clear()
            _block_by_block(meta, Checkpoint(src).rename_for(meta), src, shapes)
            assert seen == [max(1, cores // len(shapes))] * len(shapes) and torch.get_num_threads() == cores
        torch.set_num_threads(4)

        def fails(m, a):
            raise RuntimeError("a forward that fails")

        bad = block_list(meta)[1][1].register_forward_pre_hook(fails)
        with pytest.raises(RuntimeError, match="fails"):
            _block_by_block(meta, Checkpoint(src).rename_for(meta), src, shapes)
        bad.remove()
        assert torch.get_num_threads() == 4
    finally:
        hook.remove()
        torch.set_num_threads(before)


def test_a_bfloat16_checkpoint_stays_bfloat16_and_verifies(tmp_path):
    src, out = tmp_path / "in", tmp_path / "out"
    model = _saved(lambda: _opt().to(torch.bfloat16), src)
    report = normconv.stream_swap(str(src), str(out))
    assert report.passed and all(v.atol == 5e-2 for v in report.validation)  # bf16 tolerance, not fp32's
    written = _streamed_tensors(out, model)
    assert {t.dtype for t in written.values()} == {torch.bfloat16}
    original = model.state_dict()
    for name, t in written.items():  # centered writers: zero mean along the hidden axis, up to bf16 rounding
        if name.endswith("embed_tokens.weight"):
            assert t.double().mean(-1).abs().max() < 1e-3 < original[name].double().mean(-1).abs().max()


@pytest.mark.parametrize("family", sorted(FAMILIES))
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_a_half_precision_checkpoint_of_every_family_verifies_with_its_weights_kept(tmp_path, family, dtype):
    """GPT-2 (Conv1D layers: cast), OPT and GPT-NeoX (nn.Linear: kept, run a slice at a time) in bf16 and fp16: every
    block and the final outputs verify, and the written tensors keep the checkpoint's dtype."""
    src, out = tmp_path / "in", tmp_path / "out"
    model = _saved(lambda: FAMILIES[family]().to(dtype), src)
    report = normconv.stream_swap(str(src), str(out))
    assert report.passed and report.extra["blocks"] and all(b["passed"] for b in report.extra["blocks"])
    assert {t.dtype for t in _streamed_tensors(out, model).values()} == {dtype}


def test_half_precision_pass_keeps_embeddings_and_heads_as_stored_and_reads_ahead(tmp_path, monkeypatch):
    """A bf16 checkpoint runs in float32, except a weight only embeddings and linear layers read: the rewritten
    model's centered embed_tokens and its untied lm_head, the original's embed_tokens tied to lm_head, and the
    blocks' linear weights stay bf16 (an embedding's output cast: the same rows bit for bit; a linear layer's rows
    cast a slice at a time). The norms' weights and the biases are cast. The loader thread reads and rewrites
    blocks ahead; the verdict is the same."""
    from normconv.stream import onepass

    src, out = tmp_path / "in", tmp_path / "out"
    _saved(lambda: _opt().to(torch.bfloat16), src)
    filled: dict[tuple[int, str], torch.dtype] = {}
    fill, models = onepass.fill, []

    def recording(slots, ckpt, aliases, folder, compute=None):
        saved = fill(slots, ckpt, aliases, folder, compute)
        for m, k, name in slots:
            owner = next(i for i, root in enumerate(models) if any(x is m for x in root.modules()))
            filled[(owner, name)] = getattr(m, k).dtype
        return saved

    build = onepass.build_on_meta

    def remembered(*args, **kwargs):
        models.append(build(*args, **kwargs))
        return models[-1]

    monkeypatch.setattr(onepass, "fill", recording)
    monkeypatch.setattr(onepass, "build_on_meta", remembered)
    threads: set[str] = set()
    prepare = onepass._Pass._prepare

    def where(self, unit):
        threads.add(threading.current_thread().name.split("_")[0])
        return prepare(self, unit)

    monkeypatch.setattr(onepass._Pass, "_prepare", where)
    report = normconv.stream_swap(str(src), str(out))
    assert report.passed
    assert filled[(1, "model.decoder.embed_tokens.weight")] == torch.bfloat16  # rewritten, untied: kept
    assert filled[(1, "lm_head.weight")] == torch.bfloat16  # its head, the original values: kept
    assert filled[(0, "model.decoder.embed_tokens.weight")] == torch.bfloat16  # original, tied to lm_head: kept
    assert filled[(0, "lm_head.weight")] == torch.bfloat16
    assert filled[(0, "model.decoder.layers.0.fc1.weight")] == torch.bfloat16  # a block's linear weights: kept
    assert filled[(1, "model.decoder.layers.0.fc2.weight")] == torch.bfloat16  # (centered, rewritten only)
    assert filled[(0, "model.decoder.layers.0.fc1.bias")] == torch.float32  # the rest: cast
    assert filled[(0, "model.decoder.layers.0.self_attn_layer_norm.weight")] == torch.float32
    assert "normconv-read-ahead" in threads  # blocks were read and rewritten by the loader thread


@pytest.mark.parametrize("timing", ["on-time", "loader-scheduled-late", "block-given-late"])
def test_a_dropped_block_s_source_buffers_are_read_into_again_with_the_same_output(tmp_path, monkeypatch, timing):
    """The loader reads a later block's tensors into the buffers of a block already dropped (no page faults for
    memory met before); the written shards are the bytes of a run that reads every tensor into new memory. Also on a
    busy machine (CI once saw both): where the loader thread is scheduled again only long after handing its block
    over (its executor still held the finished work item, and so the block), and where the loader reads block 2
    while block 1 is still being given (the buffers of block 0 meant for that read were dropped first)."""
    import hashlib
    import time
    from concurrent.futures import thread as executor

    from normconv.stream import checkpoint, onepass

    if timing == "loader-scheduled-late":
        run = executor._WorkItem.run

        def late_run(self):
            run(self)
            if threading.current_thread().name.startswith("normconv-read-ahead"):
                time.sleep(0.3)

        monkeypatch.setattr(executor._WorkItem, "run", late_run)
    giving = threading.Event()  # block-given-late: block 1's sources are being given
    if timing == "block-given-late":
        give = onepass._Buffers.give

        def late_give(self, tensors, *generation):
            if any(".layers.1." in str(k) for k in tensors):  # block 1's sources: the loader reads block 2 meanwhile
                giving.set()
                time.sleep(0.3)
            return give(self, tensors, *generation)

        monkeypatch.setattr(onepass._Buffers, "give", late_give)
    src = tmp_path / "in"
    _saved(lambda: _opt().to(torch.bfloat16), src)
    get = checkpoint.Checkpoint.get
    reused: list[str] = []

    def spy(self, name, reuse=None):
        def taking(shape, dtype):
            if timing == "block-given-late" and ".layers.2." in name and reuse is not None:
                assert giving.wait(60)  # the loader reads block 2 only once block 1 is being given
            t = reuse(shape, dtype) if reuse is not None else None
            if t is not None:
                reused.append(name)
            return t

        return get(self, name, taking)

    monkeypatch.setattr(checkpoint.Checkpoint, "get", spy)
    # a buffer the writer thread still holds is not reused (correct, just fresh memory): on a busy machine the writer
    # can lag behind the loader, so the run is repeated until block 2 was read into block 0's buffers (CI saw none)
    for attempt in range(4):
        reused.clear()
        shutil.rmtree(tmp_path / "reused", ignore_errors=True)
        giving.clear()
        assert normconv.stream_swap(str(src), str(tmp_path / "reused")).passed
        if any(".layers.2." in n for n in reused):
            break
    assert any(".layers.2." in n for n in reused)  # block 2 read into block 0's buffers
    monkeypatch.setattr(checkpoint.Checkpoint, "get", lambda self, name, reuse=None: get(self, name))
    assert normconv.stream_swap(str(src), str(tmp_path / "fresh")).passed

    def digests(folder):
        return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(folder.iterdir())}

    assert digests(tmp_path / "reused") == digests(tmp_path / "fresh")


def test_the_source_is_read_once_and_the_output_never_loaded(tmp_path, monkeypatch):
    """One pass: each source tensor is read once for the rewrite, both verification shapes and both models (plus
    once more where the plan reads it: the norm biases), and the written output is never read into a model (its
    bytes are checked by checksum). The lockstep forwards (a thread per shape, meeting at every block) equal the
    one-at-a-time ones."""
    src, out = tmp_path / "in", tmp_path / "out"
    model = _saved(_gpt2, src)
    reads: dict[tuple[str, str], int] = {}
    get = Checkpoint.get

    def counted(self, name, reuse=None):
        key = (self.folder.name, name)
        reads[key] = reads.get(key, 0) + 1
        return get(self, name, reuse)

    monkeypatch.setattr(Checkpoint, "get", counted)
    report = streaming.swap(src, out)
    assert report.passed and len(report.extra["blocks"]) == 2 * 3
    assert all(folder == "in" for folder, _ in reads), reads  # the temp folder / OUT: never read by a model
    stored = set(Checkpoint(src).weight_map)
    assert {name for _, name in reads} == stored  # every source tensor read ...
    assert max(reads.values()) <= 2, reads  # ... at most twice
    planned = {name for (_, name), n in reads.items() if n == 2}
    assert planned and all(".ln_" in n and n.endswith(".bias") for n in planned), planned  # the plan's reads
    cls, config = model_class(src)
    meta = build_on_meta(cls, config, torch.float32)
    ckpt = Checkpoint(src).rename_for(meta)
    together = _block_by_block(meta, ckpt, src, _shapes(model))
    for inputs, (out_many, blocks_many) in zip(_shapes(model), together):
        ((out_one, blocks_one),) = _block_by_block(meta, ckpt, src, [inputs])
        assert torch.equal(out_many.logits, out_one.logits)
        assert all(torch.equal(a, b) for a, b in zip(blocks_many, blocks_one)) and len(blocks_many) == 3
    assert {p.device.type for p in meta.parameters()} == {"meta"}


def _flip_a_byte(folder):
    """One bit of one tensor's bytes flipped in place in a written shard (a disk or a write gone wrong)."""
    ckpt = Checkpoint(folder)
    name = next(k for k in sorted(ckpt.weight_map) if k.endswith("attn.c_attn.weight"))
    shard = ckpt.weight_map[name]
    h = ckpt.shards[shard]
    at = h.start + h[name]["data_offsets"][0] + 5
    with open(folder / shard, "r+b") as f:
        f.seek(at)
        byte = f.read(1)[0]
        f.seek(at)
        f.write(bytes([byte ^ 0x10]))


def test_a_byte_flipped_after_writing_is_refused(tmp_path, cli, monkeypatch):
    src, out = tmp_path / "in", tmp_path / "out"
    _saved(_gpt2, src)
    with pytest.raises(VerificationError, match=r"swap --stream: block 0: .*attn\.c_attn\.weight .*read back "
                                                r"differs .*nothing written") as exc:
        streaming.swap(src, out, after_rewrite=_flip_a_byte)
    assert not exc.value.report.passed
    assert sorted(p.name for p in tmp_path.iterdir()) == ["in"]
    # the command line: exit 1, one line, nothing at OUT
    monkeypatch.setattr(streaming, "write_verified", _with_hook(streaming.write_verified, _flip_a_byte))
    code, _, stderr = cli("swap", str(src), "--to", "rmsnorm", "--stream", "-o", str(out))
    assert code == 1 and "CRC-32" in stderr and not out.exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["in"]


def _with_hook(write_verified, hook):
    """write_verified with ``hook`` as its after_rewrite (its last positional argument, as stream.swap calls it)."""
    return lambda *args, **kw: write_verified(*args[:-1], hook, **kw)


def test_a_changed_config_after_writing_is_refused(tmp_path):
    src, out = tmp_path / "in", tmp_path / "out"
    _saved(_gpt2, src)

    def edit(folder):
        config = json.loads((folder / "config.json").read_text())
        config["n_layer"] = 2
        (folder / "config.json").write_text(json.dumps(config))

    with pytest.raises(VerificationError, match="config.json changed after it was written; nothing written"):
        streaming.swap(src, out, after_rewrite=edit)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["in"]


def test_a_failure_in_the_read_ahead_thread_leaves_nothing_and_no_thread(tmp_path, monkeypatch):
    """A read or rewrite that fails in the loader thread (a block ahead) is raised in the command, the loader is
    joined, and nothing is left under OUT or beside it."""
    from normconv.stream import onepass

    src, out = tmp_path / "in", tmp_path / "out"
    _saved(_gpt2, src)
    prepare = onepass._Pass._prepare

    def failing(self, unit):
        if unit == 2 and threading.current_thread().name.startswith("normconv-read-ahead"):
            raise OSError(5, "Input/output error", "a shard")
        return prepare(self, unit)

    monkeypatch.setattr(onepass._Pass, "_prepare", failing)
    with pytest.raises(NormconvError):
        streaming.swap(src, out)
    assert not out.exists() and sorted(p.name for p in tmp_path.iterdir()) == ["in"]
    assert not [t for t in threading.enumerate() if t.name.startswith("normconv-read-ahead")]


def test_a_model_reading_a_kept_table_s_weight_outside_its_forward_is_run_with_it_cast(tmp_path, monkeypatch):
    """An embedding kept in bf16 fails where the model multiplies its weight directly, outside the module (DeBERTa's
    head does; the plan refuses to center a table read so, and this use is eager-only, where the plan's capture
    does not see it): the pass is run again with every table cast, and verifies; it never computes with the stored
    dtype silently."""
    from transformers.models.opt import modeling_opt

    from normconv.stream import onepass

    src, out = tmp_path / "in", tmp_path / "out"
    _saved(lambda: _opt().to(torch.bfloat16), src)
    forward = modeling_opt.OPTDecoder.forward
    seen: list[torch.dtype] = []

    def reads_the_weight(self, *args, **kwargs):
        w = self.embed_tokens.weight
        if not torch.compiler.is_exporting():  # eager only (the plan's capture would refuse a centered table read)
            seen.append(w.dtype)
            torch.matmul(torch.zeros(1, w.shape[1], dtype=torch.float32), w.t())  # a use needing one dtype
        return forward(self, *args, **kwargs)

    monkeypatch.setattr(modeling_opt.OPTDecoder, "forward", reads_the_weight)
    retried = []
    cast_kept = onepass._Pass.cast_kept
    monkeypatch.setattr(onepass._Pass, "cast_kept", lambda self: retried.append(1) or cast_kept(self))
    report = normconv.stream_swap(str(src), str(out))
    assert report.passed and retried == [1]
    assert torch.bfloat16 in seen and seen[-1] == torch.float32  # the kept table failed, the retry cast it


def test_a_kept_linear_weight_computes_as_its_float32_cast_and_only_plain_modules_keep(monkeypatch):
    """A kept linear layer's call outside the lockstep (stream.meeting: its rows cast a slice at a time into a thread's
    buffer) gives the float32 product of the cast weight, with and without a bias, a slice smaller than the weight and
    larger, a smaller weight after a larger one (the buffer reused) and a larger after a smaller (grown); a subclass of
    nn.Linear or nn.Embedding (its forward may read the weight its own way) and an embedding that renormalizes its
    rows are never kept."""
    from normconv.stream import meeting, onepass

    g = torch.Generator().manual_seed(0)
    alone = meeting.Meeting(0)
    for slice_bytes in (96 * 4 * 7, 1 << 30):  # 7 rows of 96 a slice (the last one short), the whole weight
        monkeypatch.setattr(meeting, "SLICE_BYTES", slice_bytes)
        for cols, bias in ((96, False), (96, True), (40, True), (300, False)):  # the buffer reused, then grown
            lin = nn.Linear(cols, 1000, bias=bias).to(torch.bfloat16)
            x = torch.randn(2, 5, cols, generator=g)
            want = nn.functional.linear(x, lin.weight.float(), None if lin.bias is None else lin.bias.float())
            got = alone.linear(lin, x, torch.float32)
            assert got.dtype == torch.float32 and got.shape == want.shape
            torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)
            lin.float()  # a weight cast after all (``cast_kept``): the plain product
            torch.testing.assert_close(alone.linear(lin, x, torch.float32), want, rtol=0, atol=0)
    assert onepass._keeps(nn.Linear(2, 2)) and onepass._keeps(nn.Embedding(4, 2))

    class MyLinear(nn.Linear):
        pass

    assert not onepass._keeps(MyLinear(2, 2)) and not onepass._keeps(nn.Embedding(4, 2, max_norm=1.0))
    assert not onepass._keeps(nn.LayerNorm(2)) and not onepass._keeps(nn.Conv1d(2, 2, 1))


def test_a_weight_a_block_or_another_module_also_reads_is_cast(tmp_path, monkeypatch):
    """A tied weight is kept only where every reader keeps it: OPT's embed_tokens is tied to lm_head (both kept),
    but where the original's head is a subclass of nn.Linear it reads the tied weight as float32, so the original's
    embedding is cast too; the rewritten model's untied ones stay kept."""
    from normconv.stream import onepass

    src, out = tmp_path / "in", tmp_path / "out"
    _saved(lambda: _opt().to(torch.bfloat16), src)
    kept: list[tuple[frozenset, frozenset]] = []
    kept_by = onepass._Pass._kept

    class Head(nn.Linear):
        pass

    def spy(self, model, side):
        if side == 0:
            model.lm_head.__class__ = Head  # the original's tied head: a subclass
        got = kept_by(self, model, side)
        kept.append(got)
        return got

    monkeypatch.setattr(onepass._Pass, "_kept", spy)
    report = normconv.stream_swap(str(src), str(out))
    assert report.passed
    original, rewritten = kept
    assert not any("embed_tokens" in k for k in original)  # tied to a subclass's weight: cast
    assert any("embed_tokens" in k for k in rewritten) and "lm_head.weight" in rewritten
