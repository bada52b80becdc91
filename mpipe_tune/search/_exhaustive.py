"""The exhaustive walk: every point of the space not yet in the study, in increasing bound order to the
end (``--exhaustive``, or a space no larger than the trial budget): the space's optimum."""

from __future__ import annotations

from mpipe_tune.search._bound_order import walk
from mpipe_tune.search._search_run import SearchRun
from mpipe_tune.search._strategy import SearchStrategy, StrategySettings


class Exhaustive(SearchStrategy):
    name = "exhaustive"
    mode = "exhaustive"
    trial_cap = False

    def search(self, run: SearchRun, settings: StrategySettings) -> int | None:
        size = walk(run)
        run.ending = "enumerated"
        return size
