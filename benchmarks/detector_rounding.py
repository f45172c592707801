"""A detector's own float32 rounding against a fold's error (issue 31): is a refused fold a real error or float32?

For each model (random weights, randomized norms: ``coverage_vision.build``), on the example input:
- **own**: the original model run in float32 against the same model in float64, the float32 run's discrete
  selections (top-k, NMS, RoI level floor) replayed in the float64 one: what float32 evaluation of the original
  itself costs, per output and for the selections' inputs;
- **fold**: the BatchNorm-folded model (the fold pass through the door with ``judge=False``: the rewrite, unjudged) in float32 against the
  original in float32, selections replayed, the same comparison normconv's proof makes.

Each figure is the error relative to the output's scale (max |reference|), as the proof states it. A fold whose
error is about the size of the original's own float32 error is exact up to rounding, whatever a fixed bound says.

    PYTHONPATH=.vision-deps python benchmarks/detector_rounding.py tv:fasterrcnn_resnet50_fpn,tv:maskrcnn_resnet50_fpn
"""

from __future__ import annotations

import copy
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))


def main() -> None:
    import coverage_vision as cv

    cv.setup()
    from normconv.api import _loaded
    from normconv.engine.door import rewrite
    from normconv.options import Options
    from normconv.passes.fold_batchnorm import FOLD
    from normconv.verify import Inputs, compare, run, with_selections

    rows = ["| model | output | own float32 error (vs float64) | fold's error | fold / own |", "|---|---|---|---|---|"]
    for name in sys.argv[1].split(","):
        model, example, _ = cv.build(name)
        inputs = Inputs(example, {})
        ref = with_selections(model, inputs, run(model, inputs))
        wide = Inputs(tuple([x.double() for x in a] if isinstance(a, list) else a.double() for a in example), {})
        own = compare(ref, run(copy.deepcopy(model).double(), wide, replay=ref))
        report, done = rewrite(_loaded(model, example), [FOLD], Options(accept_specialized=True), command="fold",
                               write=False, judge=False)
        fold = compare(ref, run(done.model, inputs, replay=ref))
        for o, f in zip(own.outputs, fold.outputs):
            if o.scale_error != o.scale_error:  # labels: integers, equal or not
                continue
            ratio = f"{f.scale_error / o.scale_error:.2f}x" if o.scale_error else "-"  # an empty output: 0 and 0
            rows.append(f"| {name} | {o.name} | {o.scale_error:.3g} | {f.scale_error:.3g} | {ratio} |")
        print("\n".join(rows), flush=True)


if __name__ == "__main__":
    main()
