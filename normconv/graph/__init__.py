"""Graphs of the model and what they say about its norms, one concept per module:

  match.py        the op vocabulary both graph dialects share (symbolic_trace and torch.export), argument readers
                  (sits low: the norm kinds read calls with it)
  capture.py      an FX graph of the model (symbolic_trace, else torch.export) and the node -> module view
  site.py         NormSite, WeightStandardization: what detection finds
  handwritten.py  hand-written norms recognized by what they compute
  detect.py       every norm site (native modules and calls through normconv.kinds, hand-written), placement
  near_miss.py    norm-like code that is not a norm, and why
  headroom.py     half-precision margins per site
  parts.py        each submodule captured alone, for a model no method captures whole

No re-exports here: importing ``normconv.graph.match`` must not pull in capture (the kinds sit between them).
"""
