"""The residual stream of a transformer (or any network of residual adds read by norms), as one analysis.

  pre-LN    x_{l+1} = x_l + f_l(LN(x_l))         the stream is the sum of its writers: x_L = w_0 + ... + w_L
  post-LN   x_{l+1} = LN(x_l + f_l(x_l))         every sublayer is a norm over a residual add

Rooms (each a module; passes use the names below and never one another):
  axes       how the hidden axis moves back through an op: one table row per op family (``back``, ``source``)
  walk       the sum tree of residual adds behind a norm: its values and its leaves (``walk``)
  writers    the leaves as weights: embedding, linear, conv, parameter, constant-scale LayerNorm, layer scale
             (``writer``: a ``Writer`` or a ``Refused``), and the linears of a graph by weight (``linear_of``)
  streams    norms reading one stream, grouped; may its writers be centered, are they zero-mean (``streams``)
  readers    the linears reading a norm's output, that absorb its bias, scale or a rotation (``norm_readers``)
  inner      norms inside a sublayer (per-head q / k norms): they read the stream only through linears (``inner_norms``)
  edits      the edits as data (``Edits``: untie, scale, center, fold) and their float64 arithmetic, applied by
             the in-memory swap and the streaming writer alike (``center_``, ``bias_delta``, ``add_``)
  sublayers  post-LN sublayers LN(x + f(x)) and the roles of f's linears (``sublayer``)
  why        ``ResidualWhy``: one code per rule of the analysis; ``Refused`` = code + text

Used by passes/swap_norm (LayerNorm <-> RMSNorm), fold_scales (RMSNorm scale into its readers), rotate (x -> x Q)
and deepnorm (LN(alpha x + f(x))).
"""

from .axes import back, last, passes_through, source
from .edits import (Edits, Fold, Replaced, Scale, add_, apply_, bias_delta, center_, edits, fold_scale_, untie,
                    untie_config, untie_embedding)
from .inner import inner_norms
from .readers import Consumer, Reader, bias_consumers, check_weights, norm_readers, own_module_attr
from .streams import Stream, along, hidden, kept_norm_module, moved_dims, norm_module, slices, streams, writer_mean
from .walk import in_words, live_users, returned, stream_end, walk, walks
from .why import Refused, ResidualWhy
from .writers import HIDDEN_CAT, Writer, layout_axis, linear_of, own_name, owns, param_readers, writer

__all__ = ["back", "last", "passes_through", "source", "Edits", "Fold", "Replaced", "Scale", "add_", "apply_",
           "bias_delta", "center_", "edits", "fold_scale_", "inner_norms", "untie", "untie_config", "untie_embedding", "Consumer",
           "Reader", "bias_consumers", "check_weights", "norm_readers", "own_module_attr", "Stream", "along", "hidden",
           "kept_norm_module", "moved_dims", "norm_module", "slices", "streams", "writer_mean", "in_words", "live_users", "returned", "stream_end", "walk",
           "walks",
           "Refused", "ResidualWhy", "HIDDEN_CAT", "Writer", "layout_axis", "linear_of", "own_name", "owns",
           "param_readers", "writer"]
