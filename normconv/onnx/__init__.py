"""ONNX: export with one fused op per norm (export), normconv's op translations and function bodies (ops),
onnxruntime's skip-norm fusion (fuse), and validation against torch in onnxruntime (validate). Imports the
graph and the core, never the passes: the flow runs the passes and hands this package a prepared model."""
