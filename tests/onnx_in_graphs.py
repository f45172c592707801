"""Hand-built ONNX graphs in the spellings exporters write (torch legacy, paddle2onnx, tf2onnx / jax2tf), for the
ONNX-in tests. Each builder returns an onnx.ModelProto with random weights."""

from __future__ import annotations

import numpy as np
import onnx
from onnx import TensorProto as T, helper as h, numpy_helper as nh

RNG = np.random.default_rng(0)


def _f(name, a):
    return nh.from_array(np.asarray(a, dtype=np.float32), name)


def model(nodes, inputs, outputs, inits, opset, functions=()):
    g = h.make_graph(nodes, "g", inputs, outputs, inits)
    return h.make_model(g, opset_imports=[h.make_opsetid("", opset)], functions=list(functions),
                        producer_name="hand-built")


def _mean(x, out, axes, opset, keepdims=1):
    if opset >= 18:
        return [h.make_node("ReduceMean", [x, f"{out}_axes"], [out], keepdims=keepdims)], \
            [nh.from_array(np.array(axes, np.int64), f"{out}_axes")]
    return [h.make_node("ReduceMean", [x], [out], axes=axes, keepdims=keepdims)], []


def layernorm_torch(opset=11, d=16, affine=True, pow_square=True):
    """torch legacy / paddle2onnx: m = E[x]; d = x − m; v = E[d²]; (d / sqrt(v + ε)) · w + b."""
    n1, i1 = _mean("x", "m", [-1], opset)
    n2, i2 = _mean("d2", "v", [-1], opset)
    sq = h.make_node("Pow", ["d", "two"], ["d2"]) if pow_square else h.make_node("Mul", ["d", "d"], ["d2"])
    nodes = n1 + [h.make_node("Sub", ["x", "m"], ["d"]), sq] + n2 + [
        h.make_node("Add", ["v", "eps"], ["ve"]), h.make_node("Sqrt", ["ve"], ["s"]),
        h.make_node("Div", ["d", "s"], ["n" if affine else "y"])]
    inits = i1 + i2 + [_f("two", 2.0), _f("eps", 1e-5)]
    if affine:
        nodes += [h.make_node("Mul", ["n", "w"], ["nw"]), h.make_node("Add", ["nw", "b"], ["y"])]
        inits += [_f("w", RNG.random(d) + 0.5), _f("b", RNG.standard_normal(d))]
    return model(nodes, [h.make_tensor_value_info("x", T.FLOAT, ["batch", "seq", d])],
                 [h.make_tensor_value_info("y", T.FLOAT, ["batch", "seq", d])], inits, opset)


def layernorm_tf(opset=15, c=32):
    """tf2onnx / jax2tf (flax): mean and E[x²] as ReduceSum·(1/n), keepdims 0, put back by Reshape + Expand;
    Var = max(E[x²] − E[x]², 0); d · (Reciprocal(Sqrt(Var + ε)) · w) + b over axis 1 of (N, C, L)."""
    axes = nh.from_array(np.array([1], np.int64), "ax")
    nodes = [h.make_node("ReduceSum", ["x", "ax"], ["s1"], keepdims=0), h.make_node("Mul", ["s1", "inv_n"], ["m"]),
             h.make_node("Mul", ["x", "x"], ["xx"]), h.make_node("ReduceSum", ["xx", "ax"], ["s2"], keepdims=0),
             h.make_node("Mul", ["s2", "inv_n"], ["ex2"]), h.make_node("Mul", ["m", "m"], ["m2"]),
             h.make_node("Sub", ["ex2", "m2"], ["vr"]), h.make_node("Max", ["zero", "vr"], ["v"]),
             h.make_node("Shape", ["x"], ["xs"]), h.make_node("Gather", ["xs", "i0"], ["n0"], axis=0),
             h.make_node("Concat", ["n0", "one_l"], ["shp"], axis=0),
             h.make_node("Reshape", ["v", "shp"], ["vr3"]), h.make_node("Expand", ["vr3", "shp"], ["vb"]),
             h.make_node("Reshape", ["m", "shp"], ["mr3"]), h.make_node("Expand", ["mr3", "shp"], ["mb"]),
             h.make_node("Add", ["vb", "eps"], ["ve"]), h.make_node("Sqrt", ["ve"], ["s"]),
             h.make_node("Reciprocal", ["s"], ["r"]), h.make_node("Mul", ["r", "w"], ["rw"]),
             h.make_node("Sub", ["x", "mb"], ["d"]), h.make_node("Mul", ["d", "rw"], ["dw"]),
             h.make_node("Add", ["dw", "b"], ["y"])]
    inits = [axes, _f("inv_n", 1.0 / c), _f("zero", 0.0), _f("eps", 1e-6),
             nh.from_array(np.array([0], np.int64), "i0"), nh.from_array(np.array([1, 8], np.int64), "one_l"),
             _f("w", (RNG.random(c) + 0.5).reshape(1, c, 1)), _f("b", RNG.standard_normal(c).reshape(1, c, 1))]
    return model(nodes, [h.make_tensor_value_info("x", T.FLOAT, ["unk__1", c, 8])],
                 [h.make_tensor_value_info("y", T.FLOAT, ["unk__1", c, 8])], inits, opset)


def rmsnorm(opset=18, d=16, casts=False, gemma=False, div=False):
    """Llama / Gemma: x32 = Cast(x); x32 · Reciprocal(Sqrt(E[x32²] + ε)) [Cast back] · w (Gemma: · (1 + w))."""
    src = "x32" if casts else "x"
    n1, i1 = _mean("sq", "ms", [-1], opset)
    nodes = ([h.make_node("Cast", ["x"], ["x32"], to=T.FLOAT)] if casts else []) + [
        h.make_node("Pow", [src, "two"], ["sq"])] + n1 + [
        h.make_node("Add", ["ms", "eps"], ["ve"]), h.make_node("Sqrt", ["ve"], ["s"])]
    if div:
        nodes += [h.make_node("Div", [src, "s"], ["n32"])]
    else:
        nodes += [h.make_node("Reciprocal", ["s"], ["r"]), h.make_node("Mul", [src, "r"], ["n32"])]
    w = RNG.random(d).astype(np.float32)
    inits = i1 + [_f("two", 2.0), _f("eps", 1e-6)]
    if gemma:
        nodes += [h.make_node("Add", ["one", "w"], ["w1"])]
        inits += [_f("one", 1.0), _f("w", w - 0.5)]
    last = "n" if casts else "n32"
    if casts:
        nodes += [h.make_node("Cast", ["n32"], ["n"], to=T.FLOAT16)]
    wt = T.FLOAT16 if casts else T.FLOAT
    if casts:
        inits += [nh.from_array(w.astype(np.float16), "w")]
    elif not gemma:
        inits += [_f("w", w)]
    nodes += [h.make_node("Mul", [last, "w1" if gemma else "w"], ["y"])]
    return model(nodes, [h.make_tensor_value_info("x", wt, ["batch", "seq", d])],
                 [h.make_tensor_value_info("y", wt, ["batch", "seq", d])], inits, opset)


def rmsnorm_float64(opset=17, d=8):
    """A double-precision model's RMSNorm: x / sqrt(E[x²] + ε) · w, every value float64."""
    f = lambda name, a: nh.from_array(np.asarray(a, dtype=np.float64), name)  # noqa: E731
    n1, i1 = _mean("sq", "ms", [-1], opset)
    nodes = [h.make_node("Pow", ["x", "two"], ["sq"])] + n1 + [
        h.make_node("Add", ["ms", "eps"], ["ve"]), h.make_node("Sqrt", ["ve"], ["s"]),
        h.make_node("Div", ["x", "s"], ["n"]), h.make_node("Mul", ["w", "n"], ["y"])]
    inits = i1 + [f("two", 2.0), f("eps", 1e-6), f("w", RNG.standard_normal(d))]
    return model(nodes, [h.make_tensor_value_info("x", T.DOUBLE, ["batch", "seq", d])],
                 [h.make_tensor_value_info("y", T.DOUBLE, ["batch", "seq", d])], inits, opset)


def norms_eps_rank_up(kind="layernorm", d=8):
    """Two norms of a rank-3 input in a row, the second one's eps of shape (1, 1, 1, 1): its Add broadcasts the
    result up to rank 4, (1, N, T, D), which one fused op would drop; the first one is plain."""
    def norm(x, y, eps):
        p = f"{y}_"
        if kind == "layernorm":
            return [h.make_node("ReduceMean", [x], [p + "m"], axes=[-1]), h.make_node("Sub", [x, p + "m"], [p + "d"]),
                    h.make_node("Pow", [p + "d", "two"], [p + "d2"]),
                    h.make_node("ReduceMean", [p + "d2"], [p + "v"], axes=[-1]),
                    h.make_node("Add", [p + "v", eps], [p + "ve"]), h.make_node("Sqrt", [p + "ve"], [p + "s"]),
                    h.make_node("Div", [p + "d", p + "s"], [p + "n"]), h.make_node("Mul", [p + "n", "w"], [y])]
        return [h.make_node("Pow", [x, "two"], [p + "sq"]), h.make_node("ReduceMean", [p + "sq"], [p + "ms"], axes=[-1]),
                h.make_node("Add", [p + "ms", eps], [p + "ve"]), h.make_node("Sqrt", [p + "ve"], [p + "s"]),
                h.make_node("Div", [x, p + "s"], [p + "n"]), h.make_node("Mul", ["w", p + "n"], [y])]
    inits = [_f("two", 2.0), _f("eps", 1e-5), _f("eps4", np.full((1, 1, 1, 1), 1e-5)), _f("w", RNG.random(d) + 0.5)]
    return model(norm("x", "y1", "eps") + norm("y1", "y", "eps4"),
                 [h.make_tensor_value_info("x", T.FLOAT, ["batch", "seq", d])],
                 [h.make_tensor_value_info("y", T.FLOAT, None)], inits, 17)


def groupnorm(opset=17, c=8, groups=4):
    """torch legacy nn.GroupNorm: Reshape(x, [0, G, -1]) -> InstanceNormalization -> Reshape(shape(x)) · w + b."""
    nodes = [h.make_node("Reshape", ["x", "gshape"], ["xg"]),
             h.make_node("InstanceNormalization", ["xg", "ones", "zeros"], ["ng"], epsilon=1e-5),
             h.make_node("Shape", ["x"], ["xs"]), h.make_node("Reshape", ["ng", "xs"], ["nc"]),
             h.make_node("Mul", ["nc", "w"], ["nw"]), h.make_node("Add", ["nw", "b"], ["y"])]
    inits = [nh.from_array(np.array([0, groups, -1], np.int64), "gshape"), _f("ones", np.ones(groups)),
             _f("zeros", np.zeros(groups)), _f("w", RNG.random((c, 1, 1)) + 0.5), _f("b", RNG.random((c, 1, 1)))]
    return model(nodes, [h.make_tensor_value_info("x", T.FLOAT, ["n", c, "h", "w"])],
                 [h.make_tensor_value_info("y", T.FLOAT, ["n", c, "h", "w"])], inits, opset)


def _bn(x, y, c, name="bn"):
    inits = [_f(f"{name}_g", RNG.random(c) + 0.5), _f(f"{name}_b", RNG.standard_normal(c)),
             _f(f"{name}_m", RNG.standard_normal(c)), _f(f"{name}_v", RNG.random(c) + 0.5)]
    return h.make_node("BatchNormalization", [x, *[i.name for i in inits]], [y], name=name, epsilon=1e-5), inits


def conv_bn(op="Conv", groups=1, dilation=1, opset=13, cin=4, cout=8, bias_add=False):
    """Conv / ConvTranspose (groups, dilation) -> BN; ``bias_add``: the bias as a separate Add of a [1, C, 1, 1]
    constant (paddle2onnx)."""
    w = RNG.standard_normal((cout, cin // groups, 3, 3) if op == "Conv" else (cin, cout // groups, 3, 3))
    conv = h.make_node(op, ["x", "w"] + ([] if bias_add else ["cb"]), ["c" if bias_add else "z"], name="conv",
                       group=groups, dilations=[dilation, dilation], pads=[1, 1, 1, 1])
    nodes = [conv] + ([h.make_node("Add", ["c", "cb"], ["z"])] if bias_add else [])
    bn, inits = _bn("z", "y", cout)
    cb = RNG.standard_normal(cout).reshape((1, cout, 1, 1) if bias_add else (cout,))
    return model(nodes + [bn], [h.make_tensor_value_info("x", T.FLOAT, ["n", cin, "h", "w"])],
                 [h.make_tensor_value_info("y", T.FLOAT, None)], [_f("w", w), _f("cb", cb)] + inits, opset)


def gemm_bn(trans_b=1, matmul=False, opset=13, k=6, n=5):
    """Gemm (or MatMul + Add) on (N, K) -> BN over the N features."""
    if matmul:
        nodes = [h.make_node("MatMul", ["x", "w"], ["mm"]), h.make_node("Add", ["mm", "c"], ["z"])]
        w = RNG.standard_normal((k, n))
    else:
        nodes = [h.make_node("Gemm", ["x", "w", "c"], ["z"], transB=trans_b, beta=0.5)]
        w = RNG.standard_normal((n, k) if trans_b else (k, n))
    bn, inits = _bn("z", "y", n)
    return model(nodes + [bn], [h.make_tensor_value_info("x", T.FLOAT, ["batch", k])],
                 [h.make_tensor_value_info("y", T.FLOAT, ["batch", n])], [_f("w", w), _f("c", RNG.standard_normal(n))]
                 + inits, opset)


def bn_conv(pads=0, opset=13, c=4, cout=6, standalone=False):
    """BN -> Conv (foldable forward only without padding); ``standalone``: BN -> Relu, no conv next to it."""
    bn, inits = _bn("x", "b1", c)
    nodes = [bn]
    if standalone:
        nodes.append(h.make_node("Relu", ["b1"], ["y"]))
    else:
        nodes.append(h.make_node("Conv", ["b1", "w"], ["y"], pads=[pads] * 4))
        inits.append(_f("w", RNG.standard_normal((cout, c, 3, 3))))
    return model(nodes, [h.make_tensor_value_info("x", T.FLOAT, ["n", c, "h", "w"])],
                 [h.make_tensor_value_info("y", T.FLOAT, None)], inits, opset)


def l2_and_magnitude(opset=17, d=16):
    """No norm at all: an L2 normalization x / sqrt(Σx²) and an STFT-style magnitude sqrt(re² + im²)."""
    nodes = [h.make_node("Mul", ["x", "x"], ["xx"]), h.make_node("ReduceSum", ["xx", "ax"], ["ss"], keepdims=1),
             h.make_node("Sqrt", ["ss"], ["l2"]), h.make_node("Div", ["x", "l2"], ["y"]),
             h.make_node("Pow", ["re", "two"], ["r2"]), h.make_node("Pow", ["im", "two"], ["i2"]),
             h.make_node("Add", ["r2", "i2"], ["p"]), h.make_node("Sqrt", ["p"], ["mag"])]
    inits = [nh.from_array(np.array([-1], np.int64), "ax"), _f("two", 2.0)]
    f = lambda n: h.make_tensor_value_info(n, T.FLOAT, ["batch", d])  # noqa: E731
    return model(nodes, [f("x"), f("re"), f("im")], [f("y"), f("mag")], inits, opset)


def layernorm_in_if(opset=17, d=16):
    """A LayerNorm inside an If branch (the other branch passes x through)."""
    inner = layernorm_torch(opset, d, affine=True)
    then = h.make_graph(list(inner.graph.node), "then", [], [h.make_tensor_value_info("y", T.FLOAT, None)],
                        list(inner.graph.initializer))
    other = h.make_graph([h.make_node("Identity", ["x"], ["y2"])], "else", [],
                         [h.make_tensor_value_info("y2", T.FLOAT, None)])
    node = h.make_node("If", ["cond"], ["out"], then_branch=then, else_branch=other)
    return model([node], [h.make_tensor_value_info("x", T.FLOAT, ["batch", "seq", d]),
                          h.make_tensor_value_info("cond", T.BOOL, [])],
                 [h.make_tensor_value_info("out", T.FLOAT, ["batch", "seq", d])], [], opset)


def layernorm_in_function(opset=17, d=16):
    """A LayerNorm inside a model-local ONNX function (its constants as Constant nodes: functions hold no
    initializers), called once."""
    inner = layernorm_torch(opset, d, affine=False)
    consts = [h.make_node("Constant", [], [i.name], value=i) for i in inner.graph.initializer]
    fn = h.make_function("local", "MyLN", ["x"], ["y"], consts + list(inner.graph.node), [h.make_opsetid("", opset)])
    g = h.make_graph([h.make_node("MyLN", ["x"], ["y"], domain="local")], "g",
                     [h.make_tensor_value_info("x", T.FLOAT, ["batch", "seq", d])],
                     [h.make_tensor_value_info("y", T.FLOAT, ["batch", "seq", d])])
    return h.make_model(g, opset_imports=[h.make_opsetid("", opset), h.make_opsetid("local", 1)], functions=[fn],
                        producer_name="hand-built")


def save(proto: onnx.ModelProto, path) -> str:
    onnx.save(proto, str(path))
    return str(path)



def conv_bn_sigmoid(opset=13, cin=16, cout=4, spread=1e4, planted=0.0):
    """Conv -> BN -> -|.| - 12 -> Sigmoid: logits of scale ``spread`` whose largest is about -12 (a detector's
    probability map on random inputs: its largest value is 6e-6, its logits large). ``planted``: an error added to
    the BN's shift, relative to the logits' scale (then not the original's function: a check must refuse it)."""
    w = RNG.standard_normal((cout, cin, 3, 3)) * spread / 12
    nodes = [h.make_node("Conv", ["x", "w", "cb"], ["z"], name="conv", pads=[1, 1, 1, 1]),
             h.make_node("BatchNormalization", ["z", "g", "b", "m", "v"], ["y"], name="bn", epsilon=1e-5),
             h.make_node("Abs", ["y"], ["a"]), h.make_node("Neg", ["a"], ["na"]),
             h.make_node("Add", ["na", "c12"], ["logits"]), h.make_node("Sigmoid", ["logits"], ["prob"])]
    inits = [_f("w", w), _f("cb", np.zeros(cout)), _f("g", np.linspace(0.5, 2, cout)),
             _f("b", np.full(cout, planted * spread * 4)), _f("m", np.linspace(-1, 1, cout)),
             _f("v", np.linspace(0.5, 2, cout)), _f("c12", np.array(-12.0))]
    return model(nodes, [h.make_tensor_value_info("x", T.FLOAT, ["n", cin, "h", "w"])],
                 [h.make_tensor_value_info("prob", T.FLOAT, None)], inits, opset)


def bn_spatial0(before=False, per_channel=False, c=4):
    """Opset 7 BatchNormalization with spatial=0 (statistics per element, shaped (C, H, W)) after a Conv (``before``:
    in front of one), beside a Conv -> BN (spatial=1, one value per channel) that folds. ``per_channel``: the (C, H, W)
    statistics are equal along H and W (one value per channel written per element)."""
    hw, shape = (6, 6), (c, 6, 6)
    stats = [RNG.random(shape) + 0.5, RNG.standard_normal(shape), RNG.standard_normal(shape), RNG.random(shape) + 0.5]
    if per_channel:
        stats = [np.broadcast_to(a[:, :1, :1], shape) for a in stats]
    inits = [_f(n, a) for n, a in zip(("s", "b", "m", "v"), stats)]
    if before:
        nodes = [h.make_node("BatchNormalization", ["x", "s", "b", "m", "v"], ["n0"], name="bn0", spatial=0),
                 h.make_node("Conv", ["n0", "w"], ["y"], name="conv")]
        inits.append(_f("w", RNG.standard_normal((5, c, 3, 3))))
        x = h.make_tensor_value_info("x", T.FLOAT, ["n", c, *hw])
    else:
        nodes = [h.make_node("Conv", ["x", "w"], ["c0"], name="conv"),
                 h.make_node("BatchNormalization", ["c0", "s", "b", "m", "v"], ["y"], name="bn0", spatial=0)]
        inits.append(_f("w", RNG.standard_normal((c, c, 3, 3))))
        x = h.make_tensor_value_info("x", T.FLOAT, ["n", c, 8, 8])
    bn, more = _bn("c1", "y1", c, name="bn1")
    nodes += [h.make_node("Conv", ["x", "w1"], ["c1"], name="conv1"), bn]
    inits += more + [_f("w1", RNG.standard_normal((c, c, 1, 1)))]
    return model(nodes, [x], [h.make_tensor_value_info("y", T.FLOAT, None),
                              h.make_tensor_value_info("y1", T.FLOAT, None)], inits, 7)


def conv_bn_float16(gamma=300.0, c=4, before=False):
    """A float16 file: two Conv (1x1) -> BN on x / 100 (``before``: BN -> Conv); the first BN's scale
    γ/sqrt(σ² + ε) = ``gamma`` / 0.01 times its conv weight 3 passes float16's 65504 once folded (its output stays
    in range); the second folds in range."""
    f16 = lambda n, a: nh.from_array(np.asarray(a, np.float16), n)  # noqa: E731
    nodes, inits = [h.make_node("Mul", ["x", "small"], ["xs"])], [f16("small", 0.01)]
    for i, (g, w) in enumerate(((gamma, 3.0), (2.0, 0.5))):
        conv = h.make_node("Conv", ["n" if before else "xs", f"w{i}"], ["y" if before else "c"], name=f"conv{i}")
        bn = h.make_node("BatchNormalization", ["xs" if before else "c", f"g{i}", f"b{i}", f"m{i}", f"v{i}"],
                         ["n" if before else "y"], name=f"bn{i}", epsilon=1e-5)
        for node in (conv, bn):
            node.input[0] = node.input[0] if node.input[0] == "xs" else f"{node.input[0]}{i}"
            node.output[0] = f"{node.output[0]}{i}"
        nodes += [bn, conv] if before else [conv, bn]
        inits += [f16(f"w{i}", np.full((c, c if before else 3, 1, 1), w)), f16(f"g{i}", [g] + [1.0] * (c - 1)),
                  f16(f"b{i}", np.zeros(c)), f16(f"m{i}", np.zeros(c)), f16(f"v{i}", np.full(c, 1e-4))]
    return model(nodes, [h.make_tensor_value_info("x", T.FLOAT16, ["n", c if before else 3, 6, 6])],
                 [h.make_tensor_value_info(f"y{i}", T.FLOAT16, None) for i in range(2)], inits, 17)
