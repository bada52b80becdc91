"""``mpipe-tune run``: execute a plan file on torch.distributed and set the measurement beside the prediction.

Everything that can be wrong with the inputs is checked here first (plan file, model, world size,
device), with one line and exit code 2, before any process or process group exists. torch is
imported only inside :meth:`Run.take_action`, so the planner's CLI works without it.
"""

from __future__ import annotations

import argparse
import json
import sys

from mpipe_tune.cli._command import MODEL_HELP, Command


class Run(Command):
    """The ``run`` subcommand."""

    name = "run"
    after_interrupt = "no rank was started"
    help = "run a plan file on local ranks (or under torchrun) and compare the step time with the prediction"

    def add_arguments(self, parser: argparse.ArgumentParser) -> None:
        parser.add_argument("plan", help="plan.json written by the planner")
        parser.add_argument("--model", default=None, help=f"{MODEL_HELP} (default: the one the plan names; for a moved file)")
        parser.add_argument("--device", default="cpu", choices=("cpu", "cuda", "npu"),
                            help="cpu (gloo), cuda (NCCL) or npu (HCCL via torch_npu); default cpu")
        parser.add_argument("--steps", type=int, default=3, help="training steps to run (default 3)")
        parser.add_argument("--compute", default="real", choices=("real", "emulated"),
                            help="real: run the MLLM; emulated: wait each compute event's predicted time, "
                                 "transfers stay real (default real)")
        parser.add_argument("--dtype", default=None,
                            help="real compute dtype: fp32, fp64, bf16, fp16 (default: the plan's dtype)")
        parser.add_argument("--seed", type=int, default=0, help="seed of weights and synthetic batches (default 0)")
        parser.add_argument("--owners", default=None, choices=("per-step", "fixed"),
                            help="per-step: each step's encoder owner map from the plan's owner policy on that step's "
                                 "microbatches; fixed: the plan's stored map every step (default: per-step when the "
                                 "plan's policy is greedy or optimal, else fixed)")
        parser.add_argument("--data", default=None, choices=("sampled", "stored"),
                            help="sampled: step k draws its microbatches from the plan's workload mix or dataset (seed + k; step 0 "
                                 "is the stored workload); stored: the plan's microbatches every step (default: sampled "
                                 "with per-step owners when the plan records its mix, else stored)")
        parser.add_argument("--profile", default=None,
                            help="the plan's hardware profile, where it moved (read to predict steps at run time; default: the "
                                 "path the plan names)")
        parser.add_argument("--trace", default=None, help="write the measured per-event Chrome/Perfetto trace to this JSON file")
        parser.add_argument("--json", action="store_true", help="print one JSON object instead of a table")
        parser.add_argument("--no-progress", action="store_true", help="no line on stderr as each step finishes")

    def take_action(self, args: argparse.Namespace) -> int:
        from mpipe_tune.interrupt import keep, skip
        from mpipe_tune.runtime import disable_backend_autoload, RunJob, run_session

        disable_backend_autoload()  # before the first import of torch
        if args.trace:
            from mpipe_tune.outputs import validate_out_path

            validate_out_path(args.trace, label="--trace", suffixes=(".json",))
        job = RunJob(args.plan, model_spec=args.model, steps=args.steps, compute=args.compute, dtype=args.dtype,
                     seed=args.seed, trace=bool(args.trace), owners=args.owners, data=args.data,
                     profile_spec=args.profile, progress=not args.no_progress)
        session = run_session(self.name, [job], args.device)
        if session.exit_code or not session.is_rank0:  # a failure (reported), or a torchrun rank other than 0
            return session.exit_code
        result = session.results[0]
        keep("the run finished")  # what a later Ctrl-C says instead of after_interrupt
        left_out = bool(args.trace) and skip("trace")  # a Ctrl-C once the ranks finished: the result, no trace
        if args.trace and not left_out:
            from mpipe_tune.runtime import dump_trace

            dump_trace(result["trace"], args.trace)
            result["summary"]["trace"] = args.trace
        if args.json:
            print(json.dumps(result["summary"], indent=2))
        else:
            print_run(result["summary"])
        if left_out:
            print(f"mpipe-tune run: interrupted; the run finished and its result is printed, the trace {args.trace} "
                  f"was not written", file=sys.stderr)
            return 130
        return 0


def print_run(record: dict) -> None:
    what = f"compute {record['compute']}" + (f" {record['dtype']}" if record.get("dtype") else "")
    print(f"plan {record['plan']}: {record['candidate']}  on {record['world_size']} {record['device']} rank(s) "
          f"({record['backend']}), {what}")  # the candidate in its one text form
    print(f"owners {record['owners']}, data {record['data']}")
    print("step times ms: " + " ".join(f"{t * 1e3:.3f}" for t in record["step_times_s"]))
    if record["owners"] != "fixed" or record["data"] != "stored":
        print("predicted ms:  " + " ".join(f"{t * 1e3:.3f}" for t in record["predicted_step_times_s"]))
        for step in record["per_step"]:
            if step["owners"] is not None:
                fell_back = " (optimal fell back to greedy)" if step["policy"] == "greedy" and record["policy"] == "optimal" else ""
                print(f"step {step['step']} owners {','.join(map(str, step['owners']))}{fell_back}")
    losses = [f"{x:.6g}" for x in record["loss_sums"] if x is not None]
    if losses and record["compute"] == "real":
        print("summed loss per step: " + " ".join(losses))
    basis = "median of steps 2.." if record["steps"] > 1 else "one step"
    ratio = f"{record['ratio']:.3f}" if record["ratio"] is not None else "-"
    print(f"measured step time {record['measured_step_s'] * 1e3:.3f} ms ({basis}{record['steps'] if record['steps'] > 1 else ''}), "
          f"predicted {record['predicted_step_s'] * 1e3:.3f} ms, measured/predicted {ratio}")
    if record.get("trace"):
        print(f"trace written to {record['trace']}")
