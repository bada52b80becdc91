"""Calibrate the shipped accelerator profiles on the published runs marked ``fit``; report the rest.

For each profile that has fit runs in ``published_runs.yaml`` (h100-sxm, ascend-910b), these numbers are fitted by
damped Gauss-Newton on the log of predicted over published step time, first on the bf16 fit runs:

- ``efficiency.default``: achieved fraction of peak of every kernel but the attention core (the
  matmuls, which are almost all of a layer's FLOPs);
- ``efficiency.attention_core``: the attention core's, against the full-square FLOPs the cost model
  charges (a causal kernel skips about half of them, so this can reach 1 where the kernel reaches ~50%);
- ``tp_comm_overlap``: the share of tensor-parallel collective time hidden behind GEMMs;

then, with those held, on the fp8 fit runs:

- ``efficiency.fp8_linear``: the linear layers' GEMMs in an fp8 step, against the fp8 peak.

Forward and backward get the same efficiency: published step times do not separate the two phases
(the profiler's own calibration, ``mpipe-tune profile``, fits them apart on a device). Per-call
overheads are left at 0: at these sizes a layer call lasts milliseconds. The fitted numbers are
written into the profile with ``source: measured``, the fit runs and their citations in the entries'
provenance. Profiles without published runs get the same numbers only where stated
(``--transfer h200``: same GH100 compute die and software stack; its own HBM3e bandwidth and capacity
stay in the roofline; ``--transfer ascend-910c-cm384`` from ``ascend-910b``: see
:data:`TRANSFER_REASONS`), marked ``source: assumed``.

    python benchmarks/fit_published.py            # fit and print, write nothing
    python benchmarks/fit_published.py --write --profile h100-sxm --transfer h200 h100-hbm2e-500w
    python benchmarks/fit_published.py --write --profile ascend-910b --transfer ascend-910c-cm384 ascend-910c-cm384-die
    python benchmarks/fit_published.py --diagnose     # the length pairs and per-run GEMM efficiency (ascend-910b)
    python benchmarks/fit_published.py --cross-validate --profile ascend-910b   # leave-one-out over the fit runs
    python benchmarks/fit_published.py --profile ascend-910b --drop mindspeed-llama3-8b@8 mindspeed-llama31-8b@8

``--cross-validate`` judges the fit on runs it did not see when the fit runs are all the in-scope runs of a
profile (ascend-910b): each fit run is predicted from the same fit on the other fit runs (started from the
fit on all of them), and the leave-one-out errors are printed with how many lie within 10%. It writes nothing.
Runs marked ``excluded`` in ``published_runs.yaml`` are in no fit.

``--diagnose`` fits nothing into a profile: it fits ``default`` and ``attention_core`` on each pair of runs in
:data:`PAIRS` alone (one model's runs whose other settings are alike, or two fit runs), then gives, at an
attention core of ``--attention-core``, the ``default`` that reproduces each run of the profile on its own.
"""

from __future__ import annotations

import argparse
import math
import sys
from pathlib import Path

import numpy as np

sys.path[:0] = [str(Path(__file__).resolve().parents[1]), str(Path(__file__).resolve().parent)]  # this checkout

from bench_moe import MOE_RUNS_FILE  # noqa: E402
from bench_published import TARGET, evaluate, print_table, summary  # noqa: E402
from published import ROOT, load_runs, predict_run  # noqa: E402

from mpipe_tune.cost import dump_profile, load_profile, parse_profile  # noqa: E402

DATE = "2026-12-07"
BF16_NAMES = ("efficiency.default", "efficiency.attention_core", "tp_comm_overlap")
FP8_NAMES = ("efficiency.fp8_linear",)
CURVE_NAMES = {
    "h100-sxm": ("kernel_efficiency.gemm.max", "kernel_efficiency.attention.max", "tp_comm_overlap"),
    "ascend-910b": ("kernel_efficiency.gemm.max", "kernel_efficiency.attention.max", "tp_comm_overlap"),
}
"""What is fitted on a profile with efficiency curves (its ``kernel_efficiency``), in place of
:data:`BF16_NAMES`: the curves' tops and the tensor-parallel overlap. The fit runs are all 6B and larger at 4K-32K
tokens: they do not identify the roll-offs or the host's dispatch cost (fitting ``host.dispatch_s`` and
``kernel_efficiency.gemm.half_dim`` on the 910B's fit runs too drove both to their lower bounds, 0 and 5,
2026-12-07), so those stay as the profile states them (assumed, with the reason) until a microbenchmark of the
device (``mpipe-tune profile``) measures them."""
MOE_NAMES = {"ascend-910b": ("kernel_efficiency.index.max",)}
"""What a profile's MoE fit runs (``published_moe_runs.yaml``'s ``fit`` rows) calibrate, the dense fit held: on the
910B, the top of its index kernels' curve (MindSpeed's all-gather dispatcher's ``index``, ``index_put`` with
accumulation and ``argsort`` on torch_npu), which no dense run exercises."""
CURVE_FROM = {"index": "memory"}
"""The curve a fitted curve the profile lacks starts from (its other numbers kept: the index curve's half_bytes is the
memory curve's)."""
START = {"kernel_efficiency.index.max": 0.5, "efficiency.default": 0.6, "efficiency.attention_core": 0.6, "tp_comm_overlap": 0.5,
         "efficiency.fp8_linear": 0.5, "kernel_efficiency.gemm.max": 0.7, "kernel_efficiency.attention.max": 0.6,
         "host.dispatch_s": 1e-5, "kernel_efficiency.gemm.half_dim": 256}
SCALE = {"host.dispatch_s": 1e-5, "kernel_efficiency.gemm.half_dim": 100}
"""The unit each number is fitted in (the step of the finite differences is 1e-3 of it)."""
UPPER = {"host.dispatch_s": 1e-4, "kernel_efficiency.gemm.half_dim": 2048}
"""Upper bounds other than 1 (the dispatch cost: 100 microseconds; the GEMM roll-off: 2048)."""
LOWER = {"tp_comm_overlap": 0.0, "host.dispatch_s": 0.0, "kernel_efficiency.index.max": 0.01}
"""Lower bounds other than 0.05."""
WHAT = {
    "efficiency.default": "achieved fraction of the dtype's peak of every kernel but the attention core, forward "
                          "and backward",
    "efficiency.attention_core": "achieved fraction of peak of the attention core against its full-square FLOPs (a "
                                 "causal kernel computes about half of them), forward and backward",
    "tp_comm_overlap": "share of the tensor-parallel all-reduce / reduce-scatter / all-gather time hidden behind GEMMs",
    "efficiency.fp8_linear": "achieved fraction of the fp8 peak of the linear layers' GEMMs in an fp8 step (casts and "
                             "scaling included), forward and backward",
    "kernel_efficiency.gemm.max": "the GEMM curve's top (max): the achieved fraction of peak of a large GEMM, forward and "
                                  "backward; the curve's roll-off, tiles and units as shape_ref states",
    "kernel_efficiency.attention.max": "the attention curve's top (max) against the full-square FLOPs the cost model "
                                       "charges (a causal kernel computes about half), forward and backward; half_seq "
                                       "as shape_ref states",
    "kernel_efficiency.gemm.half_dim": "the GEMM curve's roll-off (half_dim): the dimension at which a GEMM runs at "
                                       "half its rate along that dimension",
    "kernel_efficiency.index.max": "the index curve's top (max): the achieved fraction of the memory bandwidth of the "
                                   "MoE dispatcher's data-dependent index kernels (the all-gather dispatcher's row "
                                   "gathers, sorts, zero buffers, casts and index_put with accumulation, forward and "
                                   "backward); half_bytes as the memory curve's",
    "host.dispatch_s": "host seconds to issue one kernel (the framework's operator dispatch, the fused kernels of the "
                       "runs' scripts)",
}


def with_parameters(base: dict, values: dict[str, float], provenance: dict[str, dict] | None = None) -> dict:
    """The profile's JSON form with the named numbers set (provenance: per name, the keys to add)."""
    data = {**base, "efficiency": dict(base["efficiency"])}
    for key in ("kernel_efficiency", "host"):
        if key in base:
            data[key] = {family: dict(entry) for family, entry in base[key].items()}
    for name, value in values.items():
        origin = (provenance or {}).get(name)
        entry = {"value": float(value), **(origin or {"source": "assumed"})}
        if name.startswith("efficiency."):
            data["efficiency"][name.split(".", 1)[1]] = entry
        elif name.startswith("kernel_efficiency."):  # one number of a curve; the curve's provenance names it
            _, family, key = name.split(".")
            if family not in data["kernel_efficiency"]:  # a curve the profile lacks starts as the one it refines
                data["kernel_efficiency"][family] = dict(data["kernel_efficiency"][CURVE_FROM[family]])
            data["kernel_efficiency"][family][key] = float(value)
            if origin:
                data["kernel_efficiency"][family].update(origin)
        elif name.startswith("host."):
            host = data["host"][name.split(".", 1)[1]]
            data["host"][name.split(".", 1)[1]] = {**host, **entry} if origin else {**host, "value": float(value)}
        else:
            data[name] = entry
    return data


TRANSFER_UNITS = {"ascend-910c-cm384": 40, "ascend-910c-cm384-die": 20}
"""Compute units of a profile that takes another's curves where its own differ (the 910C package: two dies of
the 910B's 20 AI cores assumed there)."""


def with_curves(data: dict, source: dict, source_name: str, target: str) -> dict:
    """``data`` with ``source``'s efficiency curves and host costs where it has none, as assumptions taken from
    ``source_name`` (its own compute units where :data:`TRANSFER_UNITS` gives them)."""
    if "kernel_efficiency" not in source:
        return data
    why = (f"assumed: {source_name}'s figure transferred by benchmarks/fit_published.py --transfer, not measured on "
           f"this device ({TRANSFER_REASONS[target]})")
    if "kernel_efficiency" in data:  # the families it lacks (a curve added to the source since)
        missing = {family: {**entry, "source": "assumed", "ref": f"{why}; there: {entry.get('ref', '')}"}
                   for family, entry in source["kernel_efficiency"].items() if family not in data["kernel_efficiency"]}
        for entry in missing.values():
            entry.pop("fit_r2", None)
            entry.pop("citations", None)
        return {**data, "kernel_efficiency": {**data["kernel_efficiency"], **missing}}
    curves = {family: {**entry, "source": "assumed", "ref": f"{why}; there: {entry.get('ref', '')}"}
              for family, entry in source["kernel_efficiency"].items()}
    for family in curves:
        curves[family].pop("fit_r2", None)
        curves[family].pop("citations", None)
    if target in TRANSFER_UNITS:
        curves["gemm"]["units"] = TRANSFER_UNITS[target]
    host = {key: {"value": entry["value"], "source": "assumed", "date": DATE, "ref": f"{why}; there: {entry['ref']}"}
            for key, entry in source["host"].items()}
    return {**data, "kernel_efficiency": curves, "host": host}


def residuals(base: dict, values: dict[str, float], runs) -> np.ndarray:
    profile = parse_profile(with_parameters(base, values), where="fit")
    return np.array([math.log(predict_run(run, profile).timeline.makespan_s / run.step_time_s) for run in runs])


def fit(base: dict, runs, names: tuple[str, ...], fixed: dict[str, float], iterations: int = 12,
        start: dict[str, float] | None = None):
    """Damped Gauss-Newton in [0.05, 1] (overlap: [0, 1]) over ``names``, the ``fixed`` numbers held, from
    ``start`` (default :data:`START`); returns the fitted numbers and the final residuals."""
    scale = np.array([SCALE.get(n, 1.0) for n in names])
    lower = np.array([LOWER.get(n, 0.05) for n in names]) / scale
    upper = np.array([UPPER.get(n, 1.0) for n in names]) / scale
    theta = np.array([(start or START)[n] for n in names]) / scale

    def at(t):
        return {**fixed, **dict(zip(names, t * scale))}

    r = residuals(base, at(theta), runs)
    damping = 1e-3
    for _ in range(iterations):
        jacobian = np.empty((len(runs), len(theta)))
        for k in range(len(theta)):
            step = 1e-3 if theta[k] + 1e-3 <= upper[k] else -1e-3
            moved = theta.copy()
            moved[k] += step
            jacobian[:, k] = (residuals(base, at(moved), runs) - r) / step
        normal, gradient = jacobian.T @ jacobian, jacobian.T @ r
        while True:
            delta = np.linalg.lstsq(normal + damping * np.diag(np.diag(normal) + 1e-12), -gradient, rcond=None)[0]
            candidate = np.clip(theta + delta, lower, upper)
            r_new = residuals(base, at(candidate), runs)
            if r_new @ r_new < r @ r:
                theta, r, damping = candidate, r_new, damping / 3
                break
            damping *= 10
            if damping > 1e6:
                return dict(zip(names, theta * scale)), r
        if np.max(np.abs(delta)) < 1e-5:
            break
    return dict(zip(names, theta * scale)), r


TRANSFER_REASONS = {
    "h200": "same GH100 compute and software stack, this profile's own memory bandwidth and capacity in the roofline",
    "h100-hbm2e-500w": "the same GH100 die and software stack; this profile's own assumed peak (power-limited), "
                       "memory bandwidth and capacity in the roofline; its one published run (torchtitan's 8B FSDP) "
                       "is held out",
    "ascend-910c-cm384": "the 910C package is two dies of the 910B's Da Vinci generation on the same CANN stack; the "
                         "910B fit is an achieved fraction of the 910B's assumed 320e12 bf16 peak, applied here to the "
                         "910C's datasheet 376e12 per die: if the measured 910B SKU's own peak was higher than 320e12, "
                         "this overstates the 910C by that ratio; no published 910C run with its full configuration "
                         "was collected to check it",
    "ascend-910c-cm384-die": "one 910C die is a die of the 910B's Da Vinci generation on the same CANN stack; the "
                             "910B fit is an achieved fraction of the 910B's assumed 320e12 bf16 peak, applied here to "
                             "the 910C die's datasheet 376e12: if the measured 910B SKU's own peak was higher than "
                             "320e12, this overstates the 910C by that ratio; no published 910C run with its full "
                             "configuration was collected to check it",
}
"""Why a profile takes another's fit as an assumption (``--transfer``)."""
PROFILE_NOTES = {
    "ascend-910b": "; the fit runs are every in-scope MindSpeed-LLM 1.0.RC3 Mcore dense run (Atlas 900 A2 PoDc, "
                   "tp 1/2/8, 4K-32K tokens, every row measured with mc2 on), each judged held out by "
                   "leave-one-out (fit_published.py --cross-validate; benchmarks/README.md); the HCCS collectives "
                   "are timed on the node's full mesh (links mesh_links 7, datasheet topology, not fitted); the peak "
                   "(320e12 bf16), memory bandwidth and links stay datasheet figures and assumptions: the runs' 910B "
                   "SKU is not stated (SKUs range ~280-414e12), so the fitted efficiencies absorb a peak that differs "
                   "from 320e12; the loss runs as Megatron core_r0.6.0's fp32 vocab-parallel cross-entropy "
                   "(its passes over the logits counted from megatron/core/tensor_parallel/cross_entropy.py at "
                   "core_v0.6.0 and timed at the memory roofline, not fitted) and RoPE as each run's script has "
                   "MindSpeed apply it (separate kernels without --use-fused-rotary-pos-emb, its fused kernel "
                   "with it; counted from rotary_pos_embedding.py, not fitted); the tensor-parallel overlap share "
                   "fits at its bound 0 because the two Llama 3/3.1 8B runs at tp 8 (17-24% slower than the model "
                   "gives them left out, not explained by any setting in their script) pull it there; Atlas 800T A2 (MindFormers measured one configuration 15% slower "
                   "on it), Legacy model code and MindSpeed's --swap-attention are outside this profile; "
                   "the MoE dispatcher's index kernels have their own curve (kernel_efficiency.index), fitted on "
                   "published_moe_runs.yaml's 1x8 MindSpeed-LLM MoE rows with all of the above held"
}
"""What stays an assumption in a fitted profile, appended to each fitted number's provenance."""
MOE_NOTES = {
    "ascend-910b": "; the fit runs are the single-node (1x8) MoE rows of MindSpeed-LLM's table at d58c5688 (Atlas 900 "
                   "A2 PoDc, mc2 on; MindSpeed 4ea42a23 on Megatron core_r0.6.0, --moe-token-dispatcher-type allgather "
                   "with --moe-permutation-async-comm), the multi-node rows held out (benchmarks/published_moe_runs.yaml, "
                   "bench_moe.py); the dense numbers are held at their own fit; the kernels' traffic is counted from "
                   "MindSpeed's allgather_token_permutation / _unpermutation (cost/_moe.py), so this top is what "
                   "torch_npu's index, index_put (with accumulation into fp32) and argsort achieve on it, and absorbs "
                   "whatever else the dispatcher costs beyond the model (its four syncs a forward are charged at the "
                   "host's assumed sync_s); half_bytes is not identified by the runs",
}
"""What a MoE fit's numbers' provenance adds (in place of :data:`PROFILE_NOTES`)."""


def provenance(names, runs, r: np.ndarray, transferred_from: str | None = None, target: str | None = None,
               note: str | None = None) -> dict[str, dict]:
    steps = np.array([run.step_time_s for run in runs])
    predicted = steps * np.exp(r)
    r2 = 1.0 - float(np.sum((predicted - steps) ** 2) / np.sum((steps - steps.mean()) ** 2))
    citations = sorted({f"{run.suite}: {run.source} ({run.table})" for run in runs})
    runs_text = ", ".join(run.name for run in runs)
    out = {}
    for name in names:
        if transferred_from:
            out[name] = {"source": "assumed", "date": DATE,
                         "ref": f"{WHAT[name]}: the {transferred_from} fit (benchmarks/fit_published.py) transferred, "
                                f"not fitted on this device (no published run with its full configuration collected); "
                                f"{TRANSFER_REASONS[target]}"}
        else:
            out[name] = {"source": "fitted", "date": DATE, "fit_r2": round(r2, 4),
                         "ref": f"{WHAT[name]}: fitted by benchmarks/fit_published.py (log step time, damped "
                                f"Gauss-Newton) to the published measured runs {runs_text}; fit_r2 is of their step "
                                f"times; held-out runs in benchmarks/README.md"
                                f"{PROFILE_NOTES.get(runs[0].profile, '') if note is None else note}",
                         "citations": citations}
    return out


PAIRS = {"ascend-910b": (
    ("mindspeed-glm4-9b-8k@8", "mindspeed-glm4-9b-32k@16"),
    ("mindspeed-chatglm3-6b-8k@8", "mindspeed-chatglm3-6b-32k@8"),
    ("mindspeed-llama2-70b@32", "mindspeed-llama31-70b@32"),
    ("mindspeed-llama2-7b@8", "mindspeed-chatglm3-6b-8k@8"),
)}
"""Per profile, pairs of runs that tell the attention core from the rest: one model at two lengths with its other
settings alike, or two runs of one parallel layout at two lengths."""


def diagnose(name: str, runs, attention_core: float) -> None:
    """Print the pair fits of :data:`PAIRS` and each run's own ``default`` at ``attention_core``."""
    base = load_profile(name).to_dict()
    by_name = {run.name: run for run in runs}
    held = {"tp_comm_overlap": load_profile(name).tp_comm_overlap or 0.0}
    for pair in PAIRS.get(name, ()):
        values, r = fit(base, [by_name[n] for n in pair], BF16_NAMES[:2], held, iterations=30)
        print(f"pair {' + '.join(pair)}: " + ", ".join(f"{n} = {v:.3f}" for n, v in values.items())
              + f"  (max |log error| {float(np.max(np.abs(r))):.3f})")
    for run in (run for run in runs if run.profile == name and run.dtype == "bf16"):
        lo, hi = 0.05, 1.0
        for _ in range(20):  # bisection on the log of predicted over published, which falls as default grows
            mid = math.sqrt(lo * hi)
            r = residuals(base, {**held, "efficiency.attention_core": attention_core, "efficiency.default": mid}, [run])
            lo, hi = (mid, hi) if r[0] > 0 else (lo, mid)
        text = f"{math.sqrt(lo * hi):.3f}" if hi < 1.0 else "above 1"
        print(f"  {run.name:32s} {run.split:8s} tp{run.tp} cp{run.cp} {run.seq_len:6d} tokens: default {text}")


def bf16_names(name: str, base: dict) -> tuple[str, ...]:
    """What the bf16 fit runs calibrate on profile ``name``: :data:`CURVE_NAMES` where it has curves, else
    :data:`BF16_NAMES`."""
    return CURVE_NAMES.get(name, BF16_NAMES) if "kernel_efficiency" in base else BF16_NAMES


def cross_validate(name: str, runs) -> list[tuple[str, float]]:
    """Leave-one-out over the bf16 fit runs of profile ``name``: each predicted from the fit on the others.
    Prints and returns (run name, throughput error) per run."""
    base = load_profile(name).to_dict()
    fit_runs = [run for run in runs if run.split == "fit" and run.dtype == "bf16"]
    names = bf16_names(name, base)
    everything, _ = fit(base, fit_runs, names, {})
    print(f"{name}: fit on all {len(fit_runs)}: " + ", ".join(f"{n} = {v:.4f}" for n, v in everything.items()))
    out = []
    for left in fit_runs:
        values, _ = fit(base, [run for run in fit_runs if run is not left], names, {}, start=everything)
        error = math.exp(-residuals(base, values, [left])[0]) - 1.0
        out.append((left.name, error))
        print(f"  {left.name:32s} left out: throughput error {error:+7.1%}  ("
              + ", ".join(f"{n.split('.')[-1]} {v:.3f}" for n, v in values.items()) + ")")
    within = sum(abs(e) <= TARGET for _, e in out)
    print(f"leave-one-out on {name}: {within} / {len(out)} within {TARGET:.0%}, mean |error| "
          f"{sum(abs(e) for _, e in out) / len(out):.1%}")
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--write", action="store_true", help="write the fitted numbers into profiles/")
    parser.add_argument("--transfer", nargs="*", default=[], help="profiles that take the fit as an assumption")
    parser.add_argument("--profile", nargs="*", default=None, help="fit only these profiles (default: every one "
                                                                    "with fit runs)")
    parser.add_argument("--diagnose", action="store_true", help="fit the pairs of runs in PAIRS alone and give each "
                                                                    "run's own default; write nothing")
    parser.add_argument("--drop", nargs="*", default=[], help="fit without these fit runs (names as the table "
                                                                 "prints them), to see what they pull; not with "
                                                                 "--write")
    parser.add_argument("--cross-validate", action="store_true", help="leave-one-out over the bf16 fit runs of "
                                                                          "--profile (default ascend-910b); write "
                                                                          "nothing")
    parser.add_argument("--attention-core", type=float, default=0.66, help="the attention-core efficiency --diagnose "
                                                                           "gives each run's default at")
    args = parser.parse_args(argv)
    runs = load_runs()
    unknown = sorted(set(args.drop) - {run.name for run in runs if run.split == "fit"})
    if unknown or (args.drop and args.write):
        parser.error(f"--drop takes fit runs' names and no --write; {', '.join(unknown) or '--write'} given")
    runs = [run for run in runs if run.name not in args.drop]
    if args.diagnose:
        for name in args.profile or sorted(PAIRS):
            diagnose(name, runs, args.attention_core)
        return 0
    if args.cross_validate:
        for name in args.profile or ["ascend-910b"]:
            cross_validate(name, [run for run in runs if run.profile == name and not run.excluded])
        return 0
    for name in sorted({run.profile for run in runs if run.split == "fit"}):
        if args.profile is not None and name not in args.profile:
            continue
        base = load_profile(name).to_dict()
        fitted, notes = {}, {}
        for dtype, names in (("bf16", bf16_names(name, base)), ("fp8", FP8_NAMES)):
            fit_runs = [run for run in runs if run.profile == name and run.split == "fit" and run.dtype == dtype
                        and not run.excluded]
            if not fit_runs:
                continue
            values, r = fit(base, fit_runs, names, fitted)
            fitted.update(values)
            notes[dtype] = (names, fit_runs, r, None)
            print(f"{name} {dtype}: " + ", ".join(f"{n} = {v:.4f}" for n, v in values.items())
                  + f"  (fit runs {len(fit_runs)}, rms log error {math.sqrt(float(np.mean(r ** 2))):.4f})")
        moe_runs = [run for run in load_runs(MOE_RUNS_FILE) if run.profile == name and not run.excluded]
        moe_fit = [run for run in moe_runs if run.split == "fit"]
        if name in MOE_NAMES and moe_fit:
            values, r = fit(base, moe_fit, MOE_NAMES[name], fitted)
            fitted.update(values)
            notes["moe"] = (MOE_NAMES[name], moe_fit, r, MOE_NOTES[name])
            print(f"{name} MoE: " + ", ".join(f"{n} = {v:.4f}" for n, v in values.items())
                  + f"  (fit runs {len(moe_fit)}, rms log error {math.sqrt(float(np.mean(r ** 2))):.4f})")
            for run, ratio in zip(moe_runs, np.exp(residuals(base, fitted, moe_runs))):
                print(f"  {run.name:36s} {run.split:8s} predicted / published {ratio:.3f}")
        if args.write:
            origin = {k: v for names, fit_runs, r, note in notes.values()
                      for k, v in provenance(names, fit_runs, r, note=note).items()}
            path = ROOT / "profiles" / f"{name}.json"
            dump_profile(parse_profile(with_parameters(base, fitted, origin), where=str(path)), path)
            for other in args.transfer:
                moved = {k: v for names, fit_runs, r, _ in notes.values()
                         for k, v in provenance(names, fit_runs, r, transferred_from=name, target=other).items()}
                target = ROOT / "profiles" / f"{other}.json"
                data = with_curves(load_profile(other).to_dict(), load_profile(name).to_dict(), name, other)
                data = with_parameters(data, fitted, moved)
                dump_profile(parse_profile(data, where=str(target)), target)
                print(f"  transferred to {other} (source: assumed)")
        profile = parse_profile(with_parameters(base, fitted), where="fit")
        rows = evaluate([run for run in runs if run.profile == name], None, {name: profile})
        print_table(rows, summary(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
