"""A trainer's full state as a checkpoint (save / resume) with ``megatron.core.dist_checkpointing``.

A checkpoint directory holds one dist_checkpointing checkpoint with:

* the model (Megatron ``sharded_state_dict``: reloadable at any TP/PP/DP);
* the distributed optimizer, by default in Megatron's ``dp_reshardable`` format (each rank
  writes its own Adam-state buffers in parallel, no gather; reloadable at another DP size, the
  same TP/PP), or with ``optim_sharding="fully_reshardable"`` in the canonical per-parameter
  layout (gathered on DP rank 0 at save; reloadable at another TP/PP too). The model weights
  alone reload at any TP/PP/DP either way. (``fully_sharded_model_space`` relies on
  ``ShardedTensor.flattened_range``, which megatron-core 0.16's torch_dist backend refuses.);
* common objects: LR scheduler state, step, version and the model's ``Qwen3Spec`` (a checkpoint
  of another model is refused with the differing fields named);
* RNG states per (PP, TP) coordinate (restored when TP and PP are unchanged; skipped otherwise:
  our models have no dropout, so only sampling-free determinism is affected);

plus the model's HF files (``config.json``, tokenizer, chat template), copied by rank 0 from the
directory the policy's weights came from (``trainer.cfg.init_checkpoint``: ``model.path`` or the
warm start's, or an earlier checkpoint that carries them; the HF config alone for a random init),
so that ``tools/eval.py --model <checkpoint>`` and the HF converter need nothing else;
``extra/dp<rank>.pt``, written by each DP replica's hub rank (TP 0, PP 0): the loop's own
state (replay buffer, log-prob cache), which is per DP shard (docs/architecture.md); and, with
``with_snapshots``, the trainer's parameter snapshots of older versions under ``snapshots/``
(``snapshots.save_snapshots``: exact log-prob backfill continues across a resume). The extra
state holds tensors and plain types only (checked at save) and is read with
``torch.load(weights_only=True)``: a checkpoint is data, and a crafted pickle there must not run
code on resume. ``megatron_darl.json``
(``model_io.CheckpointMetadata``, the same file the converters write, with the trainer's
step/version/layout under ``extra["trainer"]``) is written once all ranks are done, then
``checksums.json`` (the size and SHA-256 of every file, ``checksums.py``), which a load verifies
before it parses anything; the loaded weights are checked for NaN/Inf too. Either failure is one
``CheckpointDamaged`` line naming the file (or weight) and the checkpoint. Weights that are not
finite are never saved: the save refuses them first (``trainer.require_finite``, on every
rank, nothing written), so a resume point is never a poisoned one. Everything is written
under ``<dir>.tmp`` and renamed to ``<dir>`` only when all ranks are done. A checkpoint the disk
cannot hold is refused before the write, and a write (or its sealing) that fails is reported
with the disk's state and its ``.tmp`` removed (``disk.py``: both raise ``disk.CheckpointFailed``
on every rank; earlier checkpoints are untouched). Because the model
keys and metadata are the converters' own, a trainer checkpoint converts straight to HF with
``tools/convert_megatron_to_hf.py``.

Model-only loading (``load_model_weights``) takes both our checkpoints and those of
``tools/convert_hf_to_megatron.py``; an HF directory (``config.json`` with safetensors) is
loaded through the Qwen3 mapping instead.

The trainer comes in as an argument (its ``model_chunks``, ``optimizer``, ``scheduler``, ``ps``,
``snapshots`` and counters are read), so this module imports nothing of ``trainer/``.
"""

from __future__ import annotations

import contextlib
import os
import random
import shutil
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.api import CheckpointException

from megatron_darl.checkpoint import checksums, disk
from megatron_darl.checkpoint.model_io import (
    METADATA_NAME, CheckpointMetadata, check_finite, check_shards, chunked_model_state_dict,
    copy_model_files, damaged, load_model_checkpoint, read_metadata, save_sharded, verify_files,
    write_metadata,
)
from megatron_darl.checkpoint.snapshots import load_snapshots, save_snapshots
from megatron_darl.models.qwen3.config import spec_from_hf
from megatron_darl.models.qwen3.weights import load_hf_checkpoint

OPTIM_SHARDINGS = ("dp_reshardable", "fully_reshardable")


@dataclass
class Resumed:
    """What ``load_checkpoint`` found besides the model/optimizer/scheduler state."""

    step: int  # optimizer steps taken
    version: int  # published weight version
    saved_dp_size: int  # DP size at save time
    extra_states: list[Any]  # extra_states[r] is what DP rank r passed to save_checkpoint


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


def _sharded_state(trainer, is_loading: bool, with_rng: bool, optim_sharding: str) -> dict:
    model_sd = chunked_model_state_dict(trainer.model_chunks)
    flat_model = {}
    for sd in model_sd.values():
        flat_model.update(sd)
    state = dict(model_sd)
    state["optimizer"] = trainer.optimizer.sharded_state_dict(
        flat_model, is_loading=is_loading,
        **_optim_kwargs(trainer.optimizer.sharded_state_dict, optim_sharding),
    )
    state["scheduler"] = trainer.scheduler.state_dict()
    state["step"] = trainer.optimizer_steps
    state["version"] = trainer.version
    state["model_spec"] = trainer.spec.to_dict()
    if with_rng:
        state["rng"] = _rng_object(trainer)
    return state


def _optim_kwargs(fn, optim_sharding: str) -> dict:
    import inspect

    params = inspect.signature(fn).parameters
    var_kw = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values())
    if "metadata" in params or var_kw:  # ChainedOptimizer forwards **kwargs
        meta = {"distrib_optim_sharding_type": optim_sharding, "chained_optim_avoid_prefix": True}
        return {"metadata": meta}
    return {"sharding_type": optim_sharding} if "sharding_type" in params else {}


def save_checkpoint(
    trainer, ckpt_dir: str | os.PathLike, extra_state: Any = None,
    optim_sharding: str = "dp_reshardable", with_snapshots: bool = False, phases: dict | None = None,
) -> Path:
    """Save everything needed to resume; collective over all ranks.

    Args:
        trainer: the ``PolicyTrainer``.
        ckpt_dir: final directory (must not exist yet).
        extra_state: this DP replica's loop state: tensors, numbers, strings, None and
            lists/tuples/dicts of them (``weights_only`` loadable); taken from the replica's hub
            rank (TP 0, PP 0).
        optim_sharding: ``dp_reshardable`` (fast, same TP/PP on resume) or
            ``fully_reshardable`` (resume at any TP/PP; gathers optimizer state on DP rank 0).
        with_snapshots: also write the parameter snapshots of older versions.
        phases: filled with this rank's seconds per phase (``state``: weights and optimizer,
            ``snapshots``, ``seal``): which one a stop signal's deadline is spent on.
    """
    final, tmp = Path(ckpt_dir), Path(f"{ckpt_dir}.tmp")
    ps = trainer.ps
    if optim_sharding not in OPTIM_SHARDINGS:
        raise ValueError(f"optim_sharding={optim_sharding!r}; choose one of {OPTIM_SHARDINGS}")
    if final.exists():
        raise ValueError(f"checkpoint directory {final} already exists")
    check_plain(extra_state, "extra_state")
    trainer.require_finite(f"checkpoint {final}")  # collective: every rank refuses a NaN version together
    snapshots = len([v for v in trainer.snapshots.versions if v != trainer.version]) if with_snapshots else 0
    need = disk.check_room(trainer, final, snapshots)  # every rank refuses together, before any write
    if ps.rank == 0:
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)  # empty: dist_checkpointing warns of a "corrupted checkpoint" otherwise
    dist.barrier()
    error = None
    phases = {} if phases is None else phases
    clock = time.monotonic()
    try:  # dist_checkpointing's writes fail on every rank together (it gathers their results)
        save_sharded(_sharded_state(trainer, False, True, optim_sharding), tmp)
        phases["state"], clock = time.monotonic() - clock, time.monotonic()
        if with_snapshots:
            save_snapshots(trainer, tmp)
            phases["snapshots"] = time.monotonic() - clock
        if ps.tp_rank == 0 and ps.pp_rank == 0:
            (tmp / "extra").mkdir(exist_ok=True)
            torch.save(extra_state, tmp / "extra" / f"dp{ps.dp_rank:05d}.pt")
        if ps.rank == 0:  # before the seal: checksummed with the weights
            copy_model_files(getattr(trainer.cfg, "init_checkpoint", ""), tmp, _hf_dict(trainer))
    except (Exception, CheckpointException) as exc:  # a full disk, a lost mount (that one is a BaseException)
        error = exc
    failed = disk.any_rank(error is not None)  # also the barrier before the metadata
    if not failed:
        clock = time.monotonic()
        error = _seal(trainer, tmp, optim_sharding)  # the same verdict on every rank
        phases["seal"] = time.monotonic() - clock
        failed = error is not None
    if failed:
        failure = disk.write_failed(final, need, error)  # the disk as the write left it, on every rank
        dist.barrier()  # ... before rank 0 frees the partial write
        if ps.rank == 0:
            shutil.rmtree(tmp, ignore_errors=True)
        raise failure from error
    if ps.rank == 0:
        tmp.rename(final)
    dist.barrier()
    return final


def _seal(trainer, tmp: Path, optim_sharding: str) -> OSError | None:
    """Collective, once every file is written: rank 0 writes ``megatron_darl.json``, every rank
    hashes its share and rank 0 writes ``checksums.json``. The first failure, on every rank."""
    problem = ""
    if trainer.ps.rank == 0:
        try:
            _write_metadata(trainer, tmp, optim_sharding)
        except OSError as exc:
            problem = f"writing the metadata: {exc}"
    problem = checksums.first_problem(problem) or checksums.write_manifest(tmp)
    return OSError(problem) if problem else None


def _hf_dict(trainer) -> dict:
    hf = trainer.hf_config
    return dict(hf.to_dict() if hasattr(hf, "to_dict") else hf)


def _write_metadata(trainer, ckpt_dir: Path, optim_sharding: str) -> None:
    ps, chunk = trainer.ps, trainer.model_chunks[0]
    hf_dict = _hf_dict(trainer)
    trainer_meta = {
        "step": trainer.optimizer_steps, "version": trainer.version, "dp": ps.dp_size,
        "optim_sharding": optim_sharding,
    }
    meta = CheckpointMetadata(
        hf_config=hf_dict, padded_vocab_size=int(getattr(chunk, "padded_vocab", 0)),
        dtype=str(next(chunk.parameters()).dtype).replace("torch.", ""),
        saved_tp=ps.tp_size, saved_pp=ps.pp_size, model_spec=trainer.spec.to_dict(),
        extra={"trainer": trainer_meta},
    )
    import megatron.core

    meta.megatron_core_version = getattr(megatron.core, "__version__", "")
    write_metadata(ckpt_dir, meta)


def _saved_spec(meta) -> dict:
    """The Qwen3 spec a checkpoint's metadata describes (``model_spec``, else its HF config)."""
    if meta.model_spec:
        return meta.model_spec
    return spec_from_hf(meta.hf_config).to_dict()


def check_same_model(spec, ckpt_dir: Path, saved: dict) -> None:
    """Raise ``ValueError`` naming the fields where the checkpoint's model differs."""
    mine = spec.to_dict()
    diff = [f"{k}: checkpoint {saved.get(k)!r} vs model {v!r}" for k, v in mine.items() if saved.get(k) != v]
    if diff:
        raise ValueError(f"{ckpt_dir} is a checkpoint of another model ({'; '.join(diff)})")


def load_checkpoint(trainer, ckpt_dir: str | os.PathLike, with_snapshots: bool = False,
                    extra_ranks: list[int] | None = None) -> Resumed:
    """Restore model, optimizer, scheduler, step, version (and RNG at equal TP/PP), and with
    ``with_snapshots`` the parameter snapshots the checkpoint carries.

    ``extra_ranks``: the DP ranks whose extra state to read (default all); the others' entries
    of ``Resumed.extra_states`` are None (a hub's TP/PP peers read none: no replay state there).
    """
    from megatron.core import dist_checkpointing

    path = Path(ckpt_dir)
    if path.is_dir():  # every file as it was written, before any of them is parsed
        verify_files(path, resume=True)
    saved = read_metadata(path)
    meta = saved.extra.get("trainer")
    if meta is None:
        raise ValueError(f"{path}: a model-only checkpoint (no trainer state); use init_checkpoint")
    check_same_model(trainer.spec, path, _saved_spec(saved))
    ps = trainer.ps
    same_mp = (saved.saved_tp, saved.saved_pp) == (ps.tp_size, ps.pp_size)
    sharding = meta["optim_sharding"]
    if not same_mp and sharding != "fully_reshardable":
        raise ValueError(
            f"{path} was saved at tp={saved.saved_tp} pp={saved.saved_pp} with optimizer format "
            f"{sharding!r}; resuming at tp={ps.tp_size} pp={ps.pp_size} needs "
            f"optim_sharding='fully_reshardable' at save (or load_model_weights for weights only)"
        )
    _init_empty_adam_state(trainer.optimizer)  # a fresh process has not stepped yet
    check_shards_or_offer_previous(path)
    try:
        state = dist_checkpointing.load(_sharded_state(trainer, True, same_mp, sharding), str(path))
    except Exception as exc:  # noqa: BLE001 - torch.distributed.checkpoint raises many types
        last = (str(exc).strip().splitlines() or [""])[-1]
        raise damaged(path, f"loading failed ({type(exc).__name__}: {last})") from exc
    for i, chunk in enumerate(trainer.model_chunks):
        chunk.load_state_dict(state[f"model{i}"])
    named = ((f"model{i}.{name}", p) for i, chunk in enumerate(trainer.model_chunks)
             for name, p in chunk.named_parameters())
    check_finite(path, named, resume=True)  # every rank, the same line
    # no_grad: in fp32 runs the main params are views of the (grad-requiring) params
    with torch.no_grad(), _tolerate_missing_adam_step(trainer.optimizer):
        trainer.optimizer.load_state_dict(state["optimizer"])
    trainer.scheduler.load_state_dict(state["scheduler"])
    trainer.optimizer_steps, trainer.version = int(state["step"]), int(state["version"])
    _set_adam_steps(trainer.optimizer, trainer.optimizer_steps)
    if same_mp:
        _restore_rng(state["rng"])
    if with_snapshots:
        load_snapshots(trainer, path)
    extras = load_extra_states(path, int(meta["dp"]), extra_ranks)
    return Resumed(trainer.optimizer_steps, trainer.version, int(meta["dp"]), extras)


_PLAIN = (int, float, bool, str, bytes, type(None), torch.Tensor)


def check_plain(obj: Any, where: str) -> None:
    """Raise ``TypeError`` naming the first value that ``weights_only`` loading would refuse."""
    if isinstance(obj, _PLAIN):
        return
    if isinstance(obj, (list, tuple)):
        for i, item in enumerate(obj):
            check_plain(item, f"{where}[{i}]")
    elif isinstance(obj, dict):
        for key, item in obj.items():
            check_plain(key, f"{where} key {key!r}")
            check_plain(item, f"{where}[{key!r}]")
    else:
        raise TypeError(f"{where} is a {type(obj).__module__}.{type(obj).__qualname__}: checkpoint extra "
                        "state holds only tensors, numbers, strings, None, lists, tuples and dicts")


def load_extra_states(ckpt_dir: str | os.PathLike, dp: int, ranks: list[int] | None = None) -> list[Any]:
    """``extra/dp<rank>.pt`` of every DP rank in ``ranks`` (default all; None for the others),
    loaded as data only (``weights_only=True``).

    Raises:
        ValueError: naming the file, when it is damaged or holds anything but tensors and plain
            types (a crafted pickle is refused before any of its code runs).
    """
    import pickle

    path, out = Path(ckpt_dir), []
    for r in range(dp):
        if ranks is not None and r not in ranks:
            out.append(None)
            continue
        file = path / "extra" / f"dp{r:05d}.pt"
        if not file.is_file():
            raise damaged(path, f"{file} is missing")
        try:
            out.append(torch.load(file, weights_only=True, map_location="cpu"))
        except pickle.UnpicklingError as exc:
            first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
            raise ValueError(f"{file}: refused: it holds objects other than tensors and plain types "
                             f"(weights_only load: {first}); a checkpoint is data, not code") from None
        except (EOFError, RuntimeError, OSError) as exc:
            raise damaged(path, f"{file} cannot be read ({type(exc).__name__}: {exc})") from None
    return out


def check_shards_or_offer_previous(ckpt_dir: Path) -> None:
    """``model_io.check_shards`` with the previous checkpoint offered in the error."""
    try:
        check_shards(ckpt_dir)
    except (FileNotFoundError, ValueError) as exc:
        raise damaged(ckpt_dir, str(exc)) from None


@contextlib.contextmanager
def _tolerate_missing_adam_step(optimizer):
    """Work around megatron-core 0.16's ``fully_reshardable`` load with torch Adam.

    Its per-parameter loader skips the saved ``step`` but then copies every key of the live
    Adam state, ``step`` included (KeyError). During the load each parameter's ``step`` is set
    aside around that copy and put back (``load_state_dict`` restores steps separately).
    """
    patched = []
    for opt in getattr(optimizer, "chained_optimizers", [optimizer]):
        orig = getattr(opt, "_set_main_param_and_optimizer_states", None)
        if orig is None or not hasattr(opt, "model_param_group_index_map"):
            continue

        def tolerant(model_param, tensors, _opt=opt, _orig=orig):
            group, order = _opt.model_param_group_index_map[model_param]
            state = _opt.optimizer.state.get(_opt.optimizer.param_groups[group]["params"][order], {})
            step = state.pop("step", None) if "step" not in tensors else None
            try:
                _orig(model_param, tensors)
            finally:
                if step is not None:
                    state["step"] = step

        opt._set_main_param_and_optimizer_states = tolerant
        patched.append(opt)
    try:
        yield
    finally:
        for opt in patched:
            del opt._set_main_param_and_optimizer_states  # back to the class method


def _init_empty_adam_state(optimizer) -> None:
    """Give every parameter without Adam state zero moments and ``step = 0`` before a load.

    A freshly started trainer has no optimizer state yet. Megatron's ``init_state_fn`` for the
    torch Adam fallback (no apex/TE) creates the moments but no ``step``, and
    ``DistributedOptimizer.state_dict`` then asserts that all parameters share one step, so the
    sharded state dict a load needs cannot even be built. The load overwrites every value.
    """
    inner = getattr(optimizer, "chained_optimizers", [optimizer])
    for opt in inner:
        torch_opt = getattr(opt, "optimizer", None)
        if not isinstance(torch_opt, (torch.optim.Adam, torch.optim.AdamW)):
            continue
        for group in torch_opt.param_groups:
            on_device = bool(group.get("fused") or group.get("capturable"))
            for p in group["params"]:
                state = torch_opt.state[p]
                state.setdefault("exp_avg", torch.zeros_like(p, memory_format=torch.preserve_format))
                state.setdefault("exp_avg_sq", torch.zeros_like(p, memory_format=torch.preserve_format))
                if "step" not in state:
                    state["step"] = torch.zeros((), dtype=torch.float32,
                                                device=p.device if on_device else "cpu")


def _set_adam_steps(optimizer, step: int) -> None:
    """Give every parameter its own Adam ``step`` tensor, equal to the restored trainer step.

    Without apex/TE, Megatron's ``DistributedOptimizer.load_state_dict`` (a) hands the *same*
    ``step`` tensor to every parameter's torch-Adam state, which torch then increments in place
    once per parameter (measured: a resumed step off by ~half an LR step on almost every
    weight), and (b) takes the value from param-group metadata that a never-stepped process
    restores as 0 (measured: bias correction of step 1 instead of step 2). The trainer takes
    exactly one optimizer step per train step (bf16/fp32, no loss scaler that skips steps), so
    the trainer step is the Adam step.
    """
    inner = getattr(optimizer, "chained_optimizers", [optimizer])
    for opt in inner:
        torch_opt = getattr(opt, "optimizer", None)
        for param_state in getattr(torch_opt, "state", {}).values():
            old = param_state.get("step")
            if isinstance(old, torch.Tensor):
                param_state["step"] = torch.full((), float(step), dtype=old.dtype, device=old.device)


def _restore_rng(state: dict) -> None:
    from megatron.core import tensor_parallel

    random.setstate(state["python"])
    torch.set_rng_state(state["torch"])
    if state["cuda"] is not None and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])
    tensor_parallel.get_cuda_rng_tracker().set_states(state["tracker"])


def load_model_weights(model_chunks: list, ckpt_dir: str | os.PathLike, parallel_state) -> None:
    """Load only the model weights: a converted or trainer checkpoint (any TP/PP), or HF.

    Collective. The files are verified against ``checksums.json`` before parsing and the loaded
    weights for NaN/Inf (``CheckpointDamaged``: one line naming the file or weight); an HF
    directory's weights are checked for NaN/Inf after the load."""
    path = Path(ckpt_dir)
    if (path / "config.json").is_file() and any(path.glob("*.safetensors")):
        load_hf_checkpoint(model_chunks, path, parallel_state)
        check_finite(path, ((f"model{i}.{name}", p) for i, chunk in enumerate(model_chunks)
                            for name, p in chunk.named_parameters()))
        return
    if not (path / METADATA_NAME).is_file():
        raise FileNotFoundError(
            f"{path}: neither a megatron_darl checkpoint ({METADATA_NAME}) nor a HF model directory"
        )
    verify_files(path)  # every file as written, before its metadata is parsed
    check_same_model(model_chunks[0].qwen3_spec, path, _saved_spec(read_metadata(path)))
    load_model_checkpoint(model_chunks, path, verify=False)  # then NaN/Inf checked after the load
