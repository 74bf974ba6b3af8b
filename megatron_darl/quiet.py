"""The libraries' notices a user of a run, a converter or an evaluation cannot act on, kept quiet.

Why: Megatron warns at import that Apex and Transformer Engine are absent (harmless: the
fallbacks are what CPU runs use), its ``dist_checkpointing`` calls torch APIs torch has deprecated
(``load_state_dict``, ``ShardedTensor``: a ``FutureWarning`` at every checkpoint load, so at every
resume, conversion and held-out evaluation), and its DDP and optimizer log their configs at INFO.
Shown in every process, they buried the lines a user runs the job for. ``quiet_libraries`` is the
one place that says which ones go; ``launch.console`` (every process of a run), the converters'
and evaluation entry points call it unless asked to be verbose. Our own warnings always show.
"""

from __future__ import annotations

import logging
import os
import warnings

# Libraries whose INFO lines are internals to a user of the run (their warnings still show).
QUIET_LOGGERS = ("megatron", "megatron_fsdp", "torch.distributed", "transformers", "matplotlib", "launch.procs")
# Modules whose import-time UserWarnings (no Apex, no Transformer Engine) and deprecation notices
# (Future/DeprecationWarning: torch APIs they call) are hidden.
QUIET_MODULES = r"(megatron|megatron_fsdp|transformer_engine|apex)(\.|$)"
# Deprecations raised by torch for what Megatron's checkpointing calls, whichever frame they name
# (on CPU the device shim, megatron_darl.trainer.cpu_compat, is the caller torch sees).
QUIET_MESSAGES = (r"Please use DTensor instead and we are deprecating ShardedTensor",
                  r"`load_state_dict` is deprecated and will be removed")


def quiet_libraries() -> None:
    """Quieten the libraries' INFO logs, import-time notices and deprecations (idempotent)."""
    for logger in QUIET_LOGGERS:
        logging.getLogger(logger).setLevel(logging.WARNING)
    for category in (UserWarning, FutureWarning, DeprecationWarning):
        warnings.filterwarnings("ignore", category=category, module=QUIET_MODULES)
    for message in QUIET_MESSAGES:
        warnings.filterwarnings("ignore", category=FutureWarning, message=message)
    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")  # read when transformers is imported
