"""Graphs of the model and what they say about its norms, one concept per module:

  capture.py      an FX graph of the model (symbolic_trace, else torch.export) and the node -> module view
  site.py         NormSite, WeightStandardization: what detection finds
  handwritten.py  hand-written norms recognized by what they compute
  detect.py       every norm site (native modules and calls through normconv.kinds, hand-written), placement
  near_miss.py    norm-like code that is not a norm, and why
  headroom.py     half-precision margins per site
  parts.py        each submodule captured alone, for a model no method captures whole

The op vocabulary both graph dialects share is ``normconv.match`` (below the norm kinds, which read calls with it).
No re-exports here: a package __init__ that imports its modules runs them for anyone importing one of them.
"""
