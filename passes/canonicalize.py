"""Canonicalize hand-written norms into torch's native modules, carrying weights, bias, eps and dtype behaviour.

  (x - mean(x)) * rsqrt(var(x) + eps) * w + b          ->  nn.LayerNorm(shape, eps)         (same w, b)
  x * rsqrt(mean(x^2) + eps) * w   (Llama/T5, fp32)     ->  make_rmsnorm(shape, eps, w)      (same w)
  x * rsqrt(mean(x^2) + eps) * (1 + w)   (Gemma)        ->  make_rmsnorm(shape, eps, 1 + w)
  (x - running_mean) / sqrt(running_var + eps) * w + b  ->  nn.BatchNormNd(C, eps), eval, stats copied
  (x - mean_HW(x)) / sqrt(var_HW(x) + eps) * w + b      ->  nn.InstanceNormNd(C, eps, affine)
  the first over x.view(N, G, -1), viewed back, * w + b ->  nn.GroupNorm(G, C, eps) (G = C: nn.InstanceNormNd)
  any of the first two over non-trailing dims D (NAFNet's channels-first LayerNorm2d: D = dim 1 of NCHW)
                                                        ->  MovedDimNorm(native, D): native(x.movedim(D, -1)) moved back

Every rewrite is an identity of the math, so the pass is exact. Two forms:
  module   a hand-written norm module (its whole forward is the norm), or a module whose whole forward is one
           functional norm between casts (OLMo's F.layer_norm in float32, cast back): replaced in its parent, the
           user's own class comes back; works on symbolic_trace and torch.export captures (all HF models).
  inline   a norm computed inside a larger forward: the traced graph's subgraph becomes one call_module of
           a new native module, and the result is a torch.fx.GraphModule (only then). Refused in a
           torch.export graph (an aten graph is not the user's model).
Every candidate replacement is run on the norm's own input recorded on the example inputs and must
reproduce the recorded output within the dtype's tolerance; ``plan`` (what ``inspect`` shows) and
``__call__`` read the same analysis, so they never disagree.
Dtype behaviour (measured, torch 2.13 CPU): native LayerNorm / RMSNorm / BatchNorm in fp16 / bf16 compute their
statistics in float32, so a single-dtype half model keeps one native module per norm (Llama/T5 round twice,
the native op once: at most 1 ulp of the output apart). Gemma's ``(1 + w)`` is applied in float32 and 1 + w
is not representable in half: such a site (and any mixed-dtype site) gets ``Float32Norm``, a native norm in
float32 between two casts, bit-exact.
"""

from __future__ import annotations

import copy
import math
from dataclasses import dataclass
from typing import Any, Sequence

import torch
import torch.fx as fx
import torch.nn as nn

from normconv import kinds
from normconv.graph.detect import NormSite, find_norms, spans_graph
from normconv.graph.handwritten import owns_only
from normconv.graph.norm_module import held_by
from normconv.graph.capture import Captured
from normconv.report import PassResult, Site, Why
from normconv.verify import Inputs, compare, default_tolerance, forward_guard, run, same_bits
from normconv.nn.modules import Float32Norm, MovedDimNorm

from .base import Pass, apply, replace_module, skip

NAME = "canonicalize"



class CanonWhy(Why):
    """Each decision of the pass, by rule."""

    REPLACED = "replaced"  # a hand-written norm becomes its native module
    RENAMED_KEYS = "replaced-renamed-keys"  # ... whose state_dict keys take the native names
    ALREADY_NATIVE = "already-native"  # one native op or module already: nothing to do
    INLINE_IN_EXPORT = "inline-in-aten-graph"  # an inline norm in a torch.export graph: no user module to replace
    INTERMEDIATE_USED = "intermediate-used"  # a value inside the norm feeds other code
    DIMS_UNKNOWN = "dims-unknown"  # the normalized dims or their sizes are unknown
    DIMS_ABSOLUTE = "dims-absolute"  # normalized dims not counted from the end
    BAD_EPS = "bad-eps"  # epsilon not a finite non-negative number
    CHANNELS_UNKNOWN = "channels-unknown"  # a batch / instance norm whose channel count is unknown
    NO_NATIVE_RANK = "no-native-module"  # an instance norm of a rank no native module takes
    UNREADABLE = "unreadable-parameter"  # the norm's weight / bias / statistics cannot be read
    WRONG_SIZE = "wrong-size"  # a parameter is not one value per normalized element / channel
    SHARED = "shared-parameter"  # a parameter is shared, or read outside the norm
    CALL = "called-otherwise"  # the module is called with more than one tensor
    NOT_RUN = "not-run"  # the norm did not run on the example inputs: nothing to check against
    NOT_A_TENSOR = "returns-non-tensor"  # the module returns something other than the normalized tensor
    REPLACEMENT_FAILS = "replacement-fails"  # the native module rejects the recorded input
    DTYPE = "dtype-differs"  # the native module returns another dtype
    DIFFERS = "differs"  # the native module differs from the norm on the recorded input
    TRAINING_DIFFERS = "differs-in-training"  # ... in training mode (a frozen BatchNorm, a branch on self.training)


_HALF = (torch.float16, torch.bfloat16)
_MAX_RECORDED_CALLS = 4  # calls of one module checked against its replacement


# ---------------------------------------------------------------------------------------------------------
# the analysis plan and __call__ share


@dataclass
class Decision:
    """What the pass does with one norm site: the native module it inserts there, or why not."""

    site: NormSite
    applied: bool
    reason: str
    code: CanonWhy = CanonWhy.REPLACED
    form: str = ""  # module | inline
    module: nn.Module | None = None  # the native replacement (None when skipped)
    path: str = ""  # form module: the module replaced (the site's own module, or the module around a functional norm)

    @property
    def key(self) -> str:
        """Where the replacement goes: the module path (form module), else the site."""
        return self.path or self.site.target

    def to_site(self) -> Site:
        return (apply if self.applied else skip)(NAME, self.site, self.reason, self.code)


def analyze(cap: Captured, norms: Sequence[NormSite], functional: bool = False) -> list[Decision]:
    """Decide every site: structural rules first, then the replacement is checked on the recorded values.

    ``functional``: also turn functional ``F.layer_norm`` / ``F.rms_norm`` calls into modules (what swap asks
    for, since it replaces norm modules; on its own canonicalize leaves a native functional call alone)."""
    decisions = [_structural(cap, s, functional) for s in norms]
    calls = _holder_calls(cap, decisions)
    for group in calls.values():  # one module for every call of one holder, checked on every call's recording
        for d in group[1:]:
            d.module = group[0].module if all(c.applied for c in group) else d.module
    candidates = [d for d in decisions if d.applied]
    # a site already checked on this capture keeps its verdict (inspect plans canonicalize, swap's first step and
    # export on one capture: one recording forward where there were three); its module is built anew each time
    fresh = [d for d in candidates if (d.key, d.form, d.site.target) not in cap.checked]
    recorded = _record(cap, fresh) if fresh else {}
    for d in candidates:
        seen = cap.checked.get((d.key, d.form, d.site.target))
        if seen is None:
            _check(d, recorded.get(d.key, []), recorded.get(("call", d.key)),
                   cap.modules.get(d.key) if d.form == "module" else None)
            cap.checked[(d.key, d.form, d.site.target)] = (d.applied, d.reason, d.code)
        elif seen[0]:
            d.reason = seen[1]  # with what the check added (judged in float32)
        else:
            d.applied, d.reason, d.code, d.module = False, seen[1], seen[2], None
    _one_module_per_holder(calls)
    return decisions


def _holder_calls(cap: Captured, decisions: list[Decision]) -> dict[str, list[Decision]]:
    """An exported program's holder (``_holder_of``) -> the decisions of its calls, where it is called more than once
    (a .pt2 of a model calling one norm module at several places: each call is inline in the program's graph)."""
    by_owner: dict[str, list[Decision]] = {}
    for d in decisions:
        if d.form == "inline" and _holder_of(cap, d.site):
            by_owner.setdefault(d.site.owner, []).append(d)
    return {owner: group for owner, group in by_owner.items() if len(group) > 1}


def _one_module_per_holder(calls: dict[str, list[Decision]]) -> None:
    """A holder's calls share its tensors: one native module takes the holder's place and every call calls it, so
    either every call is replaced (each reproduced by that one module) or none, else a call left inline would read
    tensors the native module no longer holds under those names."""
    for owner, group in calls.items():
        kept = [d for d in group if not d.applied]
        if not kept or len(kept) == len(group):
            continue
        first = kept[0]
        for d in group:
            if d.applied:
                d.applied, d.code, d.module = False, CanonWhy.SHARED, None
                d.reason = (f"{owner} is called {len(group)} times and its calls share its tensors: one native "
                            f"module replaces them all or none, and one call is not replaced ({first.reason})")


def plan(cap: Captured, norms: Sequence[NormSite]) -> list[Site]:
    return [d.to_site() for d in analyze(cap, norms)]


def _structural(cap: Captured, site: NormSite, functional: bool = False) -> Decision:
    no = lambda reason, code: Decision(site, False, reason, code)  # noqa: E731
    owner_is_norm = isinstance(cap.modules.get(site.owner), (nn.LayerNorm, nn.RMSNorm))
    # F.layer_norm / F.rms_norm in a user's forward  =>  a module, when asked (swap replaces modules)
    modularize = (functional and site.source == "functional" and site.kind in ("layernorm", "rmsnorm")
                  and not owner_is_norm)
    # already one native op  =>  nothing to do
    if site.source != "handwritten" and not modularize:
        native = site.module_type if site.source == "module" or owner_is_norm else None
        return no(f"already native ({native or 'functional ' + site.kind})", CanonWhy.ALREADY_NATIVE)
    # an exported program's container (.pt2) is never called: its graph computes the norm, rewritten inline
    form = "module" if site.source == "handwritten" and site.target == site.owner and site.target in cap.modules \
        and not _holder(cap, site.target) else "inline"
    # a module whose whole forward is this functional norm (OLMo: cast, F.layer_norm, cast back)  =>  the module
    path = site.target if form == "module" else \
        site.owner if modularize and not _holder(cap, site.owner) and _whole_module(cap, site) else ""
    form = "module" if path else form
    # inline subgraph in an aten graph  =>  no user module to put a native one into
    if form == "inline" and cap.method != "symbolic_trace":
        return no(f"inline {site.kind} inside {site.owner or 'the root forward'} in a torch.export graph: only "
                  f"norm modules are replaced there (move the norm into its own module)", CanonWhy.INLINE_IN_EXPORT)
    # an intermediate (mean, rsqrt, ...) feeds other code  =>  replacing the subgraph would change that code
    if not site.self_contained:
        return no("an intermediate value of the norm is used outside it", CanonWhy.INTERMEDIATE_USED)
    # non-trailing normalized dims  =>  no native module normalizes them
    if site.kind in ("layernorm", "rmsnorm") and (site.dims is None or site.normalized_shape is None):
        return no("normalized dims or their sizes are unknown (dynamic shape)", CanonWhy.DIMS_UNKNOWN)
    if site.kind in ("layernorm", "rmsnorm") and any(d >= 0 for d in site.dims):
        return no(f"normalized dims {list(site.dims)} are not relative to the input's rank", CanonWhy.DIMS_ABSOLUTE)
    if site.eps is None or not math.isfinite(site.eps) or site.eps < 0:
        return no(f"epsilon {site.eps} is not a finite non-negative number", CanonWhy.BAD_EPS)
    x = cap.nodes[site.input]
    shape = cap.shape(x)
    if site.kind in ("batchnorm", "instancenorm") and (shape is None or len(shape) < 2 or not site.num_features):
        return no("the channel count is unknown (dynamic shape)", CanonWhy.CHANNELS_UNKNOWN)
    if site.kind == "instancenorm" and len(shape) not in (4, 5):
        return no(f"instance norm over a rank-{len(shape)} input: no native module", CanonWhy.NO_NATIVE_RANK)
    tensors = {role: cap.tensor(name) if name else None
               for role, name in (("weight", site.weight), ("bias", site.bias),
                                  ("running_mean", site.running_mean), ("running_var", site.running_var))}
    missing = [role for role, name in (("weight", site.weight), ("bias", site.bias), ("running_mean",
               site.running_mean), ("running_var", site.running_var)) if name and tensors[role] is None]
    if missing:
        return no(f"cannot read the norm's {', '.join(missing)} from the model", CanonWhy.UNREADABLE)
    size = math.prod(site.normalized_shape) if site.kind in ("layernorm", "rmsnorm") else site.num_features
    for role, t in tensors.items():
        # a parameter that is not one value per normalized element / channel  =>  not this native norm
        if t is not None and t.numel() != size:
            return no(f"{role} has {t.numel()} elements, the native norm needs {size}", CanonWhy.WRONG_SIZE)
    shared = _shared(cap, site, form, path)
    if shared:
        return no(shared, CanonWhy.SHARED)
    in_dtype = cap.dtype(x) or torch.float32
    out_dtype = cap.dtype(cap.nodes[site.node]) or in_dtype
    module, what = _build(site, tensors, shape, in_dtype, out_dtype)
    where = f"module {path} ({site.module_type})" if form == "module" else \
        f"the whole module ({type(cap.model).__name__}: its forward is the norm)" if spans_graph(cap, site) else \
        f"functional {site.kind} in {site.owner or 'the root forward'} (so swap can replace a module)" \
        if modularize else f"inline subgraph ({len(site.nodes)} ops) in {site.owner or 'the root forward'}"
    reason = f"replace {where} by {what}"
    renamed = _renamed_keys(site, path, module) if form == "module" else ""
    if renamed:
        reason += f"; state_dict keys {renamed}"
    return Decision(site, True, reason, CanonWhy.RENAMED_KEYS if renamed else CanonWhy.REPLACED, form, module, path)


def _holder(cap: Captured, path: str) -> bool:
    """The module at ``path`` is a holder (an exported program's: never called, the program's graph computes what
    the user's module did with its tensors; graph.norm_module.held_by)."""
    return bool(path) and path in cap.modules and held_by(cap.model, path) is not None


def _holder_of(cap: Captured, site: NormSite) -> bool:
    """The site's owner is a container (``_holder``) holding the site's tensors and nothing else: the native module
    takes its place, under its path (a .pt2's LayerNorm stays ``blocks.0.n1``)."""
    mod = cap.modules.get(site.owner)
    if not _holder(cap, site.owner) or list(mod.children()):
        return False
    mine = {n for n in (site.weight, site.bias, site.running_mean, site.running_var) if n}
    return {f"{site.owner}.{n}" for n in list(mod._parameters) + list(mod._buffers)} <= mine


def _whole_module(cap: Captured, site: NormSite) -> bool:
    """The site's owner is a leaf module computing nothing but the norm and the casts around it."""
    mod = cap.modules.get(site.owner)
    if not site.owner or mod is None or list(mod.children()):
        return False
    acc = set(site.nodes)
    v = cap.nodes[site.input]
    while cap.op(v) == "cast" and cap.owner(v) == site.owner:  # x.to(float32) before the norm
        acc.add(v.name)
        v = v.args[0]
    v = cap.nodes[site.node]
    while len(cap.users(v)) == 1 and cap.op(cap.users(v)[0]) == "cast" and cap.owner(cap.users(v)[0]) == site.owner:
        v = cap.users(v)[0]  # .to(input dtype) after it
        acc.add(v.name)
    return owns_only(cap, site.owner, acc)


def _build(site: NormSite, t: dict[str, torch.Tensor | None], shape: tuple[int, ...], in_dtype: torch.dtype,
           out_dtype: torch.dtype) -> tuple[nn.Module, str]:
    """The native module for a site (in a Float32Norm where the dtype flow needs one) and how to say it."""
    w, b = t["weight"], t["bias"]
    param_dtype = w.dtype if w is not None else b.dtype if b is not None else in_dtype
    device = next((v.device for v in t.values() if v is not None), torch.device("cpu"))
    # half input, float32 compute with the scale applied in float32 (Gemma), or mixed dtypes  =>  Float32Norm
    wide = (site.upcast and in_dtype in _HALF and bool(site.weight_offset)) or \
        (param_dtype != in_dtype) or (out_dtype != in_dtype)
    dtype = torch.float32 if wide and site.upcast else (torch.promote_types(param_dtype, in_dtype) if wide
                                                        else param_dtype)
    # the site's kind builds its native module (normconv/kinds/)
    mod, desc, notes = kinds.by_name(site.kind).native(site, t, shape, dtype, device)
    for name, p in mod.named_parameters():  # a frozen hand-written norm stays frozen
        src = w if name == "weight" and w is not None else b if name == "bias" and b is not None else None
        if isinstance(src, nn.Parameter):
            p.requires_grad_(src.requires_grad)
    moved = site.kind in ("layernorm", "rmsnorm") and site.dims != tuple(range(-len(site.dims), 0))
    if moved:
        # a norm over non-trailing dims (channels-first)  =>  the native norm on x.movedim(dims, trailing), moved back
        mod = MovedDimNorm(mod, tuple(sorted(site.dims)))
        notes.insert(0, f"over dims {list(mod.dims)}: moved last and back")
    if wide:
        out = None if out_dtype == in_dtype else out_dtype
        mod = Float32Norm(mod, dtype, out)
        notes.insert(0, f"computed in {_dt(dtype)} between casts (input {_dt(in_dtype)}, output {_dt(out_dtype)})")
    return mod, desc + (f" ({'; '.join(notes)})" if notes else "")


def _dt(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _renamed_keys(site: NormSite, path: str, module: nn.Module) -> str:
    """Old -> new state_dict names of a module site replaced at ``path`` (the native module's names replace the
    hand-written ones; a wrapper such as Float32Norm / MovedDimNorm puts them under ``norm.``)."""
    keys = {k.rsplit(".", 1)[-1]: k for k in module.state_dict()}
    pairs = []
    for role in ("weight", "bias", "running_mean", "running_var"):
        old = getattr(site, role)
        new = f"{path}.{keys.get(role, role)}"
        if old and old != new:
            pairs.append((old, new))
    if not pairs:
        return ""
    return ", ".join(f"{a} -> {b}" for a, b in pairs)


def _shared(cap: Captured, site: NormSite, form: str, path: str) -> str:
    """Why a parameter of the site cannot move into a new module ('' when none is shared)."""
    names = [n for n in (site.weight, site.bias, site.running_mean, site.running_var) if n]
    aliases: dict[int, list[str]] = {}
    for n, t in list(cap.model.named_parameters(remove_duplicate=False)) + \
            list(cap.model.named_buffers(remove_duplicate=False)):
        aliases.setdefault(id(t), []).append(n)
    inside = set(site.nodes)
    for name in names:
        t = cap.tensor(name)
        others = [a for a in aliases.get(id(t), [name]) if a != name and
                  not (form == "module" and a.startswith(path + "."))]
        if others:
            return f"{name} is shared with {others[0]}: moving it into a native module would untie them"
        for node in cap.gm.graph.nodes:
            outside = [u for u in cap.users(node) if u.name not in inside] if cap.param_name(node) == name else []
            # the module replaced whole, read by its other calls (a shared qk_norm)  =>  one native module keeps
            # the tie; every call's recorded output is reproduced by it (_record hooks the module)
            if form == "module" and all(path in cap.owner_stack(u) for u in outside):
                continue
            # an exported program's holder called more than once (.pt2: each call inline), read by its calls
            # alone  =>  one native module in the holder's place, called at each call, keeps the tie (every call
            # replaced or none: _one_module_per_holder)
            if form == "inline" and _holder_of(cap, site) and all(cap.owner(u) == site.owner for u in outside):
                continue
            # the same hand-written module called twice, traced inline: both calls read one parameter
            if site.owner and any(cap.owner(u) == site.owner for u in outside):
                return (f"{site.owner} is called more than once and its calls share {name}: "
                        f"one native module per call would untie them")
            if outside:
                return f"{name} is also read outside the norm"
    return ""


# ---------------------------------------------------------------------------------------------------------
# recording each norm's input and output on the example inputs


def _record(cap: Captured, candidates: list[Decision]) -> dict[Any, Any]:
    """site target -> [(input, output), ...] recorded on the example inputs; ("call", target) -> call problem.

    Module sites are recorded with forward hooks on the eager model (which also shows how the module is
    called); inline sites by interpreting the traced graph.
    """
    found: dict[Any, Any] = {}
    modules = {d.key for d in candidates if d.form == "module"}
    inline = [d for d in candidates if d.form == "inline"]
    if modules:
        handles = []

        def hook(path):
            def fn(module, args, kwargs, output):
                calls = found.setdefault(path, [])
                if len(args) != 1 or kwargs or not isinstance(args[0], torch.Tensor):
                    found[("call", path)] = (f"called with {len(args)} positional and {len(kwargs)} keyword "
                                             f"arguments; a native norm takes one tensor")
                elif len(calls) < _MAX_RECORDED_CALLS:
                    calls.append((args[0].detach().clone(), _detach(output)))
            return fn

        for path in modules:
            handles.append(cap.modules[path].register_forward_hook(hook(path), with_kwargs=True))
        try:
            run(cap.model, cap.inputs)  # guarded: eval mode, no grad, the model's state restored
        finally:
            for h in handles:
                h.remove()
    if inline:
        want = {d.site.input for d in inline} | {d.site.node for d in inline}
        values: dict[str, Any] = {}

        class Recorder(fx.Interpreter):
            def run_node(self, n):
                v = super().run_node(n)
                if n.name in want:
                    values[n.name] = _detach(v)
                return v

        with forward_guard(cap.gm):
            Recorder(cap.gm).run(*copy.deepcopy(cap.inputs.args))
        for d in inline:  # a holder's calls share its target: each call's values recorded
            if d.site.input in values and d.site.node in values:
                found.setdefault(d.site.target, []).append((values[d.site.input], values[d.site.node]))
    return found


def _detach(v: Any) -> Any:
    return v.detach().clone() if isinstance(v, torch.Tensor) else v


def _check(d: Decision, calls: list[tuple[Any, Any]], call_problem: str | None,
           original: nn.Module | None = None) -> None:
    """Run the replacement on each recorded input; refuse the site unless it reproduces the recorded output, or, on
    half-precision data, the hand-written module's own float32 computation better than the recorded output does
    (``original``: that module; a norm without upcast overflows in fp16 where the native one does not)."""
    def refuse(reason: str, code: CanonWhy) -> None:
        d.applied, d.reason, d.code, d.module = False, reason, code, None

    if call_problem:
        return refuse(call_problem, CanonWhy.CALL)
    if not calls:
        return refuse("the norm did not run on the example inputs, so its replacement cannot be checked",
                      CanonWhy.NOT_RUN)
    judged_in_float32 = False  # said once, for the first call that needs it
    for x, y in calls:
        if not isinstance(y, torch.Tensor):
            return refuse(f"the module returns a {type(y).__name__}, not the normalized tensor",
                          CanonWhy.NOT_A_TENSOR)
        try:
            with torch.no_grad():
                got = d.module(x)
        except Exception as exc:  # the native module rejects this input (shape, dtype)
            return refuse(f"the native replacement fails on the recorded input: {type(exc).__name__}: "
                          f"{str(exc).splitlines()[0] if str(exc) else ''}", CanonWhy.REPLACEMENT_FAILS)
        if got.dtype != y.dtype:
            return refuse(f"the native replacement returns {_dt(got.dtype)} where the norm returns {_dt(y.dtype)}",
                          CanonWhy.DTYPE)
        atol, rtol = default_tolerance(y.dtype)
        if _surely_within(y, got, atol, rtol):  # compare's verdict for certain, without its float64 pass
            continue
        v = compare(y, got, atol, rtol)
        wide = _float32_form(original, x, y) if not v.passed else None
        if wide is not None:
            # half norm that loses its statistics (x^2 overflows)  =>  judged by its float32 computation
            ours, theirs = compare(wide, got.float(), atol, rtol), compare(wide, y.float(), atol, rtol)
            if ours.passed and not theirs.passed:
                if not judged_in_float32:
                    judged_in_float32 = True
                    d.reason += (f"; in {_dt(y.dtype)} it differs from the hand-written norm by "
                                 f"{v.max_abs_error:.3g}, which is {theirs.max_abs_error:.3g} off the norm's own "
                                 f"float32 computation (the replacement: {ours.max_abs_error:.3g})")
                continue
        if not v.passed:
            return refuse(f"the native replacement differs from the norm on the recorded input "
                          f"(max abs error {v.max_abs_error:.3g}, atol {atol:g})", CanonWhy.DIFFERS)
    # the module the native one replaces trains as it did: both in training mode on the first recorded input
    # (torchvision's FrozenBatchNorm2d keeps its statistics there, nn.BatchNorm2d takes the batch's)
    differs = _differs_in_training(original, d.module, *calls[0]) if original is not None else None
    if differs:
        return refuse(f"in training mode (model.train()) the native replacement computes otherwise ({differs}): the "
                      f"hand-written norm is kept, as the model trains with it (fold folds it for inference)",
                      CanonWhy.TRAINING_DIFFERS)
    return None


def _differs_in_training(original: nn.Module, native: nn.Module, x: torch.Tensor, want_eval: Any) -> str:
    """How the native module differs from the hand-written one in training mode on ``x`` ('' where it does not:
    neither computes otherwise in training mode than in eval mode (``want_eval``: the hand-written one's recorded
    output), or both compute the same there; or where the hand-written one does not run in training mode: nothing to
    keep then)."""
    try:
        want = run(original, Inputs((x,)), training=True)
    except Exception:  # noqa: BLE001 - a norm that runs in eval mode only: the model is not trained with it
        return ""
    try:
        got, got_eval = run(native, Inputs((x,)), training=True), run(native, Inputs((x,)))
    except Exception as exc:  # noqa: BLE001
        return f"it fails: {type(exc).__name__}"
    if not all(isinstance(t, torch.Tensor) for t in (want, want_eval, got, got_eval)):
        return ""
    if same_bits(want, want_eval) and same_bits(got, got_eval):  # training mode changes neither: the eval check
        return ""                                                    # (with its half-precision rule) stands
    atol, rtol = default_tolerance(want.dtype)
    v = compare(want, got, atol, rtol)
    return "" if v.passed else f"max abs error {v.max_abs_error:.3g}: frozen statistics, or a branch on self.training"


def _surely_within(y: torch.Tensor, got: torch.Tensor, atol: float, rtol: float) -> bool:
    """Same shape, every element within half of atol + rtol |y| in their own dtype, ``y`` not all zero: then
    ``compare``'s element-wise check passes whatever the rounding of this one (a NaN, an infinity: False, and
    ``compare`` decides). 113 sites of a ViT checked twice spent 12 s in compare's float64 statistics."""
    return got.shape == y.shape and bool(y.any()) and bool(((got - y).abs() <= 0.5 * (atol + rtol * y.abs())).all())


def _float32_form(original: nn.Module | None, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor | None:
    """The hand-written module run in float32 on ``x`` (None unless ``x`` / ``y`` are half and it runs)."""
    if original is None or x.dtype not in _HALF or y.dtype not in _HALF:
        return None
    try:
        with torch.no_grad():
            out = copy.deepcopy(original).float()(x.float())
    except Exception:  # a module that does not run in float32 on its own: judged in its dtype only
        return None
    return out if isinstance(out, torch.Tensor) and out.shape == y.shape else None


# ---------------------------------------------------------------------------------------------------------
# applying the decisions


class Canonicalize(Pass):
    """Replace every hand-written norm by the native module that computes the same thing
    (``functional=True``: functional layer_norm / rms_norm calls too; see ``analyze``). Its result's
    ``extra["renamed"]``: site target -> path of the module that replaced it."""

    name = NAME
    by_parts = True  # each site is rewritten where it stands: a submodule's graph proves it
    trains = True  # a native module in place of a hand-written one trains as it did

    def __init__(self, functional: bool = False):
        self.functional = functional

    def plan(self, cap: Captured, norms: Sequence[NormSite]) -> list[Site]:
        return [d.to_site() for d in analyze(cap, norms, self.functional)]

    def __call__(self, model: nn.Module, cap: Captured) -> PassResult:
        if cap.model is not model:
            raise ValueError("canonicalize: the capture must be of the model being rewritten")
        decisions = analyze(cap, find_norms(cap), self.functional)
        applied = [d for d in decisions if d.applied]
        renamed = {d.site.target: d.key for d in applied}
        sites = tuple(d.to_site() for d in decisions)
        if len(applied) == 1 and spans_graph(cap, applied[0].site):
            # the module is itself the norm (a part captured alone): the native module takes its place whole
            module = applied[0].module
            module.train(model.training)
            return PassResult(module, True, sites, extra={"renamed": renamed})
        if any(d.form == "inline" for d in applied):
            model = _rewrite_graph(cap, applied, renamed)
        else:
            done: set[str] = set()
            for d in applied:
                if d.key not in done:  # a module called twice is replaced once
                    replace_module(model, d.key, d.module)
                    done.add(d.key)
        return PassResult(model, bool(applied), sites, extra={"renamed": renamed})


def _rewrite_graph(cap: Captured, applied: list[Decision], renamed: dict[str, str]) -> fx.GraphModule:
    """Each applied site's subgraph -> one call_module of its native module; unused attributes are dropped.
    ``renamed`` gets each site's new module path."""
    gm, graph = cap.gm, cap.gm.graph
    taken = {name for name, _ in gm.named_modules()}
    modules: dict[str, nn.Module] = {}
    for d in applied:
        s = d.site
        if d.form == "module":
            target = d.key  # the hand-written module's own path: the native module takes its place
        elif _holder_of(cap, s):  # an exported program's container: likewise (called twice: one module, two calls)
            target = s.owner
        else:
            target = _free_name(f"{s.owner}.{s.kind}" if s.owner else s.kind, taken)
        taken.add(target)
        renamed[s.target] = target
        modules.setdefault(target, d.module)  # a module called twice: one native module, two call sites
        out, x = cap.nodes[s.node], cap.nodes[s.input]
        with graph.inserting_after(out):
            new = graph.create_node("call_module", target, (x,))  # the module is added after the cleanup
        new.meta = dict(out.meta)
        out.replace_all_uses_with(new)
    # the replaced subgraphs are dead now (graph.eliminate_dead_code lints first, and the old attributes
    # of a replaced module path would fail that lint)
    # of a replaced module path would fail that lint); an exported program's dtype asserts on a replaced value go too
    replaced = {n for d in applied for n in d.site.nodes}
    for node in reversed(list(graph.nodes)):
        if node.op not in ("placeholder", "output") and not node.users and (not node.is_impure() or (
                cap.is_noise(node) and any(a.name in replaced for a in node.all_input_nodes))):
            graph.erase_node(node)
    for target, module in modules.items():
        gm.add_submodule(target, module)
    graph.lint()
    result = fx.GraphModule(gm, graph, type(cap.model).__name__)  # copies only what the graph still reads
    result.train(cap.model.training)
    for module in modules.values():
        if isinstance(module, nn.modules.batchnorm._BatchNorm):  # the traced subgraph was the inference form
            module.eval()
    return result


def _free_name(base: str, taken: set[str]) -> str:
    name, i = base, 1
    while name in taken:
        name, i = f"{base}_{i}", i + 1
    return name


CANONICALIZE = Canonicalize()


__all__ = ["CANONICALIZE", "Canonicalize", "Float32Norm", "analyze", "plan", "NAME"]
