"""The torchtitan-0.3 export runs a step of torchtitan 0.3's own Llama-3, split as the export says.

torchtitan 0.3 (``pip install -e ".[export-check]"``, which needs triton) builds its debug Llama-3 with as
many decoder layers as the plan's backbone; its own splitter (``_split_module`` of
``torchtitan/distributed/pipeline_parallel.py``, what ``pipeline_llm`` cuts each stage with) cuts it by the
export's ``--parallelism.module_fqns_per_model_part``; the stages run one after the other on one process
(what torch's pipeline runtime does across ranks), then torchtitan's own cross-entropy: the forward and loss
of a step (torch 2.13's flex attention, 0.3's only attention for its language models, has no backward on
CPU). The split model's loss equals the whole model's and every parameter sits in exactly one stage: no
module is dropped or repeated (an export that
names 0.2.x's ``output`` leaves the last stage without its head, and the loss reads hidden states).
"""

from __future__ import annotations

import dataclasses
import shlex

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("triton")  # torchtitan 0.3's model registries import it, on CPU too
pipeline_parallel = pytest.importorskip("torchtitan.distributed.pipeline_parallel")
llama3 = pytest.importorskip("torchtitan.models.llama3")
loss = pytest.importorskip("torchtitan.components.loss")

from mpipe_tune.cli import main  # noqa: E402
from mpipe_tune.plan_file import dump_plan  # noqa: E402
from test_export import make_record  # noqa: E402


def exported_parts(tmp_path, schedule, cut, pp):
    """The export's module names per stage, as torchtitan 0.3's arguments give them."""
    record, model = make_record(schedule, cut, pp, 4)  # example-mllm: 16 decoder layers
    dump_plan(record, tmp_path / "plan.json")
    assert main(["export", str(tmp_path / "plan.json"), "--to", "torchtitan-0.3", "--out",
                 str(tmp_path / "job.args")]) == 0
    words = shlex.split("\n".join(line for line in (tmp_path / "job.args").read_text().splitlines()
                                  if not line.startswith("#")))
    value = words[words.index("--parallelism.module_fqns_per_model_part") + 1:]
    return [part.split(",") for part in value[:pp * len(schedule.split(","))]]


def titan_llama3(num_layers):
    """torchtitan 0.3's debug Llama-3 with ``num_layers`` decoder layers, its weights initialised its way."""
    config = llama3.model_registry("debugmodel").model
    config = dataclasses.replace(config, layers=[config.layers[i % len(config.layers)] for i in range(num_layers)])
    torch.manual_seed(0)
    model = config.build()
    model.init_states()
    return model


@pytest.mark.parametrize("schedule,cut,pp", [("1f1b", (), 2), ("1f1b,1f1b", (17,), 2)])
def test_torchtitan_0_3_runs_a_step_of_its_llama3_split_by_the_export(tmp_path, schedule, cut, pp):
    parts = exported_parts(tmp_path, schedule, cut, pp)
    whole = titan_llama3(16)
    stages = [pipeline_parallel._split_module(whole, names) for names in parts]
    tokens = torch.randint(0, 2048, (2, 32))
    labels = torch.randint(0, 2048, (2, 32))

    positions = torch.arange(32).expand(2, 32)
    masks = whole.get_attention_masks(positions)  # flex attention's causal block mask, as the trainer builds it
    with torch.no_grad():  # torch 2.13's flex attention has no backward on CPU
        h = tokens
        for stage in stages:
            h = stage(h, positions, masks)
        assert h.shape == (2, 32, 2048), "the last stage must end in the output layer (lm_head)"
        split_loss = loss.cross_entropy_loss(h, labels)
        whole_loss = loss.cross_entropy_loss(whole(tokens, positions, masks), labels)
    torch.testing.assert_close(split_loss, whole_loss)
    kept = [name for stage in stages for name, _ in stage.named_parameters()]
    assert sorted(kept) == sorted(name for name, _ in whole.named_parameters())  # every module in one stage
