"""A plan's derivation in the file's form, and the check that a stored one is ``derive``'s.

:func:`derivation_record` is what ``derive --json`` prints and a section stores (its placement,
collectives and per-rank order); :func:`validate_derivation` refuses a section whose stored
placement, collectives or per-rank order are not the ones ``derive`` gives for its candidate (an
edited order would make the executor deadlock or compute wrong gradients).
"""

from __future__ import annotations

from typing import Any

from mpipe_tune.algebra import ByLayer, Plan
from mpipe_tune.plan_file._check import damaged, read_record, read_value
from mpipe_tune.plan_file._schema import Section, StoredCollectives, StoredPlacement


def placement_record(plan: Plan) -> list[dict[str, Any]]:
    """Each region's layers, layout, and slabs (Sharded) or owners (Replicated)."""
    out = []
    for p in plan.placement:
        entry: dict[str, Any] = {"region": p.region, "layers": list(p.layers), "layout": p.layout.value}
        if isinstance(p.owner, ByLayer):
            entry["slabs"] = [list(s) for s in p.owner.slabs]
        else:
            entry["owners"] = list(p.owner.owners)
        out.append(entry)
    return out


def collectives_record(plan: Plan) -> dict[str, Any]:
    """Each seam's forward and backward collective, and each region's gradient reduce."""
    return {
        "seams": [{"seam": [s.src_region, s.dst_region], "fwd": s.fwd.value, "bwd": s.bwd.value if s.bwd else None}
                  for s in plan.collectives.seams],
        "reduces": [{"region": j, "group": g.value} for j, g in plan.collectives.reduces],
    }


def order_record(plan: Plan) -> dict[str, Any]:
    """The event graph as stored: events in their text form, edges, and each rank's event indices."""
    return {"events": [str(e) for e in plan.order.events],
            "edges": [[s, t, kind.value] for s, t, kind in plan.order.edges],
            "nodes": [list(nodes) for nodes in plan.order.nodes]}


def derivation_record(plan: Plan) -> dict[str, Any]:
    """``derive --json``: the candidate's fields derive read, its placement, collectives and per-rank order."""
    return {
        "schedule": str(plan.schedule),
        "cut": list(plan.cut.boundaries),
        "pp": plan.num_ranks,
        "microbatches": plan.num_microbatches,
        "placement": placement_record(plan),
        "collectives": collectives_record(plan),
        "nodes": [[str(e) for e in plan.nodes(r)] for r in range(plan.num_ranks)],
        "num_events": len(plan.order.events),
        "num_edges": len(plan.order.edges),
    }


def validate_derivation(section: Section, plan: Plan, *, where: str) -> None:
    """The stored placement, collectives, events, per-rank order and edges must be exactly ``derive``'s
    (``plan``) for the stored candidate."""
    placement = read_value(tuple[StoredPlacement, ...], placement_record(plan), where=where, path="placement")
    collectives = read_record(StoredCollectives, collectives_record(plan), where=where, path="collectives")
    for key, derived in (("placement", placement), ("collectives", collectives)):
        if getattr(section, key) != derived:
            raise damaged(where, f"its stored {key} differs from what derive gives for its candidate")
    order = section.order
    events = tuple(str(e) for e in plan.order.events)
    if order.events != events:
        first = next((i for i, (a, b) in enumerate(zip(order.events, events)) if a != b),
                     min(len(events), len(order.events)))
        raise damaged(where, f"its stored events differ from what derive gives for its candidate ({len(order.events)} "
                             f"stored, {len(events)} derived; first difference at event {first})")
    for rank, (stored, derived) in enumerate(zip(order.nodes, plan.order.nodes)):
        if tuple(stored) != tuple(derived):
            step = next((k for k, (a, b) in enumerate(zip(stored, derived)) if a != b), min(len(stored), len(derived)))
            got = events[stored[step]] if step < len(stored) else "nothing"
            want = events[derived[step]] if step < len(derived) else "nothing"
            raise damaged(where, f"rank {rank}'s stored order differs from derive's for its candidate: step {step} runs "
                                 f"{got} where derive runs {want}")
    if order.edges != tuple((s, t, kind.value) for s, t, kind in plan.order.edges):
        raise damaged(where, "its stored dependency edges differ from what derive gives for its candidate")
