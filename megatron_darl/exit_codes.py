"""The exit codes of the project's processes, in one table.

A trainer rank, a rollout worker and the launchers (``launch.train``, ``launch.trainer``,
``launch.rollout``, ``launch.slurm``) end with one of these; the launcher reads them to decide
whether a rollout worker may be started again (not one that lost its trainer: a new one would
leave too). A negative code from ``Popen`` is a signal, never one of these. This module imports
nothing of the project, so every layer may use it.
"""

from __future__ import annotations

from enum import IntEnum


class ExitCode(IntEnum):
    """What a process's exit status means."""

    OK = 0  # done: the trainer's steps finished, or the rollout worker saw the stop flag
    FAILED = 1  # stopped on an error named in one line (aborted run, checkpoint failed or damaged, NaN weights)
    USAGE = 2  # the command line, config or run dir was refused before any process started
    TRAINER_LOST = 3  # a trainer rank or rollout worker lost a trainer rank (frozen or gone)
    LOAD_FAILED = 4  # a rollout engine could not load the weights the trainer sent
