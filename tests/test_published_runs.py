"""The published-runs data file that bench_published.py predicts and fit_published.py calibrates from."""

import re
import sys
from pathlib import Path

import pytest

BENCHMARKS = Path(__file__).resolve().parent.parent / "benchmarks"


@pytest.fixture(scope="module")
def published():
    sys.path.insert(0, str(BENCHMARKS))
    try:
        import published as module
        yield module
    finally:
        sys.path.remove(str(BENCHMARKS))


def test_every_run_has_its_configuration_a_citation_and_a_split(published):
    runs = published.load_runs()
    assert len({run.name for run in runs}) == len(runs)
    for run in runs:
        assert run.source.startswith("https://") and run.table and run.step_time_s > 0 and (run.mfu is None or 0 < run.mfu < 1)
        assert run.devices == run.tp * run.pp * run.cp * run.dp
        assert run.global_batch == run.num_microbatches * run.dp * run.micro_batch
    bf16 = [run for run in runs if run.dtype == "bf16" and not run.excluded]
    held = [run for run in bf16 if run.split == "held_out"]
    assert 3 * len(held) >= len(bf16)  # at least a third held out (besides the leave-one-out of the Ascend fit runs)
    for run in runs:  # every citation pinned to a commit (a paper to its arXiv version)
        assert re.search(r"/blob/[0-9a-f]{40}/|arxiv\.org/abs/\d{4}\.\d{5}v\d+$", run.source), run.name
    # a held-out model family: the calibration never sees Llama 3.1 405B
    assert all(run.split == "held_out" for run in runs if "405b" in run.suite)


def test_a_suite_like_another_takes_its_configuration(published):
    runs = {run.name: run for run in published.load_runs()}
    bf16, fp8 = runs["dgxc-llama31-70b@64"], runs["dgxc-llama31-70b-fp8@64"]
    assert (fp8.dtype, fp8.tp, fp8.pp, fp8.vp, fp8.cp, fp8.model) == ("fp8", bf16.tp, bf16.pp, bf16.vp, bf16.cp, bf16.model)


def test_megatron_layout_gives_each_virtual_stage_its_share(published):
    from mpipe_tune.errors import MpipeError
    from mpipe_tune.inputs import load_model

    model = load_model(BENCHMARKS / "models" / "llama31-405b.yaml")
    cut, schedule, slabs = published.megatron_layout(model, 9, 7)
    assert len(cut.boundaries) == 6 and schedule.count("1f1b") == 7
    assert sum(map(sum, slabs)) == model.num_layers and slabs[0][0] == 3 and slabs[-1][-1] == 3
    with pytest.raises(MpipeError, match="126 decoder layers do not split into pp 4 x vp 5"):
        published.megatron_layout(model, 4, 5)


def test_the_llama3_paper_layout_counts_the_embedding_and_the_output_layer_in_the_split(published):
    """The Llama 3 paper's 405B pipeline (section 3.3.2): 16 ranks of 8 interleaved chunks of one layer each,
    the first chunk the embedding alone and the last the output layer alone, so the first and last ranks run
    one decoder layer fewer than the others."""
    from mpipe_tune.inputs import load_model

    run = next(run for run in published.load_runs() if run.suite == "llama3-paper-405b")
    model = load_model(BENCHMARKS / "models" / "llama31-405b.yaml")
    cut, schedule, slabs = published.megatron_layout(model, run.pp, run.vp, run.layer_list, run.embedding_in_split)
    assert (run.pp, run.vp) == (16, 8) and slabs == ((1,) * 16,) * 8 and schedule.count("1f1b") == 8
    per_rank = [sum(region[rank] for region in slabs) for rank in range(16)]
    assert per_rank == [8] * 16  # the first rank's 8 layers: the embedding and 7 decoders; the last's: 7 and the head
    assert cut.boundaries == tuple(16 * k for k in range(1, 8))


def test_the_ascend_profiles_carry_the_fit_and_say_what_stays_assumed(published):
    """ascend-910b's efficiencies are fitted on its published fit runs (cited, pinned), held-out runs exist;
    the 910C takes them as an assumption."""
    import json

    runs = [run for run in published.load_runs() if run.profile == "ascend-910b" and not run.excluded]
    assert {run.split for run in runs} == {"fit", "held_out"}
    root = BENCHMARKS.parent / "profiles"
    b, c = (json.loads((root / f"{name}.json").read_text()) for name in ("ascend-910b", "ascend-910c-cm384"))
    fitted = b["efficiency"]["default"]
    assert fitted["source"] == "fitted" and 0 < fitted["value"] <= 1 and fitted["citations"]
    assert all(run.name in fitted["ref"] for run in runs if run.split == "fit")
    assert not any(run.name in fitted["ref"] for run in runs if run.split == "held_out")
    assert "SKU is not stated" in fitted["ref"]  # the peak stays an assumption
    assert "leave-one-out" in fitted["ref"] and "mesh_links 7" in fitted["ref"]
    moved = c["efficiency"]["default"]
    assert moved["source"] == "assumed" and moved["value"] == fitted["value"] and "ascend-910b" in moved["ref"]


def test_a_run_records_its_frameworks_optimizer_state(published):
    """MindFormers' fp32-state AdamW on fp16 parameters keeps 8 optimizer bytes per parameter (two fp32 moments,
    no master copy) and 16-bit gradients; Megatron runs keep the default 12. The 7B layout then fits the 64 GB
    it ran in, which it did not with Megatron's optimizer state."""
    from dataclasses import replace

    runs = {run.name: run for run in published.load_runs()}
    mindformers, megatron = runs["mindformers-llama2-7b@8"], runs["mindspeed-llama2-7b@8"]
    assert published.run_options(megatron).optimizer_bytes_per_param == 12.0
    options = published.run_options(mindformers)
    assert (options.optimizer_bytes_per_param, options.grad_bytes_per_param) == (8.0, 2.0)
    capacity = published.load_profile(mindformers.profile).memory_capacity_bytes
    fits = max(published.predict_run(mindformers).memory.peak_bytes)
    as_megatron = replace(mindformers, optimizer_bytes_per_param=12.0, grad_reduce_dtype="fp32")
    assert fits < capacity < max(published.predict_run(as_megatron).memory.peak_bytes)


def test_a_run_that_fuses_its_loss_is_predicted_with_the_fused_kernels(published):
    """NeMo's Llama 3.1 configs set cross_entropy_loss_fusion (fewer fp32 passes over the logits); MindSpeed-LLM
    1.0.RC3 runs Megatron core_r0.6.0, which has no fused loss."""
    from dataclasses import replace

    runs = {run.name: run for run in published.load_runs()}
    nemo, mindspeed = runs["dgxc-llama31-8b@8"], runs["mindspeed-llama3-8b@8"]
    assert published.run_options(nemo).fused_loss and not published.run_options(mindspeed).fused_loss
    assert all(run.loss_fusion for run in runs.values() if run.suite.startswith("dgxc-llama31"))
    assert not any(run.loss_fusion for run in runs.values() if not run.suite.startswith("dgxc-llama31"))
    fused = published.predict_run(nemo).timeline.makespan_s
    assert published.predict_run(replace(nemo, loss_fusion=False)).timeline.makespan_s > fused


def test_each_run_applies_rope_as_its_script_says(published):
    """MindSpeed-LLM's Llama 3.1 8B/70B scripts lack --use-fused-rotary-pos-emb (separate kernels) where Llama 3's
    pass it; NeMo's Llama 3.1 config sets apply_rope_fusion; the unfused form is the slower prediction."""
    from dataclasses import replace

    runs = {run.name: run for run in published.load_runs()}
    assert published.run_options(runs["mindspeed-llama31-8b@8"]).rope == "unfused"
    assert published.run_options(runs["mindspeed-llama3-8b@8"]).rope == "mindspeed_fused"
    assert published.run_options(runs["dgxc-llama31-8b@8"]).rope == "fused"
    run = runs["mindspeed-llama3-8b@8"]
    seconds = [published.predict_run(replace(run, rope=form)).timeline.makespan_s
               for form in ("unfused", "mindspeed_fused", "fused")]
    assert seconds[0] > seconds[1] > seconds[2]


def test_a_runs_uneven_layer_list_is_its_layout(published):
    """Megatron's --num-layer-list (MindSpeed-LLM's Llama 3/3.1 70B scripts: 17,20,22,21) sets the decoder layers
    per stage; the embedding joins the first stage and the head the last."""
    from mpipe_tune.errors import MpipeError
    from mpipe_tune.inputs import load_model

    model = load_model("llama3-70b")
    cut, schedule, slabs = published.megatron_layout(model, 4, 1, (17, 20, 22, 21))
    assert (cut.boundaries, schedule, slabs) == ((), "1f1b", ((18, 20, 22, 22),))
    with pytest.raises(MpipeError, match="does not give pp 4 stages"):
        published.megatron_layout(model, 4, 1, (20, 20, 20, 21))
    runs = {run.name: run for run in published.load_runs()}
    assert runs["mindspeed-llama31-70b@32"].layer_list == (17, 20, 22, 21)
    assert published.predict_run(runs["mindspeed-llama31-70b@32"]).plan.slab(0, 2) == (38, 60)


def test_the_diagnostic_pairs_name_runs_of_their_profile(published):
    sys.path.insert(0, str(BENCHMARKS))
    try:
        import fit_published
    finally:
        sys.path.remove(str(BENCHMARKS))
    runs = {run.name: run for run in published.load_runs()}
    for profile, pairs in fit_published.PAIRS.items():
        for first, second in pairs:
            assert runs[first].profile == runs[second].profile == profile
            assert runs[first].seq_len < runs[second].seq_len  # two lengths: what tells the core from the rest


def test_an_excluded_run_says_why_and_counts_in_no_figure(published):
    """Runs outside what their profile describes (Legacy model code, another machine, a setting the cost model
    cannot express) carry their reason, are shown, and count in no fit and no held-out figure."""
    sys.path.insert(0, str(BENCHMARKS))
    try:
        import bench_published
    finally:
        sys.path.remove(str(BENCHMARKS))
    runs = published.load_runs()
    excluded = {run.name: run.excluded for run in runs if run.excluded}
    assert set(excluded) == {"mindspeed-qwen-72b@128", "mindspeed-mixtral-8x22b@64", "mindformers-llama2-7b@8",
                             "mindformers-llama2-13b-800t@8", "llama3-paper-405b-128k@16384"}
    assert "Legacy" in excluded["mindspeed-qwen-72b@128"] and "800T A2" in excluded["mindformers-llama2-7b@8"]
    chosen = [run for run in runs if run.name in ("mindspeed-qwen-72b@128", "mindformers-llama2-13b@8")]
    rows = bench_published.evaluate(chosen, None)
    stats = bench_published.summary(rows)
    assert [r["split"] for r in rows] == ["excluded", "held_out"]
    assert stats["held_out_bf16_runs"] == 1 and stats["runs"] == 1 and stats["excluded"] == 1
    assert not any(key.endswith("fit bf16") for key in stats)

