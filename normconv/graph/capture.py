"""Graph capture: an FX graph of the model plus one node -> module-path view over both capture methods.

1. ``torch.fx.symbolic_trace`` with native norm modules as leaves (plain user models). The traced graph is
   trusted only if it reproduces the eager output on the example inputs (tracing can bake in a branch).
2. ``torch.export.export(strict=False)`` when tracing fails or disagrees (every Hugging Face model).

Both graphs carry ``nn_module_stack``; ``Captured.owner(node)`` reads it so passes see one view:
the module path that computed a node, the module object, the parameter a node reads, shape and dtype.

A capture that decided a Python branch on a tensor's value (torch.export.draft_export's data-dependent guards, or a
concrete tensor's value read while symbolic_trace ran: ``if self.flag.item()``) holds one branch only: it is
``specialized`` and lists each such ``Guard`` (``graph.branch_guards``: where it is, the module whose forward holds
it, what it decided); the engine refuses to claim an exact rewrite past it unless it proves the other branches are
not affected.

torch.export records each node's Python stack (``stack_trace``) unless told not to: 14% of a GPT-2 capture (0.12 of
0.89 s), and the analysis reads none of it. A capture takes none unless asked (``stack_traces=True``: an ONNX export
that reuses the capture carries them into its nodes' metadata); draft_export always does (its guards are placed by it).
The graphs it builds on the way write their Python code once, when run (about 0.2 s of a GPT-2 124M capture)."""

from __future__ import annotations

import contextlib
import copy
import functools
import operator
import time
from dataclasses import dataclass, field
from typing import Any, Iterable

import torch
import torch.fx as fx
import torch.nn as nn
from torch.fx.node import map_aggregate
from torch.fx.passes.shape_prop import _extract_tensor_metadata

from normconv.errors import CaptureError, NormconvError
from normconv.graph.autocast import inline_disabled
from normconv.graph.branch_guards import Guard, ValueReads, branch_site, clean_path, draft_guards
from normconv.io.inputs import with_attention_mask
from normconv.quiet import quiet
from normconv import kinds
from normconv.match import TRANSPARENT, op_of
from normconv.verify import Inputs, compare, forward_guard, output_leaves, run
from normconv.verify.guard import LazyGraphModule, lazy_code


class NormLeafTracer(fx.Tracer):
    """symbolic_trace that keeps torch's own modules (norms included) as leaves and traces user modules.

    Buffers are proxied too (``proxy_buffer_attributes``): otherwise ``sqrt(self.running_var + eps)`` is
    computed at trace time and frozen into a constant that no longer follows the buffer.
    """

    def __init__(self):
        super().__init__()
        self.proxy_buffer_attributes = True
        self.branched: list[tuple[str, str]] = []  # (owner, where) of a Python branch met on a traced value

    def to_bool(self, obj: Any) -> bool:
        """A Python branch on a traced value (a size, ``x.shape[1] > 2``, or a tensor): the trace fails here, as
        fx's own does; where it stood is kept (``graph.size_guards``: a static export of the same forward takes a
        branch on a size silently)."""
        self.branched.append(branch_site(self))
        return super().to_bool(obj)

    def is_leaf_module(self, m: nn.Module, qualname: str) -> bool:
        if isinstance(m, kinds.NATIVE_MODULES):
            return kinds.is_native(m)  # a subclass with its own forward is traced through like user code
        if super().is_leaf_module(m, qualname):
            # torch.nn containers with norms inside (TransformerEncoderLayer...) are traced through, not hidden:
            # fx's default makes every torch.nn module a leaf, and a leaf's norms are invisible to every pass.
            # Their forwards branch on tensors, so tracing fails and capture falls back to torch.export.
            return not any(isinstance(sub, kinds.NATIVE_MODULES) for sub in m.modules())
        return False


@dataclass
class Captured:
    """A captured graph and the view passes use to read it."""

    model: nn.Module
    gm: fx.GraphModule
    method: str  # "symbolic_trace" | "torch.export"
    inputs: Inputs
    exported: Any = None  # the ExportedProgram when method == "torch.export"
    attempts: dict[str, str] = field(default_factory=dict)  # method -> why it failed
    specialized: bool = False  # branches on tensor values taken as on the example inputs (see ``guards``)
    # each branch decided on a value (draft_export's guards, values read in tracing), and on input sizes where the
    # static export took one (``Guard.sizes``; ``specialized`` stays False: the graph holds for a range of sizes)
    guards: tuple[Guard, ...] = ()
    _params: dict[str, str] = field(default_factory=dict)  # placeholder name -> state_dict name (export)

    def __post_init__(self):
        self.modules: dict[str, nn.Module] = dict(self.model.named_modules())
        self.nodes: dict[str, fx.Node] = {n.name: n for n in self.gm.graph.nodes}
        self.order: dict[str, int] = {name: i for i, name in enumerate(self.nodes)}  # topological position
        if self.exported is not None:
            for spec in self.exported.graph_signature.input_specs:
                if spec.target is not None:
                    self._params[spec.arg.name] = spec.target
        # verdicts of value checks on this capture's example run (canonicalize's replacement checks), by site:
        # what the example run records does not change, and a pass that changes the model is captured anew
        self.checked: dict[Any, tuple] = {}
        # what detection found in this graph (``graph.detect.find_norms``) and each BatchNorm's affine form, kept
        # for the next pass that reads the same capture (fold-through, then fold): the model is as it was
        self.found: dict[Any, Any] = {}
        self.module_calls: dict[str, int] = {}
        for n in self.gm.graph.nodes:
            if n.op == "call_module":
                self.module_calls[n.target] = self.module_calls.get(n.target, 0) + 1

    def rebound(self, model: nn.Module) -> "Captured | None":
        """This capture read over ``model``, an unchanged tensor-sharing copy of its model (``clone_sharing_tensors``)
        with the same verdicts checked, without tracing it again: a torch.export graph names parameters by their
        state_dict names, not modules. None for a symbolic trace, whose graph holds the traced model's modules."""
        if self.method != "torch.export":
            return None
        twin = Captured(model, self.gm, self.method, self.inputs, exported=self.exported, attempts=dict(self.attempts),
                        specialized=self.specialized, guards=self.guards)
        twin.checked = self.checked
        return twin

    @functools.cached_property
    def live(self) -> frozenset[str]:
        """Nodes whose value reaches the graph's output or an effect (an in-place op, a mutation): the rest is dead
        code, computed by the forward but read by nothing (LiLT's last layout layer), which the ONNX exporter drops."""
        # roots: the output, and ops with effects (symbolic_trace keeps x.add_(y) whose result nothing reads)
        return frozenset(self.upstream(n for n in self.gm.graph.nodes if n.op == "output"
                                       or n.is_impure(impure_random=False)
                                       or (n.op in ("call_method", "call_function") and _in_place(n))))

    def upstream(self, nodes: Iterable[fx.Node]) -> set[str]:
        """The names of ``nodes`` and of every node they are computed from."""
        seen: set[str] = set()
        stack = list(nodes)
        while stack:
            n = stack.pop()
            if n.name not in seen:
                seen.add(n.name)
                stack.extend(n.all_input_nodes)
        return seen

    def broadcasts_along(self, c: Any, out: tuple[int, ...] | None, axis: int | None) -> bool:
        """``c`` broadcasts along ``out``'s ``axis``: size 1 there, or no such axis (broadcast from the right)."""
        shape = self.shape(c) if isinstance(c, fx.Node) else None
        if shape is None or out is None or axis is None:
            return False
        j = axis - (len(out) - len(shape))  # c's axis under ``axis``
        return j < 0 or shape[j] == 1

    def per_token_factor(self, c: Any, out: tuple[int, ...] | None, axis: int | None) -> bool:
        """``c`` in ``x * c`` is the same for every feature along ``out``'s hidden ``axis`` (size 1 there, or no
        such axis) and no parameter feeds it (an attention mask (B, S, 1)): it scales whole hidden vectors and cannot
        depend on the stream a rewrite changes."""
        if not self.broadcasts_along(c, out, axis):
            return False
        params = {name for name, _ in self.model.named_parameters()}
        return not any(self.param_name(self.nodes[n]) in params for n in self.upstream([c]))

    # -- what a node is ------------------------------------------------------------------------------------
    def op(self, node: fx.Node) -> str | None:
        if node.op == "call_module":  # a norm module is its kind's functional op, when its forward is torch's own
            kind = kinds.of_module(self.modules.get(node.target))
            if kind is not None:
                return kind.functional if kind.is_native(self.modules[node.target]) else None
        return op_of(node, self.modules)

    def owner(self, node: fx.Node) -> str:
        """Module path that computed ``node`` ('' for the root): call_module target or innermost module stack."""
        if node.op == "call_module":
            return node.target
        stack = node.meta.get("nn_module_stack") or {}
        if not stack:
            return ""
        path = list(stack.values())[-1][0]
        return clean_path(path)

    def owner_stack(self, node: fx.Node) -> list[str]:
        """All module paths enclosing ``node``, outermost first."""
        stack = node.meta.get("nn_module_stack") or {}
        paths = [clean_path(v[0]) for v in stack.values()]
        if node.op == "call_module" and (not paths or paths[-1] != node.target):
            paths.append(node.target)
        return paths

    def call_of(self, node: fx.Node, path: str) -> str | None:
        """Which call of the module at ``path`` computed ``node``: its module-stack key, which both dialects suffix
        with @1, @2, ... for the second, third call of one module (None: not inside that module)."""
        for key, value in (node.meta.get("nn_module_stack") or {}).items():
            if clean_path(value[0]) == path:
                return key
        return None

    def describe(self, node: fx.Node) -> str:
        """How a report names a node: the module path of a layer (either dialect), else the node name."""
        if node.op == "call_module":
            return node.target
        owner = self.owner(node)
        mod = self.modules.get(owner)
        if owner and mod is not None and not list(mod.children()):
            return owner  # an exported aten op of a leaf module (conv2d_5 -> layer1.0.conv1)
        return node.name

    def module(self, node: fx.Node) -> nn.Module | None:
        return self.modules.get(self.owner(node))

    def param_name(self, value: Any) -> str | None:
        """state_dict name of the parameter / buffer a node reads directly (get_attr or lifted placeholder)."""
        if not isinstance(value, fx.Node):
            return None
        if value.op == "get_attr":
            return value.target
        if value.op == "placeholder":
            return self._params.get(value.name)
        return None

    def tensor(self, name: str) -> torch.Tensor | None:
        """The parameter / buffer / tensor attribute at a dotted path of the model (or of the traced graph: a
        constant symbolic_trace lifted, ``_tensor_constant0``, lives on the GraphModule only)."""
        for root in (self.model, self.gm):
            obj: Any = root
            for part in name.split("."):
                obj = getattr(obj, part, None)
                if obj is None:
                    break
            if isinstance(obj, torch.Tensor):
                return obj
        return None

    def is_input(self, node: fx.Node) -> bool:
        return node.op == "placeholder" and self.param_name(node) is None

    # -- shapes --------------------------------------------------------------------------------------------
    def meta(self, node: Any) -> Any:
        if not isinstance(node, fx.Node):
            return None
        return node.meta.get("val", node.meta.get("tensor_meta"))

    def shape(self, node: Any) -> tuple[int, ...] | None:
        m = self.meta(node)
        shape = getattr(m, "shape", None)
        if shape is None:
            return None
        if any(isinstance(s, torch.SymInt) for s in shape):  # only torch.export's graphs hold symbolic sizes
            from torch.fx.experimental.symbolic_shapes import free_unbacked_symbols  # imports sympy: only here

            if free_unbacked_symbols(tuple(shape)):
                return None  # a size that depends on values (nonzero, masked_select: u0) has no number
        try:
            return tuple(int(s) for s in shape)
        except (TypeError, ValueError):  # symbolic sizes
            return None

    def dtype(self, node: Any) -> torch.dtype | None:
        return getattr(self.meta(node), "dtype", None)

    def users(self, node: fx.Node) -> list[fx.Node]:
        """Users that compute something (export's metadata asserts and shape reads are not users)."""
        return [u for u in node.users if not self.is_noise(u)]

    def users_through(self, node: fx.Node) -> list[fx.Node]:
        """Users of ``node``, looking through pass-through ops (casts, dropout, identities)."""
        out = []
        for u in self.users(node):
            out.extend(self.users_through(u) if self.op(u) in TRANSPARENT else [u])
        return out

    def source(self, value: Any) -> Any:
        """``value`` with the pass-through ops that produced it skipped: what it really is."""
        while isinstance(value, fx.Node) and self.op(value) in TRANSPARENT:
            value = value.args[0]
        return value

    @staticmethod
    def is_noise(node: fx.Node) -> bool:
        """Nodes that compute no tensor: metadata asserts, ``x.dtype`` / ``x.shape`` / ``x.size()`` reads."""
        if node.op == "call_function":
            name = getattr(node.target, "__name__", "")
            return name.split(".")[0] in _NOISE_FUNCTIONS or (node.target is getattr)
        return node.op == "call_method" and node.target in ("size", "dim")

    def is_size(self, node: fx.Node) -> bool:
        """A size read (``is_noise``) or integer arithmetic on sizes alone (``N, C, H, W = x.size()``, ``C // G``):
        a number the forward computes, no tensor."""
        if self.is_noise(node):
            return True
        args = [a for a in node.args if isinstance(a, fx.Node)]
        return node.op == "call_function" and node.target in _SIZE_OPS and bool(args) and \
            all(self.is_size(a) for a in args)


_NOISE_FUNCTIONS = {"_assert_tensor_metadata", "_assert_scalar", "sym_constrain_range_for_size", "sym_size"}
_SIZE_OPS = frozenset({operator.getitem, operator.mul, operator.floordiv, operator.add, operator.sub, operator.truediv})


def _in_place(node: fx.Node) -> bool:
    """x.add_(y), torch.relu_(x), aten.copy_.default: writes its first argument."""
    name = node.target if isinstance(node.target, str) else getattr(node.target, "__name__", "")
    return name.split(".")[0].endswith("_") and not name.startswith("_")


def quiet_torch_logs():
    """torch.export logs warnings and prints partial graphs to stderr when it fails; the user gets our one line."""
    return quiet(("torch",), stderr=True)


def _data_dependent(exc: BaseException) -> bool:
    """torch.export failed on a guard over a tensor's values (not on an unsupported op or a shape)."""
    while exc is not None:
        if type(exc).__name__ == "GuardOnDataDependentSymNode":
            return True
        exc = exc.__cause__ or exc.__context__
    return False


def _one_line(exc: BaseException) -> str:
    text = f"{type(exc).__name__}: {exc}".strip().splitlines()
    return text[0][:300] if text else type(exc).__name__


def capture(model: nn.Module, inputs: Inputs, method: str = "auto", reference: Any = None,
            stack_traces: bool = False) -> Captured:
    """Capture an FX graph of ``model`` on ``inputs``; raises NormconvError naming why each method failed.

    ``reference``: ``run(model, inputs)`` when the caller has it already (the trust check of a traced graph then
    compares the shape-propagation forward against it instead of running the model and the graph once more).
    ``stack_traces``: torch.export's nodes keep their Python stack (module docstring)."""
    attempts: dict[str, str] = {}
    branched: list[tuple[str, str]] = []  # Python branches symbolic_trace met on a traced value
    methods = ("symbolic_trace", "torch.export") if method == "auto" else (method,)
    for m in methods:
        if m == "symbolic_trace" and method == "auto" and inputs.kwargs:
            continue  # keyword inputs (every Hugging Face model) go to torch.export: a choice, not a failure
        try:
            start = time.monotonic()
            with forward_guard(model):  # tracing, shape propagation, the size export run forwards: they change nothing
                cap = _capture_with(m, model, inputs, attempts, reference, stack_traces, branched)
                if branched and cap.method == "torch.export":  # a branch the static export may have taken on a size
                    cap.guards += _size_guards(model, inputs, *branched[0], spent=time.monotonic() - start)
            return cap
        except Exception as exc:  # each failure is recorded; the next method is tried
            attempts[m] = _one_line(exc)
        masked = with_attention_mask(model, inputs) if m == "torch.export" else None
        if masked is not None:
            # LongT5 builds its default mask only when not compiling: under torch.export a missing mask is None
            # downstream. All ones is that default, so the graph is the model's on these inputs
            try:
                with forward_guard(model):
                    cap = _capture_with(m, model, masked, attempts, None, stack_traces)
                attempts[m] += "; captured with an all-ones attention_mask added to the inputs"
                return cap
            except Exception:  # noqa: BLE001 - the first failure is the one to report
                pass
    detail = "; ".join(f"{k} failed: {v}" for k, v in attempts.items())
    raise CaptureError(f"cannot capture a graph of {type(model).__name__}: {detail}", attempts)


def _size_guards(model: nn.Module, inputs: Inputs, owner: str, where: str, spent: float) -> tuple[Guard, ...]:
    """The Guard of the input sizes the example's path holds for (``graph.size_guards``), () when none is narrowed;
    ``owner``, ``where``: the first branch symbolic_trace met on a traced value, the one a message names."""
    from normconv.graph.size_guards import narrowed

    sizes = narrowed(model, inputs, spent)
    what = "a branch on input sizes, the example's path holding for " + ", ".join(
        f"{name} ({', '.join(f'{i}[{a}]' for i, a in places)}) {low}..{'inf' if high is None else high}"
        for places, name, low, high in sizes)
    return (Guard(owner, where, what, sizes=sizes),) if sizes else ()


def _check_draft(model: nn.Module, ep: Any, inputs: Inputs, reference: Any = None) -> None:
    """The trust check of a draft_export graph: on the example inputs it computes the eager output. Its branches on
    data-dependent sizes can be another than eager takes (LightGlue: the no-keypoint early return, so its
    transformer and norms are not in the graph); such a graph would describe another model, and is refused."""
    reference = run(model, inputs) if reference is None or not output_leaves(reference) else reference
    try:
        graph_out = run(ep.module(), inputs)
        check = compare(reference, graph_out, atol=1e-5, rtol=1e-5)
        ok, why = check.passed and bool(output_leaves(graph_out)), f"max abs error {check.max_abs_error:.3g}"
    except Exception as exc:  # noqa: BLE001 - another output structure or shape: not the eager computation
        ok, why = False, _one_line(exc)
    if not ok:
        raise NormconvError(f"torch.export.draft_export's graph is not the model's computation on these inputs "
                            f"(a branch on data-dependent sizes taken otherwise than eager: {why})")


def _inherit_module_stacks(source: fx.Graph, traced: fx.Graph) -> None:
    """A graph traced from a GraphModule (an exported program's module, loaded from a .pt2) calls the same functions
    in the same order; each call takes its source node's ``nn_module_stack``, the module tree of the model that was
    exported, so that sites are named after the modules (blocks.0.ln_1) as in the model itself, not layer_norm_3."""
    def ops(graph: fx.Graph) -> list[fx.Node]:
        # the aten calls on graph values (shape checks the tracer adds are not; a call on constants only, such as a
        # static arange, the tracer runs at once and keeps as a constant)
        return [n for n in graph.nodes if n.op == "call_function" and isinstance(n.target, torch._ops.OpOverload)
                and n.all_input_nodes]

    src, dst = ops(source), ops(traced)
    if len(src) != len(dst) or any(a.target is not b.target for a, b in zip(src, dst)):
        return  # not one to one: leave the traced graph as it is
    for a, b in zip(src, dst):
        if a.meta.get("nn_module_stack") and not b.meta.get("nn_module_stack"):
            b.meta["nn_module_stack"] = a.meta["nn_module_stack"]
        for key in a.meta.keys() - b.meta.keys():  # normconv's own marks (engine.precision.upcast's) travel too
            if key.startswith("normconv_"):
                b.meta[key] = a.meta[key]


class _ShapeProp(fx.Interpreter):
    """torch's ShapeProp for a symbolic trace (real tensors): each node's ``tensor_meta`` and ``type``, without the
    memory-format query, whose symbolic-shape helpers import sympy (0.6 s of a small command's 2.5 s)."""

    def run_node(self, n: fx.Node) -> Any:
        result = super().run_node(n)
        found = False

        def described(obj: Any) -> Any:
            nonlocal found
            if not isinstance(obj, torch.Tensor):
                return obj
            found = True
            return _extract_tensor_metadata(obj, include_contiguity=False)

        meta = map_aggregate(result, described)
        if found:
            n.meta["tensor_meta"] = meta
        n.meta["type"] = type(result)
        return result


@contextlib.contextmanager
def _stack_traces(keep: bool):
    """torch.fx's tracers record each node's stack unless ``torch.fx.config.do_not_emit_stack_traces``; set for the
    block, restored after; the GraphModules made inside write their code when first run (``lazy_code``)."""
    config = fx.config
    before = config.do_not_emit_stack_traces
    config.do_not_emit_stack_traces = not keep
    try:
        with lazy_code():
            yield
    finally:
        config.do_not_emit_stack_traces = before


def _capture_with(m: str, model: nn.Module, inputs: Inputs, attempts: dict[str, str],
                  reference: Any = None, stack_traces: bool = False,
                  branched: list[tuple[str, str]] | None = None) -> Captured:
    if m == "symbolic_trace":
        if inputs.kwargs:
            raise NormconvError("keyword inputs need torch.export")
        tracer = NormLeafTracer()
        tracer.branched = branched if branched is not None else tracer.branched
        with ValueReads(tracer) as reads:  # a concrete tensor's value read while tracing: a branch baked in
            graph = tracer.trace(model)
        if isinstance(model, fx.GraphModule):
            _inherit_module_stacks(model.graph, graph)
        # its Python code is generated when first run or read, not here: analysis and shape propagation need only
        # the graph (the code of a 3,000-node graph costs more than its trace); it pickles as a GraphModule
        gm = (LazyGraphModule or fx.GraphModule)(tracer.root, graph, type(model).__name__)
        with torch.no_grad():  # on a copy of the inputs: a graph that writes into its input leaves the example alone
            traced = _ShapeProp(gm).run(*copy.deepcopy(inputs.args))
        # the trust check: the graph's output is the eager output (a reference given by the caller is reused, and
        # the shape-propagation forward is the graph's run; an output with no tensor is judged on buffers: run both)
        if reference is None or not output_leaves(reference) or not output_leaves(traced):
            reference, traced = run(model, inputs), run(gm, inputs)
        check = compare(reference, traced, atol=1e-5, rtol=1e-5)
        if not check.passed:
            raise NormconvError(f"traced graph differs from eager (max abs error {check.max_abs_error:.3g})")
        guards = tuple(dict.fromkeys(reads.guards))
        return Captured(model, gm, "symbolic_trace", inputs, attempts=attempts, specialized=bool(guards), guards=guards)
    if m == "torch.export":
        with torch.no_grad(), quiet_torch_logs():
            try:
                with _stack_traces(stack_traces):
                    ep = torch.export.export(model, inputs.args, inputs.kwargs, strict=False)
            except Exception as exc:
                if not _data_dependent(exc):
                    raise
                # a Python branch on tensor values (FSMT: `if not padding_mask.any()`) has no symbolic graph:
                # draft_export takes each such branch as the example inputs take it. The graph then serves the
                # analysis (every rewrite is verified on the model itself), never the ONNX export
                ep = torch.export.draft_export(model, inputs.args, inputs.kwargs, strict=False)
                _check_draft(model, ep, inputs, reference)
                attempts[m] = (f"{_one_line(exc)}; captured with torch.export.draft_export instead (branches on "
                               f"tensor values taken as on the example inputs)")
                inline_disabled(ep.graph_module)
                return Captured(model, ep.graph_module, m, inputs, exported=ep, attempts=attempts, specialized=True,
                                guards=draft_guards(ep))
        inline_disabled(ep.graph_module)  # a norm in an `autocast(enabled=False)` region is seen (graph.autocast)
        return Captured(model, ep.graph_module, "torch.export", inputs, exported=ep, attempts=attempts)
    raise NormconvError(f"unknown capture method {m!r}")
