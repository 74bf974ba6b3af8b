"""What a run prints: the D-ARL run's own lines, not its libraries' internals.

Why: with Python's defaults a 4-step smoke run printed 70 lines, most of them Megatron's: the
``DistributedDataParallelConfig(...)`` and ``OptimizerConfig(...)`` reprs (1,500 characters each),
every parameter name of each gradient bucket, "Detected Megatron Core" notices, and one
``UserWarning`` per module for the absent Apex / Transformer Engine (harmless: the fallbacks are
what we test on CPU). Among them the lines a user runs the job for (the steps, the reward, where
the outputs are) were hard to find.

So every process of a run (``launch.train`` and its children, ``launch.trainer`` and
``launch.rollout``, on one machine or under Slurm) calls ``setup_logging`` once its config is
known. By default the libraries' loggers show warnings and errors only, their import-time
``UserWarning``s are not shown, and transformers' "Loading weights" progress bars stay out of
the worker logs. ``loop.verbose=true`` (``python -m launch.train --verbose``) shows all of it
again. Our own loggers are never quietened: a warning of ours is always seen.
"""

from __future__ import annotations

import logging
import os
import warnings

# Libraries whose INFO lines are internals to a user of the run (their warnings still show).
QUIET_LOGGERS = ("megatron", "megatron_fsdp", "torch.distributed", "transformers", "matplotlib", "launch.procs")
# Modules whose import-time UserWarnings (no Apex, no Transformer Engine, deprecations) are hidden.
QUIET_WARNINGS = r"(megatron|megatron_fsdp|transformer_engine|apex)(\.|$)"


def setup_logging(name: str, verbose: bool = False) -> None:
    """Log as ``name`` (``launch.train``, ``trainer0``, ``rollout1``) at INFO; quieten the
    libraries unless ``verbose``. Call it before Megatron is imported (its warnings come then)."""
    fmt = "%(asctime)s %(name)s %(levelname)s %(message)s" if name == "launch.train" else \
        f"%(asctime)s {name} %(levelname)s %(message)s"
    logging.basicConfig(level=logging.INFO, format=fmt)
    if verbose:
        return
    for logger in QUIET_LOGGERS:
        logging.getLogger(logger).setLevel(logging.WARNING)
    warnings.filterwarnings("ignore", category=UserWarning, module=QUIET_WARNINGS)
    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")  # read when transformers is imported
