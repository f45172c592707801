"""What normconv writes: the per-format writers io.write.save dispatches to, and the torch-only form of a
rewritten model.

By default a written model loads with torch alone (``torch.load(path, weights_only=False)``, or
``torch.export.load`` for a .pt2): before writing, ``torch_only`` replaces the modules normconv inserted by torch's
own or by torch.fx GraphModules (which pickle as their generated code and load with torch alone):

  normconv.nn.rmsnorm.RMSNorm           ->  nn.RMSNorm (same parameter, same state_dict key)
  normconv.nn.modules.Float32Norm       ->  GraphModule: norm(x.to(compute)).to(out)      (same keys: norm.*)
  normconv.nn.modules.ChannelShift      ->  GraphModule: (x.transpose(1, -1) + bias).transpose(1, -1)   (key: bias)
  normconv.nn.modules.MovedDimNorm      ->  GraphModule: norm(x.movedim(dims, -1)).movedim(-1, dims)  (keys: norm.*)
  normconv.nn.modules.FrozenBatchNorm   ->  GraphModule: F.batch_norm(x, its four buffers, training=False)  (same keys)
  normconv.nn.modules.ChannelAffine     ->  GraphModule: x * weight + bias per channel            (same keys)
  normconv.nn.modules.BiasAfterNorm     ->  GraphModule: norm(x) + bias                    (keys: norm.*, bias)
  DeepNorm BranchScale / InputScale     ->  GraphModule hooks computing the same product

A norm wrapper's GraphModule (Float32Norm, MovedDimNorm, BiasAfterNorm) also holds its norm's weight as its own
``weight`` (the same Parameter, so its state_dict has both names): model code reads its norm's ``.weight``
(HunYuan: ``self.k_norm.weight.dtype``), as it did on the module the wrapper replaced. The engine runs the
torch-only form once against the verified rewrite wherever it made a GraphModule (``door.write_model``).

``keep_normconv=True`` (``--normconv-modules``) keeps normconv's faster eager modules; loading then needs normconv.
"""

from __future__ import annotations

import contextlib
import io
import os
from typing import Any, Callable, Iterator

import torch
import torch.fx as fx
import torch.nn as nn
import torch.nn.functional as F

from normconv.clone import clone_sharing_tensors, release
from normconv.errors import describe
from normconv.io import durable
from normconv.io.checksum import fill_zip_crcs, unchecked_torch_save
from normconv.io.pickled import torch_tracers
from normconv.io.time_limit import DYNAMIC_EXPORT_S, Overtime, interrupt_kept, time_limit
from normconv.nn.modules import (BiasAfterNorm, BranchScale, ChannelAffine, ChannelShift, Float32Norm,
                                 FrozenBatchNorm, InputScale, MovedDimNorm)
from normconv.kinds import KINDS
from normconv.verify import Inputs, run

INPUTS_ATTR = "_normconv_example_inputs"  # example inputs carried in a pickle normconv wrote (io.load reads them back)


# ---------------------------------------------------------------------------------------------------------
# torch-only form


class _Shift(nn.Module):
    def __init__(self, bias: nn.Parameter):
        super().__init__()
        self.bias = bias

    def forward(self, x):  # x + bias per channel (dim 1), any rank: broadcast on the last dim
        return (x.transpose(1, -1) + self.bias).transpose(1, -1)


class _Cast(nn.Module):
    def __init__(self, norm: nn.Module, compute: torch.dtype, out: torch.dtype | None):
        super().__init__()
        self.norm, self.compute, self.out = norm, compute, out

    def forward(self, x):
        y = self.norm(x.to(self.compute))
        return y.to(x.dtype) if self.out is None else y.to(self.out)


class _Biased(nn.Module):
    def __init__(self, norm: nn.Module, bias: nn.Parameter):
        super().__init__()
        self.norm, self.bias = norm, bias

    def forward(self, x):
        return self.norm(x) + self.bias


class _Moved(nn.Module):
    def __init__(self, norm: nn.Module, dims: tuple[int, ...]):
        super().__init__()
        self.norm, self.dims = norm, dims

    def forward(self, x):  # no annotations: a traced GraphModule must pickle
        last = tuple(range(-len(self.dims), 0))
        return self.norm(x.movedim(self.dims, last)).movedim(last, self.dims)


class _BranchHook(nn.Module):
    def __init__(self, factor: float, tuple_output: bool):
        super().__init__()
        self.factor, self.tuple_output = factor, tuple_output

    def forward(self, module, args, output):
        if self.tuple_output:  # resolved at trace time: the branch's output type was recorded on a real forward
            return (output[0] * self.factor,) + output[1:]
        return output * self.factor


class _InputHook(nn.Module):
    def __init__(self, factor: float):
        super().__init__()
        self.factor = factor

    def forward(self, module, args):
        return (args[0] * self.factor,) + args[1:]


class _Frozen(nn.Module):
    def __init__(self, m: FrozenBatchNorm):
        super().__init__()
        self.eps = m.eps
        for name in ("weight", "bias", "running_mean", "running_var"):
            self.register_buffer(name, getattr(m, name))

    def forward(self, x):  # batch statistics never (training=False), the buffers passed as they are (kept on reload)
        return F.batch_norm(x, self.running_mean, self.running_var, self.weight, self.bias, False, 0.0, self.eps)


def _graph_module(root: nn.Module, name: str) -> fx.GraphModule:
    gm = fx.symbolic_trace(root)
    gm.__class__.__name__ = name  # the repr a user sees; pickling stores the code, not this class
    return gm


def _norm_stand_in(root: nn.Module, name: str) -> fx.GraphModule:
    """A GraphModule standing in for a norm wrapper: its inner norm's weight is also its own ``weight`` (the same
    Parameter; model code reads its norm's ``.weight``, HunYuan's ``self.k_norm.weight.dtype``), which pickles."""
    gm = _graph_module(root, name)
    w = getattr(getattr(gm, "norm", None), "weight", None)
    if isinstance(w, nn.Parameter) and "weight" not in gm._parameters:
        gm.register_parameter("weight", w)
    return gm


def _torch_form(m: nn.Module) -> nn.Module | None:
    """torch's own module for one of normconv's: a norm kind's own form (normconv/kinds/), else a traced GraphModule
    of the module's math; None for any other module."""
    for kind in KINDS:
        new = kind.torch_only(m)
        if new is not None:
            return new
    if isinstance(m, Float32Norm):
        return _norm_stand_in(_Cast(m.norm, m.compute_dtype, m.out_dtype), "Float32Norm")
    if isinstance(m, ChannelShift):
        return _graph_module(_Shift(m.bias), "ChannelShift")
    if isinstance(m, MovedDimNorm):
        return _norm_stand_in(_Moved(m.norm, m.dims), "MovedDimNorm")
    if isinstance(m, FrozenBatchNorm):
        return _graph_module(_Frozen(m), "FrozenBatchNorm")
    if isinstance(m, ChannelAffine):  # its forward is static in the rank: traced as it is
        return _graph_module(m, "ChannelAffine")
    if isinstance(m, BiasAfterNorm):
        return _norm_stand_in(_Biased(m.norm, m.bias), "BiasAfterNorm")
    return None


def _replace(model: nn.Module, path: str, new: nn.Module) -> nn.Module:
    if path == "":
        return new
    parent, _, name = path.rpartition(".")
    setattr(model.get_submodule(parent) if parent else model, name, new)
    return model


def normconv_parts(model: nn.Module) -> list[str]:
    """The normconv classes (modules and hooks) in ``model`` that a loader would have to import."""
    found = set()
    for m in model.modules():
        if type(m).__module__.startswith("normconv.nn"):
            found.add(f"{type(m).__module__}.{type(m).__qualname__}")
        for h in list(m._forward_hooks.values()) + list(m._forward_pre_hooks.values()):
            if type(h).__module__.startswith("normconv."):
                found.add(f"{type(h).__module__}.{type(h).__qualname__}")
    return sorted(found)


def graph_modules(model: nn.Module) -> int:
    """How many GraphModules are among the modules and hooks (``torch_only`` adds one per stand-in)."""
    return sum(isinstance(x, fx.GraphModule) for m in model.modules()
               for x in [m, *m._forward_hooks.values(), *m._forward_pre_hooks.values()])


def holds_graph_modules(model: nn.Module) -> bool:
    """A GraphModule among the modules or hooks: its pickle carries code (normconv's safe loader refuses it)."""
    return graph_modules(model) > 0


def torch_only(model: nn.Module, inputs: Inputs | None) -> nn.Module:
    """A copy of ``model`` (sharing its tensors) with every module and hook normconv inserted replaced by torch's
    own or by a GraphModule, so that it loads without normconv. ``model`` itself is not changed."""
    if not normconv_parts(model):
        return model
    tuple_out: dict[int, bool] = {}
    branch_hooks = [(m, h) for m in model.modules() for h in m._forward_hooks.values() if isinstance(h, BranchScale)]
    if branch_hooks:  # a BranchScale checks the output type at run time: record it on one real forward
        if inputs is None:
            raise ValueError("example inputs are needed to write DeepNorm hooks in torch-only form")
        handles = [m.register_forward_hook(lambda mod, a, out: tuple_out.__setitem__(id(mod), isinstance(out, tuple)))
                   for m, _ in branch_hooks]
        try:
            run(model, inputs)
        finally:
            for h in handles:
                h.remove()
    work = clone_sharing_tensors(model)
    # innermost first: a Float32Norm holds the RMSNorm it casts around
    for path, m in sorted(work.named_modules(), key=lambda pm: -pm[0].count(".") - (pm[0] != "")):
        new = _torch_form(m)
        if new is not None:
            new.training = m.training
            for key in ("_forward_hooks", "_forward_pre_hooks"):
                if isinstance(new, fx.GraphModule):  # a kind's torch form kept the module's own dicts
                    getattr(new, key).update(getattr(m, key))
            work = _replace(work, path, new)
    orig = dict(model.named_modules())
    for path, m in work.named_modules():
        for k, h in list(m._forward_hooks.items()):
            if isinstance(h, BranchScale):
                src = orig.get(path, m)
                gm = _graph_module(_BranchHook(h.factor, tuple_out.get(id(src), False)), "DeepNormBranchScale")
                m._forward_hooks[k] = gm
        for k, h in list(m._forward_pre_hooks.items()):
            if isinstance(h, InputScale):
                gm = _graph_module(_InputHook(h.factor), "DeepNormInputScale")
                m._forward_pre_hooks[k] = gm
    return release(work)


# ---------------------------------------------------------------------------------------------------------
# writers: (model, path, inputs) -> None; io.save gives each a temp path and renames it into place


_WRITEBACK_EVERY = 64 << 20  # the disk is started on each 64 MiB written, not on the whole file at the close


class LatchedFile(io.RawIOBase):
    """A file written through Python whose first OSError is kept, not thrown into the serializer: torch's C++ zip
    writer turns a failed write into ``unexpected pos 2048 vs 1942`` (and a .pt2 writer can abort the process from
    its destructor), so the writer is let finish into the void and ``latched`` raises the OSError itself, errno
    and all (ENOSPC: no space left on device)."""

    def __init__(self, path: str):
        super().__init__()
        self._f = open(path, "wb")
        self.error: OSError | None = None
        self._pos = 0
        self._sent = 0  # bytes before this offset were handed to the disk (start_writeback)

    def writable(self) -> bool:
        return True

    def write(self, b: Any) -> int:
        n = memoryview(b).nbytes
        if self.error is None:
            try:
                at = self._pos
                for piece in durable.pieces(b):  # a whole tensor in one write call is several times slower
                    self._f.write(piece)
                    at += piece.nbytes
                    if at - self._sent >= _WRITEBACK_EVERY:  # the disk starts on what is written so far
                        self._f.flush()
                        durable.start_writeback(self._f.fileno(), self._sent, at - self._sent)
                        self._sent = at
            except OSError as exc:
                self.error = exc
        self._pos += n
        return n

    def tell(self) -> int:
        return self._pos

    def seekable(self) -> bool:
        return True

    def seek(self, offset: int, whence: int = 0) -> int:  # torch.export.save rewinds a file object it wrote
        self.flush()
        if self.error is None:
            try:
                self._pos = self._f.seek(offset, whence)
            except OSError as exc:
                self.error = exc
        return self._pos

    def flush(self) -> None:
        if self.error is None and not self._f.closed:
            try:
                self._f.flush()
            except OSError as exc:
                self.error = exc

    def close(self) -> None:
        if not self._f.closed:
            self.flush()
            try:
                if self.error is None:  # the disk starts now; io.write.save syncs before the rename
                    durable.start_writeback(self._f.fileno())
            finally:
                try:
                    self._f.close()
                except OSError as exc:
                    self.error = self.error or exc
        super().close()


@contextlib.contextmanager
def latched(path: str) -> Iterator[LatchedFile]:
    """A ``LatchedFile`` at ``path``; its first OSError is raised when the block ends (after the serializer)."""
    f = LatchedFile(path)
    try:
        yield f
    finally:
        f.close()
    if f.error is not None:
        raise f.error


def follow_umask(path: str, mode: int = 0o666) -> None:
    """mkstemp creates 0600, mkdtemp 0700; a written model gets what open() would give (``mode`` 0666 minus the umask,
    like torch.save; a folder 0777 minus it, like mkdir)."""
    mask = os.umask(0)
    os.umask(mask)
    os.chmod(path, mode & ~mask)


def write_pickle(model: nn.Module, path: str, inputs: Inputs | None) -> None:
    """torch.save(model), carrying the example inputs so the next normconv command needs no --input-shape; a
    GraphModule normconv traced names torch's tracer class, not normconv's (``io.pickled.torch_tracers``)."""
    if inputs is not None:
        model.__dict__[INPUTS_ATTR] = {"args": tuple(inputs.args), "kwargs": dict(inputs.kwargs)}
    try:
        with latched(path) as f, unchecked_torch_save() as unchecked, torch_tracers(model):
            torch.save(model, f)  # each member's CRC-32 left at 0 by torch (its byte-at-a-time loop) ...
    finally:
        model.__dict__.pop(INPUTS_ATTR, None)
    if unchecked:
        fill_zip_crcs(path)  # ... and filled in from the page cache by ISA-L: the same standard zip (io.checksum)
    follow_umask(path)


def write_pt2(model: nn.Module, path: str, inputs: Inputs | None, static: bool = False,
              info: dict | None = None) -> None:
    """torch.export program (loads with torch.export.load alone). Every input dimension the model lets vary stays
    dynamic (``io.dims``, unless ``static``), each checked at a second size against ``model``; one that fails its
    check is pinned. Keyword inputs that are no tensors (``use_cache=False``) are left out of the program's inputs
    where the model computes the same without them (its config already says so), so the program runs on the
    tensors the model takes. ``info`` receives ``dynamic_dims``, ``notes``, and ``pinned_all`` where torch.export
    could not keep the dimensions free (its reasoning failed or ran past its limit; the program did not save).
    Dynamic dimensions torch.export refuses (a guard on the height it cannot solve: timm's DLA) are tried again with
    the batch alone dynamic, then every one pinned, as the ONNX export does; each listed with code
    ``refused-by-export`` (``io.dims.fixed``)."""
    from normconv.io import dims as io_dims
    from normconv.quiet import quiet
    from normconv.verify import compare

    if inputs is None:
        raise ValueError("example inputs are needed to write a .pt2")
    info = {} if info is None else info
    inputs = _tensor_kwargs_only(model, inputs)
    pinned: set[tuple[str, int]] = set()
    refused: dict = {}  # (input, axis) -> (code, why): torch.export refused it dynamic (or ran out of time), static
    lost: list = []  # the dimensions pinned by their checks, round by round
    while True:
        shapes = None if static else io_dims.export_shapes(model, inputs, pinned | set(refused))
        try:
            ep = export_program(model, inputs, shapes, pinned | set(refused))
        except Exception as exc:  # noqa: BLE001 - torch.export's symbolic reasoning may fail where static does not
            if shapes is None:
                raise
            # (timm's CPU-bone: NotImplementedError on an inequality sympy cannot decide): the batch alone dynamic
            # (past the time limit: not a second time), then every dimension pinned
            why = f"its reasoning about them {exc}; --static skips it" if isinstance(exc, Overtime) else describe(exc)
            rest = [p for p in io_dims.free_places(model, inputs, pinned | set(refused)) if p[1] != 0]
            said = (io_dims.DimWhy.OVERTIME, str(exc)[:200]) if isinstance(exc, Overtime) else \
                (io_dims.DimWhy.REFUSED, why[:200])  # place -> (code, why), as io_dims.fixed reads it
            refused.update({p: said for p in (io_dims.free_places(model, inputs, pinned | set(refused))
                                              if isinstance(exc, Overtime) or not rest else rest)})
            if rest and not isinstance(exc, Overtime):
                info.setdefault("notes", []).append(f"torch.export refuses dynamic dimensions for this model "
                                                    f"({why[:200]}): exported again with the batch alone dynamic")
                continue
            static = _pinned_all(info, f"torch.export failed with dynamic dimensions ({why})")
            continue
        dims = [] if shapes is None else io_dims.name_dims(io_dims.found(ep, io_dims.input_names(model, inputs)),
                                                           io_dims.input_shapes(model, inputs))
        program = ep.module()
        _same_program(model, program, inputs, path)
        io_dims.check(dims, model, inputs, lambda alt: run(model, alt), lambda alt: run(program, alt),
                      lambda a, b, label: compare(a, b, label=label))
        failed = [d for d in dims if d.pinned]
        if not failed:
            break
        pinned |= {p for d in failed for p in d.places}
        lost += failed
        info.setdefault("notes", []).extend(d.note() for d in failed)
    # specialized by the trace, or refused dynamic by torch.export
    held = [] if shapes is None and not refused else io_dims.fixed(ep, model, inputs, dims, model, pinned,
                                                                  refused=refused)
    info.setdefault("notes", []).extend(io_dims.fixed_notes(held))
    info["dynamic_dims"] = [d.to_json() for d in lost + dims + held]
    if _plain_outputs(ep):
        info.setdefault("notes", []).append(
            f"the .pt2 returns its outputs as a dict ({', '.join(ep.call_spec.out_spec.context)}): the model's "
            f"{type(run(model, inputs)).__name__} would need transformers to load")
    try:  # torch's logger warns about the temp file's name (not a .pt2 suffix)
        with quiet(("torch", "torch.export", "torch.export.pt2_archive._package")), latched(path) as f:
            torch.export.save(ep, f)
    except OSError:
        raise
    except Exception as exc:  # noqa: BLE001 - Python arithmetic on a symbolic size (NASNet's math.ceil) is a node
        if shapes is None:  # torch.export cannot save; with the example's shapes it is computed while tracing
            raise
        _pinned_all(info, f"torch.export cannot save the program with dynamic dimensions ({describe(exc)})")
        return write_pt2(model, path, inputs, static=True, info=info)
    follow_umask(path)


def _same_program(model: nn.Module, program: nn.Module, inputs: Inputs, path: str) -> None:
    """The program computes what ``model`` does at the example inputs (the dims' checks judge other sizes only),
    else VerificationError: a .pt2 that took another path than the model (a branch on the grad mode, a value the
    trace fixed) is never written."""
    from normconv.errors import VerificationError
    from normconv.verify import compare

    v = compare(run(model, inputs), run(program, inputs), label="the .pt2 program at the example inputs")
    if not v.passed:
        raise VerificationError(f"cannot write {path}: the torch.export program differs from the model at the "
                                f"example inputs ({v.worst}; {v.criterion}); write a .pt (torch.load) instead")


def _pinned_all(info: dict, why: str) -> bool:
    """Say in ``info`` that torch.export could not keep the dimensions free (``why``) and every one is pinned."""
    info.setdefault("notes", []).append(f"{why}: every dimension pinned to the example's size")
    info["pinned_all"] = True
    return True


def export_program(model: nn.Module, inputs: Inputs, shapes: dict | None,
                   pinned: set[tuple[str, int]] = frozenset()):
    """torch.export.export with ``shapes`` (an example batch of 1 traced at 2, where the model takes it)."""
    from normconv.io import dims as io_dims
    from normconv.quiet import quiet

    wide = io_dims.widened(model, inputs, pinned) if shapes is not None else None
    for example in ([wide] if wide is not None else []) + [inputs]:
        try:
            fresh = io_dims.unmarked(example)  # a failed dynamic export leaves its marks on the tensors given
            # a failing export logs the whole graph; its dynamic-shape reasoning can run for ever (time-limited)
            # traced without autograd, as every check runs the model (``verify.run``): a forward that branches on
            # torch.is_grad_enabled() (d2l's hand-written BatchNorm) is written taking the branch the checks proved
            with interrupt_kept(), quiet(("torch",), stderr=True), torch.no_grad(), \
                    time_limit(DYNAMIC_EXPORT_S if shapes is not None else None):
                ep = torch.export.export(model, tuple(fresh.args), dict(fresh.kwargs), dynamic_shapes=shapes,
                                         strict=False)
        except Exception as exc:
            if example is inputs or isinstance(exc, Overtime):  # past the limit: not a second time
                raise
            continue
        # a batch the widened trace specialized (a branch on it) would make the program static at 2: the example's
        # own batch instead
        if example is inputs or io_dims.kept_free(ep, model, inputs, pinned):
            return ep
    raise AssertionError("unreachable")


def _plain_outputs(ep) -> bool:
    """A program returning a dict subclass of a library's own (a Hugging Face ModelOutput) returns a plain dict of
    the same keys instead: torch.export.load would need that library imported to rebuild the class. True if
    changed."""
    from torch.utils._pytree import TreeSpec

    spec = ep.call_spec.out_spec
    if spec is None or spec.type is dict or not isinstance(spec.type, type) or not issubclass(spec.type, dict):
        return False
    ep._module_call_graph[0].signature.out_spec = TreeSpec(dict, list(spec.context), list(spec.children()))
    return True


def _tensor_kwargs_only(model: nn.Module, inputs: Inputs) -> Inputs:
    """``inputs`` without keyword arguments that are no tensors (a Hugging Face ``use_cache=False``) where the
    model's outputs are the same without them; else ``inputs`` as they are."""
    constant = [k for k, v in inputs.kwargs.items() if not isinstance(v, torch.Tensor)]
    if not constant:
        return inputs
    from normconv.verify import compare

    lean = Inputs(inputs.args, {k: v for k, v in inputs.kwargs.items() if k not in constant})
    try:
        same = compare(run(model, inputs), run(model, lean), 0.0, 0.0).passed
    except Exception:  # noqa: BLE001 - the model needs them (or returns something else without them)
        return inputs
    return lean if same else inputs


def write_safetensors(model: nn.Module, path: str, inputs: Inputs | None) -> None:
    """The state_dict as safetensors, tied tensors stored once (as transformers' save_pretrained and
    safetensors.torch.save_model do: ``safetensors.torch.load_model`` or ``from_pretrained`` ties them again)."""
    from safetensors.torch import save

    with latched(path) as f:
        f.write(save(untied_state(model), metadata={"format": "pt"}))
    follow_umask(path)


def untied_state(model: nn.Module) -> dict[str, torch.Tensor]:
    """``model.state_dict()`` with each shared tensor once: names whose tensor is the same storage as a kept one are
    left out (safetensors' own choice of which name to keep, the one ``load_model`` expects); tensors that share
    storage only in part are written as copies."""
    from safetensors.torch import _remove_duplicate_names

    state = model.state_dict()
    try:
        dropped = {n for names in _remove_duplicate_names(state).values() for n in names}
    except ValueError:  # views of one storage none of which covers it: no name to keep, each stored as a copy
        dropped = set()
    kept = {k: v for k, v in state.items() if k not in dropped}
    owners: dict[Any, int] = {}
    for v in kept.values():
        if v.device.type != "meta" and v.numel():
            key = (v.device, v.untyped_storage().data_ptr())
            owners[key] = owners.get(key, 0) + 1
    return {k: (v.detach().clone() if v.numel() and owners.get((v.device, v.untyped_storage().data_ptr()), 0) > 1
                else v.detach()).contiguous() for k, v in kept.items()}


# norm hyper-parameters a Hugging Face config sets; a rewrite that changes one is not expressible by the config
_CONFIG_ATTRS = ("eps", "variance_epsilon", "normalized_shape", "elementwise_affine", "num_features", "momentum")


def config_mismatch(original: nn.Module, rewritten: nn.Module) -> str | None:
    """Why ``rewritten`` cannot be saved as a Hugging Face folder whose config rebuilds it (from_pretrained builds
    the architecture from config.json, then loads weights by name): a module class, a state_dict key, a norm's
    hyper-parameter or a hook that differs. None when only weight values changed."""
    before, after = dict(original.named_modules()), dict(rewritten.named_modules())
    for path, m in after.items():
        old = before.get(path)
        if old is None or type(old) is not type(m):
            was = type(old).__name__ if old is not None else "nothing"
            return f"{path or 'the model'} is now {type(m).__name__} (was {was})"
        for attr in _CONFIG_ATTRS:
            if hasattr(m, attr) and getattr(m, attr) != getattr(old, attr, None):
                return f"{path}.{attr} is {getattr(m, attr)!r} (the config says {getattr(old, attr, None)!r})"
        if len(m._forward_hooks) + len(m._forward_pre_hooks) > len(old._forward_hooks) + len(old._forward_pre_hooks):
            return f"{path or 'the model'} carries forward hooks the config cannot express"
    gone = set(before) - set(after)
    if gone:
        return f"{sorted(gone)[0]} was removed"
    if set(original.state_dict()) != set(rewritten.state_dict()):
        changed = sorted(set(original.state_dict()) ^ set(rewritten.state_dict()))
        return f"the state_dict keys changed (e.g. {changed[0]})"
    return None


def write_hf_folder(model: nn.Module, path: str, inputs: Inputs | None) -> None:
    """save_pretrained into ``path`` (a new folder): config.json + safetensors, loadable with from_pretrained."""
    from transformers.utils import logging as hf_logging

    bars = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()  # no "Writing model shards" bar on stderr: normconv's output is its own
    try:
        model.save_pretrained(path, safe_serialization=True)
    finally:
        if bars:
            hf_logging.enable_progress_bar()
    follow_umask(path, 0o777)
    for name in os.listdir(path):  # save_pretrained's weights come 0600 (a temp file renamed): as open() makes them
        if os.path.isfile(os.path.join(path, name)):
            follow_umask(os.path.join(path, name))


WRITERS: dict[str, Callable[[nn.Module, str, Any], None]] = {
    "pickle": write_pickle, "pt2": write_pt2, "safetensors": write_safetensors, "hf": write_hf_folder,
}

__all__ = ["WRITERS", "export_program", "torch_only", "normconv_parts", "graph_modules", "holds_graph_modules",
           "follow_umask", "write_pickle", "write_pt2", "write_safetensors", "write_hf_folder", "config_mismatch",
           "INPUTS_ATTR"]
