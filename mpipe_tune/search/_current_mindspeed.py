"""``plan --current model.json``: a MindSpeed-MM run's layout as the candidate it is.

MindSpeed-MM places a model's layers by its per-stage counts
(:class:`~mpipe_tune.inputs._mindspeed.MindSpeedLayout`): the vision transformer layers by the vision
encoder's counts, its patch embedding with the first of them and its projector (a Qwen2-VL patch merger is one)
with the last; the text decoder's layers by its counts, its embedding in the first stage with decoder layers
and its output layer in the last. That gives each global stage a slab of the model's layers: the
candidate is ``1f1b`` (``v`` woven ``1f1b`` regions with VPP), cut between chunks, with those slabs.
"""

from __future__ import annotations

from dataclasses import replace

from mpipe_tune.algebra import Candidate, ArchCost, Model
from mpipe_tune.errors import MpipeError
from mpipe_tune.inputs import DECODER_OUTSIDE_KINDS, VISION_OUTSIDE_KINDS, MindSpeedLayout, read_mindspeed_layout
from mpipe_tune.search._layout_keys import parse_layout_keys
from mpipe_tune.search._space import SearchSpace

ENCODER_BLOCK = "encoder"
OUTSIDE_KINDS = VISION_OUTSIDE_KINDS + DECODER_OUTSIDE_KINDS
"""Layer kinds that MindSpeed-MM does not count in a module's num_layers."""


def mindspeed_candidate(model_json: str, space: SearchSpace, *, label: str, launch_args: str | None = None
                        ) -> Candidate:
    """The candidate of the run ``model_json`` (and ``launch_args``) describes, on ``space``'s problem."""
    layout = read_mindspeed_layout(model_json, launch_args)
    where = f"{label} layout {model_json}"
    if layout.cp > 1:
        raise MpipeError(f"{where}: --context-parallel-size {layout.cp}; a current layout with context parallelism "
                         f"is not read yet, give the run at cp 1")
    problem = space.problem
    counts = stage_layer_counts(layout, problem.model, where)
    P, v = layout.pp, layout.num_chunks
    cut = [sum(counts[:(j + 1) * P]) for j in range(v - 1)]
    dp = problem.devices // (P * layout.tp) if problem.devices % (P * layout.tp) == 0 else 0
    pairs = [f"pp={P}", f"tp={layout.tp}", f"schedule={','.join(['1f1b'] * v)}",
             f"recompute={'on' if layout.recompute is True else 'off'}"]
    if dp:
        pairs.append(f"dp={dp}")
        if layout.global_batch_size is not None:
            if layout.global_batch_size != problem.global_batch:
                raise MpipeError(f"{where}: --global-batch-size {layout.global_batch_size}, but the plan is made for a "
                                 f"global batch of {problem.global_batch} sequences; plan with global batch "
                                 f"{layout.global_batch_size}", quantities=("global batch",))
            pairs.append(f"M={layout.global_batch_size // (dp * layout.micro_batch_size) or 1}")
    if cut:
        pairs.append(f"cut={','.join(map(str, cut))}")
    candidate = parse_layout_keys(",".join(pairs), space, label=label)
    slabs = tuple(tuple(counts[j * P:(j + 1) * P]) for j in range(v))
    return replace(candidate, slab_counts=slabs,
                   recompute="selective" if layout.recompute == "selective" else candidate.recompute)


def stage_layer_counts(layout: MindSpeedLayout, model: Model, where: str) -> list[int]:
    """Per global stage, how many of ``model``'s layers MindSpeed-MM runs there (see the module docstring)."""
    kinds = [u.cost.kind if isinstance(u.cost, ArchCost) else None for u in model.layers]
    vision = [i for i, u in enumerate(model.layers) if u.block == ENCODER_BLOCK and kinds[i] not in OUTSIDE_KINDS]
    decoders = [i for i, u in enumerate(model.layers) if i >= model.backbone_start and kinds[i] not in OUTSIDE_KINDS]
    for name, found, counts in (("vision encoder", vision, layout.vision_layers),
                                ("text decoder", decoders, layout.decoder_layers)):
        if len(found) != sum(counts):
            raise MpipeError(f"{where}: the {name} has {sum(counts)} layers in model.json and {len(found)} in model "
                             f"'{model.name}'; plan with the model of that run", quantities=("model",))
    stage = [-1] * len(model.layers)
    for indices, counts in ((vision, layout.vision_layers), (decoders, layout.decoder_layers)):
        owners = [s for s, n in enumerate(counts) for _ in range(n)]
        for i, s in zip(indices, owners):
            stage[i] = s
    with_vision = [s for s, n in enumerate(layout.vision_layers) if n]
    with_decoders = [s for s, n in enumerate(layout.decoder_layers) if n]
    for i in range(len(model.layers)):
        if stage[i] >= 0:
            continue
        if i < model.backbone_start:  # a patch embedding before the vision layers, a projector after them
            before = not vision or i < vision[0]
            stage[i] = (with_vision[0] if before else with_vision[-1]) if with_vision else (
                with_decoders[0] if with_decoders else 0)
        else:  # the embedding before the decoder layers, the output layer after them
            stage[i] = with_decoders[0] if not decoders or i < decoders[0] else with_decoders[-1]
    if any(b < a for a, b in zip(stage, stage[1:])):
        raise MpipeError(f"{where}: its stages do not run the model's layers in order (vision layers after decoder "
                         f"layers); list the vision encoder's layers in the earlier stages")
    counts = [stage.count(s) for s in range(layout.pp * layout.num_chunks)]
    empty = [s for s, n in enumerate(counts) if n == 0]
    if empty:
        raise MpipeError(f"{where}: stage(s) {', '.join(map(str, empty))} hold no layer of model '{model.name}'; "
                         f"each pipeline stage needs at least one")
    return counts
