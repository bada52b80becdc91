"""Records (plain dicts, what ``--json`` prints) and readable tables of predictions and derivations.

The per-rank table of a prediction is a DataFrame (:func:`rank_frame`, seconds and bytes), printed
in milliseconds and GiB (:data:`RANK_COLUMNS`).
"""

from __future__ import annotations

from typing import Any

import pandas as pd

from mpipe_tune.algebra import Candidate
from mpipe_tune.cost import rank_bounds
from mpipe_tune.plan_file import placement_record, predicted_record
from mpipe_tune.outputs import Column, TextTable, gib, ms, text


def prediction_record(prediction, model, workload, profile) -> dict[str, Any]:
    """What ``predict --json`` prints: the inputs' names, the candidate (its fields, with the slabs and
    owners derive chose), the cost options' MoE imbalance, the placement and the predicted figures."""
    mem = prediction.memory
    record = {
        "model": model.name,
        "profile": profile.name,
        "workload": workload.name,
        **prediction.candidate.to_dict(),
        **prediction.options.framework(),
        "placement": placement_record(prediction.plan),
        **predicted_record(prediction),
        "memory_capacity_bytes": mem.capacity_bytes,
        "fits_memory": mem.fits,
    }
    for rank, bound in zip(record["ranks"], rank_bounds(prediction)):  # what bounds each rank (issue 37)
        rank["bound_by"] = bound.to_dict()
    return record


def rank_frame(record: dict[str, Any]) -> pd.DataFrame:
    """The per-rank table of a :func:`prediction_record`, one row per rank, in seconds and bytes."""
    return pd.DataFrame.from_records(
        [{"rank": r["rank"], "busy_s": r["busy_s"], "bubble_s": r["bubble_s"], "encoder_s": r["encoder_s"],
          "warmup_slack_s": r["warmup_slack_s"], "spill_s": r["spill_s"], **r["memory"],
          "bound_by": _bound_cell(r)} for r in record["ranks"]],
        columns=["rank", "busy_s", "bubble_s", "encoder_s", "warmup_slack_s", "spill_s", "static_bytes",
                 "activation_peak_bytes", "peak_bytes", "over_capacity", "bound_by"])


def _bound_cell(rank: dict[str, Any]) -> str:
    bound = rank.get("bound_by")
    return "-" if bound is None else f"{bound['bound']} {bound['share']:.0%}"


RANK_COLUMNS = (
    Column("rank", text("rank"), ">", 4),
    Column("busy ms", ms("busy_s"), ">", 10),
    Column("bubble ms", ms("bubble_s"), ">", 10),
    Column("encoder ms", ms("encoder_s"), ">", 10),
    Column("slack ms", ms("warmup_slack_s"), ">", 10),
    Column("spill ms", ms("spill_s"), ">", 10),
    Column("bound by", text("bound_by"), ">", 16),
    Column("peak GiB", gib("peak_bytes"), ">", 9),
)
"""The printed per-rank table: milliseconds and GiB from the frame's seconds and bytes."""
OVER = "OVER"
"""Marks a rank whose peak is over the device's memory capacity."""


def print_prediction(record: dict[str, Any]) -> None:
    """The header (the inputs, and the candidate in its one text form, which ``Candidate.parse`` reads back)
    and the per-rank table of a :func:`prediction_record`."""
    print(f"model {record['model']}  profile {record['profile']}  workload {record['workload']}")
    print(f"candidate {Candidate.from_dict(record)}")
    print(f"predicted step time: {record['makespan_s'] * 1e3:.3f} ms   bubble share {record['bubble_share']:.1%}\n")
    frame = rank_frame(record)
    table = TextTable.fit(frame, RANK_COLUMNS)
    print(table.header)
    for _, r in frame.iterrows():
        print(table.line(r) + (f"  {OVER}" if r["over_capacity"] else ""))
    capacity = record["memory_capacity_bytes"] / 2**30
    verdict = "fits" if record["fits_memory"] else "does NOT fit"
    print(f"\nmemory: the plan {verdict} the profile's {capacity:.4g} GiB per device"
          + (f" ({OVER}: the rank's peak is over it)" if frame["over_capacity"].any() else ""))


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
