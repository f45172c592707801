"""The pass contract (onnx-ir's ``PassBase`` / ``PassResult``, with a reason for every decision).

A pass is a small object, one per file, with:
  name                                the command-line name of its decisions (Site.pass_name)
  check                               how the one engine verifies what it did (``Check``)
  by_parts                            its proof holds within one submodule's graph (a model no method captures
                                      whole may be rewritten part by part; the whole result is verified as always)
  plan(cap, norms) -> [Site]          decide, per site, apply or skip-with-a-reason (and its code); changes nothing
  __call__(model, cap) -> PassResult  apply what plan decided, on ``model``, a tensor-sharing copy of the user's
                                      module tree that it may change in place (tensors through ``clone.owned``)
  begin_parts() / end_parts(model, results)   around a run part by part (by_parts passes only)
  reference(rewritten) -> nn.Module   ``Check.REFERENCE`` only: the model the rewritten one must equal

Everything a pass has to say comes back in its ``PassResult`` (sites, notes, extra, exact): nothing is read off the
pass object afterwards. A refusal of the whole model raises ``NormconvError(..., Code.REFUSED, pass_name=NAME)``.
Passes compose in an explicit tuple (no import-time registry), never import one another, and read no flags and
write no files (tests/test_layout.py).
"""

from __future__ import annotations

from enum import Enum
from typing import ClassVar, Sequence

import torch.nn as nn

from normconv.graph.detect import NormSite
from normconv.graph.capture import Captured
from normconv.report import PassResult, Site, Why


class Check(str, Enum):
    """How the engine verifies a pass's result against the original model, at the example inputs and a second
    shape alike."""

    EXACT = "exact"  # the same outputs within tolerance, else VerificationError (a result with exact=False: drift)
    DRIFT = "drift"  # an intended change: the outputs' distance is measured and reported, never judged
    REFERENCE = "reference"  # the same outputs as ``pass.reference(rewritten)`` (a formula computed literally)


class Pass:
    """Base of every pass; see the module docstring."""

    name: ClassVar[str]
    check: ClassVar[Check] = Check.EXACT
    by_parts: ClassVar[bool] = False
    reference_label: ClassVar[str] = "its reference"  # Check.REFERENCE: what ``reference`` computes, for people
    # the rewrite keeps the model trainable as it was (not an inference rewrite such as a fold): the door checks it
    # in training mode too (``engine.training``)
    trains: ClassVar[bool] = False

    def plan(self, cap: Captured, norms: Sequence[NormSite]) -> list[Site]:
        raise NotImplementedError

    def __call__(self, model: nn.Module, cap: Captured) -> PassResult:
        raise NotImplementedError

    def begin_parts(self) -> None:
        """Called once before the pass runs on each part of a model no method captures whole."""

    def end_parts(self, model: nn.Module, results: Sequence[PassResult]) -> None:
        """Called once after the run on parts, with every part's result: raise what a whole graph raises at once."""

    def reference(self, rewritten: nn.Module) -> nn.Module:
        raise NotImplementedError(f"{self.name} is not verified against a reference model")


def skip(pass_name: str, site: NormSite, reason: str, code: Why | str = "") -> Site:
    return Site(pass_name, site.target, False, reason, code)


def apply(pass_name: str, site: NormSite, reason: str, code: Why | str = "") -> Site:
    return Site(pass_name, site.target, True, reason, code)


def replace_module(root: nn.Module, path: str, new: nn.Module) -> nn.Module:
    """Put ``new`` at dotted ``path`` in ``root`` (the user's class stays), in the replaced module's mode."""
    parent_path, _, name = path.rpartition(".")
    parent = root.get_submodule(parent_path) if parent_path else root
    new.train(getattr(parent, name).training)
    setattr(parent, name, new)
    for i in range(len(path.split("."))):
        _fastpath_off(root.get_submodule(".".join(path.split(".")[:i])))
    return new


def _fastpath_off(m: nn.Module) -> None:
    """torch's fused inference kernels hard-code LayerNorm math: turn them off on a module whose norm was replaced.

    ``TransformerEncoderLayer`` in eval / no_grad calls ``torch._transformer_encoder_layer_fwd`` with
    ``norm1.weight / norm1.bias / norm1.eps`` (a LayerNorm whatever ``norm1`` now is) unless
    ``activation_relu_or_gelu`` is 0; that flag gates only the fused path (the slow path calls ``self.activation``).
    ``TransformerEncoder`` packs inputs into nested tensors for that path when ``use_nested_tensor`` is set.
    """
    # a replaced norm inside torch's encoder layer  =>  the layer runs its module-by-module path
    if isinstance(m, nn.TransformerEncoderLayer):
        m.activation_relu_or_gelu = 0
    # ... and the encoder around it stops packing nested tensors for the fused path
    if isinstance(m, nn.TransformerEncoder):
        m.use_nested_tensor = False
