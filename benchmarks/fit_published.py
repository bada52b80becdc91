"""Calibrate the shipped accelerator profiles on the published runs marked ``fit``; report the rest.

For each profile that has fit runs in ``published_runs.yaml`` (h100-sxm), three numbers are fitted by
damped Gauss-Newton on the log of predicted over published step time (bf16 fit runs only):

- ``efficiency.default``: achieved fraction of peak of every kernel but the attention core (the
  matmuls, which are almost all of a layer's FLOPs);
- ``efficiency.attention_core``: the attention core's, against the full-square FLOPs the cost model
  charges (a causal kernel skips about half of them, so this can reach 1 where the kernel reaches ~50%);
- ``tp_comm_overlap``: the share of tensor-parallel collective time hidden behind GEMMs.

Forward and backward get the same efficiency: published step times do not separate the two phases
(the profiler's own calibration, ``mpipe-tune profile``, fits them apart on a device). Per-call
overheads are left at 0: at these sizes a layer call lasts milliseconds. The fitted numbers are
written into the profile with ``source: measured``, the fit runs and their citations in the entries'
provenance. Profiles without published runs get the same numbers only where stated
(``--transfer h200``: same GH100 compute die and software stack; its own HBM3e bandwidth and capacity
stay in the roofline), marked ``source: assumed``; the Ascend profiles stay at their datasheet peaks.

    python benchmarks/fit_published.py            # fit and print, write nothing
    python benchmarks/fit_published.py --write --transfer h200
"""

from __future__ import annotations

import argparse
import math
import sys
from pathlib import Path

import numpy as np

sys.path[:0] = [str(Path(__file__).resolve().parents[1]), str(Path(__file__).resolve().parent)]  # this checkout

from bench_published import evaluate, print_table, summary  # noqa: E402
from published import ROOT, load_runs, predict_run  # noqa: E402

from mpipe_tune.cost.profile import dump_profile, load_profile, parse_profile  # noqa: E402

DATE = "2026-12-01"
NAMES = ("efficiency.default", "efficiency.attention_core", "tp_comm_overlap")
LOWER = np.array([0.05, 0.05, 0.0])
UPPER = np.array([1.0, 1.0, 1.0])


def with_parameters(base: dict, theta: np.ndarray, provenance: dict[str, dict] | None = None) -> dict:
    """The profile's JSON form with the three fitted numbers set (provenance: per name, the keys to add)."""
    data = {**base, "efficiency": dict(base["efficiency"])}
    extra = provenance or {}
    data["efficiency"]["default"] = {"value": float(theta[0]), **extra.get(NAMES[0], {"source": "assumed"})}
    data["efficiency"]["attention_core"] = {"value": float(theta[1]), **extra.get(NAMES[1], {"source": "assumed"})}
    data["tp_comm_overlap"] = {"value": float(theta[2]), **extra.get(NAMES[2], {"source": "assumed"})}
    return data


def residuals(base: dict, theta: np.ndarray, runs) -> np.ndarray:
    profile = parse_profile(with_parameters(base, theta), where="fit")
    return np.array([math.log(predict_run(run, profile).timeline.makespan_s / run.step_time_s) for run in runs])


def fit(base: dict, runs, iterations: int = 12) -> tuple[np.ndarray, np.ndarray]:
    """Damped Gauss-Newton in the box [LOWER, UPPER]; returns the parameters and the final residuals."""
    theta = np.array([0.6, 0.6, 0.5])
    r = residuals(base, theta, runs)
    damping = 1e-3
    for _ in range(iterations):
        jacobian = np.empty((len(runs), len(theta)))
        for k in range(len(theta)):
            step = 1e-3 if theta[k] + 1e-3 <= UPPER[k] else -1e-3
            moved = theta.copy()
            moved[k] += step
            jacobian[:, k] = (residuals(base, moved, runs) - r) / step
        normal = jacobian.T @ jacobian
        gradient = jacobian.T @ r
        while True:
            delta = np.linalg.lstsq(normal + damping * np.diag(np.diag(normal) + 1e-12), -gradient, rcond=None)[0]
            candidate = np.clip(theta + delta, LOWER, UPPER)
            r_new = residuals(base, candidate, runs)
            if r_new @ r_new < r @ r:
                theta, r, damping = candidate, r_new, damping / 3
                break
            damping *= 10
            if damping > 1e6:
                return theta, r
        if np.max(np.abs(delta)) < 1e-5:
            break
    return theta, r


def provenance(runs, r: np.ndarray, transferred_from: str | None = None) -> dict[str, dict]:
    steps = np.array([run.step_time_s for run in runs])
    predicted = steps * np.exp(r)
    r2 = 1.0 - float(np.sum((predicted - steps) ** 2) / np.sum((steps - steps.mean()) ** 2))
    citations = sorted({f"{run.suite}: {run.source} ({run.table})" for run in runs})
    what = {
        NAMES[0]: "achieved fraction of the dtype's peak of every kernel but the attention core, forward and backward",
        NAMES[1]: "achieved fraction of peak of the attention core against its full-square FLOPs (a causal kernel "
                  "computes about half of them), forward and backward",
        NAMES[2]: "share of the tensor-parallel all-reduce / reduce-scatter / all-gather time hidden behind GEMMs",
    }
    runs_text = ", ".join(run.name for run in runs)
    out = {}
    for name in NAMES:
        if transferred_from:
            out[name] = {"source": "assumed", "date": DATE,
                         "ref": f"{what[name]}: the {transferred_from} fit (benchmarks/fit_published.py) transferred, "
                                f"not fitted on this device (no published run with its full configuration collected); "
                                f"same GH100 compute and software stack, this profile's own memory bandwidth and "
                                f"capacity in the roofline"}
        else:
            out[name] = {"source": "measured", "date": DATE, "fit_r2": round(r2, 4),
                         "ref": f"{what[name]}: fitted by benchmarks/fit_published.py (log step time, damped "
                                f"Gauss-Newton) to the published measured bf16 runs {runs_text}; fit_r2 is of step "
                                f"times; held-out runs in benchmarks/README.md",
                         "citations": citations}
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--write", action="store_true", help="write the fitted numbers into profiles/")
    parser.add_argument("--transfer", nargs="*", default=[], help="profiles that take the fit as an assumption")
    args = parser.parse_args(argv)
    runs = load_runs()
    for name in sorted({run.profile for run in runs if run.split == "fit"}):
        fit_runs = [run for run in runs if run.profile == name and run.split == "fit" and run.dtype == "bf16"]
        base = load_profile(name).to_dict()
        theta, r = fit(base, fit_runs)
        print(f"{name}: " + ", ".join(f"{n} = {v:.4f}" for n, v in zip(NAMES, theta))
              + f"  (fit runs {len(fit_runs)}, rms log error {math.sqrt(float(np.mean(r ** 2))):.4f})")
        if args.write:
            path = ROOT / "profiles" / f"{name}.json"
            dump_profile(parse_profile(with_parameters(base, theta, provenance(fit_runs, r)), where=str(path)), path)
            for other in args.transfer:
                target = ROOT / "profiles" / f"{other}.json"
                data = with_parameters(load_profile(other).to_dict(), theta, provenance(fit_runs, r, name))
                dump_profile(parse_profile(data, where=str(target)), target)
                print(f"  transferred to {other} (source: assumed)")
        fitted = parse_profile(with_parameters(base, theta), where="fit")
        rows = evaluate([run for run in runs if run.profile == name], None, {name: fitted})
        print_table(rows, summary(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
