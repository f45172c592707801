"""onnx-ir passes over an ONNX model (``onnx_ir.passes.PassBase``): opset conversion, rule sets (fold, fuse),
lowering of normconv's placeholders to the target's ops. The ONNX-file flow (``normconv.onnx.onnx_in``) and the
torch export run them through one ``PassManager``."""
