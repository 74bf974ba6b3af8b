"""Training checkpoints (save / resume) with ``megatron.core.dist_checkpointing``.

A checkpoint directory holds one dist_checkpointing checkpoint with:

* the model (Megatron ``sharded_state_dict``: reloadable at any TP/PP/DP);
* the distributed optimizer in the ``fully_sharded_model_space`` format (each parameter's
  Adam state as a flat slice of its canonical tensor: reloadable at another DP size, and at
  another TP/PP as Megatron allows for that format);
* common objects: LR scheduler state, step, version and the model's ``Qwen3Spec`` (a checkpoint
  of another model is refused with the differing fields named);
* RNG states per (PP, TP) coordinate (restored when TP and PP are unchanged; skipped otherwise:
  our models have no dropout, so only sampling-free determinism is affected);

plus ``extra/dp<rank>.pt``, written by each DP replica's hub rank (TP 0, PP 0): the loop's own
state (replay buffer, log-prob cache), which is per DP shard (DESIGN 3). ``trainer_state.json``
is written last; a directory without it is incomplete. Everything is written under
``<dir>.tmp`` and renamed to ``<dir>`` only when all ranks are done.

Model-only loading (``load_model_weights``) reads the same model keys, so it takes both our
checkpoints and those of ``tools/convert_hf_to_megatron.py``; an HF directory (``config.json``
with safetensors) is loaded through the Qwen3 mapping instead.
"""

from __future__ import annotations

import json
import os
import random
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

STATE_FILE = "trainer_state.json"
OPTIM_SHARDING = "fully_sharded_model_space"


@dataclass
class Resumed:
    """What ``load_checkpoint`` found besides the model/optimizer/scheduler state."""

    step: int  # optimizer steps taken
    version: int  # published weight version
    saved_dp_size: int  # DP size at save time
    extra_states: list[Any]  # extra_states[r] is what DP rank r passed to save_checkpoint


def _model_sharded(trainer) -> dict:
    return {f"model{i}": chunk.sharded_state_dict() for i, chunk in enumerate(trainer.model_chunks)}


def _rng_object(trainer):
    from megatron.core import tensor_parallel
    from megatron.core.dist_checkpointing.mapping import ShardedObject

    state = {
        "python": random.getstate(),
        "torch": torch.get_rng_state(),
        "cuda": torch.cuda.get_rng_state() if torch.cuda.is_available() else None,
        "tracker": tensor_parallel.get_cuda_rng_tracker().get_states(),
    }
    ps = trainer.ps
    return ShardedObject(
        "trainer.rng_state", state, (ps.pp_size, ps.tp_size), (ps.pp_rank, ps.tp_rank),
        replica_id=ps.dp_rank,
    )


def _sharded_state(trainer, is_loading: bool, with_rng: bool) -> dict:
    model_sd = _model_sharded(trainer)
    flat_model = {}
    for sd in model_sd.values():
        flat_model.update(sd)
    state = dict(model_sd)
    state["optimizer"] = trainer.optimizer.sharded_state_dict(
        flat_model, is_loading=is_loading,
        **_optim_kwargs(trainer.optimizer.sharded_state_dict),
    )
    state["scheduler"] = trainer.scheduler.state_dict()
    state["step"] = trainer.step
    state["version"] = trainer.version
    state["model_spec"] = trainer.spec.to_dict()
    if with_rng:
        state["rng"] = _rng_object(trainer)
    return state


def _optim_kwargs(fn) -> dict:
    import inspect

    params = inspect.signature(fn).parameters
    if "metadata" in params:
        return {"metadata": {"distrib_optim_sharding_type": OPTIM_SHARDING}}
    return {"sharding_type": OPTIM_SHARDING} if "sharding_type" in params else {}


def save_checkpoint(trainer, ckpt_dir: str | os.PathLike, extra_state: Any = None) -> Path:
    """Save everything needed to resume; collective over all ranks.

    Args:
        trainer: the ``PolicyTrainer``.
        ckpt_dir: final directory (must not exist yet).
        extra_state: this DP replica's loop state (any picklable object); taken from the
            replica's hub rank (TP 0, PP 0).
    """
    from megatron.core import dist_checkpointing

    final, tmp = Path(ckpt_dir), Path(f"{ckpt_dir}.tmp")
    ps = trainer.ps
    if final.exists():
        raise ValueError(f"checkpoint directory {final} already exists")
    if ps.rank == 0:
        shutil.rmtree(tmp, ignore_errors=True)
        (tmp / "extra").mkdir(parents=True)
    dist.barrier()
    dist_checkpointing.save(_sharded_state(trainer, False, with_rng=True), str(tmp))
    if ps.tp_rank == 0 and ps.pp_rank == 0:
        torch.save(extra_state, tmp / "extra" / f"dp{ps.dp_rank:05d}.pt")
    dist.barrier()
    if ps.rank == 0:
        meta = {
            "step": trainer.step, "version": trainer.version, "tp": ps.tp_size,
            "pp": ps.pp_size, "dp": ps.dp_size, "model_spec": trainer.spec.to_dict(),
        }
        (tmp / STATE_FILE).write_text(json.dumps(meta, indent=2) + "\n")
        tmp.rename(final)
    dist.barrier()
    return final


def check_same_model(spec, ckpt_dir: Path, saved: dict) -> None:
    """Raise ``ValueError`` naming the fields where the checkpoint's model differs."""
    mine = spec.to_dict()
    diff = [f"{k}: checkpoint {saved.get(k)!r} vs model {v!r}" for k, v in mine.items() if saved.get(k) != v]
    if diff:
        raise ValueError(f"{ckpt_dir} is a checkpoint of another model ({'; '.join(diff)})")


def load_checkpoint(trainer, ckpt_dir: str | os.PathLike) -> Resumed:
    """Restore model, optimizer, scheduler, step, version (and RNG at equal TP/PP)."""
    from megatron.core import dist_checkpointing

    path = Path(ckpt_dir)
    meta_path = path / STATE_FILE
    if not meta_path.is_file():
        raise FileNotFoundError(f"{meta_path}: missing (not a complete trainer checkpoint)")
    meta = json.loads(meta_path.read_text())
    check_same_model(trainer.spec, path, meta["model_spec"])
    ps = trainer.ps
    same_mp = (meta["tp"], meta["pp"]) == (ps.tp_size, ps.pp_size)
    state = dist_checkpointing.load(_sharded_state(trainer, True, with_rng=same_mp), str(path))
    for i, chunk in enumerate(trainer.model_chunks):
        chunk.load_state_dict(state[f"model{i}"])
    trainer.optimizer.load_state_dict(state["optimizer"])
    trainer.scheduler.load_state_dict(state["scheduler"])
    trainer.step, trainer.version = int(state["step"]), int(state["version"])
    if same_mp:
        _restore_rng(state["rng"])
    extras = [
        torch.load(path / "extra" / f"dp{r:05d}.pt", weights_only=False) for r in range(meta["dp"])
    ]
    return Resumed(trainer.step, trainer.version, int(meta["dp"]), extras)


def _restore_rng(state: dict) -> None:
    from megatron.core import tensor_parallel

    random.setstate(state["python"])
    torch.set_rng_state(state["torch"])
    if state["cuda"] is not None and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])
    tensor_parallel.get_cuda_rng_tracker().set_states(state["tracker"])


def load_model_weights(model_chunks: list, ckpt_dir: str | os.PathLike, parallel_state) -> None:
    """Load only the model weights (init from a converted or a trainer checkpoint, or HF)."""
    from megatron.core import dist_checkpointing

    path = Path(ckpt_dir)
    if (path / "config.json").is_file() and any(path.glob("*.safetensors")):
        from megatron_darl.models.qwen3.weights import load_hf_checkpoint

        load_hf_checkpoint(model_chunks, path, parallel_state)
        return
    if not (path / "metadata.json").is_file():
        raise FileNotFoundError(f"{path}: neither a dist_checkpointing nor a HF model directory")
    for meta_name in (STATE_FILE, "megatron_darl.json"):
        if (path / meta_name).is_file():
            saved = json.loads((path / meta_name).read_text())
            if "model_spec" in saved:
                check_same_model(model_chunks[0].qwen3_spec, path, saved["model_spec"])
    for i, chunk in enumerate(model_chunks):
        state = dist_checkpointing.load({f"model{i}": chunk.sharded_state_dict()}, str(path))
        chunk.load_state_dict(state[f"model{i}"])
