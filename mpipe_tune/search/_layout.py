"""``plan --current``: the layout a user runs today, as a candidate of the same algebra: text
(``key=value`` pairs or the candidate's text form, :mod:`~mpipe_tune.search._layout_keys`) or a
MindSpeed-MM model.json with its launch arguments (:mod:`~mpipe_tune.search._current_mindspeed`).
"""

from __future__ import annotations

from mpipe_tune.algebra import Candidate
from mpipe_tune.errors import MpipeError
from mpipe_tune.inputs import is_model_json
from mpipe_tune.search._current_mindspeed import mindspeed_candidate
from mpipe_tune.search._layout_keys import EXAMPLE, KEYS, parse_layout_keys, split_pairs
from mpipe_tune.search._space import SearchSpace

__all__ = ["EXAMPLE", "KEYS", "parse_layout", "split_pairs"]


def parse_layout(text: str, space: SearchSpace, *, label: str = "current", launch_args: str | None = None
                 ) -> Candidate:
    """The candidate ``text`` describes, for ``space``'s problem: a MindSpeed-MM model.json read with
    ``launch_args`` (its launch flags or script), else a layout in text (:func:`parse_layout_keys`)."""
    if is_model_json(text):
        return mindspeed_candidate(text, space, label=label, launch_args=launch_args)
    if launch_args is not None:
        raise MpipeError(f"{label} layout '{text}': launch arguments go with a MindSpeed-MM model.json only; give "
                         f"the degrees as keys of the layout (tp=, dp=, M=, recompute=)")
    return parse_layout_keys(text, space, label=label)
