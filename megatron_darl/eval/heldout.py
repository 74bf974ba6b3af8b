"""Held-out accuracy of a training run's checkpoints: the curves of the variant study.

Why from the outside: the trainer loop does not evaluate, but it saves a checkpoint every
``loop.checkpoint_interval`` steps. This module loads each of them into one Megatron model in
this process (TP 1 / PP 1; a checkpoint reloads at any layout), hands the HF-named weights to
one ``hf`` engine through its weight-sync entry (``load_weights``, the path the rollout worker
uses) and scores a prompt set through the evaluation harness and the reward registry. One
process, one model build and one engine serve all the checkpoints of a run, so a curve of ten
points costs ten generations, not ten conversions.

    python -m megatron_darl.eval.heldout --model-dir INIT --run-dir RUN --data countdown \\
        countdown.split=test countdown.num_prompts=256 --out RUN/heldout.json

The first point (step 0) is the initial policy ``--model-dir`` itself; a checkpoint
``step_000040`` is the policy after 40 trainer steps (version 40).
"""

from __future__ import annotations

import argparse
import json
import re
import shutil
import sys
import time
from dataclasses import asdict
from pathlib import Path
from typing import Callable, Iterator

import torch

from megatron_darl.checkpoint.model_io import load_model_checkpoint, read_metadata
from megatron_darl.data.config import load_data_config
from megatron_darl.data.loaders import load_dataset
from megatron_darl.data.records import PromptRecord
from megatron_darl.exit_codes import ExitCode
from megatron_darl.eval.config import EvalConfig, HeldoutConfig
from megatron_darl.eval.harness import evaluate_benchmark, take_limit
from megatron_darl.models.qwen3.mapping import megatron_to_hf_stage
from megatron_darl.models.qwen3.model import build_qwen3_model
from megatron_darl.ports import free_port
from megatron_darl.quiet import quiet_libraries
from megatron_darl.rewards import reference_check
from megatron_darl.rollout.config import EngineConfig
from megatron_darl.rollout.engines import build_engine
from megatron_darl.trainer.config import ParallelConfig
from megatron_darl.trainer.parallel import destroy_parallel, init_parallel

_STEP = re.compile(r"step_(\d+)")


def list_checkpoints(run_dir: str | Path) -> list[tuple[int, Path]]:
    """(steps done, directory) of the finished ``checkpoints/step_*`` of a run, by step."""
    found = []
    for path in (Path(run_dir) / "checkpoints").glob("step_*"):
        match = _STEP.fullmatch(path.name)
        if match and path.is_dir():
            found.append((int(match[1]), path))
    return sorted(found)


class CheckpointWeights:
    """One Megatron model (TP 1, PP 1) in this process that yields a checkpoint's HF weights."""

    def __init__(self, ckpt_dir: Path) -> None:

        self.ps = init_parallel(ParallelConfig(tp=1, pp=1), rank=0, world_size=1,
                                init_method=f"tcp://127.0.0.1:{free_port()}")
        meta = read_metadata(ckpt_dir)
        self.model = build_qwen3_model(meta.hf_config, self.ps, dtype=meta.torch_dtype,
                                       attention="sdpa", padded_vocab=meta.padded_vocab_size)

    def weights(self, ckpt_dir: Path) -> Iterator[tuple[str, torch.Tensor]]:
        """Load ``ckpt_dir`` and yield its ``(hf_name, tensor)`` pairs."""

        load_model_checkpoint(self.model, ckpt_dir)
        yield from megatron_to_hf_stage(self.model, self.ps)

    def close(self) -> None:
        destroy_parallel()


def _score(name: str, records: list[PromptRecord], engine, tokenizer, cfg: HeldoutConfig) -> dict:
    """``accuracy`` (greedy) and, with ``cfg.samples``, ``accuracy_sampled`` (mean over samples)."""
    passes = [("", 1, 0.0)] + ([("_sampled", cfg.samples, cfg.temperature)] if cfg.samples else [])
    out: dict = {}
    for suffix, n, temperature in passes:
        ecfg = EvalConfig(n=n, temperature=temperature, top_p=1.0, max_new_tokens=cfg.max_new_tokens,
                          seed=cfg.seed, batch_prompts=cfg.batch_prompts, score_workers=1,
                          progress=cfg.progress)
        result = evaluate_benchmark(f"{name}{suffix}", records, engine, tokenizer, ecfg)
        out |= {f"accuracy{suffix}": result.avg_at_n,
                f"mean_response_tokens{suffix}": result.mean_response_tokens,
                f"truncated_fraction{suffix}": result.truncated_fraction}
    return out


def evaluate_checkpoints(model_dir: str | Path, checkpoints: list[tuple[int, Path]],
                         records: list[PromptRecord], cfg: HeldoutConfig,
                         delete: bool = False, log=print, points: list[dict] | None = None,
                         on_point: Callable[[list[dict]], None] = lambda points: None) -> list[dict]:
    """``[{"step", "accuracy", ...}]``: the initial policy (step 0), then every checkpoint.

    ``points`` are those an earlier, interrupted evaluation scored: kept, and their steps (0
    included) not scored again. ``on_point`` gets the points so far after each one. ``delete``
    removes each checkpoint once scored (the study keeps only the curve), renamed first so that
    one half deleted is never listed again.
    """
    from transformers import AutoTokenizer

    if not records:
        raise ValueError("evaluate_checkpoints: no held-out prompts")
    total, records = len(records), take_limit(records, cfg.limit)
    points = list(points or [])
    scored = {p["step"] for p in points}
    checkpoints = [(step, path) for step, path in checkpoints if step not in scored]
    of = f" (of {total}, limit {cfg.limit:g})" if len(records) < total else ""
    log(f"[heldout] {len(records)} prompts{of}, {len(checkpoints) + (0 not in scored)} policies to score"
        + (f" ({len(scored)} already scored)" if scored else ""))
    tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
    engine = build_engine(EngineConfig(backend="hf", model_path=str(model_dir)))
    loader = CheckpointWeights(checkpoints[0][1]) if checkpoints else None
    try:
        if 0 not in scored:
            points.insert(0, {"step": 0, **_score("step_0", records, engine, tokenizer, cfg)})
            log(f"[heldout] step 0: accuracy {points[0]['accuracy']:.4f} "
                f"(sampled {points[0].get('accuracy_sampled', float('nan')):.4f})")
            on_point(points)
        for step, path in checkpoints:
            engine.load_weights(loader.weights(path))
            points.append({"step": step, **_score(path.name, records, engine, tokenizer, cfg)})
            log(f"[heldout] step {step}: accuracy {points[-1]['accuracy']:.4f} "
                f"(sampled {points[-1].get('accuracy_sampled', float('nan')):.4f})")
            on_point(points)
            if delete:
                doomed = path.with_name(path.name + ".scored")  # no longer a step_* checkpoint
                path.rename(doomed)
                shutil.rmtree(doomed, ignore_errors=True)
    finally:
        engine.close()
        if loader is not None:
            loader.close()
    return points


def _records(preset: str, overrides: list[str]) -> list[PromptRecord]:
    from omegaconf import OmegaConf

    path = Path(preset)
    if not preset.endswith(".yaml"):
        path = Path(__file__).resolve().parents[2] / "configs" / "data" / f"{preset}.yaml"
    data = load_data_config(path, OmegaConf.to_container(OmegaConf.from_dotlist(overrides)))
    return load_dataset(data, reference_check(data.task)).records


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model-dir", required=True, help="the run's initial HF policy (model.path)")
    parser.add_argument("--run-dir", required=True, help="the run dir whose checkpoints/ are scored")
    parser.add_argument("--data", default="countdown", help="configs/data preset or YAML path")
    parser.add_argument("--out", required=True, help="JSON file written with the points")
    parser.add_argument("--samples", type=int, default=0, help="sampled responses per prompt (0: greedy only)")
    parser.add_argument("--temperature", type=float, default=1.0, help="temperature of the sampled pass")
    parser.add_argument("--max-new-tokens", type=int, default=48)
    parser.add_argument("--limit", type=float, default=-1,
                        help="the first N held-out prompts, or a fraction of them (0.1); -1: all")
    parser.add_argument("--no-progress", action="store_true", help="no bar per checkpoint")
    parser.add_argument("--delete", action="store_true", help="delete each checkpoint once scored")
    parser.add_argument("--resume", action="store_true",
                        help="keep the points of an interrupted evaluation in --out, score the rest")
    parser.add_argument("--verbose", action="store_true", help="the libraries' notices and deprecations too")
    parser.add_argument("overrides", nargs="*", help="data KEY=VALUE overrides (countdown.split=test)")
    args = parser.parse_args(argv)
    if not args.verbose:
        quiet_libraries()
    try:
        cfg = HeldoutConfig(samples=args.samples, temperature=args.temperature,
                            max_new_tokens=args.max_new_tokens, limit=args.limit,
                            progress=not args.no_progress)
        records = _records(args.data, args.overrides)
        if not Path(args.model_dir).is_dir():
            raise FileNotFoundError(f"--model-dir {args.model_dir}: no such directory")
    except (ValueError, FileNotFoundError) as err:
        print(f"heldout: {err}", file=sys.stderr)
        return ExitCode.USAGE
    start, out = time.monotonic(), Path(args.out)
    earlier = json.loads(out.read_text())["points"] if args.resume and out.is_file() else []
    out.parent.mkdir(parents=True, exist_ok=True)

    def write(points: list[dict]) -> None:  # after every point: an interrupted run keeps them
        tmp = out.with_name(out.name + ".tmp")
        prompts = len(take_limit(records, cfg.limit))
        tmp.write_text(json.dumps({"config": asdict(cfg), "prompts": prompts, "points": points,
                                   "seconds": time.monotonic() - start}, indent=1) + "\n")
        tmp.replace(out)

    points = evaluate_checkpoints(args.model_dir, list_checkpoints(args.run_dir), records, cfg,
                                  delete=args.delete, log=lambda m: print(m, file=sys.stderr),
                                  points=earlier, on_point=write)
    write(points)
    print(out)
    return ExitCode.OK


if __name__ == "__main__":
    sys.exit(main())
