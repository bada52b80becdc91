"""The benchmarks' own logic: the fidelity figures come from its record's raw step times and probes alone; the search
quality benchmark measures against a cached exhaustive optimum."""

import importlib.util
import json
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

BENCHMARKS = Path(__file__).resolve().parent.parent / "benchmarks"


@pytest.fixture(scope="module")
def fidelity():
    spec = importlib.util.spec_from_file_location("bench_fidelity", BENCHMARKS / "bench_fidelity.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up
    try:
        spec.loader.exec_module(module)
        yield module
    finally:
        del sys.modules[spec.name]


def _run(steps, probe_before, probe_after):
    return {"step_times_s": steps, "probe_before_s": probe_before, "probe_after_s": probe_after,
            "tries": [{"foreign_during": 0.01}]}


def _record(plans, emulated=None):
    return {"pp": 2, "plans": plans, "emulated": emulated or {},
            "conditions": {"load_average_before": (0, 0, 0), "load_average_after": (0, 0, 0), "runs_wall_s": 1.0,
                           "profiles": []}}


def _plan(label, predicted, runs, probe=0.010):
    return {"label": label, "world": 2, "predicted_s": predicted, "profile_probe_s": probe, "runs": runs}


def test_figures_are_computed_from_raw_steps_and_the_probe_alone(fidelity):
    # Every plan measured 10% over its prediction, and the probe ran 10% slower than at profile time:
    # raw MAPE 1/11 (prediction / measured - 1 = -1/11), probe-corrected 0. The first step is warm-up.
    plans = [_plan("a", 1.0, [_run([9.0, 1.1, 1.1], 0.011, 0.011), _run([9.0, 1.1, 1.1], 0.0105, 0.0115)]),
             _plan("b", 2.0, [_run([9.0, 2.2, 2.2, 2.2], 0.011, 0.011)]),
             _plan("c", 1.5, [_run([0.1, 1.65, 1.65], 0.012, 0.010)])]
    summary = fidelity.summarize_record(_record(plans))
    assert summary["measured_s"] == pytest.approx([1.1, 2.2, 1.65])
    assert summary["raw"]["mape"] == pytest.approx(1 / 11) and summary["raw"]["mean_error"] == pytest.approx(-1 / 11)
    assert summary["probe_corrected"]["mape"] == pytest.approx(0.0, abs=1e-12)
    assert summary["raw"]["kendall_tau"] == pytest.approx(1.0) and summary["raw"]["best_gap"] == 0.0
    # a probe that says nothing changed leaves the prediction as it is
    still = [_plan("a", 1.0, [_run([1.0, 1.1], 0.010, 0.010)])]
    assert fidelity.summarize_record(_record(still))["corrected_s"] == [1.0]


def test_the_probes_after_every_step_stand_for_the_run_where_it_has_them(fidelity):
    # The probes after each step bracket the measured steps (all but the first); the ones before and
    # after the run count only in a record without them.
    run = {**_run([9.0, 1.1, 1.1], 0.050, 0.011), "probe_steps_s": [0.012, 0.010, 0.011]}
    summary = fidelity.summarize_record(_record([_plan("a", 1.0, [run])]))
    assert summary["corrected_s"] == pytest.approx([1.1])  # mean 0.011 over the profile's 0.010


def test_reprofiled_runs_are_predicted_and_corrected_on_their_own_round_profile(fidelity):
    # --reprofile: each run carries its round's prediction and that profile's probe. The plan's
    # prediction is the median of its runs', the correction is per run (its probe against its profile).
    first = _run([0, 1.2], 0.011, 0.011)  # the plan's own profile: probe 0.010, prediction 1.0
    second = {**_run([0, 1.2], 0.012, 0.012), "predicted_s": 1.1, "profile_probe_s": 0.011}
    third = {**_run([0, 1.2], 0.012, 0.012), "predicted_s": 1.15, "profile_probe_s": 0.0115}
    summary = fidelity.summarize_record(_record([_plan("a", 1.0, [first, second, third])]))
    assert summary["predicted_s"] == [1.1]
    assert summary["corrected_s"] == pytest.approx([1.2])  # 1.0 * 1.1, 1.1 * 12/11, 1.15 * 12/11.5: 1.1, 1.2, 1.2


def test_best_gap_is_the_measured_cost_of_trusting_the_prediction(fidelity):
    plans = [_plan("fast on paper", 1.0, [_run([0, 1.3], 0.01, 0.01)]),
             _plan("fast in fact", 1.2, [_run([0, 1.25], 0.01, 0.01)])]
    raw = fidelity.summarize_record(_record(plans))["raw"]
    assert raw["best_gap"] == pytest.approx(1.3 / 1.25 - 1) and raw["kendall_tau"] == pytest.approx(-1.0)


def test_replot_prints_every_plan_and_the_emulated_rows(fidelity, tmp_path, capsys):
    emulated = {"8": [{"label": "megatron", "predicted_s": 5.0, "runs": [{"step_times_s": [6.0, 5.1, 5.1]}]},
                      {"label": "mpipe-rr", "predicted_s": 3.0, "runs": [{"step_times_s": [4.0, 3.1, 3.1]}]}]}
    record = _record([_plan("a", 1.0, [_run([9.0, 1.1, 1.1], 0.011, 0.011)]),
                      _plan("b", 2.0, [_run([9.0, 2.2], 0.011, 0.011)])], emulated)
    path = tmp_path / "record.json"
    path.write_text(json.dumps(record))
    assert fidelity.main(["--replot", str(path), "--plot", str(tmp_path / "fig.png")]) == 0
    out = capsys.readouterr().out
    assert "| 0 | `a` | 2 | 1000.0 | 1100.0 | -9.1% | 1100.0 | " in out
    assert "| 8 | mpipe-rr | 3000.0 | 3100.0 | -3.2% |" in out
    assert (tmp_path / "fig.png").stat().st_size > 0


def test_there_are_24_plans_or_more_with_data_and_tensor_parallel_ones(fidelity):
    from mpipe_tune.inputs import load_model

    specs = fidelity.plan_specs(load_model(str(fidelity.MODEL_PATH)))
    assert len(specs) >= 24 and len({s.label for s in specs}) == len(specs)
    assert any(s.dp > 1 for s in specs) and any(s.tp > 1 for s in specs) and max(s.world for s in specs) <= 4
    assert set(fidelity.QUICK) <= {s.label for s in specs}


def test_the_small_set_is_micro_batch_1_short_sequences_on_two_ranks(fidelity):
    specs = fidelity.small_specs()
    assert len(specs) >= 12 and len({s.label for s in specs}) == len(specs)
    assert set(fidelity.fidelity_small.QUICK) <= {s.label for s in specs}
    for spec in specs:
        workload = spec.workload()
        assert spec.world == 2 and spec.group == "small" and 64 <= spec.sample_tokens <= 256
        assert len(workload.microbatches) == spec.num_microbatches  # one sample a microbatch
        assert {mb.text_tokens for mb in workload.microbatches} == {spec.sample_tokens}
        hidden = fidelity.spec_model(spec.model).layers[-1].cost.dims_dict()["hidden"]
        assert 128 <= hidden <= 512


def test_the_zero_set_runs_every_stage_on_two_data_parallel_ranks(fidelity, tmp_path):
    """bench_fidelity's ZeRO set: each plan file carries its stage and reshard policy to the executor."""
    pytest.importorskip("torch")
    from mpipe_tune.runtime._job import RunJob, preflight

    specs = fidelity.zero_specs()
    assert [(s.zero_stage, s.reshard_after_forward) for s in specs] == [(0, None), (1, None), (2, None), (3, None),
                                                                         (3, False)]
    profile = BENCHMARKS / "profiles" / "fidelity-vm.json"
    for (spec, path, record, roofline), expected in zip(fidelity.make_plans(tmp_path, specs, {2: profile}), specs):
        view = preflight(RunJob(path, compute="real"), 2)
        assert spec.group == "zero" and (spec.pp, spec.dp, view.layout.world_size) == (1, 2, 2)
        assert view.candidate.zero_stage == expected.zero_stage, spec.label
        if expected.zero_stage == 3:  # pp 1's default reshards after forward; "keep" holds the weights
            assert view.candidate.reshards_after_forward == (expected.reshard_after_forward is None), spec.label
    names = fidelity.figures_frame(_record([{**_plan("z", 1.0, [_run([9.0, 1.1], 0.01, 0.01)]), "set": "zero"}]))
    assert list(names["prediction"]) == ["ZeRO set, the profile's prediction", "ZeRO set, probe-corrected"]
    assert list(names["plans"]) == [1, 1]


def test_the_roofline_alone_drops_every_per_call_term_and_keeps_the_efficiencies(fidelity):
    from mpipe_tune.cost import load_profile

    profile = load_profile(BENCHMARKS / "profiles" / "fidelity-vm.json")
    assert profile.call_overhead_for("dense_block") != (0.0, 0.0)  # calibrated: the test has something to drop
    bare = fidelity.fidelity_small.roofline_profile(profile)
    for kind in profile.efficiency:
        assert bare.efficiency_for(kind) == profile.efficiency_for(kind)
        assert bare.call_overhead_for(kind) == (0.0, 0.0) and bare.tp_overhead_for(kind, 2) == (0.0, 0.0)
    spec = fidelity.small_specs()[0]
    assert fidelity.roofline_s(spec, profile) < fidelity.predict_spec(spec, profile)[0].timeline.makespan_s


def test_each_set_has_its_own_figures_and_the_roofline_beside(fidelity):
    main = _plan("a", 1.0, [_run([9.0, 1.1], 0.01, 0.01)])
    small = [{**_plan("s1", 1.0, [_run([9.0, 2.0], 0.01, 0.01)]), "set": "small", "roofline_s": 0.5},
             {**_plan("s2", 2.0, [_run([9.0, 2.0], 0.01, 0.01)]), "set": "small", "roofline_s": 1.0}]
    summary = fidelity.summarize_record(_record([main, *small]))
    assert summary["raw"]["mape"] == pytest.approx(1 / 11)  # the main set's figures: its plans alone
    assert summary["small_raw"]["mape"] == pytest.approx(0.25) and summary["small_roofline"]["mape"] == pytest.approx(0.625)
    assert "roofline" not in summary  # the main plan's record has no roofline prediction


def test_the_sweep_places_the_real_compute_point_from_the_fidelity_record(fidelity):
    spec = importlib.util.spec_from_file_location("bench_sweep", BENCHMARKS / "bench_sweep.py")
    sweep = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = sweep
    try:
        spec.loader.exec_module(sweep)

        def plan(label, schedule, predicted, measured, tp=1):
            return {"label": label, "schedule": schedule, "tp": tp, "dp": 1, "predicted_s": predicted,
                    "runs": [{"step_times_s": [9.0, measured, measured]}]}

        record = {"model": "models/small-vit-llm.yaml", "pp": 2, "encoder_share": 0.2, "date": "2026-12-01",
                  "plans": [plan("transpose,1f1b rr M=4", "transpose,1f1b", 1.0, 1.1),
                            plan("transpose,1f1b rr M=8", "transpose,1f1b", 0.9, 1.2),
                            plan("transpose,1f1b rr tp2 M=4", "transpose,1f1b", 0.5, 0.6, tp=2),  # not pp-only
                            plan("1f1b megatron-slabs M=4", "1f1b", 1.8, 2.4),
                            plan("1f1b disttrain-slabs M=4", "1f1b", 1.35, 1.8)]}
        real = sweep.real_point(record)
        assert real["best"] == "transpose,1f1b rr M=8" and real["pp"] == 2 and real["encoder_share"] == 0.2
        assert real["speedup_predicted"] == pytest.approx({"megatron": 2.0, "disttrain": 1.5})
        assert real["speedup_measured"] == pytest.approx({"megatron": 2.0, "disttrain": 1.5})
        assert sweep.real_point({"plans": []}) is None
    finally:
        del sys.modules[spec.name]


def test_the_emulated_baseline_plans_are_plan_files_the_executor_reads(tmp_path, monkeypatch):
    # bench_fidelity's emulated rows start from these files; a stale call here once cost a whole real-compute run.
    monkeypatch.syspath_prepend(str(BENCHMARKS))
    from bench_runtime_emulated import baseline_plans

    from mpipe_tune.runtime._plan_view import read_plan_file, validate_runnable

    paths = baseline_plans(tmp_path, 2, 4, ("megatron", "mpipe-rr", "vpp"))
    assert set(paths) == {"megatron", "mpipe-rr", "vpp"}
    for name, path in paths.items():
        view = read_plan_file(path)  # re-derives the candidate and checks the stored order against it
        validate_runnable(view, 2)
        assert (view.candidate.pp, view.candidate.num_microbatches) == (2, 4), name


def test_only_a_word_no_plan_has_is_refused_with_the_labels(fidelity):
    with pytest.raises(SystemExit, match="no plan's label contains it; labels: 1f1b M=2"):
        fidelity.main(["--only", "tp3", "--no-emulated"])


def test_the_parallel_fidelity_plans_are_plan_files_the_executor_takes(tmp_path):
    """bench_fidelity_parallel.py: every case's plan passes run's checks for real compute."""
    pytest.importorskip("torch")
    spec = importlib.util.spec_from_file_location("bench_fidelity_parallel", BENCHMARKS / "bench_fidelity_parallel.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    try:
        spec.loader.exec_module(module)
        from mpipe_tune.runtime._job import RunJob, preflight

        profiles = {world: BENCHMARKS / "profiles" / f"moe-vm-{world}.json" for world in (2, 4)}
        for case in module.CASES:
            path = module.make_plan(case, profiles[case.world], tmp_path)
            view = preflight(RunJob(str(path), compute="real"), case.world)
            assert (view.layout.ep, view.layout.cp, view.layout.world_size) == (case.ep, case.cp, case.world), case.label
            assert view.candidate.zero_stage == case.zero_stage, case.label
    finally:
        del sys.modules[spec.name]


def test_the_parallel_fidelity_refuses_an_unknown_case_and_2_rank_cases_without_their_profile(capsys):
    """bench_fidelity_parallel.py: ``--only`` names cases (or ``zero``, every ZeRO case, the 2-rank ones among
    them); a label it does not know, or a 2-rank case without ``--profile-2``, is one line and exit code 2,
    before anything runs."""
    spec = importlib.util.spec_from_file_location("bench_fidelity_parallel", BENCHMARKS / "bench_fidelity_parallel.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    try:
        spec.loader.exec_module(module)
        assert {c.world for c in module.CASES if c.label in module.ZERO_LABELS} == {2, 4}
        profile = str(BENCHMARKS / "profiles" / "moe-vm-4.json")
        for only, message in (("dp9", "no case 'dp9'"), ("zero", "need --profile-2")):
            with pytest.raises(SystemExit) as stop:
                module.main(["--profile", profile, "--only", only])
            assert stop.value.code == 2 and message in capsys.readouterr().err
    finally:
        del sys.modules[spec.name]


@pytest.fixture(scope="module")
def bench_search():
    spec = importlib.util.spec_from_file_location("bench_search", BENCHMARKS / "bench_search.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_quality_measures_the_plan_against_a_cached_exhaustive_optimum(bench_search, tmp_path, monkeypatch, capsys):
    """bench_search.py quality on a tiny problem: the plan is within the search's 1% tolerance of the exhaustive
    optimum; the optimum is computed once and then read from the cache; a cached optimum the current cost
    model no longer predicts at its recorded step time is recomputed."""
    cache = tmp_path / "optima.json"
    exhaustive_runs = []
    real_run_search = bench_search.run_search

    def counting(*args, **kwargs):
        exhaustive_runs.append(kwargs.get("exhaustive"))
        return real_run_search(*args, **kwargs)

    monkeypatch.setattr(bench_search, "run_search", counting)
    args = dict(problems="tiny", seeds=1, cache=str(cache), refresh=False)
    rows = bench_search.quality(SimpleNamespace(**args, references_only=False))
    assert [(r["problem"], r["seed"]) for r in rows] == [("tiny", 1)]
    assert rows[0]["gap"] <= 0.01 and 0 < rows[0]["predicted_share"] <= 1
    assert "| tiny | 1 |" in capsys.readouterr().out
    entry = json.loads(cache.read_text())["tiny/seed1"]
    assert exhaustive_runs == [True] and entry["optimum_ms"] > 0 and entry["points"] > entry["predicted"]

    bench_search.quality(SimpleNamespace(**args, references_only=True))
    assert exhaustive_runs == [True]  # served from the cache
    assert json.loads(cache.read_text())["tiny/seed1"] == entry

    cache.write_text(json.dumps({"tiny/seed1": {**entry, "optimum_ms": entry["optimum_ms"] * 1.5}}))
    bench_search.quality(SimpleNamespace(**args, references_only=True))
    assert exhaustive_runs == [True, True]  # stale: the cost model predicts the cached plan otherwise
    assert "the cost model changed" in capsys.readouterr().err
    assert json.loads(cache.read_text())["tiny/seed1"]["optimum_ms"] == pytest.approx(entry["optimum_ms"])


def test_scale_sets_the_plan_beside_each_baseline_and_a_long_tpe_run(bench_search, capsys):
    args = SimpleNamespace(devices="4", model="tiny-vit-llm", profile="ideal", tpe_trials=20, tpe_cpu_s=600.0, seed=1)
    [(devices, rows)] = bench_search.scale(args).items()
    steps = dict(rows)
    assert devices == 4 and any(m.startswith("TPE, ") and "cap 20)" in m for m in steps)
    winner = next(s for m, s in rows if m.startswith("plan's winner"))
    assert all(s is None or winner <= s for m, s in rows if m.endswith("@own"))  # no baseline row beats it
    assert "| 4 | " in capsys.readouterr().out


def test_scale_s_tpe_run_stops_at_its_cpu_budget(bench_search):
    args = SimpleNamespace(devices="4", model="tiny-vit-llm", profile="ideal", tpe_trials=2000, tpe_cpu_s=0.0, seed=1)
    [(_, rows)] = bench_search.scale(args).items()
    tpe = next(m for m, _ in rows if m.startswith("TPE, "))
    assert tpe.endswith("(the 0 s CPU budget)") and int(tpe.split()[1]) < 2000
