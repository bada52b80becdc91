"""Golden derivations: the text form of a few small plans, compared exactly.

Regenerate after an intended change with ``MPIPE_UPDATE_GOLDEN=1 python -m pytest tests/algebra/test_golden.py``
and review the diff.
"""

import os
from pathlib import Path

import pytest

from mpipe_tune.algebra import Cut, Owners, derive, parse_schedule

from conftest import make_model

GOLDEN = Path(__file__).parent / "golden"

CASES = {
    "transpose-1f1b-p2-m4": (Cut((2,)), "transpose,1f1b", True, 2, 4, (0, 1, 1, 0)),
    "transpose-1f1b-frozen-p2-m4": (Cut((2,)), "transpose,1f1b", False, 2, 4, (0, 1, 1, 0)),
    "1f1b-p3-m4": (Cut(()), "1f1b", True, 3, 4, None),
    "gpipe-p2-m3": (Cut(()), "gpipe", True, 2, 3, None),
    "vpp2-p2-m4": (Cut((6,)), "1f1b,1f1b", True, 2, 4, None),
}


def render(plan) -> str:
    lines = [f"schedule {plan.schedule} cut {plan.cut} P={plan.num_ranks} M={plan.num_microbatches}"]
    for p in plan.placement:
        lines.append(f"region {p.region} {p.layout.value} layers {p.layers} owner {p.owner}")
    for s in plan.collectives.seams:
        lines.append(f"seam {s}")
    for j, g in plan.collectives.reduces:
        lines.append(f"reduce {j} {g.value}")
    for r in range(plan.num_ranks):
        lines.append(f"rank {r}: " + " ".join(map(str, plan.nodes(r))))
    for s, t, kind in sorted(plan.order.edges):
        lines.append(f"{plan.order.events[s]} -> {plan.order.events[t]} {kind.value}")
    return "\n".join(lines) + "\n"


@pytest.mark.parametrize("name", sorted(CASES))
def test_golden_derivation(name):
    cut, sched, trainable_encoder, P, M, owners = CASES[name]
    model = make_model(["encoder"] * 2 + ["llm"] * 8, trainable=[trainable_encoder] * 2 + [True] * 8)
    plan = derive(cut, parse_schedule(sched), model, P, M, Owners(microbatch=owners))
    text = render(plan)
    path = GOLDEN / f"{name}.txt"
    if os.environ.get("MPIPE_UPDATE_GOLDEN"):
        path.write_text(text)
    assert text == path.read_text()
