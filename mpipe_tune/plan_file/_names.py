"""The names that mark the plans a plan file stores: what ``--plan NAME`` selects, the rows of a
comparison and the sections ``plan`` writes. The search writes under them and every reader (``show``,
``run``, ``bench``, ``export``, ``report``) selects by them, so they live here, below both.
"""

from __future__ import annotations

BEST = "best"
"""The file's top-level plan (the search's winner)."""
BASELINES = ("megatron", "disttrain", "vpp", "gpipe", "mpipe-rr")
"""The standard schedules planned beside the best, at its degrees (:mod:`mpipe_tune.search._baselines`)."""
REFERENCE = "megatron"
"""The baseline speedups are measured against (the encoder inside the first pipeline stage)."""
MPIPE_RR = "mpipe-rr"
"""The baseline of ``<transpose,1f1b>`` with round-robin owners."""
OWN = "@own"
"""The suffix of a baseline at its own best layout (``megatron@own``)."""
CURRENT = "current"
"""The user's current layout (``plan --current``)."""
