"""The initializers of an IR version 3 file as the constants they are (an onnx-ir pass), and listed again on write.

  ir_version < 4:  every initializer is also a graph input (onnx.checker requires it), and none of them can be
                   overridden: onnxruntime feeds only the inputs that are not initializers (``CanOverrideInitializer``
                   is ``ir_version >= 4``; ``InferenceSession.get_inputs`` leaves them out)
              =>   in memory the graph inputs that name an initializer are dropped, so the rules see constants (the
                   ONNX model zoo's caffe2 and early PyTorch files: a BatchNorm's statistics and a Conv's weight)
  on write:        every initializer of the rewritten graph is listed as a graph input again, after the inputs the
                   file declared (``list_initializers``), so the written file keeps the format's rule

From IR version 4 on, an initializer that is also a graph input is a default a caller may override: it stays an input
and the rules do not read it as a constant, unless the user says it is one (``--constant-initializers``:
``unlisted``, what onnxruntime's ``remove_initializer_from_input.py`` does).
"""

from __future__ import annotations

import onnx
import onnx_ir as ir

LISTED_UNTIL = 4  # below this IR version every initializer is a graph input


class InitializerInputs(ir.passes.InPlacePass):
    """Drop the graph inputs of an IR < 4 model that name an initializer."""

    def call(self, model: ir.Model) -> ir.passes.PassResult:
        if model.ir_version >= LISTED_UNTIL:
            return ir.passes.PassResult(model, False)
        graph = model.graph
        listed = [v for v in graph.inputs if v.is_initializer()]
        for v in listed:  # a constant in IR < 4: not a caller's input
            graph.inputs.remove(v)
        return ir.passes.PassResult(model, bool(listed))


def list_initializers(proto: onnx.ModelProto) -> None:
    """In place: an IR < 4 file's initializers listed as graph inputs (those not listed yet, in initializer order)."""
    if proto.ir_version >= LISTED_UNTIL:
        return
    listed = {v.name for v in proto.graph.input}
    for t in proto.graph.initializer:
        if t.name not in listed:  # the format's rule below IR 4: an initializer is a graph input
            proto.graph.input.append(onnx.helper.make_tensor_value_info(t.name, t.data_type, list(t.dims)))


def unlisted(proto: onnx.ModelProto) -> tuple[onnx.ModelProto, list[str]]:
    """A copy of ``proto`` (the file's own is not touched) without the graph inputs that name an initializer, at any
    IR version, and the names dropped (``proto`` itself where none is)."""
    names = {t.name for t in proto.graph.initializer}
    dropped = [v.name for v in proto.graph.input if v.name in names]
    if not dropped:
        return proto, []
    out = onnx.ModelProto()
    out.CopyFrom(proto)
    kept = [v for v in out.graph.input if v.name not in names]  # a default the caller could override: a constant now
    del out.graph.input[:]
    out.graph.input.extend(kept)
    return out, dropped
