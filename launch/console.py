"""What a run prints: the D-ARL run's own lines, not its libraries' internals.

Why: with Python's defaults a 4-step smoke run prints 70 lines, most of them Megatron's: the
``DistributedDataParallelConfig(...)`` and ``OptimizerConfig(...)`` reprs (1,500 characters each),
every parameter name of each gradient bucket, "Detected Megatron Core" notices, and one
``UserWarning`` per module for the absent Apex / Transformer Engine (harmless: the fallbacks are
what we test on CPU). Among them the lines a user runs the job for (the steps, the reward, where
the outputs are) are hard to find.

So every process of a run (``launch.train`` and its children, ``launch.trainer`` and
``launch.rollout``, on one machine or under Slurm) calls ``setup_logging`` once its config is
known. By default the libraries' loggers show warnings and errors only, their import-time
``UserWarning``s and the deprecations of what Megatron's checkpointing calls (a ``FutureWarning``
at every resume) are not shown, and transformers' "Loading weights" progress bars stay out of
the worker logs (``megatron_darl.quiet`` lists them). ``loop.verbose=true``
(``python -m launch.train --verbose``) shows all of it again. Our own loggers are never quietened: a warning of ours is always seen.
"""

from __future__ import annotations

import logging

from megatron_darl.quiet import QUIET_LOGGERS, QUIET_MODULES, quiet_libraries  # noqa: F401 (re-exported)


def setup_logging(name: str, verbose: bool = False) -> None:
    """Log as ``name`` (``launch.train``, ``trainer0``, ``rollout1``) at INFO; quieten the
    libraries unless ``verbose`` (``megatron_darl.quiet``). Call it before Megatron is imported
    (its warnings come then)."""
    fmt = "%(asctime)s %(name)s %(levelname)s %(message)s" if name == "launch.train" else \
        f"%(asctime)s {name} %(levelname)s %(message)s"
    logging.basicConfig(level=logging.INFO, format=fmt)
    if not verbose:
        quiet_libraries()
