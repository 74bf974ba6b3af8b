"""Bad input stops the launcher in one line, exit 2, before any process starts.

Why: a value or dataset checked only where it is used, inside the children after the trainer
has started, fails late and obscurely: ``lr=nan``, ``num_prompts=0`` or ``master_port=99999``
as 39-79 lines of a child's traceback, ``lr=1e9`` as "trainer gone?", a dataset that is not
UTF-8 as a bare ``UnicodeDecodeError`` 16-30 s in, an empty one as "0 prompts cannot be split
into 1 shards", and ``temperature=0`` or ``group_size=1`` (no learning signal) train without a
word.

- ``check_values`` (``launch.preflight``; no files): no config value is NaN; the learning
  rate, the rendezvous and control ports (no privileged port: root can bind port 1), a finite
  importance-weight cap (``algorithm.mis.clip=inf`` would train uncapped), a
  ``data.max_records`` that keeps prompts and applies (built-in data has no records to cap),
  the generated prompt count; a sampler and group size that give group-normalized advantages something to
  normalize.
- ``check_inputs`` (once the policy is resolved): the dataset read exactly as every worker
  reads it (``data.load_dataset``: a bad row is named by file and line), enough prompts for the
  workers, and every prompt's token count (the policy's tokenizer and chat template) against
  the context (``data.prompt_fit``: refused, or dropped and counted with
  ``data.overlong_prompts=drop``).
"""

from __future__ import annotations

import logging
import math
from pathlib import Path

from launch.resume_changes import leaves

log = logging.getLogger("launch.validate")
MAX_LR = 1.0  # Adam moves every weight by about lr per step: lr >= 1 wrecks the policy at once


def check_values(cfg) -> None:
    """Config values no component rejects until it uses them; ``ValueError`` naming the key."""
    for key, value in leaves(cfg):
        if isinstance(value, float) and math.isnan(value):
            raise ValueError(f"{key}=nan is not a number")
    lr = cfg.trainer.optimizer.lr
    if not 0 < lr < MAX_LR:
        raise ValueError(f"trainer.optimizer.lr={lr:g} must be in (0, {MAX_LR:g}): Adam moves every weight by "
                         "about lr per step, so the first step would wreck the policy")
    port = cfg.cluster.master_port
    if not 0 <= port <= 65535:
        raise ValueError(f"cluster.master_port={port} must be in [0, 65535] (0: a free one)")
    for key, port in (("cluster.master_port", port), ("transport.control.port", cfg.transport.control.port)):
        if 0 < port < 1024:  # root binds it, so the run starts, on a port reserved for system services
            raise ValueError(f"{key}={port} is a privileged port (1-1023, reserved for system services): "
                             "use 0 (a free one) or a port in [1024, 65535]")
    clip = cfg.algorithm.mis.clip
    if math.isinf(clip):
        raise ValueError(f"algorithm.mis.clip={clip}: the behavior weights would be uncapped, and one token "
                         "with a large ratio pi_t / q can dominate an update; use a finite cap (default 2.0)")
    records = cfg.data.max_records
    if records == 0 or records < -1:
        raise ValueError(f"data.max_records={records} keeps no prompts: use -1 (all) or N >= 1")
    if records != -1 and cfg.data.source == "builtin":
        key = "countdown" if cfg.data.task == "countdown" else "builtin"
        raise ValueError(f"data.max_records={records} applies to dataset files; built-in data generates "
                         f"data.{key}.num_prompts prompts: set that instead")
    _check_generated(cfg)
    if cfg.sampling.temperature <= 0:
        raise ValueError(f"sampling.temperature={cfg.sampling.temperature}: greedy decoding gives a prompt's "
                         "G responses the same text, so group-normalized advantages are 0 and nothing is "
                         "learned; use a temperature > 0")
    if cfg.algorithm.group_size < 2:
        raise ValueError(f"algorithm.group_size={cfg.algorithm.group_size}: a group of one response has "
                         "advantage 0 (its reward minus its own mean), so nothing is learned; use >= 2")


def _check_generated(cfg) -> None:
    """A generated dataset gives every rollout worker at least one prompt."""
    if cfg.data.source != "builtin":
        return
    key = "countdown" if cfg.data.task == "countdown" else "builtin"
    n, workers = getattr(cfg.data, key).num_prompts, cfg.cluster.rollout_workers
    if n < workers:
        raise ValueError(f"data.{key}.num_prompts={n} must be >= cluster.rollout_workers={workers} "
                         "(every worker needs prompts of its own)")


def _dataset_name(cfg) -> str:
    return f"data.path={cfg.data.path}" if cfg.data.source == "file" else f"data {cfg.data.name}"


def check_inputs(cfg, max_position_embeddings: int, say=log.warning) -> int:
    """The prompts every worker will load (``check_values`` first): returns how many are used.

    Raises:
        ValueError: one line naming the file and line of a bad row or an over-long prompt, or
            the dataset that has too few prompts.
    """
    from megatron_darl.data import MalformedRowError, load_dataset
    from megatron_darl.data.prompt_fit import fit_prompts, prompt_tokenizer
    from megatron_darl.rewards import reference_check

    try:
        loaded = load_dataset(cfg.data, reference_check(cfg.data.task, cfg.reward))
    except MalformedRowError as exc:
        raise ValueError(f"{exc} (data.skip_malformed=true skips bad rows, counted)") from None
    records = loaded.records
    if cfg.model.path:  # the tokenizer is the policy's (model.hf_config alone: random init, none)
        fit = fit_prompts(cfg, records, prompt_tokenizer(cfg.model.path), max_position_embeddings)
        records = fit.records
        if fit.dropped:
            say(f"data.overlong_prompts=drop: {len(fit.dropped)} of {len(loaded.records)} prompts are longer "
                f"than {fit.budget} tokens and dropped (first: {fit.dropped[0]})")
    workers = cfg.cluster.rollout_workers
    if len(records) < workers:
        empty = cfg.data.source == "file" and Path(cfg.data.path).expanduser().stat().st_size == 0
        what = "is empty" if empty else f"gives {len(records)} usable prompt(s)"
        skipped = f", {loaded.skipped} malformed row(s) skipped" if loaded.skipped else ""
        raise ValueError(f"{_dataset_name(cfg)} {what}{skipped}: cluster.rollout_workers={workers} "
                         "need at least one prompt each")
    if loaded.skipped:
        say(f"{_dataset_name(cfg)}: {loaded.skipped} malformed row(s) skipped (data.skip_malformed), "
            f"lines {loaded.skipped_lines[:5]}")
    return len(records)
