"""An ONNX file against the file it came from, in onnxruntime, on fresh random inputs at two sizes.

Inputs are read off the file: every dynamic dimension (named — Paddle's ``p2o.DynamicDimension.N`` included —,
``-1``, ``0`` or unnamed) gets two sizes the original accepts: axis 0 runs at 1 and 2, other dimensions at the
first candidate pair the original runs with (64/96, 32/64, 48/96, …); a dimension the original accepts at one size
only is kept there (said in a note). Integer inputs draw from what the model does with them: the constants an
Equal compares them with (a sample rate), else [0, n) for the indices of a Gather over n rows, else [0, 2);
``-i NAME:D0,D1,..[:DTYPE]`` fixes an input's shape and dtype.

Each size runs IN with graph optimizations disabled (the reference) and OUT twice: disabled (what normconv wrote is
what runs) and at onnxruntime's default level; per output, max abs / rel error (``verify.compare``). An output a
squashing op made (Sigmoid, Softmax, Tanh) is judged through that op's input where both files hold it
(``verify.Squashed``): both sessions also return it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np

from normconv.errors import NormconvError
from normconv.report import Validation

BATCH_SIZES = (1, 2)
PAIRS = ((64, 96), (32, 64), (48, 96), (16, 32), (512, 1024), (576, 1088), (128, 192), (8, 16), (4, 8), (1, 2))
_NP = {"tensor(float)": np.float32, "tensor(float16)": np.float16, "tensor(double)": np.float64,
       "tensor(int64)": np.int64, "tensor(int32)": np.int32, "tensor(int8)": np.int8, "tensor(uint8)": np.uint8,
       "tensor(bool)": np.bool_, "tensor(int16)": np.int16, "tensor(uint16)": np.uint16}


@dataclass
class Spec:
    name: str
    dims: list  # int (static) or a key naming the dynamic dimension
    dtype: Any
    values: tuple | None = None  # integer values the model compares it with
    high: int = 2  # integer inputs draw from [0, high)


@dataclass
class Plan:
    specs: list[Spec]
    sizes: list[dict[Any, int]]  # one {dim key: size} per size validated
    notes: list[str] = field(default_factory=list)


def session(path_or_bytes, level: str):
    import onnxruntime as ort

    # fatal only: a size the model refuses while sizes are tried, or a kernel failing in validation, is normconv's
    # to report in its one line (severity 3 still printed the executor's ERROR line, in colour, on stderr)
    ort.set_default_logger_severity(4)
    opts = ort.SessionOptions()
    opts.graph_optimization_level = (ort.GraphOptimizationLevel.ORT_DISABLE_ALL if level == "disabled"
                                     else ort.GraphOptimizationLevel.ORT_ENABLE_ALL)
    opts.log_severity_level = 4
    opts.add_session_config_entry("session.intra_op.allow_spinning", "0")
    return ort.InferenceSession(path_or_bytes, opts, providers=["CPUExecutionProvider"])


def _int_hints(model) -> dict[str, tuple[tuple | None, int]]:
    """Per integer graph input: (the constants an Equal compares it with, the row count of a Gather it indexes)."""
    from normconv.onnx.rules.base import const

    out: dict[str, tuple[tuple | None, int]] = {}
    for v in model.graph.inputs:
        if v.dtype is None or v.dtype.is_floating_point():
            continue
        values, high, todo, seen = [], 0, [v], set()
        while todo:
            cur = todo.pop()
            for use in cur.uses():
                node = use.node
                if id(node) in seen:
                    continue
                seen.add(id(node))
                if node.op_type == "Equal":
                    other = node.inputs[1 - use.idx] if len(node.inputs) == 2 else None
                    c = const(other)
                    if c is not None and c.size == 1:
                        values.append(int(c.reshape(-1)[0]))
                elif node.op_type == "Gather" and use.idx == 1:
                    data = node.inputs[0]
                    axis = int(node.attributes["axis"].value) if "axis" in node.attributes else 0
                    if data.shape is not None and isinstance(data.shape[axis], int):
                        high = max(high, data.shape[axis])
                elif node.op_type in ("Cast", "Reshape", "Unsqueeze", "Squeeze", "Identity", "Flatten"):
                    todo.extend(node.outputs)
        out[v.name] = (tuple(dict.fromkeys(values)) or None, high or 2)
    return out


def specs(path: str, model, overrides: list[str] | None) -> list[Spec]:
    """The inputs of the file at ``path`` (``model``: its onnx_ir form, for integer hints); a file onnxruntime does
    not load is refused in one line (every rewrite is validated against it there)."""
    try:
        sess = session(path, "disabled")
    except Exception as exc:  # noqa: BLE001 - onnxruntime's own reason (an op or opset it has no kernel for)
        why = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        raise NormconvError(f"{path} does not load in onnxruntime ({why.split(' : ')[-1][:200]}): normconv validates "
                            f"each rewrite against the file given, in onnxruntime") from None
    hints = _int_hints(model)
    given = _parse(overrides or [], [i.name for i in sess.get_inputs()])
    shapeless = {v.name for v in model.graph.inputs if v.shape is None}  # onnxruntime shows them as rank 0
    for i in sess.get_inputs():
        if i.name in given:
            dims, dtype, item = given[i.name]
            shape = None if i.name in shapeless else i.shape
            why = _contradiction(i.type, shape, dims, dtype)
            if why:
                raise NormconvError(f"-i {item} contradicts {path}: its input {i.name} is declared "
                                    f"{_declared(i.type, shape)} ({why})")
            given[i.name] = (dims, dtype if dtype is not None else _NP.get(i.type, np.float32), item)
    unranked = [v.name for v in model.graph.inputs if v.shape is None and v.name not in given and
                v.name in {i.name for i in sess.get_inputs()}]
    if unranked:  # onnxruntime would take any rank: a made-up one fails in a kernel, or proves nothing
        raise NormconvError(f"input {unranked[0]!r} is declared without a shape (its rank is unknown): normconv "
                            f"cannot make inputs for it", hint=f"give its shape with -i {unranked[0]}:D0,D1,...")
    out = []
    for i in sess.get_inputs():
        if i.type not in _NP:
            raise NormconvError(f"input {i.name!r} is {i.type}: normconv makes float, integer and bool inputs only")
        dims = []
        for axis, d in enumerate(i.shape):
            dims.append(d if isinstance(d, int) and d > 0 else (d if isinstance(d, str) and d else (i.name, axis)))
        dtype = _NP[i.type]
        if i.name in given:
            dims, dtype, _ = given[i.name]
        values, high = hints.get(i.name, (None, 2))
        out.append(Spec(i.name, dims, dtype, values, high))
    return out


def _declared(typ: str, shape: list | None) -> str:
    """An input's declared type and shape (None: declared without one), as float[N,3,H,W]."""
    elem = typ[len("tensor("):-1] if typ.startswith("tensor(") else typ
    if shape is None:
        return f"{elem} (no shape)"
    return f"{elem}[{','.join(str(d) if isinstance(d, int) and d > 0 else (d or '?') for d in shape)}]"


def _contradiction(typ: str, shape: list | None, dims: list[int], dtype) -> str:
    """How an -i shape and dtype (None: not given) contradict an input declared ``typ`` of ``shape`` (onnxruntime's
    spelling; None: no shape declared); "" where they agree."""
    if dtype is not None and typ in _NP and np.dtype(_NP[typ]) != np.dtype(dtype):
        return f"{np.dtype(dtype).name} given"
    if shape is None:
        return ""
    if len(dims) != len(shape):
        return f"{len(dims)} dimension(s) given, {len(shape)} declared"
    fixed = [(axis, d, g) for axis, (d, g) in enumerate(zip(shape, dims)) if isinstance(d, int) and d > 0 and d != g]
    return "; ".join(f"dimension {axis}: {g} given, {d} declared" for axis, d, g in fixed)


def too_large(path: str, specs: list[Spec], sizes: dict) -> None:
    """One line where the inputs at ``sizes`` alone (every other dynamic dimension at 1) take more than half this
    machine's memory: onnxruntime cannot run the file there, whatever it computes."""
    from normconv.io.archive import memory_bytes

    total, biggest = 0, None
    for s in specs:
        shape = [d if isinstance(d, int) else sizes.get(d, 1) for d in s.dims]
        n = int(np.prod(shape, dtype=np.float64)) * np.dtype(s.dtype).itemsize
        total += n
        biggest = max(biggest or (0, s.name, shape), (n, s.name, shape))
    memory = memory_bytes()
    if memory is not None and total > memory // 2:
        _, name, shape = biggest
        raise NormconvError(f"{path} is too large to run here: its input {name} of shape {shape} alone takes "
                            f"{total / 1e9:.3g} GB, more than half this machine's {memory / 1e9:.3g} GB")


def _parse(items: list[str], names: list[str]) -> dict[str, tuple[list[int], Any, str]]:
    out = {}
    for item in items:
        parts = item.split(":")
        if len(names) == 1 and parts[0] not in names and parts[0].replace(",", "").strip().isdigit():
            parts = names + parts  # one input: its name may be left out (D0,D1,...[:DTYPE]), as for a torch model
        if len(parts) not in (2, 3) or parts[0] not in names:
            raise NormconvError(f"bad --input-shape {item!r}: expected NAME:D0,D1,...[:DTYPE] with NAME one of "
                                f"{', '.join(names)}")
        try:
            dims = [int(d) for d in parts[1].split(",")] if parts[1].strip() else []
        except ValueError:
            raise NormconvError(f"bad --input-shape {item!r}: dimensions must be integers") from None
        if any(d <= 0 for d in dims):
            raise NormconvError(f"bad --input-shape {item!r}: dimensions must be positive")
        dtype = None  # the declared one
        if len(parts) == 3:
            key = f"tensor({ {'float32': 'float', 'float64': 'double'}.get(parts[2], parts[2]) })"
            if key not in _NP:
                raise NormconvError(f"bad --input-shape {item!r}: unknown dtype {parts[2]!r}")
            dtype = _NP[key]
        if parts[0] in out:
            raise NormconvError(f"bad --input-shape {item!r}: {parts[0]} is given twice")
        out[parts[0]] = (dims, dtype, item)
    return out


def feeds(specs: list[Spec], sizes: dict, seed: int) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    out = {}
    for s in specs:
        shape = [d if isinstance(d, int) else sizes[d] for d in s.dims]
        if np.issubdtype(s.dtype, np.floating):
            out[s.name] = rng.standard_normal(shape).astype(s.dtype)
        elif s.dtype == np.bool_:
            out[s.name] = np.ones(shape, dtype=np.bool_)  # a mask or a branch condition: on
        elif s.values:
            out[s.name] = np.full(shape, s.values[0], dtype=s.dtype)
        else:
            out[s.name] = rng.integers(0, s.high, shape).astype(s.dtype)
    return out


def _runs(sess, specs, sizes) -> bool:
    from normconv.onnx.validate import run_quietly

    try:
        run_quietly(sess, feeds(specs, sizes, 0))
        return True
    except Exception:  # noqa: BLE001 - the model refuses this size: try another
        return False


def plan_sizes(path: str, specs: list[Spec]) -> Plan:
    """Two sizes per dynamic dimension that the file at ``path`` runs with (module docstring)."""
    sess = session(path, "disabled")
    keys = list(dict.fromkeys(d for s in specs for d in s.dims if not isinstance(d, int)))
    first = {k for s in specs for i, k in enumerate(s.dims) if i == 0 and not isinstance(k, int)}
    plan = Plan(specs, [])
    too_large(path, specs, {})
    if not keys:
        if not _runs(sess, specs, {}):
            raise NormconvError(f"{path} does not run in onnxruntime on random inputs of its declared shapes")
        plan.sizes = [{}]
        plan.notes.append("every input dimension is static: validated at the one size the file declares")
        return plan
    base = None
    for a, _ in PAIRS:
        trial = {k: (BATCH_SIZES[0] if k in first else a) for k in keys}
        if _runs(sess, specs, trial):
            base = trial
            break
    if base is None and len(keys) <= 6:
        # unnamed dimensions that must agree across inputs (a batch at axis 1 of a state): try each set of them
        # at the batch size, the rest at each candidate, until the file runs
        import itertools

        tries = 0
        for a, _ in PAIRS:
            for batch in itertools.product((True, False), repeat=len(keys)):
                tries += 1
                trial = {k: BATCH_SIZES[0] if b else a for k, b in zip(keys, batch)}
                if tries <= 256 and _runs(sess, specs, trial):
                    first, base = {k for k, b in zip(keys, batch) if b}, trial
                    break
            if base is not None:
                break
    if base is None:
        raise NormconvError(f"{path} runs at none of the sizes tried for its dynamic dimensions "
                            f"({', '.join(map(str, keys))})", hint="give each input's shape with -i NAME:D0,D1,...")
    pair = {a: b for a, b in PAIRS}
    second = {k: (BATCH_SIZES[1] if k in first else pair[base[k]]) for k in keys}
    if not _runs(sess, specs, second):
        second = dict(base)
        # the batch dimensions together (inputs must agree on them), then each other dimension alone
        for group in [[k for k in keys if k in first]] + [[k] for k in keys if k not in first]:
            trial = dict(second)
            trial.update({k: BATCH_SIZES[1] if k in first else pair[base[k]] for k in group})
            if group and _runs(sess, specs, trial):
                second = trial
        fixed = [str(k) for k in keys if second[k] == base[k]]
        if fixed:
            plan.notes.append(f"dimension(s) {', '.join(fixed)} ran at one size only ({', '.join(str(base[k]) for k in keys if str(k) in fixed)}): "
                              f"validated there")
    plan.sizes = [base, second] if second != base else [base]
    return plan


SQUASHING = {"Sigmoid": 0.25, "Softmax": 0.5, "Tanh": 1.0}  # op -> Lipschitz constant in the max norm


def _as_compared(path_in: str, path_out: str) -> tuple[Any, Any, dict[str, tuple[str, str]], int]:
    """Both files as compared: each with the inputs of the squashing ops that make graph outputs added as outputs,
    and {output: (op, its input)}; each unseeded random op seeded (``_seed``), and how many; the paths themselves
    (nothing changed) where there is neither, or a file keeps its weights outside (its bytes would not find them)."""
    import onnx

    models = [onnx.load(p, load_external_data=False) for p in (path_in, path_out)]
    if any(init.data_location == onnx.TensorProto.EXTERNAL for m in models for init in m.graph.initializer):
        if not _seed(onnx.ModelProto.FromString(models[0].SerializeToString())):
            return path_in, path_out, {}, 0
        models = [onnx.load(p) for p in (path_in, path_out)]  # random ops to seed: the bytes with their weights in
        if max(sum(len(t.raw_data) for t in m.graph.initializer) for m in models) > 2 ** 31 - 2 ** 26:
            return path_in, path_out, {}, 0  # past protobuf's 2 GB: no bytes to hand onnxruntime
    made = [{o: n for n in m.graph.node for o in n.output} for m in models]
    found = {}
    for out in models[0].graph.output:
        node = made[0].get(out.name)
        if node is not None and node.op_type in SQUASHING and node.input and \
                (node.input[0] in made[1] or any(i.name == node.input[0] for i in models[1].graph.input)):
            found[out.name] = (node.op_type, node.input[0])
    seeded = _seed(models[0])
    _seed(models[1])
    if not found and not seeded:
        return path_in, path_out, {}, 0
    for m in models:
        for op, x in found.values():
            m.graph.output.append(onnx.ValueInfoProto(name=x))
    return models[0].SerializeToString(), models[1].SerializeToString(), found, seeded


def _seed(model) -> int:
    """Every random op without a ``seed`` (RANDOM_OPS) given one from its first output's name, in the main graph,
    subgraphs and functions alike; the count. Both files seeded so draw the same numbers where a rewrite left the op
    and its input's shape as they were (the rewrites never touch a random op), and the comparison judges the rest;
    the file written keeps its ops unseeded, as the input has them."""
    import zlib

    import onnx

    from normconv.onnx.defaults import RANDOM_OPS

    def nodes(graph_nodes):
        for n in graph_nodes:
            yield n
            for a in n.attribute:
                for g in ([a.g] if a.type == onnx.AttributeProto.GRAPH else list(a.graphs)):
                    yield from nodes(g.node)

    count = 0
    for n in [*nodes(model.graph.node), *(x for f in model.functions for x in nodes(f.node))]:
        if n.op_type in RANDOM_OPS and n.domain in ("", "ai.onnx") and not any(a.name == "seed" for a in n.attribute):
            n.attribute.append(onnx.helper.make_attribute("seed", float(zlib.crc32(n.output[0].encode()) % 65536)))
            count += 1
    return count


def compare_files(path_in: str, path_out: str, plan: Plan, atol: float | None, rtol: float | None,
                  levels=("disabled", "default")) -> list[Validation]:
    """OUT against IN at each planned size; IN runs unoptimized (the reference). Where OUT at an optimization level
    misses it and onnxruntime's optimizations change IN's own result at that level as well (a fusion that ignores
    part of a pattern: a Pow(x, 3) variance fused into LayerNormalization), OUT is judged against IN at the same
    level, and the label says why: the optimizer, not the rewrite, moved the result."""
    import torch

    from normconv.verify import Squashed, compare

    src_in, src_out, through, seeded = _as_compared(path_in, path_out)
    ref_sess = session(src_in, "disabled")
    names = [o.name for o in ref_sess.get_outputs()][:len(ref_sess.get_outputs()) - len(through)]
    outs = {level: session(src_out, level) for level in levels}
    ins = {"disabled": ref_sess}  # IN at another level: made only where OUT misses at that level
    found = []
    for n, sizes in enumerate(plan.sizes):
        feed = feeds(plan.specs, sizes, seed=1 + n)
        ref = dict(zip([o.name for o in ref_sess.get_outputs()], ref_sess.run(None, feed)))
        shown = ", ".join(f"{k}={tuple(v.shape)}" for k, v in feed.items())
        for level, sess in outs.items():
            got = dict(zip([o.name for o in sess.get_outputs()], sess.run(None, feed)))
            missing = [k for k in names if k not in got]
            if missing:
                raise NormconvError(f"the output lost model outputs {missing}")
            a = {k: torch.from_numpy(np.asarray(ref[k])) for k in names}
            b = {k: torch.from_numpy(np.asarray(got[k])) for k in names}
            sq = {k: Squashed(op, SQUASHING[op], torch.from_numpy(np.asarray(ref[x])), torch.from_numpy(np.asarray(got[x])))
                  for k, (op, x) in through.items()}
            label = f"onnxruntime cpu, optimizations {level}, inputs {shown}" + (
                f", its {seeded} random op(s) seeded alike in both files" if seeded else "")
            v = compare(a, b, atol, rtol, label=label, squashed=sq)
            if not v.passed and level != "disabled":  # is it onnxruntime's optimizer changing the file itself?
                sess_in = ins.setdefault(level, session(src_in, level))
                same = dict(zip([o.name for o in sess_in.get_outputs()], sess_in.run(None, feed)))
                own = compare(a, {k: torch.from_numpy(np.asarray(same[k])) for k in names}, atol, rtol)
                if not own.passed:  # IN itself moves: OUT against IN as onnxruntime runs both at this level
                    v = compare({k: torch.from_numpy(np.asarray(same[k])) for k in names}, b, atol, rtol,
                                label=f"{label}, against the input at the same level (onnxruntime's own "
                                      f"optimizations change the input's result: {own.worst})")
            found.append(v)
    return found
