"""Dynamic dimensions: which input dimensions a written model (ONNX, .pt2) keeps free, found from the model, named
like its inputs, and checked at a second size each.

  found     torch.export with ``Dim.AUTO`` on every dimension of every tensor input: the exporter keeps a dimension
            symbolic where the model allows it and specializes it where the model needs one size (a conv's
            channels, a hidden width); the symbols of the exported program are the dynamic dimensions, one ``Dim``
            per symbol (an input's batch and its mask's batch are one symbol)
  batch 1   an example dimension of size 1 is specialized by torch.export (0/1 specialization): an example whose
            batch is 1 is exported at batch 2 (its values cycled) so that the batch stays free
  named     batch (dim 0), sequence (dim 1 of token ids or (B, L, C) activations; decoder_sequence for decoder_*
            inputs), height / width (dims 2, 3 of an image), depth (dim 2 of a volume), length (the last dim of a
            (B, C, T) signal or a (B, T) waveform), else INPUT_dimK; a name two symbols would share is prefixed
            with the input's name
  checked   each Dim at two more sizes (``candidates``: the example's size + 1 or - 1, then + half or - half, the
            first of each the original model accepts), every input that carries it resized together: the written
            model must equal the original there too. A Dim whose check fails is pinned (static) and the model
            written again; so is one the original takes only at sizes within one of the example's (``grid_moving``:
            63 maps to 64's own grid through a stride-2 stem, so a check there proves nothing; timm's LeViT runs
            at 49..64 only). The report lists each Dim with its range and the sizes checked.
  fixed     every other dimension of the example's tensor inputs is static in the written file: torch.export
            specialized it (a Python branch, loop or reshape on that size: HF Mamba's scan, LongT5's blocks) or the
            model takes one size only (an image's channels); each is listed with its code, said in a note where the
            original runs at another size (``fixed``)
"""

from __future__ import annotations

import contextlib
import contextvars
import inspect
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator

import torch
import torch.nn as nn

from normconv.report import Why
from normconv.verify import Inputs


class DimWhy(Why):
    """Why an input dimension of the written file is static."""

    PINNED = "pinned-by-check"  # free in the export, it failed its check at another size: exported again without it
    SPECIALIZED = "specialized-by-export"  # torch.export held it to the example's size; the original runs at others
    ONE_SIZE = "one-size-only"  # the original model runs at no other size of it (an image's channels)
    REFUSED = "refused-by-export"  # torch.export refuses it dynamic (a guard it cannot solve); the original runs at more
    OVERTIME = "export-overtime"  # torch.export's reasoning about dynamic dimensions ran past its time limit


@dataclass
class Dim:
    """One dynamic dimension: its name, the (input, axis) places that carry it, the example's size, torch.export's
    range, and the sizes it was checked at (or why it was pinned)."""

    symbols: list[str]  # the exporter's symbols it stands for (a mask's batch may be a symbol of its own)
    places: list[tuple[str, int]]
    size: int
    low: int | None = None
    high: int | None = None
    name: str = ""
    checked: list[int] = field(default_factory=list)
    pinned: str = ""  # why the dimension was made static after all ('' while dynamic)
    code: DimWhy | None = None  # the rule that made it static (None while dynamic)

    def to_json(self) -> dict[str, Any]:
        out = {"name": self.name, "inputs": [f"{i}[{a}]" for i, a in self.places], "example": self.size,
               "min": self.low, "max": self.high, "checked": list(self.checked)}
        if self.pinned:
            out["pinned"] = self.pinned
            out["code"] = str(self.code or DimWhy.PINNED)
        return out

    def note(self) -> str:
        """The report's line for a dimension the file holds to the example's size."""
        where = f"dimension {self.name} ({', '.join(f'{i}[{a}]' for i, a in self.places)})"
        if self.code in (DimWhy.SPECIALIZED, DimWhy.REFUSED):
            return (f"{where} is static at the example's {self.size}: {self.pinned}; the file runs at {self.size} "
                    f"only (export with an example of the size it will run at)")
        return f"{where} pinned to the example's {self.size}: with it free, {self.pinned}"


def input_names(model: nn.Module, inputs: Inputs) -> list[str] | None:
    """The name of each positional input (forward's parameters) then each keyword input; None where forward takes
    ``*args`` (no names to give)."""
    try:
        params = list(inspect.signature(model.forward).parameters.values())
    except (TypeError, ValueError):
        return None
    if any(p.kind is p.VAR_POSITIONAL for p in params[:len(inputs.args)]) or len(params) < len(inputs.args) and \
            not any(p.kind is p.VAR_POSITIONAL for p in params):
        return None
    return [p.name for p in params[:len(inputs.args)]] + list(inputs.kwargs)


def _named(inputs: Inputs, names: list[str]) -> dict[str, Any]:
    return dict(zip(names, list(inputs.args) + list(inputs.kwargs.values())))


# dimensions a written program may take a range of only ((input, axis) places, low, high): the sizes its rewrite was
# proven for, where the original's capture took a branch on sizes (``engine.branches``); set by the writer's caller
_BOUNDS: contextvars.ContextVar[tuple] = contextvars.ContextVar("normconv_dim_bounds", default=())


@contextlib.contextmanager
def bounded(bounds: list[tuple[tuple[tuple[str, int], ...], int, int | None]]) -> Iterator[None]:
    """Within the block ``export_shapes`` gives each of ``bounds``' dimensions its range (low..high) instead of
    Dim.AUTO: a program exported there refuses sizes outside it."""
    token = _BOUNDS.set(tuple(bounds))
    try:
        yield
    finally:
        _BOUNDS.reset(token)


def export_shapes(model: nn.Module, inputs: Inputs, pinned: set[tuple[str, int]] = frozenset()) -> dict | None:
    """torch.export's ``dynamic_shapes``: Dim.AUTO on every dimension of every tensor input but the ``pinned``
    (input, axis) places, and a ranged Dim on a dimension ``bounded`` holds; None where the inputs have no names."""
    from torch.utils._pytree import tree_map

    names = input_names(model, inputs)
    if names is None:
        return None
    auto = torch.export.Dim.AUTO
    ranged = {place: torch.export.Dim(f"bounded{k}", min=low, max=high)
              for k, (places, low, high) in enumerate(_BOUNDS.get()) for place in places}

    def spec(name: str, x: Any):
        if isinstance(x, (list, tuple, dict)):
            # a nested input (a detector's list of images): the same structure, every tensor in it static (the
            # check at a second size resizes top-level tensors only; torch.export wants the structure mirrored)
            return tree_map(lambda _: None, x)
        if not isinstance(x, torch.Tensor) or x.dim() == 0:
            return None
        return {axis: ranged.get((name, axis), auto) for axis in range(x.dim()) if (name, axis) not in pinned}

    shapes = {name: spec(name, x) for name, x in _named(inputs, names).items()}
    # keyword inputs forward takes through **kwargs go under that parameter's name, as torch.export binds them
    params = inspect.signature(model.forward).parameters.values()
    var_kw = next((p.name for p in params if p.kind is p.VAR_KEYWORD), None)
    named = {p.name for p in params if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)}
    extra = {k: shapes.pop(k) for k in list(inputs.kwargs) if k not in named}
    if extra and var_kw is not None:
        shapes[var_kw] = extra
    return shapes


def cycled(t: torch.Tensor, size: list[int]) -> torch.Tensor:
    """``t`` at another ``size``, its own values repeated along each dimension (token ids stay valid ids)."""
    index = [torch.arange(n) % m for n, m in zip(size, t.shape)]
    return t[torch.meshgrid(*index, indexing="ij")]


def resized(model: nn.Module, inputs: Inputs, places: list[tuple[str, int]], size: int) -> Inputs:
    """``inputs`` with every (input, axis) in ``places`` set to ``size`` (values cycled)."""
    names = input_names(model, inputs) or []
    axes: dict[str, list[int]] = {}
    for name, axis in places:
        axes.setdefault(name, []).append(axis)

    def one(name: str, x: Any) -> Any:
        if not isinstance(x, torch.Tensor) or name not in axes:
            return x
        shape = list(x.shape)
        for axis in axes[name]:
            shape[axis] = size
        return cycled(x, shape)

    args = tuple(one(n, x) for n, x in zip(names, inputs.args))
    kwargs = {k: one(k, v) for k, v in inputs.kwargs.items()}
    return Inputs(args, kwargs)


def unmarked(inputs: Inputs) -> Inputs:
    """The same inputs with every tensor a new object over the same storage (``detach``), for one torch.export call:
    an export given ``dynamic_shapes`` marks the tensors it was handed (``_dynamo_weak_dynamic_indices``) and, when
    it fails, leaves the marks there (torch 2.13), so that a later *static* export of the same tensors is dynamic
    again and fails the same way (timm's DLA, torchvision's S3D: an inequality sympy cannot solve). Each call gets
    tensors nothing marked, and the user's own tensors are never marked."""
    from torch.utils._pytree import tree_map

    def fresh(x):
        return x.detach() if isinstance(x, torch.Tensor) else x

    return Inputs(tree_map(fresh, tuple(inputs.args)), tree_map(fresh, dict(inputs.kwargs)))


def widened(model: nn.Module, inputs: Inputs, pinned: set[tuple[str, int]] | frozenset = frozenset()) -> Inputs | None:
    """The example at batch 2 where its batch is 1 (torch.export specializes a size of 1): every tensor input whose
    dim 0 is 1 gets its values cycled to 2, except where dim 0 is ``pinned`` (a pinned dimension keeps the example's
    size: traced at 2 it would be pinned to 2). None when no input has a free batch of 1 (or none has names)."""
    ones = batch_ones(model, inputs, pinned)
    return resized(model, inputs, ones, 2) if ones else None


def free_places(model: nn.Module, inputs: Inputs, pinned: set[tuple[str, int]] | frozenset = frozenset()
                ) -> list[tuple[str, int]]:
    """The (input, axis) places ``export_shapes`` leaves to torch.export (every axis of a top-level tensor input but
    the ``pinned``): what a dynamic export that fails gives up, the batches (axis 0) last of all."""
    names = input_names(model, inputs)
    if names is None:
        return []
    return [(n, a) for n, x in _named(inputs, names).items() if isinstance(x, torch.Tensor)
            for a in range(x.dim()) if (n, a) not in pinned]


def batch_ones(model: nn.Module, inputs: Inputs, pinned: set[tuple[str, int]] | frozenset = frozenset()
               ) -> list[tuple[str, int]]:
    """The (input, 0) places ``widened`` traces at 2: a tensor input's batch of 1 that is not pinned."""
    names = input_names(model, inputs)
    if names is None:
        return []
    return [(n, 0) for n, x in _named(inputs, names).items() if isinstance(x, torch.Tensor) and x.dim() and
            x.shape[0] == 1 and (n, 0) not in pinned]


def kept_free(program: Any, model: nn.Module, inputs: Inputs, pinned: set[tuple[str, int]] | frozenset = frozenset()
              ) -> bool:
    """Every batch ``widened`` traced at 2 is a symbol in ``program`` (a program traced from ``widened``'s example):
    a trace that specialized it (a branch on the batch size) made the program static at 2, where the example's own
    size is 1."""
    free = {p for d in found(program, input_names(model, inputs)) for p in d.places}
    return all(p in free for p in batch_ones(model, inputs, pinned))


def held(program: Any) -> dict[str, int]:
    """Symbols of a torch.export program that its range holds to one value (a conv's channels kept symbolic by the
    ONNX exporter): symbol -> that value."""
    return {str(k): int(v.lower) for k, v in program.range_constraints.items()
            if str(v.upper) != "int_oo" and int(v.lower) == int(v.upper)}


def found(program: Any, inputs_names: list[str] | None = None) -> list[Dim]:
    """The dynamic dimensions of a torch.export program: one Dim per symbol of its user inputs' shapes, with the
    program's range for it (an unbounded maximum is None)."""
    user = list(program.graph_signature.user_inputs)
    ranges = {str(k): v for k, v in program.range_constraints.items()}
    dims: dict[str, Dim] = {}
    for node in program.graph.nodes:
        if node.op != "placeholder" or node.name not in user:
            continue
        val = node.meta.get("val")
        if not isinstance(val, torch.Tensor):
            continue
        name = inputs_names[user.index(node.name)] if inputs_names and len(inputs_names) == len(user) else node.name
        for axis, d in enumerate(val.shape):
            if isinstance(d, int):
                continue
            symbol = str(d)
            if not symbol.isidentifier():  # an expression of symbols (s0 * 2): carried by the free one
                continue
            r = ranges.get(symbol)
            hi = getattr(r, "upper", None) if r is not None else None
            if r is not None and str(hi) != "int_oo" and int(r.lower) == int(hi):
                continue  # a symbol held to one value (a conv's channels): static after all
            dim = dims.get(symbol)
            if dim is None:
                dim = dims[symbol] = Dim([symbol], [], int(d.node.hint) if hasattr(d, "node") and
                                         d.node.hint is not None else 0,
                                         max(int(r.lower), 1) if r is not None else None,
                                         int(hi) if hi is not None and str(hi) != "int_oo" else None)
            dim.places.append((name, axis))
    return list(dims.values())


def dim_name(input_name: str, rank: int, axis: int, floating: bool) -> str:
    """What the dimension is, read off the input: batch, sequence, decoder_sequence, height, width, depth, length."""
    if axis == 0:
        return "batch"
    if axis == 1 and ((not floating and rank == 2) or (floating and rank == 3)):
        return "decoder_sequence" if input_name.startswith("decoder_") else "sequence"
    if floating and rank == 4 and axis in (2, 3):
        return ("height", "width")[axis - 2]
    if floating and rank == 5 and axis in (2, 3, 4):
        return ("depth", "height", "width")[axis - 2]
    if floating and axis == rank - 1 and rank in (2, 3):
        return "length"
    return f"{input_name}_dim{axis}"


def name_dims(dims: list[Dim], shapes: dict[str, tuple[int, bool]], chosen: dict[str, str] | None = None) -> list[Dim]:
    """Name the Dims (``dim_name`` of their first place; ``shapes``: input -> (rank, floating)) and merge those of one
    name and one example size: token ids and their attention mask are two symbols to the exporter but one batch and
    one sequence to the model (checked together, named alike). A name two different Dims would share is prefixed
    with the input's name. ``chosen``: the user's names by kind (batch=N). Returns the merged Dims."""
    merged: dict[tuple[str, int], Dim] = {}
    for d in dims:
        want = ""
        for input_name, axis in d.places:
            rank, floating = shapes.get(input_name, (0, False))
            want = dim_name(input_name, rank, axis, floating)
            if not want.startswith(f"{input_name}_dim"):
                break
        key = (want, d.size)
        if key in merged:
            merged[key].symbols += d.symbols
            merged[key].places += d.places
            merged[key].low = max(x for x in (merged[key].low, d.low, 0) if x is not None) or None
            highs = [x for x in (merged[key].high, d.high) if x is not None]
            merged[key].high = min(highs) if highs else None
            continue
        d.name = want
        merged[key] = d
    taken: set[str] = set()
    out = list(merged.values())
    for d in out:
        name = (chosen or {}).get(d.name, d.name)
        if name in taken:
            name = f"{d.places[0][0]}_{d.name}"
        taken.add(name)
        d.name = name
    return out


def fixed(program: Any, model: nn.Module, inputs: Inputs, dims: list[Dim], original: nn.Module,
          pinned: set[tuple[str, int]] | frozenset = frozenset(), chosen: dict[str, str] | None = None,
          refused: dict[tuple[str, int], tuple[DimWhy, str]] | None = None) -> list[Dim]:
    """The dimensions of the example's tensor inputs that a dynamic export (``program``, whose free ``dims`` were
    found) holds to the example's size though normconv did not pin them (``pinned``): torch.export specialized
    them (a Python branch, loop or reshape on that size), or held their symbol to one value. Each is named like a
    free one and tried in ``runs`` (the original model) at the first of ``candidates``' first probe: where it runs,
    code SPECIALIZED (the file lost a dimension the model has), else ONE_SIZE; REFUSED instead of SPECIALIZED where
    the dimension is one of ``refused``'s places (place -> (REFUSED or OVERTIME, why): torch.export refused it
    dynamic, or ran past its time limit, so it was exported static; OVERTIME keeps its own code). [] where the inputs
    have no names or do not line up with the program's (nested inputs: static by design)."""
    from normconv.verify import run

    names = input_names(model, inputs)
    if names is None or len(names) != len(program.graph_signature.user_inputs):
        return []
    free = {p for d in dims for p in d.places} | set(pinned)
    held = [Dim([], [(n, a)], int(x.shape[a])) for n, x in _named(inputs, names).items()
            if isinstance(x, torch.Tensor) for a in range(x.dim()) if (n, a) not in free]
    out = name_dims(held, input_shapes(model, inputs), chosen)
    for d in out:
        d.low = d.high = d.size
        d.checked = [d.size]
        other = next((s for s in candidates(d.size)[0] if _runs(lambda alt: run(original, alt), resized(model, inputs, d.places, s))), None)
        code, why = next((refused[p] for p in d.places if p in (refused or {})), (None, None))
        if other is None:
            d.code, d.pinned = DimWhy.ONE_SIZE, "the original model runs at no other size of it"
        elif code is DimWhy.OVERTIME:  # a time limit, not a refusal: --static skips the reasoning
            d.code = code
            d.pinned = (f"torch.export's reasoning about dynamic dimensions {why} (--static skips it), where the "
                        f"original also runs at {d.name} = {other}")
        elif why is not None:
            d.code = DimWhy.REFUSED
            d.pinned = f"torch.export refuses it dynamic ({why}), where the original also runs at {d.name} = {other}"
        else:
            d.code = DimWhy.SPECIALIZED
            d.pinned = (f"torch.export specialized it to that size (the model's forward, traced, holds for it only: "
                        f"a Python branch, loop or reshape on it), where the original also runs at {d.name} = {other}")
    return out


def fixed_notes(dims: list[Dim]) -> list[str]:
    """The report's lines for ``fixed``'s dimensions: one per dimension torch.export specialized, one for those the
    model takes at one size only."""
    one = [f"{i}[{a}] = {d.size}" for d in dims if d.code is DimWhy.ONE_SIZE for i, a in d.places]
    return [d.note() for d in dims if d.code in (DimWhy.SPECIALIZED, DimWhy.REFUSED)] + \
        ([f"static, as the original model runs at no other size of them: {', '.join(one)}"] if one else [])


def _runs(runs: Callable[[Inputs], Any], alt: Inputs) -> bool:
    try:
        runs(alt)
    except Exception:  # noqa: BLE001 - the original does not run at that size
        return False
    return True


def example_size(model: nn.Module, inputs: Inputs, d: Dim) -> int:
    """The example's own size of ``d`` (its first place): what a pinned dimension is pinned to, where the program
    that found it was traced at a widened batch."""
    name, axis = d.places[0]
    x = _named(inputs, input_names(model, inputs) or []).get(name)
    return int(x.shape[axis]) if isinstance(x, torch.Tensor) and x.dim() > axis else d.size


def input_shapes(model: nn.Module, inputs: Inputs) -> dict[str, tuple[int, bool]]:
    """input name -> (rank, floating), for ``name_dims``."""
    names = input_names(model, inputs) or []
    return {n: (x.dim(), x.is_floating_point()) for n, x in _named(inputs, names).items()
            if isinstance(x, torch.Tensor)}


def candidates(n: int) -> list[list[int]]:
    """The probes of a dimension of example size ``n``: each a list of sizes, first choice first, the first size the
    original accepts checked. The first probe moves it by one, upwards first: a stride-2 conv (kernel 3, padding 1)
    maps n - 1 to n's own size when n is even (64 and 63 both give 32, 16, 8, ...), so n - 1 proved nothing there,
    where n + 1 gives odd sizes at every stride (65: 33, 17, 9). The second moves it by half (n + n // 2, n // 2,
    2n): a path that holds for some multiples of a stride only (a size rounded up to a patch, then reshaped) shows
    at one or the other."""
    first = [m for m in (n + 1, n - 1, 2 * n, n // 2) if m >= 1 and m != n]
    second = [m for m in (n + n // 2, n // 2, 2 * n) if m >= 1 and m not in (n, n + 1)]
    return [list(dict.fromkeys(first)), list(dict.fromkeys(second))]


def check(dims: list[Dim], model: nn.Module, inputs: Inputs, reference: Callable[[Inputs], Any],
          candidate: Callable[[Inputs], Any], compare: Callable[[Any, Any, str], Any],
          refusals: type[Exception] | tuple[type[Exception], ...] = Exception) -> list[tuple[Dim, Any]]:
    """Check each Dim at two more sizes (after the caller validated the example): per probe of ``candidates`` of
    the example's own size, the first size the ``reference`` (the original model) accepts, the ``candidate`` (the
    written model) compared with it. Returns (Dim, Validation) per size checked; a Dim the reference takes at no
    other size, or whose candidate fails or differs, gets ``pinned`` (its reason). ``refusals``: what the candidate
    raises when it refuses a size (a runtime's own exception); anything else it raises goes up (a bug of the caller's
    own code is no refusal)."""
    checks = []
    for d in dims:
        # the example's own size (the program may have been traced at a widened batch), which the caller validated
        d.size = example_size(model, inputs, d)
        d.checked = [d.size]
        if d.low is not None and d.size < d.low:
            d.low = d.size  # torch.export's range starts at 2 (0/1 specialization); the example ran at 1
        for probe in candidates(d.size):  # every probe checked, until one fails (the Dim is then pinned)
            if not d.pinned:
                _probe(d, probe, model, inputs, reference, candidate, compare, checks, refusals)
        if len(d.checked) == 1 and not d.pinned:
            d.pinned = "the original model runs at no other size of it"
        elif not d.pinned and not any(grid_moving(d.size, s) for s in d.checked[1:]):
            tried = [s for probe in candidates(d.size) for s in probe if s not in d.checked]
            d.pinned = (f"the original model runs only at {', '.join(map(str, d.checked[1:]))} besides it, within "
                        f"one of the example's, which a strided layer can map to the example's own grid (63 and "
                        f"64 both give 32 at stride 2), and at none of {', '.join(map(str, dict.fromkeys(tried)))}, "
                        f"which change it: nothing proves it free")
    return checks


def grid_moving(n: int, m: int) -> bool:
    """A check at size ``m`` proves something for a dimension of example size ``n``: ``m`` is no near size (n - 1,
    n + 1) that a strided layer can map to ``n``'s own grid (a stride-2 conv, kernel 3, padding 1: 63 and 64 give
    32; a stride-2 pool: 65 and 64 give 32), or it is a doubling or halving of ``n`` (batch 1 and 2), which changes
    the grid at every stride."""
    return abs(m - n) > 1 or m in (2 * n, n // 2)


def _probe(d: Dim, sizes: list[int], model: nn.Module, inputs: Inputs, reference: Callable[[Inputs], Any],
           candidate: Callable[[Inputs], Any], compare: Callable[[Any, Any, str], Any], checks: list,
           refusals: type[Exception] | tuple[type[Exception], ...] = Exception) -> None:
    """``d`` checked at the first of ``sizes`` the original accepts (and not checked yet): the candidate compared
    with it (appended to ``checks``), ``d.pinned`` set where it fails or differs; nothing where the original takes
    none of them."""
    for size in sizes:
        if size in d.checked or (d.high is not None and size > d.high):
            continue  # checked already, or beyond the program's own range
        alt = resized(model, inputs, d.places, size)
        try:
            expected = reference(alt)
        except Exception:  # noqa: BLE001 - the original does not run at that size: try the next
            continue
        label = f"{d.name} = {size}"
        try:
            got = candidate(alt)
        except refusals as exc:  # the written model refuses a size the original takes
            d.pinned = f"the exported model fails at {label} where the original runs ({type(exc).__name__})"
            return
        v = compare(expected, got, label)
        checks.append((d, v))
        d.checked.append(size)
        if not v.passed:
            d.pinned = f"the exported model differs from the original at {label} (max abs error " \
                       f"{v.max_abs_error:.3g})"
        elif d.low is not None and size < d.low:
            d.low = size  # torch.export's range starts at 2 (0/1 specialization); the check ran at 1
        return


__all__ = ["Dim", "DimWhy", "fixed", "fixed_notes", "export_shapes", "found", "held", "check", "name_dims", "input_shapes", "dim_name", "resized", "widened", "batch_ones", "kept_free", "example_size",
           "input_names", "candidates", "cycled", "grid_moving", "free_places"]
