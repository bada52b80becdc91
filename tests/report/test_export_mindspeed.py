"""The MindSpeed-MM export, checked against the layout checks MindSpeed-MM runs when it builds a VLM.

MindSpeed-MM's model code needs megatron, mindspeed and torch_npu, none installable here, so
:func:`layout_errors` mirrors its checks at Ascend/MindSpeed-MM commit 57069cd55a8ab16d5affe379a2e2c5f0a4d962b9,
``mindspeed_mm/models/vlm_model.py``: lines 152-163 (vision encoder: P x v stages with VPP, else P
counts), 312-321 (text decoder: the same), 185-186 and 342-343 (a module's first stage is where its
layers start at 0, its last where they end at ``num_layers``, so the counts must sum to it), and
``checkpoint/vlm_model/config.py`` lines 283-293 (the converter's: counts flattened to P x v, summing
to the module's layers). ``pretrain_vlm.py`` lines 107-120 read ``freeze`` of the vision encoder (default
true) and projector; ``examples/qwen2.5vl/README.md`` line 466 asks for ``--enable-dummy-optimizer``
when a stage's parameters are all frozen.
"""

import json
import shlex

import pytest

from mpipe_tune.cli import main
from mpipe_tune.report.exports._plan import read_export_plan, wavefront_stages
from export_writers import mindspeed_arguments, mindspeed_layout
from test_export import VISION, NUM_DECODERS, export_plan, make_record, one_line_error
from mpipe_tune.plan_file import dump_plan

NUM_VIT = 8  # the example's vision tower: 8 ViT layers and a projector


def layout_errors(config: dict, pp: int, vpp: int | None) -> list[str]:
    """MindSpeed-MM's checks of a model.json's pipeline split at ``pp`` and ``vpp`` (None: no VPP)."""
    errors = []
    for key, module in (("vision_encoder", config["image_encoder"]["vision_encoder"]),
                        ("text_decoder", config["text_decoder"])):
        layers = module["pipeline_num_layers"]
        if vpp:  # vlm_model.py:152-158 / 312-317, indexed [vp_rank][pp_rank] (lines 166, 325)
            if pp * vpp != len(layers) * len(layers[0]) or any(len(row) != pp for row in layers):
                errors.append(f"{key}: {len(layers)} x {len(layers[0])} stages for pp {pp} x vpp {vpp}")
            flat = [n for row in layers for n in row]
        else:  # vlm_model.py:159-163 / 318-321
            if pp != len(layers):
                errors.append(f"{key}: {len(layers)} stages for pp {pp}")
            flat = layers
        # vlm_model.py:185-186 / 342-343: post_process where the stage's end index equals num_layers
        if sum(flat) != module["num_layers"] or any(n < 0 for n in flat):
            errors.append(f"{key}: counts sum to {sum(flat)}, num_layers {module['num_layers']}")
    return errors


def launch_values(text: str) -> dict[str, str]:
    """The flags of the launch fragment (its MPIPE_ARGS string), as the shell would split them."""
    body = text.split('MPIPE_ARGS="', 1)[1].rsplit('"', 1)[0].replace("\\\n", " ")
    tokens = shlex.split(body)
    return {t: (tokens[i + 1] if i + 1 < len(tokens) and not tokens[i + 1].startswith("--") else "")
            for i, t in enumerate(tokens) if t.startswith("--")}


@pytest.mark.parametrize("schedule,cut,pp,m", [("1f1b", (), 2, 4), ("1f1b", (), 4, 8), ("1f1b,1f1b", (17,), 2, 4),
                                               ("1f1b,1f1b,1f1b", (12, 19), 2, 6), ("1f1b", (), 2, 1)])
def test_the_layout_passes_mindspeeds_checks(schedule, cut, pp, m):
    plan = export_plan(schedule, cut, pp, m)
    config = mindspeed_layout(plan)
    args = launch_values(mindspeed_arguments(plan, "model.json"))
    v = plan.num_chunks
    assert layout_errors(config, int(args["--pipeline-model-parallel-size"]),
                         int(args["--virtual-pipeline-model-parallel-size"]) if v > 1 else None) == []
    assert ("--virtual-pipeline-model-parallel-size" in args) == (v > 1)
    assert config["image_encoder"]["vision_encoder"]["num_layers"] == NUM_VIT
    assert config["text_decoder"]["num_layers"] == NUM_DECODERS
    assert args["--global-batch-size"] == str(m * plan.dp) and args["--micro-batch-size"] == "1"
    # the counts are the plan's stages: global stage j*P + r is rank r's chunk j
    flat = [n for row in config["text_decoder"]["pipeline_num_layers"] for n in row] if v > 1 else \
        config["text_decoder"]["pipeline_num_layers"]
    assert flat == [len(s.decoders) for s in wavefront_stages(plan)]


def test_an_encoder_spread_over_stages_is_listed_per_stage():
    """MindSpeed-MM (unlike Megatron-LM's LLaVA) runs a vision tower over several stages."""
    plan = export_plan("1f1b", (), 4, 8, slabs=((5, 7, 7, 6),))  # the 8 ViT layers in stages 0 and 1
    config = mindspeed_layout(plan)
    assert config["image_encoder"]["vision_encoder"]["pipeline_num_layers"] == [5, 3, 0, 0]
    assert config["text_decoder"]["pipeline_num_layers"] == [0, 3, 7, 6]
    assert layout_errors(config, 4, None) == []


def test_freezing_recomputation_and_the_dummy_optimizer():
    plan = export_plan("1f1b", (), 4, 8, slabs=((9, 5, 5, 6),), frozen=("encoder", "projector"))
    config = mindspeed_layout(plan)
    assert config["image_encoder"]["vision_encoder"]["freeze"] is True
    assert config["image_encoder"]["vision_projector"]["freeze"] is True
    text = mindspeed_arguments(plan, "model.json")
    assert "--enable-dummy-optimizer" in launch_values(text)  # stage 0 holds only the frozen tower
    trainable = export_plan("1f1b", (), 2, 4, recompute=True)
    config = mindspeed_layout(trainable)
    assert config["image_encoder"]["vision_encoder"]["freeze"] is False  # MindSpeed-MM's default is frozen
    assert config["text_decoder"]["recompute_granularity"] == "full"
    assert config["image_encoder"]["vision_encoder"]["recompute_method"] == "uniform"
    assert "--enable-dummy-optimizer" not in launch_values(mindspeed_arguments(trainable, "model.json"))


def test_what_mindspeed_cannot_run_is_one_line_naming_the_closest_plan():
    assert "closest plan" in one_line_error(lambda: mindspeed_layout(export_plan("transpose,1f1b", (VISION,), 2, 4)))
    assert "not GPipe" in one_line_error(lambda: mindspeed_layout(export_plan("gpipe", (), 2, 4)))
    zb = one_line_error(lambda: mindspeed_layout(export_plan("zb1p", (), 2, 4)))
    assert "not zb1p's split input/weight backwards" in zb and "GPipe" not in zb
    assert "M >= P" in one_line_error(lambda: mindspeed_layout(export_plan("1f1b,1f1b", (17,), 4, 2)))


def test_cli_writes_both_files_and_the_round_trip_reads_them_back_as_the_current_row(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)  # the default study store is the working folder's
    record, _ = make_record("1f1b", (), 2, 8, baselines={"megatron": ("1f1b", ()), "vpp": ("1f1b,1f1b", (17,))},
                            dp=2)
    dump_plan(record, tmp_path / "plan.json")
    assert main(["export", str(tmp_path / "plan.json"), "--to", "mindspeed-mm", "--plan", "vpp"]) == 2
    assert "--out" in capsys.readouterr().err
    out = tmp_path / "model.json"
    assert main(["export", str(tmp_path / "plan.json"), "--to", "mindspeed-mm", "--plan", "vpp",
                 "--out", str(out)]) == 0
    layout = json.loads(out.read_text())
    decoders = layout["text_decoder"]["pipeline_num_layers"]
    assert len(decoders) == 2 and all(len(row) == 2 for row in decoders) and sum(map(sum, decoders)) == NUM_DECODERS
    assert json.dumps(decoders) in out.read_text()  # written on one line, as MindSpeed-MM's files write it
    launch = (tmp_path / "model.sh").read_text()  # MindSpeed-MM reads no VP_SIZE: the flag is its VPP
    assert "VP_SIZE" not in launch and "--virtual-pipeline-model-parallel-size 2" in launch
    capsys.readouterr()
    assert main(["plan", "--devices", "4", "--global-batch", "16", "--pp", "2", "--dp", "2", "--trials", "4",
                 "--no-progress", "--json", "--out", str(tmp_path / "again.json"), "--current", str(out),
                 "--current-args", str(tmp_path / "model.sh")]) == 0
    current = json.loads(capsys.readouterr().out)["current"]
    exported = read_export_plan(tmp_path / "plan.json", "vpp")
    assert current["schedule"] == "1f1b,1f1b" and current["microbatches"] == 8
    assert current["slabs"] == [[stop - start for start, stop in r.slabs] for r in exported.sharded]


def test_a_qwen2_vl_merger_is_the_vision_projector_not_a_vision_layer():
    """MindSpeed-MM's Qwen2-VL / Qwen2.5-VL model.json (examples/qwen2.5vl/model_7b.json at 57069cd5) lists
    ``vision_encoder.num_layers`` 32, the ViT blocks, and the patch merger as ``vision_projector``: a
    count of 33 would build a tower one block deeper than the checkpoint."""
    model = "qwen2vl-vit-qwen2-7b"  # patch_embed, 32 ViT blocks, merger (block encoder), embed, 28 decoders, head
    plan = export_plan("1f1b", (), 2, 4, model_name=model, slabs=((43, 21),))
    config = mindspeed_layout(plan)
    assert config["image_encoder"]["vision_encoder"]["num_layers"] == 32
    assert config["image_encoder"]["vision_encoder"]["pipeline_num_layers"] == [32, 0]
    assert config["text_decoder"]["pipeline_num_layers"] == [8, 20]
    assert config["image_encoder"]["vision_projector"] == {"freeze": False}
    assert layout_errors(config, 2, None) == []
    frozen = mindspeed_layout(export_plan("1f1b", (), 2, 4, model_name=model, slabs=((43, 21),), frozen=("encoder",)))
    assert frozen["image_encoder"]["vision_encoder"]["freeze"] and frozen["image_encoder"]["vision_projector"]["freeze"]
    # the merger in the stage after the last ViT block: MindSpeed-MM runs it with that block, and says so
    split = export_plan("1f1b", (), 2, 4, model_name=model, slabs=((33, 31),))
    assert mindspeed_layout(split)["image_encoder"]["vision_encoder"]["pipeline_num_layers"] == [32, 0]
    assert "runs the projector after the last vision layer, in stage 0; the plan has it in stage 1" in \
        mindspeed_arguments(split, "model.json")


def test_tensor_parallel_launch_arguments_set_one_device_connection():
    """Megatron core's tensor-parallel layers (which MindSpeed-MM runs) order their communication by
    CUDA_DEVICE_MAX_CONNECTIONS=1, which MindSpeed-MM's example launch scripts export; without tp it is not needed."""
    assert "export CUDA_DEVICE_MAX_CONNECTIONS=1" in mindspeed_arguments(export_plan("1f1b", (), 2, 4, tp=2), "m.json")
    assert "CUDA_DEVICE_MAX_CONNECTIONS" not in mindspeed_arguments(export_plan("1f1b", (), 2, 4), "m.json")
