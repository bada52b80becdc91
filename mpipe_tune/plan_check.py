"""A plan file's stored fields checked as strictly as the flags that made them.

:func:`validate_section_fields` is what :func:`~mpipe_tune.plan_file.load_plan` runs on every
section: each candidate field has its type and range (the limits the CLI applies), and the predicted
figures are finite and non-negative, so a damaged file ends in one line naming the field instead of
a ``KeyError`` or a division by zero further on. :func:`validate_inputs` checks the inputs a file
names, :func:`validate_search` the search summary ``show`` prints.

>>> check_count({"tp": 0}, "tp", where="plan file p.json", upper=8)
Traceback (most recent call last):
...
mpipe_tune.errors.MpipeError: plan file p.json: candidate field 'tp' = 0 must be an integer from 1 to 8; the file is damaged or was edited: re-create it with 'mpipe-tune plan'
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from mpipe_tune.algebra.candidate import DTYPE_BYTES, GRAD_REDUCE_DTYPES, MAX_DEVICES, RECOMPUTE_GRANULARITIES
from mpipe_tune.algebra.encoder_backward import COOLDOWN, PLACEMENTS
from mpipe_tune.inputs.workload import MAX_MICROBATCHES
from mpipe_tune.errors import MpipeError
from mpipe_tune.inputs import check_finite

_FIX = "the file is damaged or was edited: re-create it with 'mpipe-tune plan'"


def damaged(where: str, message: str) -> MpipeError:
    """The one-line error for a damaged or edited plan file: where, what is wrong, how to fix it."""
    return MpipeError(f"{where}: {message}; {_FIX}")


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def check_count(c: Mapping[str, Any], key: str, *, where: str, lower: int = 1, upper: int) -> int:
    """``c[key]`` as an integer in ``[lower, upper]``, or a one-line error naming the field."""
    value = c.get(key)
    if not _is_int(value) or not lower <= value <= upper:
        raise damaged(where, f"candidate field {key!r} = {value!r} must be an integer from {lower} to {upper}")
    return value


def _int_list(value: Any, *, where: str, field: str, lower: int, upper: int, length: int | None = None) -> list[int]:
    if not isinstance(value, list) or not all(_is_int(v) and lower <= v <= upper for v in value):
        raise damaged(where, f"candidate field {field!r} = {value!r} must be a list of integers from {lower} to {upper}")
    if length is not None and len(value) != length:
        raise damaged(where, f"candidate field {field!r} lists {len(value)} entries, but the candidate needs {length}")
    return value


def validate_candidate(c: Any, *, where: str) -> None:
    """Every field of a stored candidate: types, ranges, and lengths that agree with each other."""
    if not isinstance(c, dict):
        raise damaged(where, "field 'candidate' must be an object")
    if not isinstance(c.get("schedule"), str) or not c["schedule"].strip():
        raise damaged(where, f"candidate field 'schedule' = {c.get('schedule')!r} must be a schedule text such as 'transpose,1f1b'")
    pp, tp, dp = (check_count(c, k, where=where, upper=MAX_DEVICES) for k in ("pp", "tp", "dp"))
    if pp * tp * dp > MAX_DEVICES:
        raise damaged(where, f"candidate pp*tp*dp = {pp}*{tp}*{dp} is above {MAX_DEVICES} devices")
    m = check_count(c, "microbatches", where=where, upper=MAX_MICROBATCHES)
    for key in ("ep", "cp", "encoder_tp"):  # optional degrees (1 when absent)
        if key in c:
            check_count(c, key, where=where, upper=MAX_DEVICES)
    if "zero_stage" in c:
        check_count(c, "zero_stage", where=where, lower=0, upper=3)
    for key in ("owner_policy", "label"):
        if c.get(key) is not None and not isinstance(c[key], str):
            raise damaged(where, f"candidate field {key!r} = {c[key]!r} must be text or null")
    if not isinstance(c.get("frozen"), list) or not all(isinstance(b, str) for b in c["frozen"]):
        raise damaged(where, f"candidate field 'frozen' = {c.get('frozen')!r} must be a list of block names")
    if not isinstance(c.get("sequence_parallel", False), bool):
        raise damaged(where, f"candidate field 'sequence_parallel' = {c['sequence_parallel']!r} must be true or false")
    _int_list(c.get("cut"), where=where, field="cut", lower=1, upper=1 << 20)
    if not isinstance(c.get("dtype"), str) or c["dtype"] not in DTYPE_BYTES:
        raise damaged(where, f"candidate field 'dtype' = {c.get('dtype')!r} must be one of {', '.join(DTYPE_BYTES)}")
    if not isinstance(c.get("recompute", False), bool) and c.get("recompute") not in RECOMPUTE_GRANULARITIES:
        raise damaged(where, f"candidate field 'recompute' = {c.get('recompute')!r} must be true, false or one of "
                           f"{', '.join(RECOMPUTE_GRANULARITIES)}")
    slabs = c.get("slabs")
    if not isinstance(slabs, list):
        raise damaged(where, f"candidate field 'slabs' = {slabs!r} must be a list of per-rank layer counts per region")
    for counts in slabs:
        _int_list(counts, where=where, field="slabs", lower=0, upper=1 << 20, length=pp)
    if "owners" not in c:
        raise damaged(where, "candidate field 'owners' is missing (null for a plan without a transpose region)")
    if c["owners"] is not None:
        _int_list(c["owners"], where=where, field="owners", lower=0, upper=pp - 1, length=m)
    if c.get("encoder_backward", COOLDOWN) not in PLACEMENTS:
        raise damaged(where, f"candidate field 'encoder_backward' = {c['encoder_backward']!r} must be one of "
                           f"{', '.join(PLACEMENTS)}")
    if c.get("encoder_backward_slots") is not None:
        _int_list(c["encoder_backward_slots"], where=where, field="encoder_backward_slots", lower=0, upper=1 << 30,
                  length=m)
    if c.get("encoder_backward_ranks") is not None:
        _int_list(c["encoder_backward_ranks"], where=where, field="encoder_backward_ranks", lower=0, upper=pp - 1,
                  length=m)
        if c.get("encoder_backward_slots") is None:
            raise damaged(where, "candidate field 'encoder_backward_ranks' is set but 'encoder_backward_slots' is "
                                 "null; moved encoder backwards need their slots")


def validate_predicted(predicted: Any, num_events: int, pp: int, *, where: str) -> None:
    """The stored prediction: a finite, non-negative step time, per-rank figures, one duration per event."""
    if not isinstance(predicted, dict):
        raise damaged(where, "field 'predicted' must be an object")
    durations = predicted.get("durations_s")
    if not isinstance(durations, list) or len(durations) != num_events:
        raise damaged(where, f"field 'predicted.durations_s' must list one duration per event ({num_events})")
    ranks = predicted.get("ranks")
    if not isinstance(ranks, list) or len(ranks) != pp or not all(isinstance(r, dict) for r in ranks):
        raise damaged(where, f"field 'predicted.ranks' must hold one object per pipeline rank ({pp})")
    numbers = [("makespan_s", predicted.get("makespan_s")), *(("durations_s", d) for d in durations)]
    numbers += [("ranks.memory.peak_bytes", r["memory"].get("peak_bytes") if isinstance(r.get("memory"), dict) else None)
                for r in ranks]
    try:
        for field, value in numbers:
            check_finite(value, where=f"{where} predicted", field=field)
    except MpipeError as exc:
        raise MpipeError(f"{exc}; {_FIX}") from None


def validate_inputs(inputs: Any, *, where: str) -> None:
    """The model and profile a plan names (a spec, a name and a content hash each), and its workload's name and hash."""
    for what in ("model", "profile"):
        entry = inputs.get(what) if isinstance(inputs, dict) else None
        if not isinstance(entry, dict) or not all(isinstance(entry.get(k), str) for k in ("spec", "name", "hash")):
            raise damaged(where, f"field 'inputs.{what}' must hold its 'spec', 'name' and 'hash' as text")
    workload = inputs.get("workload")
    if not isinstance(workload, dict) or not all(isinstance(workload.get(k), str) for k in ("name", "hash")):
        raise damaged(where, "field 'inputs.workload' must hold its 'name' and 'hash' as text, and its microbatches")
    frozen = inputs["model"].get("frozen", [])
    if not isinstance(frozen, list) or not all(isinstance(b, str) for b in frozen):
        raise damaged(where, "field 'inputs.model.frozen' must be a list of block names")
    try:
        check_finite(inputs.get("moe_imbalance"), where=f"{where} inputs", field="moe_imbalance", lower=1.0)
        if inputs.get("grad_reduce_dtype", "fp32") not in GRAD_REDUCE_DTYPES:
            raise MpipeError(f"{where} inputs: field 'grad_reduce_dtype' must be one of {', '.join(GRAD_REDUCE_DTYPES)}")
        if not isinstance(inputs.get("overlap_dp_comm", True), bool):
            raise MpipeError(f"{where} inputs: field 'overlap_dp_comm' must be true or false")
    except MpipeError as exc:
        raise MpipeError(f"{exc}; {_FIX}") from None


def validate_section_fields(section: dict[str, Any], workload: Any, *, where: str) -> None:
    """One section's candidate, its prediction, and its stored workload's length."""
    c = section.get("candidate")
    validate_candidate(c, where=where)
    events = section.get("order", {}).get("events") if isinstance(section.get("order"), dict) else None
    if not isinstance(events, list):
        raise damaged(where, "field 'order.events' must be a list of event texts")
    validate_predicted(section.get("predicted"), len(events), c["pp"], where=where)
    microbatches = workload.get("microbatches") if isinstance(workload, dict) else None
    if not isinstance(microbatches, list) or len(microbatches) != c["microbatches"]:
        count = len(microbatches) if isinstance(microbatches, list) else "no"
        raise damaged(where, f"the stored workload holds {count} microbatches but the candidate has "
                           f"{c['microbatches']}")


def validate_search(search: Any, *, where: str) -> None:
    """The search summary ``plan`` stores (what ``show`` prints): the fields read besides the table rows."""
    if not isinstance(search, dict):
        raise damaged(where, "field 'search' must be an object")
    for key, kind in (("study", str), ("trials", int), ("samples", int), ("global_batch", int), ("comparison", list)):
        if not isinstance(search.get(key), kind) or isinstance(search.get(key), bool):
            raise damaged(where, f"field 'search.{key}' = {search.get(key)!r} must be {kind.__name__}")
    if search["samples"] < 1 or not all(isinstance(row, dict) for row in search["comparison"]):
        raise damaged(where, "field 'search' holds a sample count below 1 or a comparison row that is not an object")
