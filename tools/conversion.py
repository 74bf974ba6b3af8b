"""HF <-> Megatron (dist_checkpointing) conversion of Qwen3, as per-rank worker functions.

The application side of the two converters (``convert_hf_to_megatron.py`` and back): input
validation, staging and manifests, the worker ranks. It lives with the tools, not in
``megatron_darl/models``: the model layer keeps only the HF<->Megatron mapping
(``models/qwen3/mapping.py``) that the converters, checkpoint loading and weight sync share, and
must not import the trainer, which this module does.

Why multi-rank: each of the ``tp * pp`` gloo ranks builds only its own model shard, streams only
its own HF tensors from the memory-mapped safetensors and writes only its own checkpoint shards,
so peak memory per process is ~1/(tp*pp) of the model and the code path is exactly the one the
trainer uses to load and save (``load_hf_checkpoint``, ``sharded_state_dict``,
``megatron_to_hf_stage``). A single process would have to hold the full model. The dist
checkpoint itself is layout-independent: it reloads at any TP/PP.

The tools validate inputs (``validate_hf_dir``, ``validate_megatron_dir``) before
spawning anything, so bad input fails fast with one line naming the file. The output never
overlaps the input (``check_no_overlap``: an ``--out-dir`` equal to or above the input once let
``--force`` delete the model being converted), and ``--force`` replaces only what an earlier
conversion wrote, as listed in its ``conversion_manifest.json``, and only inside the output
directory (a manifest entry with ``..``, an absolute path or a symlinked directory leading out
is refused by name before anything is converted or deleted).
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
from dataclasses import dataclass
from pathlib import Path

import torch

from megatron_darl.models.qwen3.config import (
    check_layout,
    load_hf_config_dict,
    padded_vocab_size,
    spec_from_hf,
)
from megatron_darl.models.qwen3.hf_io import (
    HF_SIDE_FILES,
    HFCheckpointReader,
    ShardedSafetensorsWriter,
    copy_side_files,
    finalize_shards,
)

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}  # conversion_args.DTYPE_NAMES
MANIFEST_NAME = "conversion_manifest.json"  # files a conversion wrote: all --force may remove


@dataclass
class ConversionJob:
    """What one conversion run does; passed to every worker rank."""

    src_dir: str  # HF dir (to Megatron) or Megatron checkpoint dir (to HF)
    out_dir: str  # temporary output dir; the tool renames it on success
    tp: int
    pp: int
    dtype: str = "fp32"  # to-Megatron only: parameter dtype of the checkpoint
    progress: bool = True
    max_shard_bytes: int = 2 * 1024**3  # to-HF only: safetensors file size
    tokenizer_dir: str = ""  # to-HF only: take the tokenizer files from here (a checkpoint without them)


def validate_hf_dir(hf_dir: str | Path, tp: int, pp: int) -> dict:
    """Check config, architecture, layout and every weight header; return the config dict."""
    if not Path(hf_dir).is_dir():
        raise FileNotFoundError(f"{hf_dir}: HF model directory does not exist")
    cfg = load_hf_config_dict(hf_dir)
    source = str(Path(hf_dir) / "config.json")
    spec = spec_from_hf(cfg, source)
    check_layout(spec, tp, pp, source)
    HFCheckpointReader(hf_dir).validate(spec)
    return cfg


def validate_megatron_dir(ckpt_dir: str | Path, tp: int, pp: int, tokenizer_dir: str | Path = ""):
    """Check every file against ``checksums.json`` (before any is parsed), then
    ``megatron_darl.json``, the layout, that every shard file is present/complete and that there
    is a tokenizer to export (the checkpoint's, or ``tokenizer_dir``'s): an HF dir without one
    loads in transformers as an empty tokenizer. The weights are checked for NaN/Inf once loaded
    (``load_model_checkpoint``)."""
    from megatron_darl.checkpoint.model_io import (
        METADATA_NAME, check_shards, has_tokenizer, missing_tokenizer, read_metadata, verify_files,
    )

    if Path(ckpt_dir).is_dir():
        verify_files(ckpt_dir)
    meta = read_metadata(ckpt_dir)
    source = str(Path(ckpt_dir) / METADATA_NAME)
    spec = spec_from_hf(meta.hf_config, source)
    check_layout(spec, tp, pp, source)
    if meta.padded_vocab_size % tp:
        raise ValueError(f"tp={tp} does not divide padded_vocab_size={meta.padded_vocab_size} "
                         f"({source})")
    check_shards(ckpt_dir)
    if tokenizer_dir and not has_tokenizer(tokenizer_dir):
        raise ValueError(f"--tokenizer-dir {tokenizer_dir}: no tokenizer files there (tokenizer.json, "
                         "tokenizer.model or vocab.json)")
    if not tokenizer_dir and missing_tokenizer(ckpt_dir):
        raise ValueError(missing_tokenizer(ckpt_dir))
    return meta


def _quiet_warnings() -> None:
    """Megatron warns at import about missing TE/apex and its checkpoint loads call torch APIs torch
    deprecates; converters need none of them (``megatron_darl.quiet`` lists what is hidden)."""
    import warnings

    from megatron_darl.quiet import quiet_libraries

    quiet_libraries()
    for category in (UserWarning, FutureWarning, DeprecationWarning):
        warnings.filterwarnings("ignore", category=category, module=r"(megatron|torch)\..*")


def _progress(total: int, desc: str, enabled: bool):
    if not enabled:
        return None
    from tqdm import tqdm

    return tqdm(total=total, desc=desc, unit="tensor", dynamic_ncols=True)


def hf_to_megatron_worker(rank: int, world_size: int, job: ConversionJob) -> None:
    """One rank of HF -> Megatron: build shard, stream HF weights in, save dist checkpoint."""
    from megatron_darl.models.qwen3.model import build_qwen3_model
    from megatron_darl.models.qwen3.weights import load_hf_checkpoint
    from megatron_darl.checkpoint.model_io import CheckpointMetadata, check_finite, save_model_checkpoint
    from megatron_darl.trainer.config import ParallelConfig
    from megatron_darl.trainer.parallel import init_parallel

    _quiet_warnings()
    ps = init_parallel(ParallelConfig(tp=job.tp, pp=job.pp), rank, world_size)
    cfg = load_hf_config_dict(job.src_dir)
    spec = spec_from_hf(cfg)
    vocab = padded_vocab_size(spec.vocab_size, job.tp)
    model = build_qwen3_model(cfg, ps, dtype=DTYPES[job.dtype], attention="sdpa",
                              padded_vocab=vocab)
    n_params = len(list(model[0].parameters()))
    bar = _progress(n_params, "load HF shard (rank 0)", job.progress and rank == 0)
    load_hf_checkpoint(model, job.src_dir, ps, progress=bar)
    check_finite(job.src_dir, model[0].named_parameters())  # NaN/Inf weights are refused, not converted
    if bar is not None:
        bar.close()
        print("writing dist checkpoint ...", flush=True)
    meta = CheckpointMetadata(
        hf_config=cfg, padded_vocab_size=vocab, dtype=str(DTYPES[job.dtype]).split(".")[-1],
        saved_tp=job.tp, saved_pp=job.pp, model_spec=spec.to_dict(),
    )
    save_model_checkpoint(model, job.out_dir, meta, model_files_from=job.src_dir)  # tokenizer: checksummed


def megatron_to_hf_worker(rank: int, world_size: int, job: ConversionJob) -> None:
    """One rank of Megatron -> HF: load checkpoint shard, gather each stage, write safetensors."""
    import torch.distributed as dist

    from megatron_darl.models.qwen3.mapping import megatron_to_hf_stage, stage_hf_names
    from megatron_darl.models.qwen3.model import build_qwen3_model
    from megatron_darl.checkpoint.model_io import load_model_checkpoint, read_metadata
    from megatron_darl.trainer.config import ParallelConfig
    from megatron_darl.trainer.parallel import init_parallel

    _quiet_warnings()
    ps = init_parallel(ParallelConfig(tp=job.tp, pp=job.pp), rank, world_size)
    meta = read_metadata(job.src_dir)
    model = build_qwen3_model(meta.hf_config, ps, dtype=meta.torch_dtype, attention="sdpa",
                              padded_vocab=meta.padded_vocab_size)
    load_model_checkpoint(model, job.src_dir, verify=False)  # files verified before the spawn; NaN/Inf here
    writer = ShardedSafetensorsWriter(job.out_dir, job.max_shard_bytes, f"{ps.pp_rank:03d}-")
    total = len(stage_hf_names(model[0].qwen3_spec, ps.pp_rank, ps.pp_size))
    bar = _progress(total, "write HF (stage 0)", job.progress and rank == 0)
    for name, tensor in megatron_to_hf_stage(model, ps):
        if ps.tp_rank == 0 and ps.dp_rank == 0:
            writer.add(name, tensor)
        if bar is not None:
            bar.update(1)
    parts = writer.close() if ps.tp_rank == 0 and ps.dp_rank == 0 else []
    everything = [None] * world_size
    dist.all_gather_object(everything, (parts, writer.total_bytes if parts else 0))
    if rank == 0:
        if bar is not None:
            bar.close()
        all_parts = [p for ranks_parts, _ in everything for p in ranks_parts]
        finalize_shards(Path(job.out_dir), all_parts, sum(b for _, b in everything))
        copy_side_files(job.src_dir, job.out_dir)
        if job.tokenizer_dir:
            _copy_tokenizer(Path(job.tokenizer_dir), Path(job.out_dir))
        _write_hf_config(Path(job.out_dir), meta)


def _copy_tokenizer(src: Path, out_dir: Path) -> None:
    """``--tokenizer-dir``: every side file of ``src`` but ``config.json`` (the checkpoint's own
    config, from its metadata, describes the weights), replacing the checkpoint's."""
    for name in HF_SIDE_FILES:
        if name != "config.json" and (src / name).is_file():
            shutil.copy2(src / name, out_dir / name)


def _write_hf_config(out_dir: Path, meta) -> None:
    """Keep ``config.json`` byte-identical unless the stored dtype differs from it."""
    path = out_dir / "config.json"
    cfg = json.loads(path.read_text()) if path.is_file() else dict(meta.hf_config)
    key = "dtype" if "dtype" in cfg else "torch_dtype"
    if path.is_file() and cfg.get(key) in (meta.dtype, None):
        return
    cfg[key] = meta.dtype
    path.write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n")


def check_no_overlap(src_dir: str | Path, out_dir: str | Path, src_flag: str) -> None:
    """``ValueError`` when the output would be the input, contain it, or sit inside it."""
    src, out = Path(src_dir).resolve(), Path(out_dir).resolve()
    if src == out:
        raise ValueError(f"--out-dir {out_dir} is {src_flag} {src_dir} itself: write the conversion elsewhere")
    if out in src.parents:
        raise ValueError(f"--out-dir {out_dir} contains {src_flag} {src_dir}: replacing it would delete the "
                         "input; write the conversion elsewhere")
    if src in out.parents:
        raise ValueError(f"--out-dir {out_dir} is inside {src_flag} {src_dir}: write the conversion elsewhere")


def _files(root: Path) -> set[str]:
    return {str(p.relative_to(root)) for p in root.rglob("*") if not p.is_dir()}


def _inside(out: Path, entry: object) -> bool:
    """Whether a manifest entry names a path strictly inside ``out``: relative, no ``..``, and
    no symlinked directory on the way that leads elsewhere (what a written manifest holds;
    an edited or planted one may name anything)."""
    if not isinstance(entry, str) or not entry or os.path.isabs(entry) or "\0" in entry:
        return False
    parts = Path(entry).parts
    if not parts or ".." in parts:
        return False
    root = out.resolve()
    parent = (out / entry).parent.resolve()
    return parent == root or root in parent.parents


def _previous_conversion(out: Path) -> list[str]:
    """The files ``--force`` may remove from ``out``: those its manifest lists, if that is all."""
    manifest = out / MANIFEST_NAME
    if not out.is_dir():
        raise FileExistsError(f"{out}: exists and is not a directory; --force replaces only an earlier "
                              "conversion's output")
    if not manifest.is_file():
        raise FileExistsError(f"{out}: not written by a conversion (no {MANIFEST_NAME}); --force replaces only "
                              "an earlier conversion's output: remove it yourself or pick another --out-dir")
    try:
        listed = set(json.loads(manifest.read_text())["files"])
    except (json.JSONDecodeError, KeyError, TypeError) as exc:
        raise FileExistsError(f"{manifest}: unreadable ({exc}); remove {out} yourself") from None
    for entry in sorted(listed, key=str):
        if not _inside(out, entry):
            raise FileExistsError(f"{manifest}: entry {entry!r} is not a file inside {out}; --force "
                                  f"deletes only inside the output directory: remove {out} yourself")
    foreign = sorted(_files(out) - listed - {MANIFEST_NAME})
    if foreign:
        raise FileExistsError(f"{out}: holds files a conversion did not write ({', '.join(foreign[:3])}"
                              f"{', ...' if len(foreign) > 3 else ''}); --force will not remove them")
    return sorted(listed)


def _remove_previous(out: Path, files: list[str]) -> None:
    """Delete exactly ``files`` (and the manifest) from ``out``, then its emptied directories."""
    for rel in files + [MANIFEST_NAME]:
        (out / rel).unlink(missing_ok=True)
    for d in sorted((p for p in out.rglob("*") if p.is_dir()), key=lambda p: len(p.parts), reverse=True):
        d.rmdir()
    out.rmdir()  # fails (OSError) if anything else appeared meanwhile: nothing foreign is removed


def write_manifest(out_dir: Path, tool: str, source: str) -> None:
    """List every file under ``out_dir`` (what a later ``--force`` may remove)."""
    files = sorted(_files(out_dir) - {MANIFEST_NAME})
    manifest = {"tool": tool, "source": source, "files": files}
    (out_dir / MANIFEST_NAME).write_text(json.dumps(manifest, indent=1) + "\n")


@contextlib.contextmanager
def staged_output_dir(out_dir: str | Path, force: bool = False):
    """Yield a fresh temporary dir next to ``out_dir``; rename it to ``out_dir`` on success.

    On any exception the temporary dir is removed, so nothing half-written is left behind. With
    ``force`` a non-empty ``out_dir`` is replaced only if it is an earlier conversion's output
    (see ``MANIFEST_NAME``), and only its listed files are deleted.
    """
    out = Path(out_dir)
    previous: list[str] | None = None
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        if not force:
            raise FileExistsError(f"{out}: output directory exists and is not empty (use --force)")
        previous = _previous_conversion(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.parent / f".{out.name}.tmp-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    try:
        yield tmp
        if previous is not None:
            _remove_previous(out, previous)
        elif out.exists():
            out.rmdir()  # an empty directory
        tmp.rename(out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def run_job(worker, job: ConversionJob, timeout_s: float = 24 * 3600.0) -> None:
    """Run ``worker`` on ``job.tp * job.pp`` local CPU ranks (gloo).

    Conversion is I/O- and memory-bound, and tp*pp may exceed the GPU count, so the workers
    never see a GPU: ``CUDA_VISIBLE_DEVICES`` is emptied for the spawned processes only.
    """
    from megatron_darl.trainer.parallel import run_local_gloo

    saved = os.environ.get("CUDA_VISIBLE_DEVICES")
    os.environ["CUDA_VISIBLE_DEVICES"] = ""
    try:
        run_local_gloo(worker, job.tp * job.pp, (job,), timeout_s=timeout_s)
    finally:
        if saved is None:
            os.environ.pop("CUDA_VISIBLE_DEVICES", None)
        else:
            os.environ["CUDA_VISIBLE_DEVICES"] = saved


def run_conversion(prog: str, args, src_dir: str, validate, worker, src_flag: str = "--hf-dir",
                   **job_fields) -> int:
    """Validate, convert into a staged dir, rename on success; one error line and 1 on failure."""
    import sys

    from megatron_darl.trainer.parallel import LocalWorkerError

    try:
        check_no_overlap(src_dir, args.out_dir, src_flag)
        validate(src_dir, args.tp, args.pp)
        with staged_output_dir(args.out_dir, args.force) as tmp:
            job = ConversionJob(src_dir=str(Path(src_dir).resolve()), out_dir=str(tmp),
                                tp=args.tp, pp=args.pp, progress=not args.no_progress,
                                **job_fields)
            run_job(worker, job)
            write_manifest(tmp, prog, job.src_dir)
    except (ValueError, OSError, RuntimeError) as exc:
        if args.verbose and isinstance(exc, LocalWorkerError):
            print(exc.details, file=sys.stderr)
        line = str(exc)
        if isinstance(exc, LocalWorkerError):  # a worker's last traceback line: "pkg.mod.Error: what"
            line = re.sub(r"^[\w.]+\.(\w+): ", "", line)
        print(f"{prog}: error: {line}", file=sys.stderr)
        return 1
    return 0
