"""Encoder backwards moved off their owners in the cost model (full recomputation): re-timed without
deriving again they predict what a fresh derive does; the moved event keeps its seconds, its Scatter
takes the new rank's link, its saved bytes live on the new rank during the backward only; ``optimised``
moves some where that helps and is never slower than the owner-only placements; plan.json keeps the
ranks, ``show`` re-derives them, and exports refuse them."""

from __future__ import annotations

import json
from dataclasses import replace

import numpy as np
import pytest

from test_compiled import _same_step

from mpipe_tune.algebra import Candidate, Bwd, Coll, Comm, Fwd
from mpipe_tune.cli import main
from mpipe_tune.cost import CompiledPlan, optimise, CostOptions, predict, load_profile
from mpipe_tune.errors import MpipeError
from mpipe_tune.inputs import load_workload
from mpipe_tune.plan_file._check import read_candidate as validate_candidate
from mpipe_tune.report.exports import TARGETS
from mpipe_tune.report.exports._plan import plan_from_record
from mpipe_tune.plan_file import PlanInputs, dump_plan, plan_record
from mpipe_tune.inputs import load_model

REAL = "qwen2vl-vit-llama3-8b"


def _setup(P=4, M=8, model_name=REAL, profile="h100-sxm", mix="balanced", recompute=True, **fields):
    model, hw = load_model(model_name), load_profile(profile)
    workload = load_workload(mix, num_microbatches=M, seed=1)
    c = Candidate("transpose,1f1b", (model.backbone_start,), pp=P, tp=1, dp=1, num_microbatches=M,
                  owner_policy="round-robin", recompute=recompute, **fields)
    return c, model, workload, hw


def _moved(P=4, M=8):
    """The cooldown prediction and a fresh one with microbatches 0 and 3 moved to the next rank's cooldown."""
    c, model, workload, hw = _setup(P, M)
    base = predict(c, model, workload, hw)
    compiled = CompiledPlan(base.plan, model, hw, base.options)
    ranks = tuple((o + 1) % P if m in (0, 3) else o for m, o in enumerate(compiled.owners))
    slots = compiled.backbone_steps.cooldown_slots(ranks)
    fresh = predict(replace(c, encoder_backward="optimised", encoder_backward_slots=slots, encoder_backward_ranks=ranks),
                    model, workload, hw)
    return base, fresh, compiled, slots, ranks, (c, model, workload, hw)


def test_a_moved_backward_re_times_to_what_a_fresh_derive_predicts():
    base, fresh, compiled, slots, ranks, _ = _moved()
    _same_step(compiled.with_encoder_backward(slots, ranks), fresh, base.table)
    # and back on the owners from the moved plan: the cooldown again
    again = CompiledPlan(fresh.plan, compiled.model, compiled.profile, fresh.options)
    _same_step(again.with_encoder_backward(compiled.backbone_steps.cooldown_slots(compiled.owners)), base, base.table)


def test_the_moved_event_keeps_its_seconds_its_scatter_takes_the_new_link_and_its_memory_moves():
    base, fresh, compiled, slots, ranks, _ = _moved()
    owners = compiled.owners
    for m in (0, 3):
        old, new = base.plan.index[Bwd(1, owners[m], m)], fresh.plan.index[Bwd(1, ranks[m], m)]
        assert old == new and fresh.timeline.durations_s[new] == base.timeline.durations_s[old] > 0
        (scatter,) = [i for i, e in enumerate(fresh.plan.order.events)
                      if isinstance(e, Coll) and e.comm is Comm.SCATTER and e.mb == m]
        # rank 0 runs the first stage: a Scatter to it is free, one from it to another rank is not
        assert (fresh.timeline.durations_s[scatter] == 0) == (ranks[m] == 0)
        assert (base.timeline.durations_s[scatter] == 0) == (owners[m] == 0)
    layout = CompiledPlan(fresh.plan, compiled.model, compiled.profile, fresh.options).memory_layout
    saved = np.arange(layout.num_saved)
    for m in (0, 3):
        backward, encode = fresh.plan.index[Bwd(1, ranks[m], m)], fresh.plan.index[Fwd(1, owners[m], m)]
        (k,) = saved[layout.free_event[saved] == backward]
        assert layout.rank[k] == ranks[m] and layout.alloc_event[k] == backward  # held during the backward only
        assert encode not in layout.alloc_event[saved].tolist()  # the owner keeps nothing for it
    # rank 0 ends with two encoder backwards in the cooldown; one moved away lowers its peak
    assert fresh.memory.activation_peak_bytes[0] < base.memory.activation_peak_bytes[0]


CONFIGS = [(REAL, "h100-sxm", 4, 8, "balanced"), (REAL, "h100-sxm", 8, 16, "image-heavy"),
           ("qwen2vl-vit-qwen2-7b", "h100-sxm", 4, 8, "image-heavy")]


@pytest.mark.parametrize("model_name,profile,P,M,mix", CONFIGS)
def test_optimised_with_moves_is_never_slower_than_the_owner_only_placements(model_name, profile, P, M, mix):
    c, model, workload, hw = _setup(P, M, model_name, profile, mix)
    times = {p: predict(replace(c, encoder_backward=p), model, workload, hw) for p in ("cooldown", "earliest")}
    compiled = CompiledPlan(times["cooldown"].plan, model, hw, times["cooldown"].options)
    owners_only = optimise(compiled, times["cooldown"].table, other_ranks=False)
    assert owners_only.ranks is None
    moved = predict(replace(c, encoder_backward="optimised"), model, workload, hw)
    ranks = moved.candidate.encoder_backward_ranks
    assert ranks is not None and ranks != compiled.owners, "full recomputation: some encoder backward moved"
    owner_s = compiled.with_encoder_backward(owners_only.slots).makespan(times["cooldown"].table)
    assert moved.timeline.makespan_s <= min(owner_s, *(p.timeline.makespan_s for p in times.values()))


def test_without_full_recomputation_optimised_moves_nothing():
    for recompute in (False, "selective"):
        c, model, workload, hw = _setup(recompute=recompute)
        assert predict(replace(c, encoder_backward="optimised"), model, workload, hw).candidate.encoder_backward_ranks \
            is None


def test_plan_json_keeps_the_ranks_show_re_derives_them_and_exports_refuse_them(tmp_path, capsys):
    base, fresh, compiled, slots, ranks, (c, model, workload, hw) = _moved()
    record = plan_record(fresh, model, workload, hw, PlanInputs(REAL, (), "h100-sxm"))
    path = tmp_path / "plan.json"
    dump_plan(record, path)
    stored = json.loads(path.read_text())["candidate"]
    assert stored["encoder_backward_ranks"] == list(ranks) and stored["encoder_backward_slots"] == list(slots)
    assert main(["show", str(path), "--json"]) == 0
    shown = json.loads(capsys.readouterr().out)
    assert shown["makespan_s"] == pytest.approx(shown["recorded_makespan_s"], rel=1e-12)
    with pytest.raises(MpipeError, match=r"runs 2 encoder backward\(s\) on other ranks than their owners"):
        TARGETS["hyper-parallel"].export(plan_from_record(record, model), None)
    bad = dict(stored, encoder_backward_ranks=[0] * 7)
    with pytest.raises(MpipeError, match="'encoder_backward_ranks' lists 7 entries, but the candidate needs 8"):
        validate_candidate(bad, where="plan.json")
    with pytest.raises(MpipeError, match="'encoder_backward_ranks' = .* integers from 0 to 3"):
        validate_candidate(dict(stored, encoder_backward_ranks=[4] * 8), where="plan.json")
