"""The export's defaults and choices, in a module that imports nothing: the command line reads them to build its
flags without importing torch, onnx or the exporter (``normconv --help`` / ``--version`` stay light)."""

OPSETS = range(17, 24)
# 23: the first opset with a standard RMSNormalization (and GroupNormalization-21, Gelu-20): every norm is one
# standard op, which onnxruntime, OpenVINO and TensorRT (10.15+) load; below 23 an RMSNorm is the model-local function
# normconv.RMSNorm, which onnxruntime inlines and fuses but OpenVINO cannot load (measured: "No conversion rule for
# normconv.RMSNorm"). At 18 a tanh GELU decomposes into 8 ops onnxruntime CPU does not fuse back (zoo:gpt 6% slower)
DEFAULT_OPSET = 23
TARGETS = ("onnx", "ort")
# a standard file by default: it passes onnx.checker (full_check) and loads in every runtime (onnxruntime, OpenVINO,
# TensorRT); measured (BENCHMARKS.md, export defaults) as fast on onnxruntime CPU as --target ort at opset 20 (the
# function body normconv.RMSNorm is written in the form onnxruntime fuses into SimplifiedLayerNormalization) and 23
# (RMSNormalization); onnxruntime's own ops (SimplifiedLayerNormalization in the default domain, which the checker
# rejects; Skip*LayerNormalization) stay one flag away: --target ort
DEFAULT_TARGET = "onnx"
# ONNX ops that draw random numbers (each takes an optional float ``seed``): a file holding one computes other outputs
# at every run unless they are seeded
RANDOM_OPS = ("RandomUniform", "RandomUniformLike", "RandomNormal", "RandomNormalLike", "Bernoulli", "Multinomial")

__all__ = ["OPSETS", "DEFAULT_OPSET", "TARGETS", "DEFAULT_TARGET", "RANDOM_OPS"]
