"""The paper's two experiments at their setups, predicted: Mpipe's ``<transpose, 1f1b>`` (round-robin owners,
``mpipe-rr``) against the baseline each experiment names, beside the paper's measured speedups.

- **A** (paper Table 3): Qwen2-VL's ViT with DeepSeek-V3 on 512 dies of a CloudMatrix384
  (``ascend-910c-cm384-die``) against the DistTrain-like baseline (the encoder on a pipeline stage of its own,
  the backbone 5D-parallel: pipeline, tensor, data, expert, sequence); paper 16.26 s -> 13.42 s, 1.21x.
- **B** (paper Table 4): a Qwen3.5-based MLLM on 8 dies against the Megatron-LM baseline (the encoder in the
  first pipeline stage) on CapsFusion-120M-shaped data (one image and one short caption a sample);
  paper 11.01 s -> 4.07 s, 2.70x.

The paper states the model pairing, the device count, the baseline kind and the dataset; the layouts, batch
sizes and sequence lengths are not stated, so the ones below are ours (stated as such). Nothing here is tuned
toward the paper's figures: the cost model and the profiles are what every other benchmark uses.

    python benchmarks/bench_paper_configs.py
        A and B at their fixed layouts: step times and speedups, with and without recomputation.

    python benchmarks/bench_paper_configs.py own-best
        ``mpipe-tune plan`` for each experiment with the fixed layout as ``--current``: the best plan, and
        each baseline at its own best layout.

    python benchmarks/bench_paper_configs.py emulated
        B on the executor with emulated compute: ``plan`` pinned to B's layout, then
        ``mpipe-tune bench plan.json --compute emulated`` (8 ranks on this machine).

    python benchmarks/bench_paper_configs.py write-capsfusion
        Regenerate ``benchmarks/data/capsfusion-shaped.csv`` (seeded; see :func:`capsfusion_rows`).
"""

from __future__ import annotations

import json
import platform
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np

from mpipe_tune.cost import load_profile
from mpipe_tune.inputs import load_model, DatasetOptions, load_dataset
from mpipe_tune.search import baseline, Evaluator, Problem

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
CAPSFUSION = HERE / "data" / "capsfusion-shaped.csv"
DIE = "ascend-910c-cm384-die"


@dataclass(frozen=True)
class Experiment:
    key: str
    model: str
    devices: int
    pp: int
    tp: int
    dp: int
    ep: int
    microbatches: int
    global_batch: int
    baseline: str
    """The paper's baseline for this experiment (``disttrain`` or ``megatron``)."""
    paper: str
    paper_speedup: float
    mix: str | None = None
    dataset: Path | None = None
    seq_len: int | None = None
    setup: str = ""
    """What of the setup is the paper's and what is ours."""

    def problem(self) -> Problem:
        model = load_model(self.model)
        common = dict(num_samples=4, seed=0)
        if self.dataset is None:
            return Problem(model, load_profile(DIE), self.devices, self.global_batch, mix=self.mix, **common)
        dataset, _notes = load_dataset(str(self.dataset), self.model, model, DatasetOptions(seq_len=self.seq_len))
        return Problem(model, load_profile(DIE), self.devices, self.global_batch, dataset=dataset, **common)

    def workload_args(self) -> list[str]:
        if self.dataset is None:
            return ["--workload", self.mix]
        return ["--workload", str(self.dataset.relative_to(ROOT)), "--seq-len", str(self.seq_len)]

    def layout(self) -> str:
        return f"pp={self.pp},tp={self.tp},dp={self.dp},schedule=1f1b,M={self.microbatches},recompute=on"


EXPERIMENTS = (
    Experiment(
        "A", "qwen2vl-vit-deepseek-v3", 512, pp=16, tp=1, dp=32, ep=32, microbatches=32, global_batch=1024,
        baseline="disttrain", paper="16.26 s -> 13.42 s, 1.21x vs DistTrain-like", paper_speedup=1.21,
        mix="balanced",
        setup="paper: the model pair, 512 devices of a CloudMatrix384, the DistTrain-like baseline; ours: the layout "
              "(DeepSeek-V3's own recipe, pipeline 16 with expert parallelism and no tensor parallelism, at 512 dies), "
              "M=32, 1,024 sequences a step, and the `balanced` mix for the paper's internal dataset"),
    Experiment(
        "B", "benchmarks/models/Qwen3.5-9B/config.json", 8, pp=8, tp=1, dp=1, ep=1, microbatches=16, global_batch=16,
        baseline="megatron", paper="11.01 s -> 4.07 s, 2.70x vs Megatron-LM", paper_speedup=2.70,
        dataset=CAPSFUSION, seq_len=4096,
        setup="paper: a Qwen3.5-based MLLM, 8 devices, CapsFusion, the Megatron-LM baseline; ours: the size, "
              "Qwen3.5-9B with its own ViT (the paper names none), the layout (pp8, M=16), 16 sequences of 4,096 "
              "tokens a step, the CapsFusion-shaped manifest"),
)


# ------------------------------------------------------------------ the CapsFusion-shaped manifest

CAPTION_WORDS_MEAN = 22.74
"""Mean words of a CapsFusion caption: BLIP3-KALE, arXiv:2411.07461, Table 1 (CapsFusion, 120M samples)."""
TOKENS_PER_WORD = 1.3
"""Assumed: English BPE tokens per word."""
CAPTION_SPREAD = 0.35
"""Assumed: the log-normal spread of caption lengths (no distribution is published)."""
WEB_SIZES = ((336, 336, 0.3), (448, 448, 0.3), (480, 640, 0.2), (768, 1024, 0.2))
"""Assumed: web image sizes, the built-in mixes' (the dataset card gives image URLs, no sizes)."""


def capsfusion_rows(num_rows: int = 4096, seed: int = 0) -> list[tuple[int, int, int]]:
    """``(text_tokens, image_width, image_height)`` per sample, one image each, as the CapsFusion-120M card
    describes its entries (an image URL and its captions; github.com/baaivision/CapsFusion): caption tokens
    log-normal around :data:`CAPTION_WORDS_MEAN` x :data:`TOKENS_PER_WORD`, image sizes drawn from
    :data:`WEB_SIZES` with each side jittered by up to 20%."""
    rng = np.random.default_rng(seed)
    mean_tokens = CAPTION_WORDS_MEAN * TOKENS_PER_WORD
    mu = np.log(mean_tokens) - CAPTION_SPREAD ** 2 / 2  # the log-normal's mean is mean_tokens
    text = np.clip(np.rint(rng.lognormal(mu, CAPTION_SPREAD, num_rows)), 4, 256).astype(int)
    probs = np.array([p for *_, p in WEB_SIZES])
    pick = rng.choice(len(WEB_SIZES), size=num_rows, p=probs / probs.sum())
    jitter = rng.uniform(0.8, 1.2, size=(num_rows, 2))
    heights = np.rint([WEB_SIZES[i][0] for i in pick] * jitter[:, 0]).astype(int)
    widths = np.rint([WEB_SIZES[i][1] for i in pick] * jitter[:, 1]).astype(int)
    return list(zip(text.tolist(), widths.tolist(), heights.tolist()))


def write_capsfusion(path: Path = CAPSFUSION) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    lines = ["text_tokens,image_width,image_height", *(f"{t},{w},{h}" for t, w, h in capsfusion_rows())]
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    print(f"wrote {path} ({len(lines) - 1} samples)")


# ------------------------------------------------------------------ fixed layouts

def fixed() -> None:
    print(f"python {platform.python_version()}; profile {DIE}; 4 sampled steps (seeds 0-3), bf16\n")
    for e in EXPERIMENTS:
        print(f"- {e.key}: {e.model}, {e.devices} dies, pp{e.pp} tp{e.tp} dp{e.dp} ep{e.ep}, M={e.microbatches}, "
              f"{e.global_batch} sequences; {e.setup}")
    print("\n| experiment | recompute | plan | step s (mean) | p90 s | peak GiB | speedup over the paper's baseline "
          "| paper |")
    print("|---|---|---|---|---|---|---|---|")
    for e in EXPERIMENTS:
        problem = e.problem()
        evaluator = Evaluator(problem)
        for recompute in (False, True):
            results = {}
            for name in (e.baseline, "mpipe-rr"):
                c = baseline(name, problem.model, e.pp, e.tp, e.dp, e.microbatches)
                results[name] = evaluator.evaluate(replace(c, recompute=recompute, ep=e.ep))
            ref = results[e.baseline]
            for name, r in results.items():
                peak = r.peak_bytes / 2**30
                print(f"| {e.key} | {'on' if recompute else 'off'} | {name} | {r.mean_s:.2f} | {r.p90_s:.2f} | "
                      f"{peak:.1f}{'' if r.fits else ' (over)'} | {ref.mean_s / r.mean_s:.2f}x | "
                      f"{e.paper if name == 'mpipe-rr' else ''} |")
        sys.stdout.flush()


# ------------------------------------------------------------------ own best layouts

def plan_argv(e: Experiment, *, pinned: bool = False) -> list[str]:
    argv = ["plan", "--model", e.model, "--profile", DIE, "--devices", str(e.devices), "--global-batch",
            str(e.global_batch), *e.workload_args(), "--recompute", "search"]
    if pinned:
        return [*argv, "--pp", str(e.pp), "--tp", str(e.tp), "--dp", str(e.dp)]
    return [*argv, "--current", e.layout()] if e.ep == 1 else argv  # --current's grammar has no ep


def _cli(argv: list[str], folder: str) -> tuple[dict, float]:
    start = time.perf_counter()
    proc = subprocess.run([sys.executable, "-m", "mpipe_tune.cli", *argv, "--json", "--no-progress",
                           "--storage", f"sqlite:///{folder}/study.db", "--out", f"{folder}/plan.json"],
                          capture_output=True, text=True, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout), time.perf_counter() - start


def _layout(r: dict) -> str:
    cut = ",".join(map(str, r["cut"]))
    ep = f" ep{r['ep']}" if r.get("ep", 1) > 1 else ""
    return (f"`<{r['schedule']}>`{' cut ' + cut if cut else ''} pp{r['pp']} tp{r['tp']} dp{r['dp']}{ep} "
            f"M={r['microbatches']}{' rc' if r['recompute'] else ''}")


def own_best() -> None:
    for e in EXPERIMENTS:
        argv = plan_argv(e)
        with tempfile.TemporaryDirectory() as folder:
            out, wall = _cli(argv, folder)
        best = out["comparison"][0]
        own = {r["plan"]: r for r in out["own_best"]}
        print(f"**{e.key}**: `mpipe-tune {' '.join(argv)}` ({wall:.0f} s wall). Best: {_layout(best)}, "
              f"{best['step_s']:.2f} s, peak {best['peak_bytes'] / 2**30:.1f} GiB.")
        for name in out["families"]:
            r = own.get(name + "@own")
            if r is not None:
                print(f"- {name} at its own best, {_layout(r)}: {r['step_s']:.2f} s, best's speedup "
                      f"{r['best_speedup']:.2f}x")
        current = out.get("current")
        if current is not None:
            print(f"- the fixed layout as --current: {current['step_s']:.2f} s, best's speedup "
                  f"{current['best_speedup']:.2f}x")
        print()
        sys.stdout.flush()


def emulated() -> None:
    e = next(x for x in EXPERIMENTS if x.key == "B")
    with tempfile.TemporaryDirectory() as folder:
        _plan, _wall = _cli(plan_argv(e, pinned=True), folder)
        argv = ["bench", f"{folder}/plan.json", "--compute", "emulated", "--plans", f"best,mpipe-rr,{e.baseline}",
                "--json", "--no-progress"]
        start = time.perf_counter()
        proc = subprocess.run([sys.executable, "-m", "mpipe_tune.cli", *argv], capture_output=True, text=True, cwd=ROOT)
        assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout)
    print(f"`mpipe-tune {' '.join(plan_argv(e, pinned=True))} --out plan.json` then `mpipe-tune bench plan.json "
          f"--compute emulated --plans best,mpipe-rr,{e.baseline}` ({time.perf_counter() - start:.0f} s wall, "
          f"{out['rounds']} rounds of {out['steps']} steps)\n")
    print(f"| plan | schedule | predicted s | measured s | measured / predicted | speedup over {e.baseline} "
          f"predicted | measured |")
    print("|---|---|---|---|---|---|---|")
    ref = next(r for r in out["plans"] if r["name"] == e.baseline)
    for r in out["plans"]:
        print(f"| {r['name']} | `<{r['schedule']}>` | {r['predicted_step_s']:.2f} | {r['measured_step_s']:.2f} | "
              f"{r['ratio']:.3f} | {ref['predicted_step_s'] / r['predicted_step_s']:.2f}x | "
              f"{ref['measured_step_s'] / r['measured_step_s']:.2f}x |")


def main() -> None:
    what = sys.argv[1] if len(sys.argv) > 1 else "fixed"
    actions = {"fixed": fixed, "own-best": own_best, "emulated": emulated, "write-capsfusion": write_capsfusion}
    if what not in actions or len(sys.argv) > 2:
        sys.exit(f"usage: {sys.argv[0]} [{' | '.join(actions)}]")
    actions[what]()


if __name__ == "__main__":
    main()
