"""Opset conversion (onnx.version_converter), for a file below the opset its fused ops need.

  ai.onnx opset N  =>  opset M > N   (LayerNormalization needs 17): the converter rewrites each op whose schema
  changed in between (e.g. Reduce* axes from attribute to input at 18). The flow validates the converted model
  against the file before any rule runs, and the report says it was converted.

  The converter converts the graph, not the model-local functions (FunctionProto): it drops them, and the converted
  file no longer resolves their calls. So, as onnxscript's ConvertVersionPass does, the local functions are inlined
  first (onnx.inliner, each body brought to the model's opset where it imports another): the converted graph holds
  their bodies, converted with it, and the rules see the norms written inside them.
"""

from __future__ import annotations

import onnx
import onnx_ir as ir

from normconv.errors import Code, NormconvError

from .inline import function_names, inline_functions

NAME = "convert-opset"  # the pass_name of its refusals (Code.REFUSED)


class ConvertOpset(ir.passes.FunctionalPass):
    """Return the model at default-domain opset ``opset`` (unchanged when it is there already); ``inlined`` lists
    the local functions inlined on the way (domain.name)."""

    def __init__(self, opset: int) -> None:
        super().__init__()
        self.opset = opset
        self.inlined: list[str] = []

    def call(self, model: ir.Model) -> ir.passes.PassResult:
        have = model.opset_imports.get("", 1)
        if have >= self.opset:
            return ir.passes.PassResult(model, False)
        proto = ir.serde.serialize_model(model)
        self.inlined = function_names(proto)
        try:
            proto = inline_functions(proto)
        except NormconvError as exc:
            raise NormconvError(f"cannot convert the file's opset: {exc.message} first", Code.REFUSED,
                                hint="pass --opset with the file's own opset to keep its norms as written",
                                pass_name=NAME) from None
        try:
            converted = onnx.version_converter.convert_version(proto, self.opset)
        except Exception as exc:  # noqa: BLE001 - the converter's own message names the op
            raise NormconvError(f"cannot convert the file from opset {have} to {self.opset} "
                                f"(onnx.version_converter: {str(exc).splitlines()[0][:200]})",
                                Code.REFUSED,
                                hint="pass --opset with the file's own opset to keep its norms as written",
                                pass_name=NAME) from None
        return ir.passes.PassResult(ir.serde.deserialize_model(converted), True)
