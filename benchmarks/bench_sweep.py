"""The encoder-to-bubble sweep: where ``<transpose, 1f1b>`` pays, by encoder share and pipeline depth.

The study the paper leaves to future work (its section 5: "a sweep that isolates scale and the
resulting encoder-to-bubble ratio"). For every configuration (backbone, ViT, images per sample) and
pipeline degree ``P`` it predicts, with the planner's own machinery (:class:`Problem`,
:class:`SearchSpace`, :class:`Evaluator`, :func:`evaluate_baselines`, :func:`search_family`):

- **the best transpose plan**: ``<transpose,1f1b>`` cut before the backbone, at ``pp = P`` and the
  group's fixed ``tp`` (``dp = 1``), the fastest that fits memory over every microbatch count the
  space allows and owner policies ``greedy`` and ``optimal`` (``optimal`` only where the space
  offers it: ``M <= 12`` and ``P <= 16``). Not a full search (no other skeletons, cuts or degrees):
  the best transpose plan over owner policies and microbatch counts is what the question asks;
- **each baseline at its own best layout at the same degrees** (:func:`search_family`, the
  ``@own`` rows of ``mpipe-tune plan``: the fastest microbatch count that fits memory), whose
  speedups colour the heat map: ``megatron`` (encoder and projector in stage 0, backbone split
  evenly by layer count) and ``disttrain`` (encoder and projector alone on stage 0);
- the baselines at the transpose plan's own microbatch count (:func:`evaluate_baselines`, the rows
  of ``mpipe-tune plan``'s table, fitting or not), recorded in the JSON beside them.

Recomputation: ``--recompute on`` (the default) gives every plan full activation recomputation, the
one memory policy under which these plans fit the 910C (as in ``bench_paper_configs.py``), so a
speedup compares schedules and not memory policies; ``--recompute search`` lets every plan, the
transpose and each baseline, take it or not (the fastest that fits wins).

**Encoder share** (the y axis): of one step's compute seconds, the share spent in the layers the
transpose moves (encoder and projector, everything before the first backbone layer), forward plus
backward, read off the cost model's layer table: ``sum(w[:b]) / sum(w)`` with ``w`` =
:func:`mpipe_tune.cost._predict.layer_weights` (per layer, mean forward + backward seconds per
microbatch) of the step's global batch, one sequence per microbatch, at the group's ``tp``, ``dp = 1``,
no recomputation. It depends on the configuration only, not on ``P`` or the plan.

**Encoder-to-slack ratio** (in the JSON, per point): ``sum_m encode_m / sum_r w_r`` of the best plan,
the encodes' forward seconds over the warmup slack ``w_r`` the cost model reads off the same plan
without encoder work (:meth:`Evaluator.encode_s`, :meth:`Evaluator.slack_s`); the spill is
``max_r max(0, E_r - w_r)``.

Measured points: for a few (configuration, P) the best plan and the baselines' own best layouts are
written as one plan file with the planner's ``plan_record`` (as ``mpipe-tune plan`` writes it) and run with
``mpipe-tune bench PLAN --compute emulated --rounds 1 --steps 2`` (each compute event waits its
predicted duration on the real executor, transfers are real gloo messages): the measured speedups
are placed on the heat map.

    python benchmarks/bench_sweep.py                  # sweep + measured points (about 6 minutes), PNG and JSON
    python benchmarks/bench_sweep.py --no-measure     # predictions only (about 1.5 minutes)
    python benchmarks/bench_sweep.py --replot benchmarks/sweep-results.json   # table and PNG from the record
"""

from __future__ import annotations

import argparse
import json
import platform
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import yaml

from mpipe_tune.cost import build_layer_table, layer_weights
from mpipe_tune.inputs import Mix, Workload, sample_workload
from mpipe_tune.errors import MpipeError
from mpipe_tune.plan_file import PlanInputs, dump_plan, plan_record, plan_section
from mpipe_tune.search import Candidate, Evaluator, Problem, SearchSpace, SpaceOptions, evaluate_baselines
from mpipe_tune.plan_file import OWN
from mpipe_tune.search import search_family
from mpipe_tune.cost import load_profile
from mpipe_tune.inputs import load_model

HERE = Path(__file__).resolve().parent
PROFILE = "ascend-910c-cm384"
"""The paper's hardware (CloudMatrix384 Ascend 910C datasheet profile, 119 GiB per device); bf16."""
PIPELINE_DEGREES = (2, 4, 8, 16, 32, 64)
IMAGE_COUNTS = (0, 1, 2, 3, 4)
RESOLUTIONS = ((448, 448, 1 / 3), (768, 1024, 1 / 3), (1080, 1920, 1 / 3))
"""Per image, one of three sizes (256, about 1,000 and 1,280 tokens after Qwen2-VL's resize), +-10% per side."""
SEQ_LEN = 8192
SEED = 0
BASELINE_NAMES = ("megatron", "disttrain")
PAPER = (
    dict(name="8 devices vs Megatron-LM", speedup=2.70, baseline="megatron", devices=8,
         setting="Qwen3.5 MLLM on CapsFusion, 8 Ascend devices"),
    dict(name="512 devices vs DistTrain-like", speedup=1.21, baseline="disttrain", devices=512,
         setting="Qwen2-VL ViT + DeepSeek-V3, 512 x Ascend 910C, internal dataset"),
)


@dataclass(frozen=True)
class Group:
    """A backbone swept over ``P`` at a fixed tensor-parallel degree and global batch (``dp = 1``)."""

    backbone: str
    """A built-in language model."""
    hidden: int
    """Its width, what the projector maps to."""
    tp: int
    global_batch: int
    """Sequences of ``SEQ_LEN`` tokens per step, the same for every ``P``."""
    vits: tuple[str, ...]


GROUPS = (
    Group("llama3-8b", 4096, tp=1, global_batch=32, vits=("siglip-so400m", "qwen2-vl-vit", "vit-2b")),
    Group("llama3-70b", 8192, tp=8, global_batch=64, vits=("siglip-so400m", "qwen2-vl-vit", "vit-2b", "vit-6b")),
)
"""llama3-8b (34 backbone layers: P <= 32) at tp = 1, devices = P, so P = 8 is the paper's small
setting; llama3-70b (82 layers) at tp = 8, devices = 8 P, so P = 64 is its 512 devices. A 6B ViT
replicated on every rank does not fit one 910C beside an 8B backbone share at tp = 1: not swept there."""


def scaled_vit(hidden: int, heads: int, ffn: int, blocks: int) -> list[dict]:
    """Qwen2-VL's ViT layout (patch embedding, pre-LN blocks, 2x2 merger to 3584) at another size."""
    common = dict(block="encoder", hidden=hidden, merge_factor=4)
    return [
        dict(name="patch_embed", kind="patch_embed", patch_size=14, temporal_patch=2, in_channels=3, **common),
        dict(name="vit", kind="vit_block", repeat=blocks, heads=heads, ffn=ffn, activation="gelu", **common),
        dict(name="merger", kind="merger", out_hidden=3584, **common),
    ]


VITS = {
    # name: (compose entry, output width, what it is)
    "siglip-so400m": ("siglip-so400m", 1152, "built-in, 0.4B, no merge: one image token is one patch"),
    "qwen2-vl-vit": ("qwen2-vl-vit", 3584, "built-in, 0.68B, 2x2 merge"),
    "vit-2b": ({"layers": scaled_vit(2048, 16, 8192, 40)}, 3584,
               "Qwen2-VL's ViT scaled to 2.0B: width 2048, 40 blocks, 16 heads, ffn 8192"),
    "vit-6b": ({"layers": scaled_vit(4096, 32, 16384, 32)}, 3584,
               "Qwen2-VL's ViT scaled to 6.4B: width 4096, 32 blocks, 32 heads, ffn 16384"),
}


@dataclass(frozen=True)
class Config:
    group: Group
    vit: str
    images: int
    """Images per sample (every sample has exactly this many; 0: text only)."""

    @property
    def model_name(self) -> str:
        return f"sweep-{self.vit}-{self.group.backbone}"

    @property
    def label(self) -> str:
        return "text only" if self.images == 0 else f"{self.vit}, {self.images} img"

    def model_dict(self) -> dict:
        entry, width, _ = VITS[self.vit]
        projector = {"name": "projector", "block": "projector", "kind": "projector", "in_hidden": width,
                     "hidden": self.group.hidden}
        return {"name": self.model_name, "compose": [entry, {"layers": [projector]}, self.group.backbone]}

    def mix(self) -> Mix:
        k = self.images
        return Mix(f"img{k}", f"{k} images per sample", text_only_share=1.0 if k == 0 else 0.0,
                   images_per_sample=((max(k, 1), 1.0),), resolutions=RESOLUTIONS, samples_per_microbatch=1,
                   seq_len=SEQ_LEN, jitter=0.1)

    def workload(self) -> Workload:
        return sample_workload(self.mix(), self.group.global_batch, SEED)


def configurations() -> list[Config]:
    out = []
    for group in GROUPS:
        out.append(Config(group, "qwen2-vl-vit", 0))
        out += [Config(group, vit, k) for vit in group.vits for k in IMAGE_COUNTS if k > 0]
    return out


def write_model(config: Config, folder: Path) -> Path:
    """The configuration's model as a YAML file (``compose``), so plan files name a spec the runner loads."""
    path = folder / f"{config.model_name}.yaml"
    if not path.exists():
        path.write_text(yaml.safe_dump(config.model_dict(), sort_keys=False), encoding="utf-8")
    return path


# ------------------------------------------------------------------------------------ predictions

def encoder_share(problem: Problem, tp: int) -> float:
    """The layers before the backbone's share of all layers' forward + backward seconds (module docstring)."""
    workload = Workload(problem.sequences(0, problem.global_batch), "share")
    table = build_layer_table(problem.model, workload, problem.profile, problem.options_for(tp, 1))
    weights = np.array(layer_weights(problem.model, table))
    return float(weights[:problem.model.backbone_start].sum() / weights.sum())


RECOMPUTE = {"on": (True,), "search": (False, True)}
"""The recomputation settings the plans may take, by ``--recompute`` value."""


def space_for(problem: Problem, evaluator: Evaluator, pp: int, tp: int, recompute: tuple[bool, ...]) -> SearchSpace:
    options = SpaceOptions(skeletons=("1f1b",), max_chunks=1, cut_window=0, owner_policies=("greedy", "optimal"),
                           recompute=recompute, pp=(pp,), tp=(tp,), dp=(1,))
    return SearchSpace(problem, evaluator.reference_weights(), options)


def best_transpose(space: SearchSpace, evaluator: Evaluator):
    """The fastest ``<transpose,1f1b>`` cut before the backbone that fits (else the fastest; None
    where the space has none), and how many candidates were predicted."""
    seam = space.problem.model.backbone_start
    evaluations = []
    for _, c in space.enumerate():
        if c.schedule == "transpose,1f1b" and c.cut == (seam,):
            try:
                evaluations.append(evaluator.evaluate(c))
            except MpipeError:  # optimal owners beyond the branch and bound's node limit
                continue
    if not evaluations:
        return None, 0
    fitting = [e for e in evaluations if e.fits]
    return min(fitting or evaluations, key=lambda e: e.mean_s), len(evaluations)


def _plan_entry(e, best=None) -> dict:
    entry = {"candidate": e.candidate.to_dict(), "step_s": e.mean_s, "peak_gib": e.peak_bytes / 2**30, "fits": e.fits}
    if best is not None:
        entry["speedup"] = e.mean_s / best.mean_s
    return entry


def sweep_point(config: Config, model, workload: Workload, profile, pp: int, recompute: tuple[bool, ...]) -> dict:
    group = config.group
    problem = Problem(model, profile, pp * group.tp, group.global_batch, workload=workload)
    evaluator = Evaluator(problem)
    point = {"backbone": group.backbone, "config": config.label, "vit": config.vit, "images": config.images,
             "pp": pp, "tp": group.tp, "dp": 1, "devices": pp * group.tp}
    try:
        space = space_for(problem, evaluator, pp, group.tp, recompute)
    except MpipeError as error:  # no (pp, tp, dp) gives a plan
        return {**point, "error": str(error)}
    best, num_candidates = best_transpose(space, evaluator)
    if best is None:
        layers = model.num_layers - model.backbone_start
        return {**point, "error": f"no <transpose,1f1b> layout: the backbone's {layers} layers are fewer than {pp} stages"}
    encode = float(np.sum(evaluator.encode_s(best.candidate, 0)))
    slack = float(np.sum(evaluator.slack_s(best.candidate, 0)))
    point.update(best=_plan_entry(best), candidates=num_candidates, bubble_share=best.bubble_share,
                 max_spill_s=best.max_spill_s, encode_s=encode, slack_s=slack,
                 encoder_to_slack=encode / slack if slack > 0 else None)
    at_best = dict(evaluate_baselines(evaluator, space, best))
    point["baselines"] = {}
    for name in BASELINE_NAMES:
        family = search_family(name, space, evaluator).best
        point["baselines"][name] = {
            "own_best": None if family is None else _plan_entry(family, best),
            "at_best_settings": None if at_best[name] is None else _plan_entry(at_best[name], best),
        }
    point["other_baselines_at_best_settings"] = {  # step times only
        name: None if e is None else {k: v for k, v in _plan_entry(e, best).items() if k != "candidate"}
        for name, e in at_best.items() if name not in BASELINE_NAMES}
    return point


def speedup(point: dict | None, name: str) -> float | None:
    """The best transpose plan's speedup over baseline ``name`` at its own best layout (the heat
    map's colour); None where there is no transpose plan or no layout of the baseline fits."""
    if point is None or "best" not in point or point["baselines"][name]["own_best"] is None:
        return None
    return point["baselines"][name]["own_best"]["speedup"]


def run_sweep(recompute: tuple[bool, ...]) -> tuple[list[dict], list[dict]]:
    profile = load_profile(PROFILE)
    rows, points = [], []
    with tempfile.TemporaryDirectory() as folder:
        for config in configurations():
            model = load_model(write_model(config, Path(folder)))
            workload = config.workload()
            problem = Problem(model, profile, config.group.tp, config.group.global_batch, workload=workload)
            share = encoder_share(problem, config.group.tp)
            image_tokens = [mb.image_tokens for mb in workload.microbatches]
            rows.append({"config": config.label, "backbone": config.group.backbone, "vit": config.vit,
                         "vit_description": VITS[config.vit][2], "images": config.images, "tp": config.group.tp,
                         "global_batch": config.group.global_batch, "encoder_share": share,
                         "image_tokens_per_sequence": float(np.mean(image_tokens))})
            start = time.perf_counter()
            for pp in PIPELINE_DEGREES:
                points.append({**sweep_point(config, model, workload, profile, pp, recompute), "encoder_share": share})
            print(f"{config.group.backbone:<10} {config.label:<24} share {share:6.1%}  "
                  f"{time.perf_counter() - start:5.1f} s", file=sys.stderr, flush=True)
    return rows, points


# --------------------------------------------------------------------------------- measured points

def nearest_paper(points: list[dict]) -> list[dict]:
    """Per paper result, the sweep point at its device count whose predicted speedup over its
    baseline (:func:`speedup`) is nearest, among points where the transpose plan fits memory."""
    out = []
    for paper in PAPER:
        name = paper["baseline"]
        pool = [p for p in points if p["devices"] == paper["devices"] and speedup(p, name) is not None
                and p["best"]["fits"]]
        if not pool:
            out.append({**paper, "point": None})
            continue
        p = min(pool, key=lambda p: abs(speedup(p, name) - paper["speedup"]))
        same = p["baselines"][name]["at_best_settings"]
        out.append({**paper, "point": {k: p[k] for k in ("backbone", "config", "pp", "tp", "devices", "encoder_share")},
                    "predicted": speedup(p, name), "predicted_at_best_settings": same and same["speedup"],
                    "at_best_settings_fits": same and same["fits"]})
    return out


def measured_choices(points: list[dict], paper: list[dict]) -> list[tuple[str, str, int]]:
    """(backbone, config, P) to run: the highest-share configuration of the tp = 1 group whose
    transpose plan and Megatron-style baseline fit at P = 2, 4 and 8 (no DistTrain-like layout fits
    at P = 2: it holds the whole backbone on one device), at those three P; and the point nearest
    the paper's 8-device result, if it is another."""
    degrees = (2, 4, 8)
    by_key = {(p["backbone"], p["config"], p["pp"]): p for p in points}
    group = GROUPS[0]
    rows = sorted({(p["config"], p["encoder_share"]) for p in points if p["backbone"] == group.backbone},
                  key=lambda r: -r[1])
    label = next(label for label, _ in rows
                 if all(by_key[(group.backbone, label, pp)]["best"]["fits"]
                        and speedup(by_key[(group.backbone, label, pp)], "megatron") is not None for pp in degrees))
    chosen = [(group.backbone, label, pp) for pp in degrees]
    small = paper[0]["point"]
    if small is not None and (small["backbone"], small["config"], small["pp"]) not in chosen:
        chosen.append((small["backbone"], small["config"], small["pp"]))
    return chosen


def measure(points: list[dict], choices: list[tuple[str, str, int]]) -> list[dict]:
    """Write each chosen point's best plan and the baselines' own best layouts (those that fit) with
    ``plan_record`` (as ``mpipe-tune plan`` does) and run ``mpipe-tune bench --compute emulated`` on them."""
    profile = load_profile(PROFILE)
    by_key = {(c.group.backbone, c.label): c for c in configurations()}
    out = []
    with tempfile.TemporaryDirectory() as folder:
        for backbone, label, pp in choices:
            config = by_key[(backbone, label)]
            point = next(p for p in points if (p["backbone"], p["config"], p["pp"]) == (backbone, label, pp))
            model_path = write_model(config, Path(folder))
            model = load_model(model_path)
            problem = Problem(model, profile, pp * config.group.tp, config.group.global_batch,
                              workload=config.workload())
            evaluator = Evaluator(problem)

            def section(candidate: dict) -> dict:
                c = Candidate.from_dict(candidate)
                prediction, workload = evaluator.prediction(c)
                return plan_section(prediction, workload)

            best = Candidate.from_dict(point["best"]["candidate"])
            prediction, workload = evaluator.prediction(best)
            entries = point["baselines"]
            names = [n for n in BASELINE_NAMES if entries[n]["own_best"] is not None]
            record = plan_record(
                prediction, model, workload, profile, PlanInputs(str(model_path), (), PROFILE),
                baselines={n: section(entries[n]["at_best_settings"]["candidate"]) for n in BASELINE_NAMES
                           if entries[n]["at_best_settings"] is not None},
                alternatives={n + OWN: section(entries[n]["own_best"]["candidate"]) for n in names})
            plan_path = Path(folder) / f"{config.model_name}-{config.images}img-p{pp}.json"
            dump_plan(record, plan_path)
            command = ["bench", str(plan_path), "--compute", "emulated", "--plans", ",".join(["best", *(n + OWN for n in names)]),
                       "--rounds", "1", "--steps", "2", "--json"]
            start = time.perf_counter()
            proc = subprocess.run([sys.executable, "-m", "mpipe_tune.cli", *command], capture_output=True, text=True)
            wall = time.perf_counter() - start
            if proc.returncode != 0:
                raise SystemExit(f"mpipe-tune {' '.join(command)} failed:\n{proc.stderr}")
            bench = {p["name"]: p for p in json.loads(proc.stdout)["plans"]}
            ratio = {kind: {n: bench[n + OWN][f"{kind}_step_s"] / bench["best"][f"{kind}_step_s"] if n in names else None
                            for n in BASELINE_NAMES} for kind in ("predicted", "measured")}
            out.append({"backbone": backbone, "config": label, "pp": pp, "wall_s": wall,
                        "steps_s": {n: {"predicted": bench[n]["predicted_step_s"], "measured": bench[n]["measured_step_s"]}
                                    for n in bench},
                        "speedup_predicted": ratio["predicted"], "speedup_measured": ratio["measured"]})
            print(f"measured {backbone} {label} P={pp}: "
                  + ", ".join(f"over {n} {ratio['measured'][n]:.2f}x (predicted {ratio['predicted'][n]:.2f}x)"
                              for n in names) + f", {wall:.0f} s", file=sys.stderr, flush=True)
    return out


# ---------------------------------------------------------------------------------- table and plot

NO_FIT = "n/f"
"""A cell whose baseline has no layout that fits memory at these degrees."""


def _value(p: dict, name: str) -> str:
    value = speedup(p, name)
    return NO_FIT if value is None else f"{value:.2f}"


def _cell(p: dict | None) -> str:
    if p is None or "best" not in p:
        return "-"
    return " / ".join(_value(p, n) for n in BASELINE_NAMES) + ("" if p["best"]["fits"] else " !")


def table(record: dict) -> str:
    points = {(p["backbone"], p["config"], p["pp"]): p for p in record["points"]}
    lines = [f"| backbone, tp | configuration | encoder share | {' | '.join(f'P={pp}' for pp in PIPELINE_DEGREES)} |",
             "|---|---|---:|" + "---|" * len(PIPELINE_DEGREES)]
    for row in sorted(record["configs"], key=lambda r: (r["tp"], r["encoder_share"])):
        cells = [_cell(points.get((row["backbone"], row["config"], pp))) for pp in PIPELINE_DEGREES]
        lines.append(f"| {row['backbone']}, tp {row['tp']} | {row['config']} | {row['encoder_share']:.1%} | "
                     f"{' | '.join(cells)} |")
    return "\n".join(lines)


REAL_BASELINES = {"megatron": "1f1b megatron-slabs M=4", "disttrain": "1f1b disttrain-slabs M=4"}
"""The fidelity benchmark's plans that are the two baselines' layouts at P = 2 (real compute)."""


def real_point(fidelity: dict) -> dict | None:
    """The real-compute point at P = 2 from ``bench_fidelity.py``'s record: the fastest predicted
    ``transpose,1f1b`` plan at pp 2 (tp = dp = 1, trainable encoder, as the baselines') against the Megatron-style and DistTrain-like slabs,
    predicted and measured (median of each plan's steps after each run's first)."""
    from bench_fidelity import measured_s, predicted_s

    if "encoder_share" not in fidelity:  # a record from before the probe and the raw runs (issue 14)
        return None
    plans = {r["label"]: r for r in fidelity.get("plans", []) if r["tp"] == 1 and r["dp"] == 1}
    transposes = [r for r in plans.values() if r["schedule"] == "transpose,1f1b" and not r.get("frozen_encoder")]
    if not transposes or not all(label in plans for label in REAL_BASELINES.values()):
        return None
    best = min(transposes, key=predicted_s)
    out = {"config": f"{Path(fidelity['model']).stem}, this CPU, real compute", "pp": fidelity["pp"],
           "encoder_share": fidelity["encoder_share"], "best": best["label"], "date": fidelity["date"],
           "speedup_predicted": {}, "speedup_measured": {}}
    for name, label in REAL_BASELINES.items():
        out["speedup_predicted"][name] = predicted_s(plans[label]) / predicted_s(best)
        out["speedup_measured"][name] = measured_s(plans[label]["runs"]) / measured_s(best["runs"])
    return out


def plot(record: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.colors import LogNorm

    rows = sorted(record["configs"], key=lambda r: (-r["tp"], r["encoder_share"]))  # tp 8 group at the bottom
    points = {(p["backbone"], p["config"], p["pp"]): p for p in record["points"]}
    measured = {(m["backbone"], m["config"], m["pp"]): m for m in record.get("measured", [])}
    paper = {(n["point"]["backbone"], n["point"]["config"], n["point"]["pp"], n["baseline"]): n
             for n in record.get("paper_nearest", []) if n.get("point")}
    values = [v for p in record["points"] for n in BASELINE_NAMES if (v := speedup(p, n)) is not None]
    norm = LogNorm(vmin=min(0.75, min(values)), vmax=max(values))
    cmap = matplotlib.colormaps["viridis"].with_extremes(bad="0.88")
    real = record.get("real")
    fig, axes = plt.subplots(1, 2, figsize=(15, 0.3 * (len(rows) + bool(real)) + 1.6), sharey=True,
                             layout="constrained")
    for ax, name in zip(axes, BASELINE_NAMES):
        grid = np.array([[np.nan if (v := speedup(points.get((r["backbone"], r["config"], pp)), name)) is None else v
                          for pp in PIPELINE_DEGREES] for r in rows])
        if real:  # one more row on top: the real-compute point at P = 2 on this machine
            grid = np.vstack([grid, [real["speedup_predicted"][name] if pp == real["pp"] else np.nan
                                     for pp in PIPELINE_DEGREES]])
            j = PIPELINE_DEGREES.index(real["pp"])
            ax.add_patch(plt.Rectangle((j - 0.47, len(rows) - 0.45), 0.94, 0.9, fill=False, ec="red", lw=1.8))
            dark = norm(real["speedup_predicted"][name]) < 0.55
            ax.text(j, len(rows), f"{real['speedup_predicted'][name]:.2f}  m {real['speedup_measured'][name]:.2f}",
                    ha="center", va="center", fontsize=6.5, color="white" if dark else "black")
            ax.axhline(len(rows) - 0.5, color="black", lw=2)
        image = ax.imshow(grid, cmap=cmap, norm=norm, aspect="auto", origin="lower")
        for i, row in enumerate(rows):
            for j, pp in enumerate(PIPELINE_DEGREES):
                key = (row["backbone"], row["config"], pp)
                p = points.get(key)
                if p is None or "best" not in p:
                    ax.text(j, i, "no layout", ha="center", va="center", fontsize=6, color="0.35")
                    continue
                text = _value(p, name)
                dark = not np.isnan(grid[i, j]) and norm(grid[i, j]) < 0.55
                if key in measured:
                    value = measured[key]["speedup_measured"][name]
                    text += "" if value is None else f"  m {value:.2f}"
                    ax.add_patch(plt.Rectangle((j - 0.47, i - 0.45), 0.94, 0.9, fill=False, ec="red", lw=1.8))
                if not p["best"]["fits"]:
                    ax.add_patch(plt.Rectangle((j - 0.5, i - 0.5), 1, 1, fill=False, hatch="////", ec="0.5", lw=0))
                if key + (name,) in paper:
                    ax.plot(j - 0.4, i, marker="*", color="orange", markersize=10, markeredgecolor="black")
                ax.text(j, i, text, ha="center", va="center", fontsize=6.5, color="white" if dark else "black")
        split = sum(1 for r in rows if r["tp"] == max(g.tp for g in GROUPS)) - 0.5
        ax.axhline(split, color="black", lw=2)
        ax.set_xticks(range(len(PIPELINE_DEGREES)), [str(pp) for pp in PIPELINE_DEGREES])
        ax.set_xlabel("P = pp (devices: P for llama3-8b at tp 1, 8 P for llama3-70b at tp 8)")
        ax.set_title(f"best <transpose,1f1b> over {name} (at its own best M)", fontsize=10)
    labels = [f"{r['backbone']} | {r['config']} | {r['encoder_share']:.1%}" for r in rows]
    if real:
        labels.append(f"{real['config']} | {real['encoder_share']:.1%}")
    axes[0].set_yticks(range(len(labels)), labels, fontsize=7)
    axes[0].set_ylabel("configuration | encoder share of the step's compute")
    bar = fig.colorbar(image, ax=list(axes), shrink=0.5, label="predicted speedup (log scale)")
    ticks = [t for t in (0.8, 1.0, 1.25, 1.5, 2.0, 3.0, 4.0, 5.0) if norm.vmin <= t <= norm.vmax]
    bar.set_ticks(ticks, labels=[f"{t:g}x" for t in ticks])
    bar.minorticks_off()
    fig.suptitle(f"Where transpose pays: predicted speedup on {PROFILE} (bf16, recompute {record['recompute']}, dp 1, "
                 f"fixed global batch)", fontsize=11)
    fig.supxlabel(f"red box, m: measured speedup (emulated compute, mpipe-tune bench; the top row: real compute on "
                  f"this 2-core CPU, bench_fidelity.py's plans, predicted on its profile). star: the sweep point nearest "
                  f"the paper's 2.70x at 8 devices vs Megatron-LM / 1.21x at 512 devices vs DistTrain-like. "
                  f"{NO_FIT} (grey): no layout of the baseline fits memory. hatched: no transpose plan fits (the "
                  f"fastest is shown).", fontsize=7)
    fig.savefig(path, dpi=120, bbox_inches="tight")
    plt.close(fig)


def report(record: dict, plot_path: Path) -> None:
    print(table(record))
    print(f"\ncells: predicted speedup of the best <transpose,1f1b> over megatron / over disttrain, each baseline at "
          f"its own best layout at the same degrees (the fastest microbatch count that fits; recomputation "
          f"{record['recompute']}); "
          f"{NO_FIT}: no layout of that baseline fits; !: no transpose plan fits (the fastest is shown); "
          f"-: no layout at this P")
    for m in record.get("measured", []):
        print(f"\nmeasured (emulated) {m['backbone']} {m['config']} P={m['pp']}: "
              + ", ".join(f"over {n} {m['speedup_measured'][n]:.3f}x (predicted {m['speedup_predicted'][n]:.3f}x)"
                          if m["speedup_measured"][n] is not None else f"over {n}: {NO_FIT}" for n in BASELINE_NAMES)
              + f"; {m['wall_s']:.0f} s")
    if record.get("real"):
        r = record["real"]
        print(f"\nmeasured ({r['config']}, {r['date']}) P={r['pp']}, best {r['best']}: "
              + ", ".join(f"over {n} {r['speedup_measured'][n]:.3f}x (predicted {r['speedup_predicted'][n]:.3f}x)"
                          for n in BASELINE_NAMES))
    for n in record.get("paper_nearest", []):
        if n["point"] is None:
            print(f"\npaper {n['name']} ({n['speedup']}x): no sweep point at {n['devices']} devices fits")
            continue
        q = n["point"]
        same = n["predicted_at_best_settings"]
        print(f"\npaper {n['name']} ({n['speedup']:.2f}x, {n['setting']}): nearest at {n['devices']} devices: "
              f"{q['backbone']} {q['config']} (encoder share {q['encoder_share']:.1%}), pp{q['pp']} tp{q['tp']}: "
              f"{n['predicted']:.2f}x (at the transpose plan's microbatch count: "
              f"{'-' if same is None else f'{same:.2f}x'}{'' if n['at_best_settings_fits'] else ', that baseline over memory'})")
    plot(record, plot_path)
    print(f"\nplot written to {plot_path}")


def dump_record(record: dict) -> str:
    """The record as JSON, one line per configuration, point and measured run (diffable, compact)."""
    def value(v) -> str:
        if isinstance(v, list) and v and isinstance(v[0], dict):
            return "[\n  " + ",\n  ".join(json.dumps(x) for x in v) + "\n ]"
        return json.dumps(v)

    return "{\n" + ",\n".join(f" {json.dumps(k)}: {value(v)}" for k, v in record.items()) + "\n}\n"


def versions() -> dict:
    import matplotlib

    out = {"python": platform.python_version(), "numpy": np.__version__, "matplotlib": matplotlib.__version__,
           "machine": platform.machine()}
    try:
        import torch

        out["torch"] = torch.__version__
    except ImportError:
        pass
    return out


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--json", default=str(HERE / "sweep-results.json"), help="where to write every point")
    parser.add_argument("--plot", default=str(HERE / "sweep.png"), help="where to draw the heat map")
    parser.add_argument("--recompute", default="on", choices=tuple(RECOMPUTE),
                        help="on: every plan recomputes activations (default); search: each plan takes it or not")
    parser.add_argument("--no-measure", action="store_true", help="skip the emulated-compute runs")
    parser.add_argument("--replot", default=None, metavar="JSON", help="print the table and draw from a record")
    parser.add_argument("--fidelity", default=str(HERE / "fidelity-results.json"), metavar="JSON",
                        help="bench_fidelity.py's record, whose real-compute plans at P = 2 are placed on the plot "
                             "(skipped when the file is missing or has no such plans)")
    args = parser.parse_args(argv)
    fidelity = Path(args.fidelity)
    real = real_point(json.loads(fidelity.read_text())) if fidelity.is_file() else None
    if args.replot:
        record = json.loads(Path(args.replot).read_text())
        if real:
            record["real"] = real  # the fidelity record's, not stored in the sweep's
        report(record, Path(args.plot))
        return
    start = time.perf_counter()
    configs, points = run_sweep(RECOMPUTE[args.recompute])
    sweep_s = time.perf_counter() - start
    record = {"profile": PROFILE, "dtype": "bf16", "recompute": args.recompute, "seq_len": SEQ_LEN, "seed": SEED,
              "groups": [{"backbone": g.backbone, "tp": g.tp, "dp": 1, "global_batch": g.global_batch} for g in GROUPS],
              "pipeline_degrees": list(PIPELINE_DEGREES), "versions": versions(), "sweep_wall_s": sweep_s,
              "configs": configs, "points": points}
    record["paper_nearest"] = nearest_paper(points)
    if real:
        record["real"] = real
    if not args.no_measure:
        start = time.perf_counter()
        record["measured"] = measure(points, measured_choices(points, record["paper_nearest"]))
        record["measure_wall_s"] = time.perf_counter() - start
    Path(args.json).write_text(dump_record(record), encoding="utf-8")
    report(record, Path(args.plot))
    print(f"\nsweep {sweep_s:.0f} s" + (f", measured points {record['measure_wall_s']:.0f} s" if "measure_wall_s" in record else ""))


if __name__ == "__main__":
    main()
