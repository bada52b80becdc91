"""The best plan beside the baselines: rows of one comparison table (plain dicts, what ``--json`` prints).

Three kinds of rows beside ``best``:

- ``<baseline>``: each baseline at the best plan's degrees, microbatch count and recomputation;
- ``<baseline>@own``: each baseline at its own best layout (:mod:`mpipe_tune.search.families`);
- ``current``: a layout the user gives (:mod:`mpipe_tune.search.layout`).

Every row carries two ratios: ``speedup``, its speedup over ``megatron`` at the best plan's degrees
(the reference ``bench`` keeps), and ``best_speedup``, the best plan's speedup over the row. So for a
baseline the two speedups of the best plan are ``best_speedup`` on its row and on its ``@own`` row.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from mpipe_tune.search.baselines import BASELINES, REFERENCE, baseline
from mpipe_tune.search.evaluate import Evaluation, Evaluator
from mpipe_tune.search.families import OWN, OwnBest
from mpipe_tune.search.space import SearchSpace

CURRENT = "current"
"""The name of the user's current layout, in the table and in plan.json."""


def evaluate_baselines(evaluator: Evaluator, space: SearchSpace, best: Evaluation) -> list[tuple[str, Evaluation | None]]:
    """Every baseline at the best plan's degrees, microbatch count and recomputation setting (None
    where it does not exist)."""
    c = best.candidate
    vpp_counts = space.microbatch_choices(c.pp, c.dp, "1f1b,1f1b")
    out = []
    for name in BASELINES:
        candidate = baseline(name, evaluator.problem.model, c.pp, c.tp, c.dp, c.num_microbatches, vpp_counts)
        if candidate is not None:
            candidate = replace(candidate, recompute=c.recompute)  # the same memory policy as the best plan
        out.append((name, None if candidate is None else evaluator.evaluate(candidate)))
    return out


def _ratio(slow: Evaluation | None, fast: Evaluation | None) -> float | None:
    """``slow``'s step time over ``fast``'s: how many times faster ``fast`` is."""
    if slow is None or fast is None or not fast.mean_s > 0:
        return None
    return slow.mean_s / fast.mean_s


def row(label: str, e: Evaluation, reference: Evaluation | None, best: Evaluation | None = None) -> dict[str, Any]:
    c = e.candidate
    return {
        "plan": label,
        "schedule": c.schedule,
        "cut": list(c.cut),
        "owners": c.owner_policy,
        "slabs": [list(s) for s in e.slab_counts],
        "pp": c.pp, "tp": c.tp, "dp": c.dp,
        "microbatches": c.num_microbatches,
        "recompute": c.recompute,
        "step_s": e.mean_s,
        "p90_s": e.p90_s,
        "step_samples_s": list(e.makespans_s),
        "speedup": _ratio(reference, e),
        "best_speedup": _ratio(e, best),
        "bubble_share": e.bubble_share,
        "spill_s": e.max_spill_s,
        "peak_bytes": e.peak_bytes,
        "fits_memory": e.fits,
    }


def comparison_rows(best: Evaluation, baselines: list[tuple[str, Evaluation | None]]) -> list[dict[str, Any]]:
    """``best``, then each baseline at its degrees."""
    reference = dict(baselines).get(REFERENCE)
    rows = [row("best", best, reference, best)]
    rows += [row(name, e, reference, best) for name, e in baselines if e is not None]
    return rows


def own_best_rows(best: Evaluation, baselines: list[tuple[str, Evaluation | None]],
                  families: list[OwnBest]) -> list[dict[str, Any]]:
    """One row per baseline whose family has a plan that fits memory: ``<name>@own``."""
    reference = dict(baselines).get(REFERENCE)
    return [row(f.label, f.best, reference, best) for f in families if f.best is not None]


def current_row(best: Evaluation, baselines: list[tuple[str, Evaluation | None]], current: Evaluation) -> dict[str, Any]:
    return row(CURRENT, current, dict(baselines).get(REFERENCE), best)


def family_record(families: list[OwnBest]) -> dict[str, dict[str, int]]:
    """What each family's search covered: candidates, predicted, settled by bounds."""
    return {f.name: {"candidates": f.num_candidates, "evaluated": f.num_evaluated, "bounded": f.num_bounded}
            for f in families}


def speedups(best: Evaluation, baselines: list[tuple[str, Evaluation | None]], families: list[OwnBest],
             current: Evaluation | None) -> dict[str, Any]:
    """The best plan's speedups: over each baseline at its degrees and at the baseline's own best
    (None where that plan does not exist or none fits), and over the current layout."""
    return {
        "at_best_degrees": {name: _ratio(e, best) for name, e in baselines},
        "at_own_best": {f.name: _ratio(f.best, best) for f in families},
        "over_current": _ratio(current, best),
    }


def faster_than_best(families: list[OwnBest], best: Evaluation) -> list[OwnBest]:
    """Families whose own best beats the searched best (the search's space has no even layer splits,
    and a sampled search may miss a plan): the table says so."""
    return [f for f in families if f.best is not None and f.best.mean_s < best.mean_s]


# --------------------------------------------------------------------------------------- table

_HEADER = (f"{'plan':<13} {'schedule':<20} {'cut':<7} {'owners':<11} {'pp/tp/dp':<9} {'M':>4} "
           f"{'step ms':>10} {'p90 ms':>10} {'speedup':>8} {'best over':>9} {'bubble':>7} {'peak GiB':>9} "
           f"{'recomp':>6}")


def _times(value: float | None) -> str:
    return "-" if value is None else f"{value:.3f}x"


def _line(r: dict[str, Any]) -> str:
    peak = "-" if r["peak_bytes"] is None else f"{r['peak_bytes'] / 2**30:.2f}" + ("" if r["fits_memory"] else "!")
    degrees = f"{r['pp']}/{r['tp']}/{r['dp']}"
    cut = ",".join(map(str, r["cut"])) or "-"
    best_over = "-" if r["plan"] == "best" else _times(r.get("best_speedup"))
    return (f"{r['plan']:<13} {r['schedule']:<20} {cut:<7} {r['owners'] or '-':<11} "
            f"{degrees:<9} {r['microbatches']:>4} {r['step_s'] * 1e3:>10.3f} "
            f"{r['p90_s'] * 1e3:>10.3f} {_times(r['speedup']):>8} {best_over:>9} {r['bubble_share']:>7.1%} "
            f"{peak:>9} {'yes' if r.get('recompute') else 'no':>6}")


def format_rows(rows: list[dict[str, Any]]) -> str:
    """A fixed-width table: one line per plan, in the given order (a peak over capacity is marked ``!``)."""
    return "\n".join([_HEADER, "-" * len(_HEADER), *(_line(r) for r in rows)])


def format_comparison(search: dict[str, Any]) -> str:
    """The table of a ``plan`` summary (``comparison``, and where present ``own_best``, ``families``
    and ``current``): each baseline's row followed by its ``@own`` row, the current layout last, and
    what the columns mean."""
    rows = {r["plan"]: r for r in search["comparison"]}
    own = {r["plan"]: r for r in search.get("own_best", [])}
    families = search.get("families", {})
    lines = [_line(rows["best"])]
    for name in BASELINES:
        if name in rows:
            lines.append(_line(rows[name]))
        if name + OWN in own:
            lines.append(_line(own[name + OWN]))
        elif families.get(name, {}).get("candidates"):
            lines.append(f"{name + OWN:<13} none of its {families[name]['candidates']} layouts in the space fits memory")
    if search.get("current") is not None:
        lines.append(_line(search["current"]))
    notes = [
        f"speedup    the row's speedup over {REFERENCE} at the best plan's degrees",
        "best over  the best plan's speedup over the row",
        "rows       <baseline>: at the best plan's degrees, M and recomputation; <baseline>@own: at its own best",
        "           layout, the fastest (degrees, M, recomputation, VPP chunks) of the same space that fits memory"
        + ("" if search.get("current") is None else ";\n           current: the current layout given"),
    ]
    return "\n".join([_HEADER, "-" * len(_HEADER), *lines, "", *notes])
