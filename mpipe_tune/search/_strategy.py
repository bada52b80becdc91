"""The search-strategy interface: how a run visits the points of a space.

A strategy is a subclass of :class:`SearchStrategy` in its own module, registered by one line in
:data:`~mpipe_tune.search._driver.STRATEGIES` under the name ``--sampler`` gives. The driver
(:func:`~mpipe_tune.search._driver.run_search`) opens the study, makes a
:class:`~mpipe_tune.search._search_run.SearchRun` (the problem, the store, the incumbent, the bounds that
settle a point) and calls :meth:`SearchStrategy.search` once; the strategy evaluates and records points
through the run (:meth:`~SearchRun.evaluate`, :meth:`~SearchRun.info`, :meth:`~SearchRun.record`), stops
when :meth:`~SearchRun.must_stop` says so, and leaves why it stopped in the run's ``ending`` and ``gap``.
In the shape of Optuna's ``BaseSampler`` and torch pipelining's schedule classes.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import ClassVar

from mpipe_tune.search._search_run import SearchRun


@dataclass(frozen=True)
class StrategySettings:
    """What the command asks of any strategy; each reads the fields it needs."""

    n_trials: int
    """The study's total of trials to stop at."""
    seed: int = 0
    tolerance: float = 0.0
    """Stop once no unvisited point can beat the best by more than this share (bound order)."""
    refine: bool = True
    """Hill-climb from the best trials once half the budget is spent (sampling)."""
    sync_every_s: float = 10.0
    """How often the trials other workers stored are read."""


class SearchStrategy(ABC):
    """How a run visits the space's points."""

    name: ClassVar[str]
    """The ``--sampler`` name (``bound``, ``tpe``), or the mode's name for one the driver picks itself."""
    mode: ClassVar[str]
    """The summary's ``mode``: ``bound``, ``exhaustive`` or ``optuna``."""
    trial_cap: ClassVar[bool] = True
    """Whether it stops at ``n_trials`` (the summary names the cap)."""

    @abstractmethod
    def search(self, run: SearchRun, settings: StrategySettings) -> int | None:
        """Visit points until done, the study holds ``settings.n_trials`` or ``run.must_stop()``; the
        space's size when the strategy enumerated it, else None."""
