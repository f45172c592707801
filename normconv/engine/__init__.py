"""The pass engine: the one door every rewriting command goes through.

  run.py        apply_passes: a tensor-sharing copy, captured, each pass in turn (by parts where allowed) -> Run
  door.py       rewrite: apply_passes -> verify (by the passes' Check: exact, drift, reference; two shapes) -> write
  precision.py  the half-precision policy (references, tolerances, per-site float32)
  plans.py      plans as data: the table of planners inspect and export read
  rounding.py   the original's own float32 rounding (a float64 run): the floor of a check the fixed bound failed

Imports: commands and api above it; passes, onnx, graph and the core below.
"""
