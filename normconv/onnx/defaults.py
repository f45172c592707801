"""The export's defaults and choices, in a module that imports nothing: the command line reads them to build its
flags without importing torch, onnx or the exporter (``normconv --help`` / ``--version`` stay light)."""

OPSETS = range(17, 24)
# torch.onnx.export's own default; at 18 tanh-GELU decomposes into 8 ops onnxruntime CPU does not fuse back
# (zoo:gpt measured 6% slower than at 20, where it is one Gelu)
DEFAULT_OPSET = 20
TARGETS = ("onnx", "ort")
# onnxruntime is the runtime users deploy to unless they say otherwise; measured (BENCHMARKS.md, export defaults):
# at opset 20 an RMSNorm stack runs 2.1x slower as the portable function-bodied normconv.RMSNorm (--target onnx)
# than as SimplifiedLayerNormalization (--target ort), which matches plain torch.onnx.export at its best opset (23)
DEFAULT_TARGET = "ort"

__all__ = ["OPSETS", "DEFAULT_OPSET", "TARGETS", "DEFAULT_TARGET"]
