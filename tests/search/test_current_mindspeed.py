"""``plan --current model.json``: a MindSpeed-MM run's model.json and launch arguments as the current row."""

import json

import pytest

from mpipe_tune.cli import main
from mpipe_tune.errors import MpipeError
from mpipe_tune.inputs import MindSpeedLayout, read_mindspeed_layout
from mpipe_tune.search._current_mindspeed import stage_layer_counts
from mpipe_tune.inputs import load_model

# the shape of MindSpeed-MM's examples/qwen2.5vl/finetune_qwen2_5_vl_7b.sh: variables, arithmetic, GPT_ARGS
SCRIPT = """#!/bin/bash
NPUS_PER_NODE=8
NNODES=1
WORLD_SIZE=$(($NPUS_PER_NODE*$NNODES))
TP=2
PP=4
CP=1
MBS=1
GRAD_ACC_STEP=8
DP=$(($WORLD_SIZE/$TP/$PP/$CP))
GBS=$(($MBS*$GRAD_ACC_STEP*$DP))
GPT_ARGS="
    --use-mcore-models \\
    --tensor-model-parallel-size ${TP} \\
    --pipeline-model-parallel-size ${PP} \\
    --context-parallel-size ${CP} \\
    --micro-batch-size ${MBS} \\
    --global-batch-size ${GBS} \\
    --recompute-granularity full \\
    --bf16 \\
"
torchrun $DISTRIBUTED_ARGS pretrain_vlm.py $GPT_ARGS
"""


def model_json(tmp_path, vision, decoders, *, vit_layers=None, llm_layers=None, name="model.json"):
    config = {"image_encoder": {"vision_encoder": {"pipeline_num_layers": vision, "freeze": True}},
              "text_decoder": {"pipeline_num_layers": decoders}}
    if vit_layers is not None:
        config["image_encoder"]["vision_encoder"]["num_layers"] = vit_layers
    if llm_layers is not None:
        config["text_decoder"]["num_layers"] = llm_layers
    path = tmp_path / name
    path.write_text(json.dumps(config))
    return path


def test_a_launch_script_resolves_its_variables(tmp_path):
    (tmp_path / "run.sh").write_text(SCRIPT)
    path = model_json(tmp_path, [32, 0, 0, 0], [1, 10, 10, 7], vit_layers=32, llm_layers=28)
    layout = read_mindspeed_layout(path, str(tmp_path / "run.sh"))
    assert layout == MindSpeedLayout(pp=4, num_chunks=1, vision_layers=(32, 0, 0, 0), decoder_layers=(1, 10, 10, 7),
                                     tp=2, cp=1, micro_batch_size=1, global_batch_size=8, recompute=True,
                                     frozen_modules=("image_encoder.vision_encoder",))
    flags = read_mindspeed_layout(path, "--tensor-model-parallel-size 4 --micro-batch-size 2")
    assert (flags.tp, flags.micro_batch_size, flags.global_batch_size, flags.recompute) == (4, 2, None, False)


def test_virtual_stages_are_chunk_major(tmp_path):
    path = model_json(tmp_path, [[10, 10, 10, 2], [0, 0, 0, 0], [0, 0, 0, 0]], [[0, 0, 0, 1], [4, 4, 4, 4], [4, 3, 2, 2]])
    layout = read_mindspeed_layout(path, "--virtual-pipeline-model-parallel-size 3")
    assert (layout.pp, layout.num_chunks) == (4, 3)
    assert layout.decoder_layers == (0, 0, 0, 1, 4, 4, 4, 4, 4, 3, 2, 2)


@pytest.mark.parametrize("vision,decoders,extra,args,message", [
    ([32, 0], [1, 10, 10, 7], {}, None, "same shape"),
    ([32, 0, 0, 0], [1, 10, 10, 7], {"llm_layers": 27}, None, "sums to 28"),
    ([32, 0, 0, 0], [1, "10", 10, 7], {}, None, "list of layer counts per stage"),
    ([32, 0, 0, 0], [1, 10, 10, 7], {}, "--pipeline-model-parallel-size 2", "make them agree"),
    ([32, 0, 0, 0], [1, 10, 10, 7], {}, "--tensor-model-parallel-size $TP", "integer >= 1"),
    ([32, 0, 0, 0], [1, 10, 10, 7], {}, "no-such-script.sh", "neither a launch script"),
    ([32, 0, 0, 0], [1, 10, 10, 7], {}, "--seq-length 1024", "none of --tensor-model-parallel-size, "),
])
def test_bad_input_is_one_line(tmp_path, vision, decoders, extra, args, message):
    path = model_json(tmp_path, vision, decoders, **extra)
    with pytest.raises(MpipeError) as info:
        read_mindspeed_layout(path, args)
    assert message in str(info.value) and "\n" not in str(info.value)


def test_the_layers_go_where_mindspeed_runs_them():
    """Patch embedding with the first vision layers, projector with the last, embedding with the first
    decoder layers, output layer with the last."""
    model = load_model("qwen2vl-vit-llama3-8b")  # patch_embed, 32 ViT blocks, merger, projector, embed, 32, head
    vit = sum(1 for u in model.layers if u.block == "encoder") - 2  # the merger is MindSpeed-MM's projector
    layout = MindSpeedLayout(pp=4, num_chunks=1, vision_layers=(vit, 0, 0, 0), decoder_layers=(0, 10, 12, 10))
    counts = stage_layer_counts(layout, model, "test")
    assert counts == [model.backbone_start, 11, 12, 11] and sum(counts) == model.num_layers
    with pytest.raises(MpipeError, match="hold no layer"):
        stage_layer_counts(MindSpeedLayout(4, 1, (vit, 0, 0, 0), (0, 0, 16, 16)), model, "test")
    with pytest.raises(MpipeError, match="32 in model"):
        stage_layer_counts(MindSpeedLayout(4, 1, (vit, 0, 0, 0), (1, 10, 10, 7)), model, "test")


def test_plan_shows_the_run_as_its_current_row(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)  # the default study store is the working folder's
    model = load_model("example-mllm")  # 8 ViT layers, a projector, 16 decoder layers
    path = model_json(tmp_path, [8, 0], [4, 12], vit_layers=8, llm_layers=16)
    assert main(["plan", "--devices", "4", "--global-batch", "16", "--pp", "2", "--trials", "4", "--no-progress",
                 "--json", "--out", str(tmp_path / "p.json"), "--current", str(path),
                 "--current-args", "--tensor-model-parallel-size 1 --global-batch-size 16"]) == 0
    out, err = capsys.readouterr()
    current = json.loads(out)["current"]
    assert current["slabs"] == [[model.backbone_start + 4, 12]] and current["dp"] == 2 and current["microbatches"] == 8
    # the model.json freezes the vision encoder and --frozen is not given: said, with the model's blocks to name
    assert (f"--current {path} freezes image_encoder.vision_encoder, and --frozen is not given, so the plan and every "
            f"row train all of model 'example-mllm'; give --frozen with its blocks to freeze (") in err, err
    assert main(["plan", "--devices", "4", "--global-batch", "16", "--pp", "2", "--trials", "4", "--no-progress",
                 "--json", "--out", str(tmp_path / "p.json"), "--current", str(path), "--frozen", "encoder",
                 "--current-args", "--tensor-model-parallel-size 1 --global-batch-size 16"]) == 0
    assert "freezes" not in capsys.readouterr().err
    assert main(["plan", "--devices", "4", "--trials", "4", "--no-progress", "--out", str(tmp_path / "p.json"),
                 "--current-args", "--tensor-model-parallel-size 1"]) == 2
    assert "give --current model.json" in capsys.readouterr().err
    assert main(["plan", "--devices", "4", "--trials", "4", "--no-progress", "--out", str(tmp_path / "p.json"),
                 "--current", str(path), "--current-args", "--global-batch-size 64"]) == 2
    err = capsys.readouterr().err
    assert "global batch (--global-batch) of 16 sequences; plan with global batch 64" in err


def test_an_exported_qwen2vl_layout_reads_back_as_the_current_row(tmp_path, capsys, monkeypatch):
    """A Qwen2-VL model's patch merger is MindSpeed-MM's vision_projector on both sides: the layout
    ``export --to mindspeed-mm`` writes (32 vision layers for a 32-block tower) is read back by
    ``plan --current`` as the same layout (it said the tower had 33 layers)."""
    monkeypatch.chdir(tmp_path)
    common = ["--model", "qwen2vl-vit-qwen2-7b", "--profile", "ascend-910b", "--devices", "8", "--global-batch", "16",
              "--pp", "2", "--trials", "4", "--no-progress", "--json"]
    assert main(["plan", *common, "--out", "p.json"]) == 0
    megatron = next(r for r in json.loads(capsys.readouterr().out)["comparison"] if r["plan"] == "megatron")
    assert main(["export", "p.json", "--to", "mindspeed-mm", "--plan", "megatron", "--out", "m.json"]) == 0
    vision = json.loads((tmp_path / "m.json").read_text())["image_encoder"]["vision_encoder"]
    assert vision["num_layers"] == 32 and sum(vision["pipeline_num_layers"]) == 32
    capsys.readouterr()
    assert main(["plan", *common, "--out", "q.json", "--current", "m.json", "--current-args", "m.sh"]) == 0
    current = json.loads(capsys.readouterr().out)["current"]
    assert {k: current[k] for k in ("slabs", "pp", "tp", "dp", "microbatches")} == {
        k: megatron[k] for k in ("slabs", "pp", "tp", "dp", "microbatches")}


def test_a_launch_script_that_sets_none_of_the_flags_is_refused(tmp_path):
    """An empty script (or one that sources its flags from elsewhere) read as all defaults would price tp 1."""
    (tmp_path / "run.sh").write_text("#!/bin/bash\nsource ./common.sh\n")
    path = model_json(tmp_path, [32, 0, 0, 0], [1, 10, 10, 7])
    with pytest.raises(MpipeError, match=r"launch script .*run\.sh: none of --tensor-model-parallel-size, .*give the "
                                         r"script that launches the run"):
        read_mindspeed_layout(path, str(tmp_path / "run.sh"))
