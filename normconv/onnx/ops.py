"""Norm ops for ONNX export: exporter translations to normconv placeholders, then lowering to the target's op.

The dynamo exporter decomposes ``aten.rms_norm`` below opset 23 (an ``rsqrt`` chain onnxruntime does not fuse)
and ``aten.group_norm`` below opset 21 (Reshape + InstanceNormalization + Reshape + Mul + Add). normconv keeps
each as one node instead:

  1. export: ``custom_translation_table`` maps each aten op to a placeholder node in the ``normconv`` domain
     (built from a hand-written ``onnx.defs.OpSchema``; the recorder needs one):
       rms_norm(x, shape, w, eps)          -> normconv.RMSNorm(x, w; axes=[-k..-1], epsilon)
       group_norm(x, G, w, b, eps)         -> normconv.GroupNorm(x, w, b; num_groups=G, epsilon)
  2. lower (``passes/lower.py``, with the rules of ``rules/lower.py``) on the exported onnx_ir model:
       RMSNorm, target ort                 -> SimplifiedLayerNormalization (default domain, ORT kernel)
       RMSNorm, target onnx, opset >= 23   -> RMSNormalization
       RMSNorm, target onnx, opset < 23    -> stays normconv.RMSNorm, its FunctionProto attached (inlined by ORT)
       GroupNorm, opset >= 21              -> GroupNormalization (per-channel scale/bias, opset 21 semantics)
       GroupNorm, opset < 21               -> stays normconv.GroupNorm, its FunctionProto attached

Function bodies (RMSNorm computed in float32, or float64 where a norm of the model reads float64, cast back):
  RMSNorm(X, w)   = CastLike(X32 / sqrt(mean_axes(X32 ^ 2) + eps), X) * w   (the form onnxruntime fuses)
  GroupNorm(X, w, b) = reshape(InstanceNorm(reshape(X, [N, G, -1])), [N, C, -1]) * w[:, None] + b[:, None]
"""

from __future__ import annotations

from typing import Any

import numpy as np
import onnx
import onnx_ir as ir
from onnx import defs, helper

from normconv.kinds import KINDS

DOMAIN = "normconv"
MS_DOMAIN = "com.microsoft"

# every op type that counts as one fused norm in an exported graph, by (domain, op_type): what each kind declares
FUSED_NORM_OPS = {op: kind.name for kind in KINDS for op in kind.onnx_ops}

_FLOATS = ["tensor(float)", "tensor(float16)", "tensor(bfloat16)", "tensor(double)"]
_P = defs.OpSchema.FormalParameter
_A = defs.OpSchema.Attribute
_AT = defs.OpSchema.AttrType

_RMS_SCHEMA = defs.OpSchema(
    "RMSNorm", DOMAIN, 1, inputs=[_P("X", "T"), _P("scale", "T")], outputs=[_P("Y", "T")],
    type_constraints=[("T", _FLOATS, "float tensors")],
    attributes=[_A("axes", _AT.INTS, "normalized axes (trailing, negative)"), _A("epsilon", _AT.FLOAT, "eps")])
_GN_SCHEMA = defs.OpSchema(
    "GroupNorm", DOMAIN, 1, inputs=[_P("X", "T"), _P("scale", "T"), _P("bias", "T")], outputs=[_P("Y", "T")],
    type_constraints=[("T", _FLOATS, "float tensors")],
    attributes=[_A("num_groups", _AT.INT, "groups"), _A("epsilon", _AT.FLOAT, "eps")])

# ir.DataType -> numpy dtype name for constants and finfo (bfloat16 through ml_dtypes)
_EPS_BY_DTYPE = {ir.DataType.FLOAT: float(np.finfo(np.float32).eps), ir.DataType.FLOAT16: float(np.finfo(np.float16).eps),
                 ir.DataType.DOUBLE: float(np.finfo(np.float64).eps), ir.DataType.BFLOAT16: 2.0 ** -7}


def _ops():
    from onnxscript import values

    opset = values.Opset(DOMAIN, 1)
    return values.Op(opset, "RMSNorm", _RMS_SCHEMA), values.Op(opset, "GroupNorm", _GN_SCHEMA)


def _const(fill: float, shape: list[int], like: Any):
    """A constant shaped ``shape`` in ``like``'s dtype (a norm without a learned scale or shift)."""
    from onnxscript import opset18 as op

    dtype = like.dtype if like.dtype is not None else ir.DataType.FLOAT
    return op.Constant(value=ir.tensor(np.full(shape, fill, dtype=dtype.numpy())))


def _in_input_dtype(param: Any, input: Any):
    """A norm's scale or shift in the input's dtype: torch computes rms_norm(x float32, w float16) in x's dtype
    (Mamba's fp16 model does, on its float32 residual stream), while onnxruntime's norm ops give Y the scale's type."""
    from onnxscript import opset18 as op

    if param.dtype is None or input.dtype is None or param.dtype == input.dtype:
        return param
    return op.CastLike(param, input)


def _ones(shape: list[int], like: Any):
    return _const(1.0, shape, like)


def _zeros(shape: list[int], like: Any):
    return _const(0.0, shape, like)


def translation_table() -> dict:
    """aten op -> translation emitting a normconv placeholder (lowered afterwards by ``lower_norm_ops``)."""
    import torch

    rms_op, gn_op = _ops()

    def rms_norm(input, normalized_shape, weight=None, eps=None):
        # rms_norm(x, shape, w, eps)  =>  normconv.RMSNorm(x, w)
        shape = [int(d) for d in normalized_shape]
        if eps is None:  # torch's default: finfo(x.dtype).eps
            eps = _EPS_BY_DTYPE.get(input.dtype, _EPS_BY_DTYPE[ir.DataType.FLOAT])
        scale = _in_input_dtype(weight, input) if weight is not None else _ones(shape, input)
        return rms_op(input, scale, axes=list(range(-len(shape), 0)), epsilon=float(eps))

    def group_norm(input, num_groups, weight=None, bias=None, eps=1e-5, cudnn_enabled=True):
        # group_norm(x, G, w, b, eps)  =>  normconv.GroupNorm(x, w, b)
        channels = input.shape[1] if input.shape is not None else None
        if (weight is None or bias is None) and not isinstance(channels, int):
            raise ValueError("group_norm without affine needs a static channel count")
        scale = _in_input_dtype(weight, input) if weight is not None else _ones([channels], input)
        shift = _in_input_dtype(bias, input) if bias is not None else _zeros([channels], input)
        return gn_op(input, scale, shift, num_groups=int(num_groups), epsilon=float(eps))

    return {torch.ops.aten.rms_norm.default: rms_norm, torch.ops.aten.group_norm.default: group_norm,
            **missing_translations()}


def missing_translations() -> dict:
    """aten ops (or forms of them) the torch exporter has no ONNX function for, that models call where no norm is
    involved: without them the whole export fails (``torch._check`` in Hugging Face VLMs emits ``aten._is_all_true``;
    timm's Hiera, NesT, Twins and SAM call SDPA on 3-D or 5-D tensors, which torch.onnx takes only in 4-D)."""
    import torch

    def is_all_true(self):
        # _is_all_true(x) = all(x), a bool scalar  =>  Cast(ReduceMin(Cast(x, int32), keepdims=0), bool)
        from onnxscript import opset18 as op

        return op.Cast(op.ReduceMin(op.Cast(self, to=ir.DataType.INT32), keepdims=0), to=ir.DataType.BOOL)

    def scaled_dot_product_attention(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None,
                                     enable_gqa=False):
        # torch.onnx's SDPA takes 4-D q, k, v only (Hiera, NesT, Twins, SAM call it on 3-D or 5-D ones):
        # (..., L, E)  =>  (1, prod(...), L, E), SDPA, then back to (..., L, Ev); a mask of rank <= 2 broadcasts
        from onnxscript import opset18 as op
        from onnxscript.function_libs.torch_lib.ops.nn import aten_scaled_dot_product_attention as sdpa

        ranks = {len(t.shape) for t in (query, key, value)}
        lead = [tuple(t.shape)[:-2] for t in (query, key, value)]
        # a mask of rank <= 2 broadcasts as it is; one of q's rank is reshaped with it where its leading dims are
        # q's or all 1 (SAM's relative-position bias: (B * heads, L, S) beside 3-D q, k, v)
        mask_lead = tuple(attn_mask.shape)[:-2] if attn_mask is not None else ()
        folds_mask = attn_mask is not None and len(attn_mask.shape) > 2
        if ranks == {4} or len(ranks) != 1 or enable_gqa or lead[0] != lead[1] or lead[1] != lead[2] or \
                folds_mask and (len(mask_lead) != len(lead[0]) or
                                mask_lead != lead[0] and any(d != 1 for d in mask_lead)):
            return sdpa(query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa)  # as torch.onnx does
        head = op.Constant(value_ints=[1, -1])
        folded = (query, key, value) + ((attn_mask,) if folds_mask else ())
        four = [op.Reshape(t, op.Concat(head, op.Shape(t, start=-2), axis=0)) for t in folded]
        for t, f in zip(folded, four):  # the rank the exporter's SDPA asserts, known before inference
            f.shape, f.dtype = ir.Shape([1, None, *tuple(t.shape)[-2:]]), t.dtype
        if folds_mask:
            *four, attn_mask = four
        out = sdpa(*four, attn_mask, dropout_p, is_causal, scale, enable_gqa)
        return op.Reshape(out, op.Concat(op.Shape(query, end=-1), op.Shape(value, start=-1), axis=0))

    return {torch.ops.aten._is_all_true.default: is_all_true,
            torch.ops.aten.scaled_dot_product_attention.default: scaled_dot_product_attention}


# transformers' MoE kernels: one MatMul per expert over its rows (transformers' own translation)
_GROUPED_MM = ("aten::_grouped_mm", "transformers::grouped_mm_fallback")


def model_translations(model: Any) -> dict:
    """Translations a model's own library gives for the ops it alone calls: a Hugging Face mixture of experts run
    with ``experts_implementation="grouped_mm"`` (transformers 5's default: Mixtral, Qwen2-MoE, Qwen3-MoE, ...)
    calls ``aten._grouped_mm`` / ``transformers.grouped_mm_fallback``, which torch.onnx has no function for;
    transformers' ONNX exporter has one, taken from it (imported only for such a model: 1.5 s)."""
    modules = model.modules() if hasattr(model, "modules") else ()
    if not any(getattr(getattr(m, "config", None), "_experts_implementation", None) == "grouped_mm"
               for m in modules):
        return {}
    try:
        from transformers.exporters.exporter_onnx import _ONNX_TRANSLATION_TABLE as table
    except Exception:  # noqa: BLE001 - a transformers without its ONNX exporter: the export says what failed
        return {}
    return {op: fn for op, fn in table.items() if getattr(op, "name", lambda: "")() in _GROUPED_MM}


# ---------------------------------------------------------------------------------------------------------
# function bodies


def _ref(name: str, ref: str, typ: int) -> onnx.AttributeProto:
    a = onnx.AttributeProto()
    a.name, a.ref_attr_name, a.type = name, ref, typ
    return a


def _node(op: str, inputs: list[str], outputs: list[str], refs: tuple = (), **attrs) -> onnx.NodeProto:
    n = helper.make_node(op, inputs, outputs, **attrs)
    n.attribute.extend(refs)
    return n


# the default-domain opset the function bodies need: Constant(value_float / value_int) is opset 12, CastLike 15;
# a file below it is converted first (onnx.onnx_in)
FUNCTION_OPSET = 15


def function_proto(op_type: str, opset: int, wide: bool = False) -> onnx.FunctionProto:
    """The ONNX function body of normconv.<op_type> in default-domain opset ``opset`` (>= ``FUNCTION_OPSET``);
    ``wide``: a norm of the model reads float64, so RMSNorm's statistics are computed in float64 (a body is one per
    model and cannot choose by type: float32 would lose a float64 input's digits)."""
    if op_type == "RMSNorm":
        return _rms_function(opset, onnx.TensorProto.DOUBLE if wide else onnx.TensorProto.FLOAT)
    if op_type == "GroupNorm":
        return _group_norm_function(opset)
    raise ValueError(f"no function body for {DOMAIN}.{op_type}")


def _rms_function(opset: int, compute: int) -> onnx.FunctionProto:
    A = onnx.AttributeProto
    # Pow(x, 2), not Mul(x, x): onnxruntime fuses Pow -> ReduceMean -> Add -> Sqrt -> Div -> Mul into its
    # SimplifiedLayerNormalization kernel once it inlines the function (measured 2.1x faster than Mul's form)
    two = helper.make_tensor("two", compute, [], [2.0])
    nodes = [_node("Cast", ["X"], ["X32"], to=compute),
             _node("Constant", [], ["Two"], value=two),
             _node("Pow", ["X32", "Two"], ["Sq"])]
    if opset >= 18:  # ReduceMean takes axes as an input from opset 18
        nodes += [_node("Constant", [], ["Axes"], (_ref("value_ints", "axes", A.INTS),)),
                  _node("ReduceMean", ["Sq", "Axes"], ["MeanSq"], keepdims=1)]
    else:
        nodes += [_node("ReduceMean", ["Sq"], ["MeanSq"], (_ref("axes", "axes", A.INTS),), keepdims=1)]
    wide = compute != onnx.TensorProto.FLOAT  # float64: the float attribute epsilon cast to it
    nodes += [_node("Constant", [], ["Eps32" if wide else "Eps"], (_ref("value_float", "epsilon", A.FLOAT),))]
    nodes += [_node("Cast", ["Eps32"], ["Eps"], to=compute)] if wide else []
    nodes += [_node("Add", ["MeanSq", "Eps"], ["Var"]),
              _node("Sqrt", ["Var"], ["Rms"]),
              _node("Div", ["X32", "Rms"], ["N32"]),
              _node("CastLike", ["N32", "X"], ["N"]),
              _node("Mul", ["N", "scale"], ["Y"])]
    return helper.make_function(DOMAIN, "RMSNorm", ["X", "scale"], ["Y"], nodes,
                                [helper.make_opsetid("", opset)], attributes=["axes", "epsilon"],
                                doc_string="Y = X / sqrt(mean(X^2 over axes) + epsilon) * scale, in "
                                f"{'float64' if wide else 'float32'}")


def _group_norm_function(opset: int) -> onnx.FunctionProto:
    A = onnx.AttributeProto
    one = helper.make_tensor("one", onnx.TensorProto.FLOAT, [1], [1.0])
    nodes = [
        _node("Shape", ["X"], ["S"]),
        _node("Shape", ["X"], ["N1"], start=0, end=1),
        _node("Shape", ["X"], ["C1"], start=1, end=2),
        _node("Constant", [], ["Gs"], (_ref("value_int", "num_groups", A.INT),)),
        _node("Constant", [], ["Shape1"], value_ints=[1]),
        _node("Constant", [], ["Minus1"], value_ints=[-1]),
        _node("Reshape", ["Gs", "Shape1"], ["G1"]),
        _node("Concat", ["N1", "G1", "Minus1"], ["ShapeG"], axis=0),
        _node("Reshape", ["X", "ShapeG"], ["Xg"]),
        _node("ConstantOfShape", ["G1"], ["Ones32"], value=one),
        _node("CastLike", ["Ones32", "X"], ["OnesG"]),
        _node("Sub", ["OnesG", "OnesG"], ["ZerosG"]),
        _node("Constant", [], ["Eps"], (_ref("value_float", "epsilon", A.FLOAT),)),
        _node("InstanceNormalization", ["Xg", "OnesG", "ZerosG"], ["Ng"], (_ref("epsilon", "epsilon", A.FLOAT),)),
        _node("Concat", ["N1", "C1", "Minus1"], ["ShapeC"], axis=0),
        _node("Reshape", ["Ng", "ShapeC"], ["Nc"]),
        _node("Concat", ["C1", "Shape1"], ["ShapeW"], axis=0),
        _node("Reshape", ["scale", "ShapeW"], ["W"]),
        _node("Reshape", ["bias", "ShapeW"], ["B"]),
        _node("Mul", ["Nc", "W"], ["Yw"]),
        _node("Add", ["Yw", "B"], ["Yc"]),
        _node("Reshape", ["Yc", "S"], ["Y"]),
    ]
    nodes = [n for n in nodes if n.output[0] != "Eps"]
    return helper.make_function(DOMAIN, "GroupNorm", ["X", "scale", "bias"], ["Y"], nodes,
                                [helper.make_opsetid("", opset)], attributes=["num_groups", "epsilon"],
                                doc_string="GroupNorm with per-channel scale and bias (GroupNormalization-21 semantics)")
