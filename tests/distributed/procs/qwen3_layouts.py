"""One 4-rank gloo world that checks Megatron Qwen3 logits at TP1PP1, TP2PP1, TP1PP2, TP2PP2.

The same processes re-initialise Megatron's parallel state per layout (DP fills the rest of
the 4 ranks), so the four layouts cost one spawn. Per layout and for tied and untied models:
logits after ``load_hf_checkpoint`` vs the HF reference; a negative control (QKV concatenated
without the per-group interleave) at TP1 and TP2; and logits after reloading dist checkpoints
written at other layouts (the converter's TP2PP2 one, and one saved here at TP2PP1).
Results (max abs diff per check and rank) go to ``results.json`` in the work dir.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
import torch.distributed as dist

LAYOUTS = [(1, 1), (2, 1), (1, 2), (2, 2)]


def _diff(logits, ref) -> float | None:
    return None if logits is None else float((logits - ref).abs().max())


def _naive_qkv(model, hf_dir: Path, ps) -> None:
    """Negative control: overwrite every linear_qkv with plain [q; k; v] rows split over TP."""
    from megatron_darl.models.qwen3.hf_io import HFCheckpointReader

    reader = HFCheckpointReader(hf_dir)
    for local, layer in enumerate(model.decoder.layers):
        hf_layer = ps.pp_rank * len(model.decoder.layers) + local
        qkv = torch.cat([reader.get(f"model.layers.{hf_layer}.self_attn.{x}_proj.weight")
                         for x in "qkv"])
        with torch.no_grad():
            layer.self_attention.linear_qkv.weight.copy_(qkv.chunk(ps.tp_size)[ps.tp_rank])


def _layout(work: Path, tp: int, pp: int, ids, refs, records: list) -> None:
    from megatron_darl.models.qwen3.logits import forward_logits
    from megatron_darl.models.qwen3.model import build_qwen3_model
    from megatron_darl.models.qwen3.weights import load_hf_checkpoint
    from megatron_darl.checkpoint import model_io as ckio
    from megatron_darl.trainer.config import ParallelConfig
    from megatron_darl.trainer.parallel import init_parallel

    ps = init_parallel(ParallelConfig(tp=tp, pp=pp, timeout_s=240))

    def record(variant, kind, logits):
        records.append(dict(tp=tp, pp=pp, variant=variant, kind=kind, rank=ps.rank,
                            diff=_diff(logits, refs[variant])))

    for variant in ("tied", "untied"):
        hf_dir = work / f"hf_{variant}"
        cfg = json.loads((hf_dir / "config.json").read_text())
        model = build_qwen3_model(cfg, ps, attention="sdpa")
        load_hf_checkpoint(model, hf_dir, ps)
        record(variant, "hf", forward_logits(model, ids, ps))
        if variant == "untied" and (tp, pp) == (2, 1):
            meta = ckio.CheckpointMetadata(hf_config=cfg, padded_vocab_size=model[0].padded_vocab,
                                           dtype="float32", saved_tp=tp, saved_pp=pp)
            if ps.rank == 0:
                (work / "mg_untied").mkdir()
            dist.barrier()
            ckio.save_model_checkpoint(model, work / "mg_untied", meta)
        if pp == 1:
            _naive_qkv(model[0], hf_dir, ps)
            record(variant, "negative", forward_logits(model, ids, ps))
    for variant, ckpt in (("tied", work / "mg_tied"), ("untied", work / "mg_untied")):
        if not (ckpt / ckio.METADATA_NAME).is_file():
            continue
        meta = ckio.read_metadata(ckpt)
        model = build_qwen3_model(meta.hf_config, ps, attention="local",
                                  padded_vocab=meta.padded_vocab_size)
        ckio.load_model_checkpoint(model, ckpt)
        record(variant, "reload", forward_logits(model, ids, ps))


def worker(rank: int, world_size: int, work_dir: str) -> None:
    from megatron_darl.trainer.parallel import destroy_parallel

    work = Path(work_dir)
    ids = torch.load(work / "input_ids.pt")
    refs = {v: torch.load(work / f"ref_{v}.pt") for v in ("tied", "untied")}
    records: list = []
    for tp, pp in LAYOUTS:
        _layout(work, tp, pp, ids, refs, records)
        destroy_parallel(keep_default_group=True)
    gathered = [None] * world_size
    dist.all_gather_object(gathered, records)
    if rank == 0:
        flat = [r for part in gathered for r in part if r["diff"] is not None]
        (work / "results.json").write_text(json.dumps(flat, indent=1))
