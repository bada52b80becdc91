"""The refusals several export targets share, each written once: one line that says why the target
cannot express a plan and names the closest plan it can (a stored plan of the file where it holds one).
"""

from __future__ import annotations

from mpipe_tune.errors import MpipeError
from mpipe_tune.plan_file import REFERENCE
from mpipe_tune.report.exports._plan import ExportPlan, Stage


def validate_one_tensor_parallel_degree(plan: ExportPlan, target: str) -> None:
    """For a trainer with one tensor-parallel degree for the whole model: the encoder at the plan's tp."""
    if plan.encoder_tp is not None:
        raise MpipeError(f"{target} cannot express {plan.describe()}: it runs the encoder at tp {plan.encoder_tp}, "
                         f"and {target} has one tensor-parallel degree for the whole model; the closest plan it can "
                         f"express: the same plan with the encoder at tp {plan.tp} (re-plan without encoder tensor "
                         f"parallelism)", quantities=("encoder tensor parallelism",))


def validate_pp_tp_dp(plan: ExportPlan, target: str) -> None:
    """For a format that writes pp x dp x tp plans only: one line naming the degrees beyond them."""
    beyond = [f"{key} {value}" for key, value in (("ep", plan.ep), ("cp", plan.cp)) if value > 1]
    beyond += ["sequence parallelism"] * plan.sequence_parallel + ["selective recomputation"] * (
        plan.selective_recompute) + [f"encoder tp {plan.encoder_tp}"] * (plan.encoder_tp is not None)
    split = sorted({r.skeleton.value for r in plan.sharded if r.skeleton.splits_backward})
    if split:
        beyond.append(f"the zero-bubble skeleton(s) {', '.join(split)}")
    if beyond:
        raise MpipeError(f"{target} cannot express {plan.describe()}: it uses {', '.join(beyond)}; {target} writes "
                         f"pp x dp x tp plans of 1f1b/gpipe/transpose with no or full recomputation and the encoder "
                         f"at the plan's tp; re-plan with expert-parallel degree 1, context-parallel degree 1, no "
                         f"sequence parallelism, no encoder tensor parallelism and recomputation off or on, or export "
                         f"this one in export format torch-csv or torchtitan",
                         quantities=("expert-parallel degree", "context-parallel degree", "sequence parallelism",
                                     "encoder tensor parallelism", "recomputation", "export format"))


def closest_plan(plan: ExportPlan, name: str, otherwise: str) -> str:
    """How to get the stored plan ``name`` when the file holds it, else ``otherwise``."""
    if name in plan.names and name != plan.name:
        return f"export the file's stored plan '{name}'"
    return otherwise


def stored_hint(plan: ExportPlan, name: str) -> str:
    """``, which the file holds as stored plan 'NAME'`` when it does."""
    return f", which the file holds as stored plan '{name}'" if name in plan.names and name != plan.name else ""


def _encoder_first(plan: ExportPlan) -> str:
    """The closest all-Sharded plan: the encoder inside the first stage (Megatron-LM style)."""
    stored = closest_plan(plan, REFERENCE, f"<1f1b> with no cut, stored by 'mpipe-tune plan' as baseline '{REFERENCE}' "
                                       f"(or 'mpipe-tune predict --schedule 1f1b --cut \"\"')")
    return f"the encoder inside the first stage, {stored}"


def validate_all_sharded(plan: ExportPlan, target: str, why: str) -> None:
    """Every region Sharded; ``why`` says why ``target`` cannot run a transpose."""
    for region in plan.regions:
        if not region.is_sharded:
            raise MpipeError(
                f"{target} cannot express {plan.describe()}: region {region.index} is a transpose, {why}; closest "
                f"plan: {_encoder_first(plan)}", quantities=("stored plan",))


def validate_vision_first(plan: ExportPlan, stages: tuple[Stage, ...], target: str) -> None:
    """The vision tower in the first stage, as Megatron-LM's LLaVA and torchtitan's VLM build it."""
    spread = [s.index for s in stages[1:] if s.vision]
    if spread:
        raise MpipeError(
            f"{target} builds the vision encoder inside the first pipeline stage, but {plan.describe()} puts encoder "
            f"layers in stage(s) {', '.join(map(str, spread))} too; closest plan: {_encoder_first(plan)}",
            quantities=("stored plan",))
