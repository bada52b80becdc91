"""Records (plain dicts, what ``--json`` prints) and readable tables of predictions and derivations."""

from __future__ import annotations

from typing import Any

from mpipe_tune.algebra.derive import Plan
from mpipe_tune.algebra.placement import ByLayer


def placement_record(plan: Plan) -> list[dict[str, Any]]:
    out = []
    for p in plan.placement:
        entry: dict[str, Any] = {"region": p.region, "layers": list(p.layers), "layout": p.layout.value}
        if isinstance(p.owner, ByLayer):
            entry["slabs"] = [list(s) for s in p.owner.slabs]
        else:
            entry["owners"] = list(p.owner.owners)
        out.append(entry)
    return out


def derivation_record(plan: Plan) -> dict[str, Any]:
    return {
        "schedule": str(plan.schedule),
        "cut": list(plan.cut.boundaries),
        "pp": plan.num_ranks,
        "microbatches": plan.num_microbatches,
        "placement": placement_record(plan),
        "collectives": {
            "seams": [
                {"seam": [s.src_region, s.dst_region], "fwd": s.fwd.value, "bwd": s.bwd.value if s.bwd else None}
                for s in plan.collectives.seams
            ],
            "reduces": [{"region": j, "group": g.value} for j, g in plan.collectives.reduces],
        },
        "nodes": [[str(e) for e in plan.nodes(r)] for r in range(plan.num_ranks)],
        "num_events": len(plan.order.events),
        "num_edges": len(plan.order.edges),
    }


def candidate_record(plan: Plan, options) -> dict[str, Any]:
    """The schedule and degrees a prediction was made for (the cost options included)."""
    return {
        "schedule": str(plan.schedule),
        "cut": list(plan.cut.boundaries),
        "pp": plan.num_ranks,
        "tp": options.tp_degree,
        "dp": options.dp_degree,
        "dtype": options.dtype,
        "recompute": options.recompute,
        "microbatches": plan.num_microbatches,
    }


def prediction_record(prediction, model, workload, profile, options) -> dict[str, Any]:
    t = prediction.timeline
    plan = prediction.plan
    mem = prediction.memory
    record = {
        "model": model.name,
        "profile": profile.name,
        "workload": workload.name,
        **candidate_record(plan, options),
        "placement": placement_record(plan),
        "makespan_s": t.makespan_s,
        "bubble_share": sum(t.bubble_s) / (t.makespan_s * plan.num_ranks) if t.makespan_s > 0 else 0.0,
        "ranks": [
            {"rank": r, "busy_s": t.busy_s[r], "bubble_s": t.bubble_s[r], "spill_s": t.spill_s[r],
             "encoder_s": t.encoder_s[r], "warmup_slack_s": t.warmup_slack_s[r],
             "memory": {"static_bytes": mem.static_bytes[r], "activation_peak_bytes": mem.activation_peak_bytes[r],
                        "peak_bytes": mem.peak_bytes[r], "over_capacity": mem.over_capacity[r]}}
            for r in range(plan.num_ranks)
        ],
        "memory_capacity_bytes": mem.capacity_bytes,
        "fits_memory": mem.fits,
    }
    return record


def _ms(seconds: float) -> str:
    return f"{seconds * 1e3:10.3f}"


def print_prediction(record: dict[str, Any]) -> None:
    print(f"model {record['model']}  profile {record['profile']}  workload {record['workload']}")
    print(f"schedule <{record['schedule']}>  cut {record['cut'] or '-'}  P={record['pp']} tp={record['tp']} "
          f"dp={record['dp']}  M={record['microbatches']}  dtype {record['dtype']}")
    print(f"predicted step time: {record['makespan_s'] * 1e3:.3f} ms   bubble share {record['bubble_share']:.1%}\n")
    header = f"{'rank':>4} {'busy ms':>10} {'bubble ms':>10} {'encoder ms':>10} {'slack ms':>10} {'spill ms':>10}"
    print(header + f" {'peak GiB':>9}")
    for r in record["ranks"]:
        line = (f"{r['rank']:>4} {_ms(r['busy_s'])} {_ms(r['bubble_s'])} {_ms(r['encoder_s'])} "
                f"{_ms(r['warmup_slack_s'])} {_ms(r['spill_s'])}")
        line += f" {r['memory']['peak_bytes'] / 2**30:9.2f}" + ("  OVER" if r["memory"]["over_capacity"] else "")
        print(line)
    capacity = record["memory_capacity_bytes"] / 2**30
    verdict = "fits" if record["fits_memory"] else "does NOT fit"
    print(f"\nmemory: the plan {verdict} the profile's {capacity:.4g} GiB per device")


def print_derivation(record: dict[str, Any]) -> None:
    print(f"schedule <{record['schedule']}>  cut {record['cut'] or '-'}  P={record['pp']}  M={record['microbatches']}")
    print("placement:")
    for p in record["placement"]:
        owner = f"slabs {p['slabs']}" if "slabs" in p else f"owners {p['owners']}"
        print(f"  region {p['region']} layers [{p['layers'][0]}, {p['layers'][1]}) {p['layout']}: {owner}")
    print("collectives:")
    for s in record["collectives"]["seams"]:
        print(f"  seam {tuple(s['seam'])}: fwd {s['fwd']}, bwd {s['bwd'] or '-'}")
    for red in record["collectives"]["reduces"]:
        print(f"  reduce region {red['region']} over {red['group']} group")
    print("order:")
    for r, nodes in enumerate(record["nodes"]):
        print(f"  rank {r}: {' '.join(nodes)}")
