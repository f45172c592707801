"""Why a residual stream (or a norm's readers) cannot be rewritten: a code per rule of the analysis, and the words.

A pass that uses the analysis reports its own decision (its ``Why``) on each site; the analysis's own reason stays in
the plan as a ``Refused`` (code + text), so code can tell, say, a gated writer from a stream read by an attention
mask without reading the text.
"""

from __future__ import annotations

from dataclasses import dataclass

from normconv.report import Why


class ResidualWhy(Why):
    """One member per rule of the residual-stream analysis."""

    # a writer (a leaf of the stream's sum tree) has no weights whose rewrite changes its output the same way
    CONSTANT = "constant-added"  # a Python constant is added to the stream
    MODEL_INPUT = "starts-at-input"  # the stream starts at a model input
    BROADCAST = "broadcast-along-hidden"  # the same value is added to every feature
    UNSAVED = "unsaved-buffer"  # a non-persistent buffer: a rewrite would not survive saving
    OFF_AXIS = "off-hidden-axis"  # the writer's features reach the stream on another axis
    COMPUTED = "computed-weight"  # the writer computes its weight or bias instead of reading a parameter
    GATED = "gated-writer"  # the writer is multiplied by a factor computed from the input
    NORM_SCALE = "norm-scale-varies"  # a LayerNorm writer whose scale g is not constant
    GROUPED = "grouped-conv"  # a grouped or transposed conv writer
    HIDDEN_CAT = "hidden-axis-joined"  # the stream is joined along its hidden axis (patch merging)
    MERGED = "hidden-axis-merged"  # the hidden axis is merged with others (patch unfolding)
    NOT_A_LAYER = "not-a-layer"  # the writer is no linear, conv, embedding, parameter or LayerNorm
    # the stream as a whole
    SHARED_OUTPUT = "writer-output-shared"  # a writer's output is also read outside the stream
    SHARED_TENSOR = "tensor-shared"  # a tensor to rewrite is also read by a node that is not rewritten with it
    SHARED_SCALE = "layer-scale-shared"  # one layer scale multiplies two writers
    READ_ELSEWHERE = "stream-read-elsewhere"  # a stream value is read by something other than its adds and norms
    WIDTH = "width-mismatch"  # more than one hidden dim, or streams (writers, readers) of different widths
    NOT_ZERO_MEAN = "writer-not-zero-mean"  # a writer is not zero-mean (and nothing centers it)
    # the readers of a norm's output
    UNREAD = "output-unread"  # the norm's output is read by no layer
    RETURNED = "output-returned"  # the norm's output is returned by the model
    NON_LINEAR = "read-by-non-linear"  # the norm's output is read by something other than a linear layer
    NOT_PARAM = "weight-not-parameter"  # a reader's weight is not a parameter of the model
    WRITES_STREAM = "norm-writes-stream"  # the norm's output is a writer of a stream: no linear takes its bias
    NO_BIAS = "no-bias-parameter"  # a reader has no bias parameter of its own to take the norm's bias
    CHANNELS_FIRST = "back-to-channels-first"  # a channels-first norm's output goes back to channels first: no linear


@dataclass(frozen=True)
class Refused:
    """An analysis result that says no: ``code`` for code, ``text`` for people (``str()`` is the text)."""

    code: ResidualWhy
    text: str

    def __str__(self) -> str:
        return self.text
