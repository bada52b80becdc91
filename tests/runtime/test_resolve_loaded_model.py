"""A plan resolved on a model passed in as a loaded ``Model`` (the Python API: ``read_plan_file(path,
model=...)``, ``repredict(model=...)``) is checked against the plan's model hash like a spec is: a model whose
content differs (other trainable bits, another layer's costs) is refused (skipping that check passed every other
test)."""

from __future__ import annotations

from dataclasses import replace

import pytest
from runtime_plans import FIRST_LLM, TEST_MODEL, make_plan

from mpipe_tune.algebra import Model
from mpipe_tune.errors import PlanFileError
from mpipe_tune.inputs import load_model
from mpipe_tune.report import repredict
from mpipe_tune.runtime import read_plan_file


@pytest.fixture(scope="module")
def plan(tmp_path_factory):
    return make_plan(tmp_path_factory.mktemp("plan"), "transpose,1f1b", (FIRST_LLM,), 2)


def _others(model: Model) -> dict[str, Model]:
    last = model.layers[-1]
    return {"frozen encoder": model.with_frozen(("encoder",)),
            "renamed": replace(model, name=model.name + "-other"),
            "one layer fewer": replace(model, layers=model.layers[:-1]),
            "a layer's name": replace(model, layers=(*model.layers[:-1], replace(last, name=last.name + "x")))}


def test_the_plan_s_own_loaded_model_resolves(plan):
    model = load_model(TEST_MODEL)
    assert read_plan_file(str(plan), model=model).model == model
    assert repredict(plan, model=model).unchanged


@pytest.mark.parametrize("change", ["frozen encoder", "renamed", "one layer fewer", "a layer's name"])
def test_a_loaded_model_whose_content_differs_is_refused(plan, change):
    other = _others(load_model(TEST_MODEL))[change]
    with pytest.raises(PlanFileError, match="content hash mismatch"):
        read_plan_file(str(plan), model=other)
    with pytest.raises(PlanFileError, match="content hash mismatch"):
        repredict(plan, model=other)
