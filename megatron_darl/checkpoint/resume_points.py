"""Which checkpoints of a run directory are resume points: one answer for the launcher and the loop.

A checkpoint is written to ``step_NNNNNN.tmp`` and renamed to ``step_NNNNNN`` only after its
last file, the completion marker ``megatron_darl.json`` (the format's metadata,
``model_io.METADATA_NAME``), is in place. A kill, a full disk or a lost mount can leave a ``.tmp``
directory, or (copied by hand, damaged) a final-named directory without the marker. Neither is a
resume point, for the launcher (which tells the workers to wait for resumed weights) and the
trainer alike: both ask ``complete_checkpoints``, so they never disagree on whether a run resumes.

Completeness is judged from names and the marker's presence only, never from file contents, so
checksums or retention rules of the checkpoint writer do not change the answer. The marker's
name is defined here, not in ``model_io`` (which writes it): the launcher asks these questions
before it needs torch.
"""

from __future__ import annotations

import re
from pathlib import Path

CHECKPOINTS_DIR = "checkpoints"  # under the run dir
COMPLETION_MARKER = "megatron_darl.json"  # a checkpoint's metadata (model_io): its write's last file
_FINAL = re.compile(r"step_(\d+)")  # a final name: no suffix


def checkpoint_root(run_dir: str | Path) -> Path:
    return Path(run_dir) / CHECKPOINTS_DIR


def checkpoint_step(path: Path) -> int | None:
    """The step of a final checkpoint name (``step_000012`` -> 12), None for any other name."""
    match = _FINAL.fullmatch(path.name)
    return int(match.group(1)) if match else None


def is_complete(path: Path) -> bool:
    """A final name (no ``.tmp``), a directory, and its completion marker present."""
    return checkpoint_step(path) is not None and path.is_dir() and (path / COMPLETION_MARKER).is_file()


def complete_checkpoints(run_dir: str | Path) -> list[Path]:
    """The run's resume points, oldest first (sorted by step)."""
    root = checkpoint_root(run_dir)
    if not root.is_dir():
        return []
    found = [p for p in root.iterdir() if is_complete(p)]
    return sorted(found, key=lambda p: checkpoint_step(p))


def latest_checkpoint(run_dir: str | Path) -> Path | None:
    """The newest resume point, or None."""
    found = complete_checkpoints(run_dir)
    return found[-1] if found else None


def partial_checkpoints(run_dir: str | Path) -> list[Path]:
    """``step_*`` entries that are not resume points (cut-off writes, damaged copies), by name."""
    root = checkpoint_root(run_dir)
    if not root.is_dir():
        return []
    return sorted(p for p in root.glob("step_*") if not is_complete(p))
