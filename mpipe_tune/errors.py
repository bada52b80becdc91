"""The project's errors, by how the user recovers (Optuna's ``exceptions.py`` separates them alike).

Every one is a :class:`MpipeError`: a user error whose message is one line that names what is wrong
(the quantity, the value, what must hold) and how to fix it. The CLI prints the line and exits with
the class's :attr:`~MpipeError.exit_code`; programmer errors are ``assert``s and are not caught.

============================  =========  ==================================================================
class                         exit code  how the user recovers
============================  =========  ==================================================================
:class:`MpipeError`           2          bad input: change the value the message names
:class:`NotSupportedError`    2          a valid request this version cannot carry out: change the request
:class:`DoesNotFitError`      2          no plan fits the devices: more devices, less memory per device
:class:`PlanFileError`        2          a damaged, edited or stale plan file: re-create it, or point to its
                                         moved inputs
:class:`~mpipe_tune.runtime   1          a run that started and failed (a rank died, a step raised): the
.launch.RankFailed`                      message names the rank and the cause (a rank's own MpipeError: 2)
============================  =========  ==================================================================

A command interrupted by Ctrl-C exits with 130 (the shell's code for SIGINT).

An error names quantities, never command-line flags (``trial budget``, not ``--trials``): the same
check serves the CLI, the Python API and the plan file. It lists the quantities its message names in
:attr:`~MpipeError.quantities`, so that the CLI can add the flag that sets each one where it helps
(``mpipe_tune.cli._errors``: ``trial budget (--trials) is 0, ...``).
"""

from __future__ import annotations


class MpipeError(ValueError):
    """A user error (bad input): one line naming what is wrong and how to fix it."""

    exit_code: int = 2
    """What the CLI exits with when this error ends a command."""

    def __init__(self, message: str = "", *, quantities: tuple[str, ...] = ()) -> None:
        super().__init__(message)
        self.quantities = quantities
        """The input quantities the message names, each as it appears there (``"trial budget"``): what the
        user changes to recover; the CLI adds the flag that sets each (one the message does not name, in a
        hint given only sometimes, is skipped)."""


class NotSupportedError(MpipeError):
    """A valid request that this version cannot carry out yet (the message says which part)."""


class DoesNotFitError(MpipeError):
    """No plan of the request fits the devices' memory (the message gives the smallest need found)."""


class PlanFileError(MpipeError):
    """A plan file that is damaged, was edited, or no longer matches its inputs (the model, profile or
    workload changed since the plan was made); re-create it, or point to the inputs where they moved."""

