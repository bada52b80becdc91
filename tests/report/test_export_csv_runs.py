"""The torch-csv export of zero-bubble plans runs in torch's own schedule runtime
(``_PipelineScheduleRuntime._load_csv`` + ``step()``, gloo, one process per pipeline rank) and gives
the single-process step's loss and every gradient (float64): ``zb1p``'s split ``I``/``W`` backwards on
a loop of stages, ``zbv``'s on a V (rank r holding stages r and 2P-1-r), beside a 1f1b plan.

The model is a chain of one small block per stage: the CSV names stages, not layers, so any chain with
the plan's stage count runs it.
"""

from __future__ import annotations

import csv
import os

import pytest

torch = pytest.importorskip("torch")
dist = pytest.importorskip("torch.distributed")
schedules = pytest.importorskip("torch.distributed.pipelining.schedules")

from torch.distributed.pipelining import PipelineStage  # noqa: E402

from export_writers import to_torch_csv  # noqa: E402

from test_export import export_plan  # noqa: E402

WIDTH = 6
BATCH_PER_MICROBATCH = 2
P = 2
M = 4


def chain(num_stages):
    torch.manual_seed(7)
    return [torch.nn.Sequential(torch.nn.Linear(WIDTH, WIDTH), torch.nn.Tanh()).double() for _ in range(num_stages)]


def batch():
    generator = torch.Generator().manual_seed(11)
    x = torch.randn(M * BATCH_PER_MICROBATCH, WIDTH, generator=generator, dtype=torch.float64)
    return x, torch.randn(M * BATCH_PER_MICROBATCH, WIDTH, generator=generator, dtype=torch.float64)


def loss_fn(output, target):
    return ((output - target) ** 2).mean()


def run_rank(rank, csv_path, num_stages, init_file, out_dir):
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=P)
    try:
        with open(csv_path, newline="") as f:
            row = list(csv.reader(f))[rank]
        mine = sorted({int(cell.split("F")[0]) for cell in row if "F" in cell})
        blocks = chain(num_stages)
        stages = [PipelineStage(blocks[s], s, num_stages, torch.device("cpu")) for s in mine]
        schedule = schedules._PipelineScheduleRuntime(stages, M, loss_fn=loss_fn)
        schedule._load_csv(csv_path)
        x, target = batch()
        losses = []
        schedule.step(x, target=target, losses=losses)
        grads = {f"{s}.{name}": p.grad for s in mine for name, p in blocks[s].named_parameters()}
        torch.save({"grads": grads, "losses": [float(v) for v in losses]}, os.path.join(out_dir, f"rank{rank}.pt"))
    finally:
        dist.destroy_process_group()


def reference(num_stages):
    """One process: the mean over microbatches of each microbatch's loss, its gradients."""
    blocks = chain(num_stages)
    model = torch.nn.Sequential(*blocks)
    x, target = batch()
    losses = [loss_fn(model(xm), tm) for xm, tm in zip(x.chunk(M), target.chunk(M))]
    (sum(losses) / M).backward()
    grads = {f"{s}.{name}": p.grad for s, block in enumerate(blocks) for name, p in block.named_parameters()}
    return grads, [float(v.detach()) for v in losses]


@pytest.mark.parametrize("schedule,cut,num_chunks", [("zb1p", (), 1), ("zbv,zbv", (17,), 2)])
def test_torch_runs_the_exported_csv_with_the_single_process_gradients(tmp_path, schedule, cut, num_chunks):
    text = to_torch_csv(export_plan(schedule, cut, P, M))
    if schedule.startswith("zb"):
        assert "I" in text and "W" in text
    csv_path = tmp_path / "schedule.csv"
    csv_path.write_text(text)
    num_stages = P * num_chunks
    torch.multiprocessing.start_processes(run_rank, args=(str(csv_path), num_stages, str(tmp_path / "init"),
                                                          str(tmp_path)), nprocs=P, start_method="spawn")
    results = [torch.load(tmp_path / f"rank{r}.pt") for r in range(P)]
    grads = {k: v for result in results for k, v in result["grads"].items()}
    expected_grads, expected_losses = reference(num_stages)
    assert grads.keys() == expected_grads.keys()
    for name, grad in expected_grads.items():
        torch.testing.assert_close(grads[name], grad, rtol=1e-12, atol=1e-12, msg=name)
    losses = next(result["losses"] for result in results if result["losses"])
    assert losses == pytest.approx(expected_losses, rel=1e-12)
