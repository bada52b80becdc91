"""The best plan beside the baselines: rows of one comparison table (plain dicts, what ``--json`` prints)."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from mpipe_tune.search.baselines import BASELINES, REFERENCE, baseline
from mpipe_tune.search.evaluate import Evaluation, Evaluator
from mpipe_tune.search.space import SearchSpace


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


def row(label: str, e: Evaluation, reference: Evaluation | None) -> dict[str, Any]:
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
        "speedup": reference.mean_s / e.mean_s if reference is not None and e.mean_s > 0 else None,
        "bubble_share": e.bubble_share,
        "spill_s": e.max_spill_s,
        "peak_bytes": e.peak_bytes,
        "fits_memory": e.fits,
    }


def comparison_rows(best: Evaluation, baselines: list[tuple[str, Evaluation | None]]) -> list[dict[str, Any]]:
    reference = dict(baselines).get(REFERENCE)
    rows = [row("best", best, reference)]
    rows += [row(name, e, reference) for name, e in baselines if e is not None]
    return rows


def format_rows(rows: list[dict[str, Any]]) -> str:
    """A fixed-width table: one line per plan (a peak over capacity is marked ``!``)."""
    header = (f"{'plan':<10} {'schedule':<20} {'cut':<7} {'owners':<11} {'pp/tp/dp':<9} {'M':>4} "
              f"{'step ms':>10} {'p90 ms':>10} {'speedup':>8} {'bubble':>7} {'peak GiB':>9} {'recomp':>6}")
    lines = [header, "-" * len(header)]
    for r in rows:
        speedup = f"{r['speedup']:.3f}x" if r["speedup"] is not None else "-"
        peak = "-" if r["peak_bytes"] is None else f"{r['peak_bytes'] / 2**30:.2f}" + ("" if r["fits_memory"] else "!")
        degrees = f"{r['pp']}/{r['tp']}/{r['dp']}"
        cut = ",".join(map(str, r["cut"])) or "-"
        lines.append(
            f"{r['plan']:<10} {r['schedule']:<20} {cut:<7} {r['owners'] or '-':<11} "
            f"{degrees:<9} {r['microbatches']:>4} {r['step_s'] * 1e3:>10.3f} "
            f"{r['p90_s'] * 1e3:>10.3f} {speedup:>8} {r['bubble_share']:>7.1%} {peak:>9} "
            f"{'yes' if r.get('recompute') else 'no':>6}"
        )
    return "\n".join(lines)
