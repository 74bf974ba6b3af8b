"""What the launcher settles in the run directory before any process starts.

Why: the launcher and the trainer loop must agree on the resume point (a cut-off checkpoint
write counted by one and skipped by the other leaves the workers waiting for resumed weights
that never come), and ``run_config.yaml`` must not be rewritten by a launch whose resume then
fails on a changed config. Here, in order (``launch.train`` and
``launch.slurm`` alike; the run dir is locked first, ``launch.run_lock``):

- ``inspect_run_dir``: the resume point is the newest complete checkpoint
  (``megatron_darl.checkpoint.resume_points``: the loop's own answer); partial writes are named,
  never used; a dir holding an earlier run (complete checkpoints or metric records) is refused without
  ``loop.resume=true``; a resume with no complete checkpoint starts at step 0 and says so (the
  earlier metric records are kept, ``loop.metrics``); a resume with another model than the
  checkpoint's is refused here, before the warm start fits one (``check_same_model``).
- ``check_changes``: the new config against the checkpoint run's ``run_config.yaml``
  (``launch.resume_changes``: the table of allowed changes; the others refused in one line).
- ``commit_config``: ``run_config.yaml`` is written only once all checks passed; when the run's
  config changed, the old file stays as ``run_config.until_step_NNNNNN.yaml``.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from pathlib import Path

from launch.config import save_run_config
from launch.resume_changes import LAUNCH_KEYS, Change, check_resume, config_changes
from megatron_darl.checkpoint.resume_points import (
    COMPLETION_MARKER, checkpoint_step, complete_checkpoints, partial_checkpoints,
)

CONFIG_NAME = "run_config.yaml"
log = logging.getLogger("launch.run_dir")


@dataclass
class RunDirState:
    """What an earlier run left in the run dir, as far as this launch is concerned."""

    run_dir: Path
    resume_from: Path | None  # the newest complete checkpoint when resuming, else None
    records: int  # metric records (lines of metrics.jsonl) earlier launches wrote

    @property
    def start_step(self) -> int:
        return checkpoint_step(self.resume_from) if self.resume_from is not None else 0


def _records(run_dir: Path) -> int:
    path = run_dir / "metrics.jsonl"
    if not path.is_file():
        return 0
    with path.open("rb") as f:
        return sum(1 for line in f if line.strip())


def inspect_run_dir(cfg, say=log.warning, knobs=("loop.run_dir", "pass loop.resume=true")) -> RunDirState:
    """The resume point, or ``ValueError`` when the run dir holds a run this launch would clobber
    (``knobs``: how the message names the run dir and the resume switch; Slurm has its own)."""
    run_dir = Path(cfg.loop.run_dir)
    complete, partial, records = complete_checkpoints(run_dir), partial_checkpoints(run_dir), _records(run_dir)
    if not cfg.loop.resume and (complete or records):
        held = ", ".join(filter(None, [f"checkpoint {complete[-1].name}" if complete else "",
                                       f"{records} step record(s) in metrics.jsonl" if records else ""]))
        raise ValueError(f"{knobs[0]}={run_dir} holds an earlier run ({held}): {knobs[1]} to continue it, "
                         f"or another {knobs[0]}")
    if partial:
        say(f"{run_dir / 'checkpoints'}: {', '.join(p.name for p in partial)} incomplete (a write cut off: "
            f"no {COMPLETION_MARKER}): not a resume point")
    resume_from = complete[-1] if cfg.loop.resume and complete else None
    if cfg.loop.resume and resume_from is None and records:
        from megatron_darl.loop.metrics import SUPERSEDED  # here: that module imports torch

        say(f"loop.resume=true but {run_dir} holds no complete checkpoint: the run starts at step 0; the "
            f"{records} earlier step record(s) move to {SUPERSEDED} at its first step")
    if resume_from is not None:
        check_same_model(cfg, resume_from)
    return RunDirState(run_dir, resume_from, records)


# the sizes a warm-start preset fixes before its tokenizer (vocab) and fit exist
_SHAPE = ("hidden_size", "intermediate_size", "num_layers", "num_heads", "num_kv_heads", "head_dim",
          "max_position_embeddings", "tie_word_embeddings")


def check_same_model(cfg, checkpoint: Path) -> None:
    """A resume with another model than the checkpoint's is refused here, in one line naming the
    fields, before the warm start fits a new policy or any process starts (the trainer's loader
    would refuse it minutes later, in a 24-line traceback, after ``run_config.yaml`` was
    replaced). The launch's model is known from its config alone: ``model.path``'s
    ``config.json``, ``model.hf_config``, or the warm-start preset's sizes (its vocabulary comes
    from the tokenizer later, and the loader still compares every field)."""
    from launch.preflight import model_shape
    from megatron_darl.checkpoint.model_io import read_metadata
    from megatron_darl.models.qwen3.config import spec_from_hf

    hf, source = model_shape(cfg)
    mine = spec_from_hf(hf, source).to_dict()
    try:
        meta = read_metadata(checkpoint)
        saved = meta.model_spec or spec_from_hf(meta.hf_config).to_dict()
    except (OSError, ValueError):  # damaged metadata: the trainer's load refuses it, naming the file
        return
    keys = _SHAPE if source == "warmstart.model" else sorted(mine)
    diff = [f"{k}: checkpoint {saved.get(k)!r} vs {mine[k]!r}" for k in keys if k in saved and saved[k] != mine[k]]
    if diff:
        raise ValueError(f"loop.resume: {checkpoint} holds another model than this launch's ({source}): "
                         f"{'; '.join(diff)}; resume with the checkpoint's model, or start a new loop.run_dir")


def _old_config(run_dir: Path) -> tuple[dict | None, Path]:
    from omegaconf import OmegaConf

    path = run_dir / CONFIG_NAME
    if not path.is_file():
        return None, path
    try:
        old = OmegaConf.to_container(OmegaConf.load(path), resolve=False)
    except Exception as exc:  # noqa: BLE001 (yaml and OmegaConf errors: a damaged file)
        raise ValueError(f"{path}: unreadable ({type(exc).__name__}); it is the checkpoint's run config: "
                         "restore it, or move it aside to resume without checking config changes") from None
    return (old if isinstance(old, dict) else None), path


def check_changes(cfg, state: RunDirState, say=log.warning) -> list[Change]:
    """Config changes since the checkpoint's run, all allowed (else ``ValueError``, one line)."""
    if state.resume_from is None:
        return []
    old, path = _old_config(state.run_dir)
    if old is None:
        say(f"{path} is missing: config changes since the checkpoint's run cannot be checked")
        return []
    changes = check_resume(old, cfg, str(path))
    noted = [str(c) for c in changes if c.key not in LAUNCH_KEYS]
    if noted:
        say(f"resuming from {state.resume_from.name} with {len(noted)} allowed config change(s): "
            + "; ".join(noted[:6]) + (" ..." if len(noted) > 6 else ""))
    return changes


def commit_config(cfg, state: RunDirState, say=log.warning) -> Path:
    """Write ``run_config.yaml`` (all checks passed); a changed one of an earlier run is kept."""
    path = state.run_dir / CONFIG_NAME
    if state.resume_from is not None or state.records:
        old, _ = _old_config(state.run_dir)
        if old is not None and any(c.key not in LAUNCH_KEYS for c in config_changes(old, cfg)):
            keep = state.run_dir / f"run_config.until_step_{state.start_step:06d}.yaml"
            n = 1
            while keep.exists():
                keep, n = state.run_dir / f"run_config.until_step_{state.start_step:06d}.{n}.yaml", n + 1
            os.replace(path, keep)
            say(f"the run's config changed: the earlier one is kept as {keep.name}")
    return save_run_config(cfg, path)
