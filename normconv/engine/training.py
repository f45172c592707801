"""The training path: a rewrite proven in eval mode is run once more in training mode (``model.train()``: dropout
on, BatchNorm on batch statistics, every branch on ``self.training``) against the original, on the same random draws
(``verify.same_draws``), at the example inputs. The written model can take that path the moment its user trains it.

    expected = reference(original, inputs)                   # before the passes (they may rewrite it in place)
    judge_training(expected, run, inputs, opts, report)      # before the write; for passes that keep the model
                                                             # trainable (``Pass.trains``), torch-format outputs

  original(train) == rewrite(train)      the proof holds in both modes: ``extra.training_mode`` says "same"
  they differ                            the rewrite is exact for inference only: a drift check ("training mode")
                                         with its measured error, a note, code ``eval-only``, and the rewrite is
                                         left in eval mode (a model saved mid-training would otherwise be written
                                         in the one mode where it computes otherwise). Causes: dropout on a stream
                                         whose writers a swap centered (dropout(C W x) is not zero-mean), a
                                         hand-written frozen BatchNorm made a live one, a traced graph that fixed
                                         ``self.training`` as it was while tracing (eval)
  the original fails in training mode    not checked, said (``not-checked``): BatchNorm on one value per channel
  an approximate rewrite (a drift)       measured in training mode too (``approximate``): a drift check and a note;
                                         its mode is kept (it was never exact, in either mode)

Which modules' training flag changes what they compute (``flag_reader``): those whose own code (any method of their
class below nn.Module, but train / eval / __init__ and the repr) or forward hooks read ``training``: BatchNorm kinds,
InstanceNorm, dropout, RReLU, MultiheadAttention, RNNs, timm's DropPath and BatchNormAct2d, a user's ``if
self.training``. A Conv2d, a Linear, a ReLU read none: a model whose only training-mode modules are such is, for every
forward, its eval-mode self (timm's ``reparameterize_model`` leaves its new ``reparam_conv`` layers so). A scripted
module's code cannot be read: its flag is taken to matter.

A pass that knows how its rewrite computes otherwise in training mode says so in its result's
``extra["training_differs"]`` ({"code", "why"}: a FrozenBatchNorm never takes batch statistics, ...): the note gives
that why, and ``extra.training_mode.causes`` the codes.
"""

from __future__ import annotations

import dataclasses
import enum
import types
from typing import Any

import torch
import torch.fx as fx

import torch.nn as nn

from normconv.errors import describe
from normconv.io.load import training_ops
from normconv.options import Options
from normconv.report import Report
from normconv.verify import Inputs, compare, output_leaves, run, same_bits

from .run import Run


class TrainingWhy(str, enum.Enum):
    SAME = "same"  # the rewrite computes what the original does in training mode too
    EVAL_ONLY = "eval-only"  # it differs in training mode: exact for inference only, written in eval mode
    NOT_CHECKED = "not-checked"  # the original does not run in training mode on the example
    APPROXIMATE = "approximate"  # an approximate rewrite (a drift in eval mode): its training-mode drift measured


LABEL = "training mode (model.train(), same random draws)"


def reference(original: nn.Module, inputs: Inputs) -> Any:
    """The original's outputs in training mode on the example, taken before the passes (a disposable original is
    rewritten in place); a ``Failed`` where it does not run in training mode."""
    try:
        return run(original, inputs, training=True)
    except Exception as exc:  # noqa: BLE001 - the original's own limit, said
        return Failed(describe(exc))


@dataclasses.dataclass(frozen=True)
class Failed:
    """The original raised in training mode (why)."""

    why: str


def judge_training(expected: Any, done: Run, inputs: Inputs, opts: Options, report: Report,
                   in_eval: tuple[Any, Any] = (None, None), exact: bool = True) -> None:
    """Compare ``done.model`` in training mode with ``expected`` (``reference``) (module docstring); record the
    outcome in ``report.extra["training_mode"]``, and where it differs a drift check, a note and the rewrite set to
    eval mode. ``in_eval``: the original's and the rewrite's outputs in eval mode on the same inputs: where training
    mode changes neither, the eval-mode proof (with its own rules: a half model judged against float32) stands.
    ``exact=False``: an approximate rewrite, its training-mode distance measured and said (module docstring)."""
    if isinstance(expected, Failed):
        report.extra["training_mode"] = {"code": TrainingWhy.NOT_CHECKED.value, "why": expected.why}
        report.notes.append(f"not checked in training mode: the original does not run in it on the example "
                            f"({expected.why})")
        return
    try:
        got = run(done.model, inputs, training=True)
    except Exception as exc:  # noqa: BLE001 - a rewrite that fails where the original runs differs
        v, error = None, describe(exc)
    else:
        v, error = compare(expected, got, opts.atol, opts.rtol, label=LABEL), None
    if exact and v is not None and (v.passed or (_same(expected, in_eval[0]) and _same(got, in_eval[1]))):
        report.extra["training_mode"] = {"code": TrainingWhy.SAME.value}
        return
    measured = f"it fails there: {error}" if v is None else f"max abs error {v.max_abs_error:.3g}" + (
        f", {v.max_scale_error:.2g} of the output's scale" if v.max_scale_error == v.max_scale_error else "")
    causes = [c for _, r in done.results if (c := r.extra.get("training_differs"))]
    causes = [c for i, c in enumerate(causes) if c not in causes[:i]]  # once each (a pass run by parts)
    why = "; ".join(c["why"] for c in causes) or ("dropout on a centered stream, a frozen BatchNorm made a live one, "
                                                  "or a traced graph that fixed self.training")
    code = TrainingWhy.EVAL_ONLY if exact else TrainingWhy.APPROXIMATE
    report.extra["training_mode"] = {"code": code.value, "max_abs_error": None if v is None else v.max_abs_error,
                                     **({"causes": [c["code"] for c in causes]} if causes else {}),
                                     **({"error": error} if error else {})}
    if v is not None:
        report.validation.append(dataclasses.replace(v, drift=True, label=f"{LABEL}: drift against the original"))
    if not exact:
        report.notes.append(f"in training mode (model.train()) too the rewrite computes otherwise than the original "
                            f"({measured}): {why}")
        return
    for m in done.model.modules():  # left in eval mode: the only mode the proof covers
        m.training = False
    report.notes.append(f"exact in eval mode only: in training mode (model.train()) the rewrite computes otherwise "
                        f"than the original ({measured}): {why}; the result is set to eval mode, and training it "
                        f"trains a different model")


_NOT_COMPUTING = frozenset({"train", "eval", "__init__", "extra_repr", "__repr__", "__setstate__", "__getstate__"})


def flag_reader(module: nn.Module) -> str | None:
    """Why ``module``'s training flag matters, for people (``Class.method`` reads it, a hook does, a scripted module,
    a captured graph that holds training-mode ops), or None: then its flag changes nothing it computes (module
    docstring)."""
    if isinstance(module, torch.jit.ScriptModule):  # compiled: no Python code to read
        return f"{type(module).__name__} is scripted: its code cannot be read"
    if isinstance(module, fx.GraphModule):  # generated code; a capture fixed the mode (a .pt2's flags say which)
        found = training_ops(module)
        if found:
            return f"its graph was captured in training mode ({found[0]})"
    for cls in type(module).__mro__:
        if cls is nn.Module or not (isinstance(cls, type) and issubclass(cls, nn.Module)):
            continue
        for name, value in vars(cls).items():
            if name not in _NOT_COMPUTING and _reads_training(value):
                return f"{cls.__name__}.{name} reads self.training"
    hooks = [*module._forward_pre_hooks.values(), *module._forward_hooks.values()]
    return next((f"a forward hook ({getattr(h, '__qualname__', h)}) reads its training flag" for h in hooks
                 if _reads_training(h)), None)


def _reads_training(value: Any) -> bool:
    """A function (method, static / class method, property) whose code names ``training``, nested code included."""
    if isinstance(value, (staticmethod, classmethod)):
        value = value.__func__
    elif isinstance(value, property):
        value = value.fget
    code = getattr(value, "__code__", None)
    return isinstance(code, types.CodeType) and _names_training(code)


def _names_training(code: types.CodeType) -> bool:
    return "training" in code.co_names or "training" in code.co_consts or \
        any(_names_training(c) for c in code.co_consts if isinstance(c, types.CodeType))


def live_in_training(model: nn.Module) -> tuple[list[tuple[str, nn.Module, str]], list[str]]:
    """The modules in training mode, split: those whose flag changes what they compute (path, module, what reads
    it), and the paths of those whose flag changes nothing."""
    live, idle = [], []
    for path, m in model.named_modules():
        if m.training:
            reader = flag_reader(m)
            if reader is None:
                idle.append(path)
            else:
                live.append((path, m, reader))
    return live, idle


def _same(a: Any, b: Any) -> bool:
    """Two outputs equal leaf for leaf, bit for bit (NaN where NaN): training mode changed nothing."""
    x, y = output_leaves(a), output_leaves(b) if b is not None else None
    return y is not None and len(x) == len(y) and all(same_bits(s, t) for (_, s), (_, t) in zip(x, y))


__all__ = ["LABEL", "Failed", "TrainingWhy", "flag_reader", "judge_training", "live_in_training", "reference"]
