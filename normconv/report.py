"""The one report shape every command shares, and its rendering.

JSON shape (``--json``), for every command that rewrites a model::

    {
      "command": "fold", "model": "zoo:resnet", "output": "out.pt" | null,
      "sites": [{"pass": "fold", "target": "layer1.bn1", "applied": true, "reason": "..."}],
      "validation": {"max_abs_error": 1e-7, "max_rel_error": 2e-7, "atol": 1e-5, "rtol": 1e-4,
                     "passed": true, "outputs": [{"name": "out", "max_abs_error": ..., ...}]},
      "before": {...}, "after": {...}, "extra": {...}
    }

``inspect`` uses the same envelope; its ``sites`` are norm sites, each with a ``plan`` list of
``{"pass", "applied", "reason"}`` entries (what each pass would do there).
"""

from __future__ import annotations

import json
import math
import sys
from dataclasses import asdict, dataclass, field
from enum import Enum
from typing import Any, Mapping

import torch.nn as nn


class Why(str, Enum):
    """Base of every decision code: each pass names its decisions in a ``Why`` of its own (``class FoldWhy(Why)``),
    one member per rule, and puts one on every ``Site`` it makes. Code compares codes; people read the reason."""

    def __str__(self) -> str:
        return self.value


@dataclass(frozen=True)
class Site:
    """One place a pass looked at, and what it did there (or would do, in a plan) and why."""

    pass_name: str
    target: str
    applied: bool
    reason: str = ""  # for people: what was done, or why not
    code: str = ""  # for code: the decision's name (a member of the deciding pass's ``Why``); branch on this

    def to_json(self) -> dict[str, Any]:
        return {"pass": self.pass_name, "target": self.target, "applied": self.applied, "code": str(self.code),
                "reason": self.reason}


@dataclass(frozen=True)
class PassResult:
    """What a pass returns: the (possibly new) model, whether it changed, every site it looked at, what a user
    should know beyond the sites (``notes``), the pass's own figures for the report (``extra``, JSON-able values
    and plans as data), and whether the rewrite keeps the outputs (``exact``; False: an intended change, measured
    as drift). Nothing is read off a pass object afterwards: a result says everything."""

    model: nn.Module
    modified: bool
    sites: tuple[Site, ...] = ()
    notes: tuple[str, ...] = ()
    extra: Mapping[str, Any] = field(default_factory=dict)
    exact: bool = True


@dataclass(frozen=True)
class OutputError:
    """Error of one model output (a leaf of the output pytree). ``scale`` is the output's largest finite |value| in
    the reference, ``scale_error`` = max abs error / scale, ``rms_error`` = |a - b| / |b| (2-norms); ``tolerance``
    is the bound ``scale_error`` was held to (NaN: judged element-wise by atol / rtol); ``note`` says how the output
    was judged when not plainly (after a discrete selection, with the original's selections replayed)."""

    name: str
    max_abs_error: float
    max_rel_error: float
    cosine: float
    passed: bool
    scale: float = math.nan
    scale_error: float = math.nan
    rms_error: float = math.nan
    tolerance: float = math.nan
    note: str = ""


@dataclass(frozen=True)
class Validation:
    """Original vs rewritten outputs on the same inputs. ``rule`` says how ``passed`` was decided: "scale" (the
    default for float32 / float64 outputs: each output's max abs error within ``scale_tolerance`` x its scale,
    ``normconv.verify``'s docstring derives the bound) or "elementwise" (allclose(atol, rtol) on every element: given
    tolerances, half-precision outputs). ``max_scale_error`` is the worst output's error relative to its scale."""

    max_abs_error: float
    max_rel_error: float
    atol: float
    rtol: float
    passed: bool
    cosine: float = 1.0
    outputs: tuple[OutputError, ...] = ()
    label: str = "torch"
    drift: bool = False  # measures an intended change (approximate swap): no pass / fail
    rule: str = "elementwise"
    scale_tolerance: float = math.nan
    max_scale_error: float = math.nan
    rounding: str = "float32"  # the precision(s) whose rounding the scale bound allows ("float64", "float32, float64")

    @property
    def criterion(self) -> str:
        """The bound the check held the outputs to, for people."""
        if self.rule == "scale":
            return f"error within {self.scale_tolerance:.2g} of each output's scale ({self.rounding} rounding)"
        return f"atol {self.atol:g}, rtol {self.rtol:g}"

    @property
    def worst(self) -> str:
        """The largest error, for people: absolute, and relative to the output's scale where measured."""
        text = f"max abs error {self.max_abs_error:.3g}"
        if not math.isfinite(self.max_abs_error):  # NaN for NaN and equal infinities count as no difference
            return text + " (a NaN or an infinity on one side only: an overflow, or a division by zero)"
        return text + (f", {self.max_scale_error:.3g} of the output's scale" if math.isfinite(self.max_scale_error)
                       else "")

    def to_json(self) -> dict[str, Any]:
        d = asdict(self)
        d["outputs"] = [asdict(o) for o in self.outputs]
        return _finite(d)


@dataclass
class Report:
    """Everything a command has to say; rendered as tables on a terminal or as one JSON object."""

    command: str
    model: str
    sites: list[Any] = field(default_factory=list)  # Site, or dicts for inspect
    validation: list[Validation] = field(default_factory=list)
    before: dict[str, Any] = field(default_factory=dict)
    after: dict[str, Any] = field(default_factory=dict)
    output: str | None = None
    extra: dict[str, Any] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)

    @property
    def passed(self) -> bool:
        """Every check held; a drift measurement (an intended change) is reported, not judged."""
        return all(v.passed or v.drift for v in self.validation)

    def to_json(self) -> dict[str, Any]:
        val = [v.to_json() for v in self.validation]
        return _finite(
            {
                "command": self.command,
                "model": self.model,
                "output": self.output,
                "sites": [s.to_json() if hasattr(s, "to_json") else s for s in self.sites],
                # every check made, in order (the example inputs first; a second shape, onnxruntime per provider)
                "passed": self.passed if val else None,
                "validation": val,
                "before": self.before,
                "after": self.after,
                "extra": self.extra,
                "notes": self.notes,
            }
        )


def _finite(obj: Any) -> Any:
    """JSON has no inf/nan: a number that is not finite is null (a tolerance not used, no limit), never a string
    where a number is read, so ``json.loads`` of our output never fails and each key keeps one type."""
    if isinstance(obj, float) and not math.isfinite(obj):
        return None
    if isinstance(obj, Mapping):
        return {k: _finite(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_finite(v) for v in obj]
    return obj


def print_json(report: Report, error: dict[str, Any] | None = None) -> None:
    """The report as one JSON object; ``error``: the keys of a run that failed with this report (``error``, ``code``,
    ``exit_code``, as every failure's object carries them)."""
    sys.stdout.write(json.dumps({**report.to_json(), **(error or {})}, indent=2, default=str) + "\n")


# ---------------------------------------------------------------------------------------------------------
# terminal rendering (rich); plain text when stdout is not a terminal


def console():
    from rich.console import Console

    class _Console(Console):
        def on_broken_pipe(self) -> None:  # rich exits 1 (normconv's "failed verification"): the caller says it
            self.quiet = True  # (the command line: 141, the reader went away)
            raise BrokenPipeError

    # no colour codes or box-drawing surprises in pipes and CI logs
    return _Console(highlight=False, soft_wrap=False, emoji=False, width=None if sys.stdout.isatty() else 160)


def table(title: str, columns: list[str], rows: list[list[Any]]):
    from rich import box
    from rich.table import Table

    t = Table(title=title, box=box.SIMPLE_HEAD if sys.stdout.isatty() else box.ASCII2, title_justify="left")
    for c in columns:
        t.add_column(c, overflow="fold")
    for r in rows:
        t.add_row(*[fmt(v) for v in r])
    return t


def fmt(v: Any) -> str:
    if v is None:
        return "-"
    if isinstance(v, bool):
        return "yes" if v else "no"
    if isinstance(v, float):
        return f"{v:.3g}"
    if isinstance(v, (tuple, list)):
        return ",".join(fmt(x) for x in v)
    return str(v)


def render_sites(sites: list[Site], title: str = "sites"):
    return table(title, ["pass", "target", "applied", "reason"], [[s.pass_name, s.target, s.applied, s.reason] for s in sites])


def render_headroom(room: Mapping[str, Any]):
    """The half-precision headroom table (``extra.headroom`` of inspect, fold and export)."""
    def num(v, fmt: str = ".3g") -> str:
        return "-" if v is None else format(v, fmt)

    dt = room["dtype"]
    rows = [[h["target"], h["kind"], num(h["max_abs"]), num(h["max_square"]), num(h["max_stat"]),
             num(h.get("max_out")), num(h["margin_log2"], ".1f"),
             f"{h['eps']:g} -> {h['eps_in_dtype']:g}" if h["eps"] is not None else "-", num(h["folded_scale"]),
             num(h.get("folded_weight")), num(h["error"]),
             "ok" if h["ok"] else "NO: " + "; ".join(h["reasons"])] for h in room["sites"]]
    missing = room["without_headroom"]
    return table(f"{dt} headroom, measured in float32 on {room['inputs']}"
                 + (f": {len(missing)} site(s) without it ({', '.join(missing)})" if missing else ""),
                 ["target", "kind", "max |x|", "max square", "max stat", "max |y|", "margin 2^", "eps",
                  "folded scale", "folded weight", f"site err {dt}", "headroom"], rows)


def render_validation(v: Validation):
    def result(o: OutputError) -> str:
        verdict = "drift" if v.drift else "pass" if o.passed else "FAIL"
        return f"{verdict} ({o.note})" if o.note else verdict

    rows = [[o.name, o.max_abs_error, o.scale, o.scale_error, o.rms_error, o.max_rel_error, o.cosine, result(o)]
            for o in v.outputs]
    if v.drift:
        title = f"{v.label}: max abs {v.max_abs_error:.3g}, cosine {v.cosine:.6f} (approximate: expected drift)"
    elif v.rule == "scale":
        title = f"validation ({v.label}): {v.criterion} -> {'PASSED' if v.passed else 'FAILED'}"
    else:
        title = f"validation ({v.label}): atol={v.atol:g} rtol={v.rtol:g} -> {'PASSED' if v.passed else 'FAILED'}"
    return table(title, ["output", "max abs err", "scale (max |ref|)", "err / scale", "rms err / rms",
                         "max rel err", "cosine", "result"], rows)


def render_before_after(before: Mapping[str, Any], after: Mapping[str, Any]):
    keys = list(dict.fromkeys([*before, *after]))
    return table("before / after", ["", "before", "after"], [[k, before.get(k), after.get(k)] for k in keys])


def print_report(report: Report) -> None:
    """The human view: before/after, sites, validations, notes."""
    c = console()
    if report.before or report.after:
        c.print(render_before_after(report.before, report.after))
    if report.sites:
        c.print(render_sites(report.sites, f"{report.command}: {sum(s.applied for s in report.sites)} applied, "
                                           f"{sum(not s.applied for s in report.sites)} skipped"))
    for v in report.validation:
        c.print(render_validation(v))
    if report.extra.get("headroom"):
        c.print(render_headroom(report.extra["headroom"]))
    for n in report.notes:
        c.print(f"note: {n}")
    if report.output:
        c.print(f"wrote {report.output}")
