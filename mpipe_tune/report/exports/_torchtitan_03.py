"""``export --to torchtitan-0.3``: the torchtitan job of :mod:`._torchtitan` in torchtitan 0.3's command-line form
(``torchtitan/config/manager.py``, which reads no TOML), and the schedule CSV it runs beside it.

The last stage's modules name the output layer ``lm_head``, as 0.3's models do. ``--module`` and ``--config``
(a registered config function: torchtitan's smallest llama3 or deepseek_v3 one,
to be replaced by the user's), ``--parallelism.*`` and ``--training.*`` overrides (``enable_sequence_parallel``
as the plan says, ``disable_cuda_graphs`` with PP), the ``activation-checkpoint:MODE`` subcommand last. At pp 1
the arguments name no pipeline and no CSV is written (:mod:`._torchtitan`).
"""

from __future__ import annotations

import shlex
from pathlib import Path

from mpipe_tune.report.exports._plan import ExportPlan, Output
from mpipe_tune.report.exports._target import ExportTarget, TwoFiles
from mpipe_tune.report.exports._torchtitan import titan_job, titan_outputs, validate_titan_job

HEAD_MODULE = "lm_head"
"""The output layer's module in torchtitan 0.3's decoders (``torchtitan/models/common/decoder.py``: ``lm_head``;
0.2.x named it ``output``): the last stage's ``module_fqns_per_model_part`` must name it, or its stage drops
the head and the loss reads hidden states."""


TITAN_MODULES = {"dense": ("llama3", "llama3_debugmodel"), "moe": ("deepseek_v3", "deepseek_v3_debugmodel")}
"""torchtitan 0.3's ``--module``/``--config`` (a ``config_registry`` function) per backbone type: the
release's smallest registered config of a dense and of a MoE backbone, for the user to replace with
their model's."""


def _job_arguments(plan: ExportPlan, csv_path: str) -> str:
    """torchtitan 0.3's command-line form (``torchtitan/config/manager.py``: ``--module`` and
    ``--config`` pick a registered config function, ``--section.field value`` overrides it, the
    activation-checkpoint choice is a ``activation-checkpoint:MODE`` subcommand, last), one argument per
    line after ``#`` comments."""
    job = titan_job(plan, csv_path, head=HEAD_MODULE)
    module, config = TITAN_MODULES["moe" if plan.moe_layers else "dense"]
    par = dict(job.parallelism)
    parts = par.pop("module_fqns_per_model_part", None)
    args = [f"# torchtitan 0.3 arguments for mpipe-tune {plan.describe()}",
            *(f"# {n}" for n in job.notes),
            f"# --config names torchtitan's smallest {module} config: replace it with your model's config function",
            f"--module {module}", f"--config {config}",
            *(f"--parallelism.{k} {shlex.quote(str(v))}" for k, v in par.items()),
            *(["--parallelism.module_fqns_per_model_part " + " ".join(shlex.quote(",".join(p)) for p in parts)]
              if parts else []),
            "--parallelism.enable_sequence_parallel" if plan.sequence_parallel
            else "--parallelism.no-enable-sequence-parallel",
            *(f"--training.{k} {shlex.quote(str(v))}" for k, v in job.training.items()),
            *(["--training.disable_cuda_graphs"] if plan.pp > 1 else []),  # its CUDA graphs refuse PP
            f"activation-checkpoint:{job.activation_checkpoint}"]
    return "\n".join(args) + "\n"


class TorchTitan03(ExportTarget):
    name = "torchtitan-0.3"
    trainer = "torchtitan"
    help = "torchtitan 0.3 arguments (--module/--config and overrides) and the CSV they run (needs --out)"
    client = ("torchtitan 0.3's ConfigManager parses the arguments (tests/report/test_export.py, with the "
              "export-check extra installed); torch 2.13 runs the CSV (tests/report/test_export_csv_runs.py)")
    files = TwoFiles("the arguments", "arguments'", "the schedule CSV they name", "CSV", None, ".csv", "job.args")

    def validate(self, plan: ExportPlan) -> None:
        validate_titan_job(plan, self.trainer)

    def write(self, plan: ExportPlan, paths: tuple[Path | None, ...]) -> tuple[Output, ...]:
        return titan_outputs(plan, paths, _job_arguments)
