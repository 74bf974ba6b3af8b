"""Model checkpoints in ``megatron.core.dist_checkpointing`` format plus ``megatron_darl.json``.

A checkpoint directory holds the dist_checkpointing files (global tensors, reloadable at any
TP/PP), ``megatron_darl.json`` (how to rebuild the model: HF config, padded vocab, dtype; other
tools detect a Megatron checkpoint dir by this file name) and the HF ``config.json``/tokenizer
files, so ``AutoTokenizer.from_pretrained(dir)`` works and the checkpoint converts back to HF.

Keys are Megatron's own: its local layer spec already maps the input norms to the Transformer
Engine names (``self_attention.linear_qkv.layer_norm_weight``...), so checkpoints move between
TE and non-TE machines, and plain ``dist_checkpointing.load(model.sharded_state_dict(), dir)``
reads them.

Every loader of weights goes through ``load_model_checkpoint`` (the converters, eval by way of
the converter, ``trainer.init_checkpoint``): it verifies each file against ``checksums.json``
before parsing it and the loaded weights for NaN/Inf after, so 4 KiB of zeros or 0xFF inside a
tensor is refused in one line naming the file, never converted, evaluated or trained from.
``save_model_checkpoint`` writes that manifest, as a training save does.

The HF side files (``config.json``, ``generation_config.json``, tokenizer, chat template:
``copy_model_files``) come from the directory the weights came from and are written before the
manifest, so they are checksummed like the weights; converted and training checkpoints alike
carry them, and one copied elsewhere evaluates and exports with nothing else. Without a tokenizer
transformers builds an empty one (every prompt encodes as no tokens), so the tools refuse such a
checkpoint by name (``missing_tokenizer``) rather than export or score it.
"""

from __future__ import annotations

import inspect
import json
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch

from megatron_darl.checkpoint import checksums
from megatron_darl.checkpoint.resume_points import COMPLETION_MARKER as METADATA_NAME
from megatron_darl.models.qwen3.hf_io import copy_side_files

FORMAT_VERSION = 1
TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json")  # any one: a loadable tokenizer


@dataclass
class CheckpointMetadata:
    """Contents of ``megatron_darl.json``."""

    hf_config: dict[str, Any]  # the HF config.json this model was built from
    padded_vocab_size: int  # embedding rows in the checkpoint (vocab padded for TP)
    dtype: str  # parameter dtype of the stored tensors: "float32" | "bfloat16" | "float16"
    saved_tp: int  # layout the checkpoint was written at (it reloads at any TP/PP)
    saved_pp: int
    model_family: str = "qwen3"
    format: str = "megatron_darl"
    format_version: int = FORMAT_VERSION
    megatron_core_version: str = ""
    model_spec: dict[str, Any] = field(default_factory=dict)  # Qwen3Spec.to_dict() (checks)
    extra: dict[str, Any] = field(default_factory=dict)  # trainer state (step, version, ...)

    @property
    def torch_dtype(self) -> torch.dtype:
        return getattr(torch, self.dtype)


def write_metadata(ckpt_dir: str | Path, meta: CheckpointMetadata) -> Path:
    path = Path(ckpt_dir) / METADATA_NAME
    path.write_text(json.dumps(asdict(meta), indent=2, sort_keys=True) + "\n")
    return path


def read_metadata(ckpt_dir: str | Path) -> CheckpointMetadata:
    """Read and check ``megatron_darl.json``; errors name the file."""
    path = Path(ckpt_dir) / METADATA_NAME
    if not Path(ckpt_dir).is_dir():
        raise FileNotFoundError(f"{ckpt_dir}: checkpoint directory does not exist")
    if not path.is_file():
        raise FileNotFoundError(f"{path}: missing (not a megatron_darl checkpoint directory)")
    try:
        data = json.loads(path.read_text())
        meta = CheckpointMetadata(**data)
    except (json.JSONDecodeError, UnicodeDecodeError, TypeError) as exc:
        raise ValueError(f"{path}: corrupt metadata ({exc})") from None
    if meta.format != "megatron_darl" or meta.format_version > FORMAT_VERSION:
        raise ValueError(f"{path}: format {meta.format} v{meta.format_version} not supported")
    if not (Path(ckpt_dir) / "metadata.json").is_file():
        raise FileNotFoundError(f"{Path(ckpt_dir) / 'metadata.json'}: dist_checkpointing "
                                "metadata missing (incomplete checkpoint)")
    return meta


def check_shards(ckpt_dir: str | Path) -> None:
    """Every shard file the dist checkpoint's ``.metadata`` names is there and long enough.

    Raises ``FileNotFoundError``/``ValueError`` naming the file: a truncated ``.distcp`` would
    otherwise surface as a bare ``EOFError`` from deep inside the loader.
    """
    from torch.distributed.checkpoint import FileSystemReader

    try:
        storage = FileSystemReader(str(ckpt_dir)).read_metadata().storage_data
    except Exception as exc:  # noqa: BLE001 - corrupt pickle, missing .metadata ...
        raise ValueError(f"{Path(ckpt_dir) / '.metadata'}: unreadable ({exc})") from None
    needed: dict[str, int] = {}
    for info in storage.values():
        end = info.offset + info.length
        needed[info.relative_path] = max(needed.get(info.relative_path, 0), end)
    for rel, end in sorted(needed.items()):
        path = Path(ckpt_dir) / rel
        if not path.is_file():
            raise FileNotFoundError(f"{path}: checkpoint shard missing")
        if path.stat().st_size < end:
            raise ValueError(f"{path}: checkpoint shard truncated ({path.stat().st_size} < {end})")


def previous_checkpoint(ckpt_dir: str | Path) -> Path | None:
    """The newest complete sibling checkpoint older than ``ckpt_dir`` (``step_*`` naming), if any."""
    path = Path(ckpt_dir)
    older = [p for p in path.parent.glob("step_*") if p.is_dir() and p.name < path.name
             and not p.name.endswith(".tmp") and (p / METADATA_NAME).is_file()]
    return max(older, default=None)


def has_tokenizer(model_dir: str | Path) -> bool:
    """Whether ``model_dir`` holds a tokenizer ``AutoTokenizer.from_pretrained`` can load (without
    one, transformers builds an empty tokenizer that encodes every prompt as no tokens)."""
    return any((Path(model_dir) / name).is_file() for name in TOKENIZER_FILES)


def copy_model_files(src: str | Path | None, dst: str | Path, hf_config: dict | None = None) -> list[str]:
    """Copy the HF side files of ``src`` (a HF model dir or another checkpoint) into ``dst``; write
    ``hf_config`` as ``config.json`` where ``src`` has none. Returns the names written.

    The tokenizer and chat template of the policy are a few MB at most (Qwen3: 11 MB), next to
    weights of hundreds of MB or more, so each checkpoint carries its own copy."""
    src_dir = Path(src) if src else None
    written = copy_side_files(src_dir, dst) if src_dir is not None and src_dir.is_dir() else []
    if "config.json" not in written and hf_config:
        (Path(dst) / "config.json").write_text(json.dumps(dict(hf_config), indent=2, sort_keys=True) + "\n")
        written.append("config.json")
    return written


def missing_tokenizer(ckpt_dir: str | Path) -> str:
    """The one-line refusal for a checkpoint without tokenizer files ("" when it has one)."""
    if has_tokenizer(ckpt_dir):
        return ""
    return (f"checkpoint {ckpt_dir} has no tokenizer (none of {', '.join(TOKENIZER_FILES)}): it was "
            "saved without its model's HF files; pass --tokenizer-dir <the HF model it was trained "
            "from> to tools/convert_megatron_to_hf.py")


class CheckpointDamaged(ValueError):
    """A checkpoint that must not be loaded: the message is one line naming it and the problem."""


def damaged(ckpt_dir: str | Path, problem: str, resume: bool = True) -> CheckpointDamaged:
    """A one-line error for a checkpoint that cannot be loaded, offering the previous one (with
    ``resume``, how to resume from it; a tool that only loads weights just names it)."""
    path = Path(ckpt_dir)
    prev = previous_checkpoint(path)
    aside = path.parent / f"damaged-{path.name}"  # not a step_* name: resume skips it
    if prev is None:
        offer = f"there is no earlier checkpoint in {path.parent}" if resume else "it was not loaded"
    elif resume:
        offer = (f"the previous checkpoint is {prev}: move the damaged one aside (mv {path} {aside}) "
                 "and resume again (loop.resume=true takes the newest step_*)")
    else:
        offer = f"it was not loaded; the previous checkpoint is {prev}"
    return CheckpointDamaged(f"checkpoint {path} is damaged: {problem}; {offer}")


def verify_files(ckpt_dir: str | Path, resume: bool = False) -> None:
    """Collective: raise ``CheckpointDamaged`` (the same line on every rank) when a file of the
    checkpoint does not match its ``checksums.json``; before anything of it is parsed."""
    problem = checksums.verify_checkpoint(Path(ckpt_dir))
    if problem:
        raise damaged(ckpt_dir, problem, resume=resume)


def check_finite(ckpt_dir: str | Path, named_params, resume: bool = False) -> None:
    """Collective: raise ``CheckpointDamaged`` on every rank when a loaded weight of any rank holds
    NaN or Inf (a checkpoint whose bytes carry no checksums, or were written that way)."""
    bad = checksums.first_problem(checksums.nonfinite_parameter(named_params))
    if bad:
        raise damaged(ckpt_dir, f"weight {bad} after loading", resume=resume)


def sharded_model_state_dict(model_chunks) -> dict:
    """The model's ``sharded_state_dict()`` (Megatron's own checkpoint keys)."""
    assert len(model_chunks) == 1, "virtual pipeline chunks are not supported yet"
    return _unwrap(model_chunks[0]).sharded_state_dict()


def chunked_model_state_dict(model_chunks) -> dict:
    """``{"model<i>": chunk.sharded_state_dict()}``: the model part of a training checkpoint (and
    of each parameter snapshot saved with it)."""
    return {f"model{i}": chunk.sharded_state_dict() for i, chunk in enumerate(model_chunks)}


def _unwrap(model):
    """The model inside Megatron DDP / Float16Module wrappers (they nest ``.module``)."""
    while hasattr(model, "module") and not hasattr(model, "decoder"):
        model = model.module
    return model


def use_local_results_queue() -> None:
    """Make megatron-core's torch_dist writer hand its results over a plain ``queue.Queue``.

    The writer passes its write results to the caller through a module-level queue that it makes,
    on first use, a ``multiprocessing`` Manager queue (built for async saves, where a background
    process writes): a server process started by spawn, which imports torch to unpickle the first
    results (~3 s in every process, paid at its first save) and takes ~2 s more to stop at exit.
    A synchronous save puts and takes in the same process (feature-detected in megatron-core 0.16
    and 0.19: a release without that variable is left alone).
    """
    import queue

    try:
        from megatron.core.dist_checkpointing.strategies import filesystem_async
    except ImportError:  # pragma: no cover - a layout without the async writer
        return
    if getattr(filesystem_async, "_results_queue", "absent") is None:
        filesystem_async._results_queue = queue.Queue()


def save_sharded(sharded_state: dict, ckpt_dir: str | Path) -> None:
    """``dist_checkpointing.save`` (collective), synchronously and without a helper process
    (``use_local_results_queue``), by as many writer threads as the rank hashes with.

    megatron-core's default is 2 writer threads. On a 16-core GPU host 8 write 25.8 GB in 15 s
    where 2 take 32 s (benchmarks/checkpoint_io.py), which decides whether the checkpoint a stop
    signal asks for fits Slurm's KillWait. A rank writes one file per thread; loading reads any
    count."""
    from megatron.core import dist_checkpointing
    from megatron.core.dist_checkpointing.strategies.torch import TorchDistSaveShardedStrategy

    use_local_results_queue()
    strategy = TorchDistSaveShardedStrategy("torch_dist", 1, thread_count=checksums.hash_threads())
    dist_checkpointing.save(sharded_state, str(ckpt_dir), sharded_strategy=strategy)


def save_model_checkpoint(model_chunks, ckpt_dir: str | Path, meta: CheckpointMetadata,
                          model_files_from: str | Path | None = None) -> None:
    """Collective over all ranks: write the model shards, then (rank 0) ``megatron_darl.json``
    and the HF files of ``model_files_from`` (``copy_model_files``), then ``checksums.json``.

    ``ckpt_dir`` must exist. The metadata file is written last, so its presence marks a
    complete checkpoint.
    """
    import megatron.core
    import torch.distributed as dist

    save_sharded(sharded_model_state_dict(model_chunks), ckpt_dir)
    dist.barrier()
    if dist.get_rank() == 0:
        meta.megatron_core_version = getattr(megatron.core, "__version__", "")
        write_metadata(ckpt_dir, meta)
        copy_model_files(model_files_from, ckpt_dir, meta.hf_config)
    dist.barrier()
    problem = checksums.write_manifest(Path(ckpt_dir))  # what every load verifies first
    if problem:
        raise OSError(f"{ckpt_dir}: checkpoint written but not sealed: {problem}")


def load_model_checkpoint(model_chunks, ckpt_dir: str | Path, verify: bool = True) -> None:
    """Collective over all ranks: load model weights from a checkpoint (any saved TP/PP).

    Every file is checked against ``checksums.json`` before it is parsed (``verify``: False only
    where the caller did that already), and the loaded weights for NaN/Inf; either failure is
    one ``CheckpointDamaged`` line naming the file (or weight) and the checkpoint.
    """
    from megatron.core import dist_checkpointing

    if verify:
        verify_files(ckpt_dir)
    sharded = sharded_model_state_dict(model_chunks)
    kwargs = {}
    if "strict" in inspect.signature(dist_checkpointing.load).parameters:
        kwargs["strict"] = "assume_ok_unexpected"
    try:
        state = dist_checkpointing.load(sharded, str(ckpt_dir), **kwargs)
    except Exception as exc:  # noqa: BLE001 - torch.distributed.checkpoint raises many types
        msg = str(exc).strip().splitlines()[-1] if str(exc).strip() else type(exc).__name__
        raise ValueError(f"{ckpt_dir}: cannot load checkpoint ({msg})") from exc
    model = _unwrap(model_chunks[0])
    missing, _ = model.load_state_dict(state, strict=False)
    missing = [k for k in missing if not k.endswith("_extra_state")]
    if missing:
        raise ValueError(f"{ckpt_dir}: checkpoint lacks {missing[:5]}")
    check_finite(ckpt_dir, model.named_parameters())
