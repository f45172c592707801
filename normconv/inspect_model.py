"""``normconv inspect``: every norm site, and what each pass would do with it or why not."""

from __future__ import annotations

from normconv.detect import NormSite, find_norms
from normconv.graph import Captured, capture
from normconv.io import Loaded
from normconv.near_miss import find_near_misses
from normconv.report import Report, Site, console, table

from normconv.passes import canonicalize, deepnorm, fold_batchnorm, swap_norm
from normconv import export

# the passes inspect asks, in the order a user would run them
PLANNERS = (
    ("fold", fold_batchnorm.plan),
    ("canonicalize", canonicalize.plan),
    ("swap", swap_norm.plan),
    ("deepnorm", deepnorm.plan),
    ("export", export.plan),
)


def plans(cap: Captured, norms: list[NormSite]) -> dict[str, list[Site]]:
    """target -> the sites each pass planned for it (a target called twice gets each call's plan)."""
    by_target: dict[str, list[Site]] = {}
    for _, planner in PLANNERS:
        for site in planner(cap, norms):
            by_target.setdefault(site.target, []).append(site)
    return by_target


def inspect(loaded: Loaded, method: str = "auto") -> Report:
    inputs = loaded.require_inputs()
    cap = capture(loaded.model, inputs, method)
    norms = find_norms(cap)
    plan = plans(cap, norms)
    sites = []
    for n in norms:
        entry = n.to_json()
        seen: set[tuple[str, bool, str]] = set()
        entry["plan"] = []
        for p in plan.get(n.target, []):
            key = (p.pass_name, p.applied, p.reason)
            if key not in seen:  # a module called twice plans once per call; show each distinct plan once
                seen.add(key)
                entry["plan"].append(p.to_json())
        sites.append(entry)
    counts: dict[str, int] = {}
    for n in norms:
        counts[n.kind] = counts.get(n.kind, 0) + 1
    return Report(
        command="inspect", model=loaded.spec, sites=sites,
        extra={"capture": cap.method, "capture_failures": cap.attempts, "inputs": inputs.describe(),
               "counts": counts, "parameters": sum(p.numel() for p in loaded.model.parameters()),
               "near_misses": [m.to_json() for m in find_near_misses(cap, norms)]},
    )


def print_inspect(report: Report) -> None:
    c = console()
    ex = report.extra
    c.print(f"{report.model}: {len(report.sites)} norm sites "
            f"({', '.join(f'{v} {k}' for k, v in ex['counts'].items()) or 'none'}); "
            f"graph by {ex['capture']}; inputs {ex['inputs']}")
    for method, why in ex["capture_failures"].items():
        c.print(f"note: {method} failed: {why}")
    rows = []
    for s in report.sites:
        rows.append([s["target"], s["kind"], s["source"], s["module_type"], s["eps"], _shape(s), s["placement"],
                     _affine(s)])
    c.print(table("norm sites", ["target", "kind", "source", "class", "eps", "shape", "placement", "params"], rows))
    plan_rows = []
    for s in report.sites:
        for p in s["plan"]:
            plan_rows.append([s["target"], p["pass"], "apply" if p["applied"] else "skip", p["reason"]])
    c.print(table("plan", ["target", "pass", "would", "why"], plan_rows))
    misses = ex.get("near_misses", [])
    if misses:
        c.print(table(f"norm-like but not a norm: {len(misses)} left as written", ["target", "computes", "why"],
                      [[m["target"], m["computes"], m["reason"]] for m in misses]))


def _shape(s: dict) -> str:
    if s["normalized_shape"]:
        return "x".join(str(d) for d in s["normalized_shape"])
    parts = []
    if s["num_features"]:
        parts.append(f"C={s['num_features']}")
    if s["num_groups"]:
        parts.append(f"G={s['num_groups']}")
    return " ".join(parts) or "-"


def _affine(s: dict) -> str:
    a = s["affine"]
    parts = [("w+1" if a["weight_offset"] else "w") if a["weight"] else "", "b" if a["bias"] else "",
             "running" if s["running_stats"] else ""]
    return ",".join(p for p in parts if p) or "-"
