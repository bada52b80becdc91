"""``mpipe-tune bench``: run a plan file's best plan and its stored baselines on the executor, in
rounds, and set measured step times and speedups beside the predicted ones.

Every check (the plan names, the round and step counts, each plan's pre-flight, the world size, the
device) runs before any process starts, with one line and exit code 2. The runs share one set of
ranks (:func:`mpipe_tune.runtime._session.run_session`, as ``run`` does); each finished run prints a
progress line on stderr, and a bench cut short by Ctrl-C still prints the rounds that finished.
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import replace
from pathlib import Path

from mpipe_tune.cli._command import MODEL_HELP, Command
from mpipe_tune.errors import MpipeError


class Bench(Command):
    """The ``bench`` subcommand."""

    name = "bench"
    help = "run a plan file's best plan and its baselines in rounds: measured beside predicted step time and speedup"

    def add_arguments(self, parser: argparse.ArgumentParser) -> None:
        parser.add_argument("plan", help="plan.json written by 'mpipe-tune plan' (it stores the baselines)")
        parser.add_argument("--model", default=None,
                            help=f"{MODEL_HELP} (default: the one the plan names; for a moved file)")
        parser.add_argument("--plans", default=None,
                            help="comma-separated plans to run, e.g. best,megatron (default: every plan in the file)")
        parser.add_argument("--compute", default="real", choices=("real", "emulated"),
                            help="real: run the MLLM; emulated: wait each compute event's predicted time, "
                                 "transfers stay real (default real, as for run)")
        parser.add_argument("--steps", type=int, default=2, help="training steps per plan per round (default 2)")
        parser.add_argument("--rounds", type=int, default=3, help="rounds over the plans (default 3)")
        parser.add_argument("--device", default="cpu", choices=("cpu", "cuda", "npu"),
                            help="cpu (gloo), cuda (NCCL) or npu (HCCL via torch_npu); default cpu")
        parser.add_argument("--dtype", default=None,
                            help="real compute dtype: fp32, fp64, bf16, fp16 (default: each plan's dtype)")
        parser.add_argument("--seed", type=int, default=0, help="seed of weights and synthetic batches (default 0)")
        parser.add_argument("--gantt", default=None, metavar="DIR",
                            help="draw each plan's measured timeline (its last step) to DIR/<plan>.png")
        parser.add_argument("--json", action="store_true", help="print one JSON object instead of a table")
        parser.add_argument("--no-progress", action="store_true", help="no line on stderr as each run finishes")

    def take_action(self, args: argparse.Namespace) -> int:
        from mpipe_tune.report import (
            bench_plans, bench_record, format_bench, progress_line, round_robin, validate_rounds,
        )
        from mpipe_tune.plan_file import read_plan
        from mpipe_tune.runtime import RunJob
        from mpipe_tune.interrupt import skip
        from mpipe_tune.runtime import run_session

        validate_rounds(args.rounds)
        file = read_plan(args.plan)
        chosen = None if args.plans is None else [n.strip() for n in args.plans.split(",") if n.strip()]
        names = bench_plans(file, chosen)
        if args.gantt:  # every picture's path, before anything runs
            from mpipe_tune.report import validate_picture_path

            if not Path(args.gantt).is_dir():
                raise MpipeError(f"--gantt {args.gantt}: no such folder; create it or pick another one")
            for name in names:
                validate_picture_path(Path(args.gantt) / f"{name}.png", label="--gantt")
        runs = round_robin(names, args.rounds)
        last = args.rounds - 1
        # The stored plans as they are (their stored owner maps, on their stored microbatches): every plan
        # of the comparison runs the same steps.
        template = RunJob(args.plan, model_spec=args.model, steps=args.steps, compute=args.compute, dtype=args.dtype,
                          seed=args.seed, owners="fixed", data="stored")
        jobs = [replace(template, plan_name=name, trace=bool(args.gantt) and k == last) for name, k in runs]

        def on_result(index: int, result: dict) -> None:
            if not args.json and not args.no_progress:
                name, k = runs[index]
                print(progress_line(name, k, args.rounds, result["summary"]), file=sys.stderr, flush=True)

        session = run_session(self.name, jobs, args.device, on_result=on_result)
        if not session.is_rank0:
            return session.exit_code
        out = bench_record([r["summary"] for r in session.results], names, args.rounds, plan_file=args.plan,
                           compute=args.compute, device=args.device, steps=args.steps)
        left_out = bool(args.gantt) and skip("timelines")  # a Ctrl-C after the rounds: the table, no pictures
        if args.gantt and not left_out:
            _draw_measured(file, runs, session.results, out, Path(args.gantt))
        if args.json:
            print(json.dumps(out, indent=2))
        else:
            print(format_bench(out))
            if args.gantt and not left_out:
                print(f"\nmeasured timelines written to {args.gantt}/<plan>.png")
        if left_out:
            print(f"mpipe-tune bench: interrupted; every round's result is printed, the measured timelines were not "
                  f"drawn", file=sys.stderr)
            return 130
        return session.exit_code


def _draw_measured(file, runs: list[tuple[str, int]], results, out: dict, folder: Path) -> None:
    """One measured timeline per plan whose traced (last) round finished, written together; its path
    goes into ``out``."""
    from mpipe_tune.outputs import write_together
    from mpipe_tune.report import draw_measured_gantt

    entries = {p["name"]: p for p in out["plans"]}
    pictures = []
    for (name, _k), result in zip(runs, results):
        if "trace" not in result:
            continue
        section = file.section(name)
        replicated = [p.region for p in section.placement if p.owners is not None]
        title = f"{name} <{section.candidate.schedule}>, compute {out['compute']}"
        pictures.append((folder / f"{name}.png", lambda tmp, trace=result["trace"], replicated=replicated, title=title:
                         draw_measured_gantt(trace, tmp, replicated_regions=replicated, title=title)))
        entries[name]["gantt"] = str(folder / f"{name}.png")
    write_together(pictures)
