"""Graph capture and matching: an FX graph of the model (symbolic_trace, else torch.export) with a node ->
module view (capture), the op vocabulary both dialects share (match), norm detection (detect), and norm-like
code that is not a norm (near_miss). Imports only the core (errors, report, verify, nn)."""

from normconv.graph.capture import Captured, capture

__all__ = ["Captured", "capture"]
