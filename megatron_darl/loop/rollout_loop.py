"""The rollout side of a run: one worker's engine, prompts and reward, wired and served.

The counterpart of ``trainer_loop``: ``run_rollout(cfg, worker_id)`` is to ``launch.rollout``
what ``run_trainer(cfg, trainer, ps)`` is to ``launch.trainer``. It builds the engine on the initial
policy, this worker's shard of the prompts (chat-templated token ids), the task's reward function,
waits for the trainer's go (and, on a resumed run, continues after the groups the trainer
already received from this worker), and runs ``RolloutWorker`` until the trainer raises the stop
flag (0). When the worker stops for a reason of its own (the engine cannot load the weights, the
trainer is gone) it raises ``RolloutAborted`` with the exit code and the one line saying why.
"""

from __future__ import annotations

import dataclasses
import json
import logging
from pathlib import Path

from megatron_darl import timeline
from megatron_darl.data.prompt_fit import fit_prompts
from megatron_darl.exit_codes import ExitCode
from megatron_darl.loop.resume import prompt_position, worker_groups_made
from megatron_darl.data import load_dataset
from megatron_darl.eval.periodic import harness_config, heldout_sets
from megatron_darl.loop.heldout_eval import HeldoutServer
from megatron_darl.loop.run_config import RunConfig
from megatron_darl.rewards import reference_check
from megatron_darl.rewards.registry import get_reward_fn
from megatron_darl.rollout.config import SamplingConfig
from megatron_darl.rollout.engines import build_engine
from megatron_darl.rollout.prompts import PromptRecord, PromptSource
from megatron_darl.rollout.worker import RolloutWorker
from megatron_darl.transport import connect_store

log = logging.getLogger(__name__)


class RolloutAborted(RuntimeError):
    """The worker stopped on its own: ``code`` is its exit code, the message the one line why
    (empty when the worker gave none)."""

    def __init__(self, code: int, reason: str) -> None:
        super().__init__(reason)
        self.code = code


def build_prompt_source(cfg: RunConfig, tokenizer, worker_id: int, max_position_embeddings: int):
    """This worker's shard of the dataset (tokenized prompts that fit the context, the launcher's
    rule: ``prompt_fit``) and the dataset's size."""

    records = load_dataset(cfg.data, reference_check(cfg.data.task, cfg.reward)).records
    fit = fit_prompts(cfg, records, tokenizer, max_position_embeddings)
    prompts = [PromptRecord(r.prompt_id, tuple(ids), r) for r, ids in zip(fit.records, fit.token_ids)]
    source = PromptSource(prompts, shard=worker_id, num_shards=cfg.topology.workers,
                          seed=cfg.sampling.seed)
    return source, len(prompts)


def resume_position(cfg: RunConfig, worker, worker_id: int, num_prompts: int) -> None:
    """Wait for the trainer's go; continue after the groups it already received from us."""

    control = cfg.transport.control
    store = connect_store(control, who=f"rollout {worker_id} (start)")
    try:
        made = worker_groups_made(store, worker_id, control.store_timeout_s)
    finally:
        store.close()
    if made:
        shard_size = len(range(worker_id, num_prompts, cfg.topology.workers))
        worker.load_state_dict({"prompts": prompt_position(made, shard_size), "groups_made": made})
        log.info("rollout %d: resuming after %d groups", worker_id, made)


def engine_config(cfg: RunConfig):
    """The engine's config, its model path defaulting to the policy's (``model.path``)."""
    if not cfg.model.path:
        raise ValueError(f"model.path is empty in the run config: model={cfg.model.name} has no weights or "
                         "tokenizer for the engine; pass model.path=<HF checkpoint dir> (launch.train and "
                         "launch.slurm resolve the embedded default's policy and refuse a preset without it)")
    return cfg.engine if cfg.engine.model_path else dataclasses.replace(cfg.engine, model_path=cfg.model.path)


def heldout_server(cfg: RunConfig, worker_id: int, engine, tokenizer):
    """The held-out evaluation hook when this worker is ``eval.worker`` of a run with
    ``eval.benchmarks`` (``loop.heldout_eval``), else None. Its sets are loaded here, once."""
    if not cfg.eval.enabled or worker_id != cfg.eval.worker:
        return None
    sets = heldout_sets(cfg.eval, cfg.data, cfg.reward)
    if sets:
        log.info("rollout %d: evaluates %s when the trainer asks", worker_id,
                 ", ".join(f"{name} ({len(records)} prompts)" for name, records in sets.items()))
    ecfg = harness_config(cfg.eval, cfg.sampling.max_new_tokens, cfg.reward)
    return HeldoutServer(cfg.eval, sets, engine, tokenizer, ecfg,
                         lambda: connect_store(cfg.transport.control, who=f"rollout {worker_id} (eval)"))


def run_rollout(cfg: RunConfig, worker_id: int) -> int:
    """Entry of one rollout worker (called by ``launch.rollout``): 0 after the trainer's stop flag.

    Raises:
        RolloutAborted: the worker stopped on its own, with its exit code and why.
    """
    from transformers import AutoTokenizer

    engine_cfg = engine_config(cfg)
    tokenizer = AutoTokenizer.from_pretrained(cfg.model.path)
    hf = json.loads((Path(cfg.model.path) / "config.json").read_text())
    source, num_prompts = build_prompt_source(cfg, tokenizer, worker_id, int(hf["max_position_embeddings"]))
    engine = build_engine(engine_cfg)
    evaluator = heldout_server(cfg, worker_id, engine, tokenizer)
    timeline.mark("engine_ready")
    if cfg.worker.initial_version >= 0:  # the engine loaded the policy's own weights: version 0
        timeline.mark("first_weights")
    try:
        sampling = SamplingConfig.group(cfg.sampling, cfg.algorithm.group_size)
        worker = RolloutWorker(dataclasses.replace(cfg.worker, worker_id=worker_id), cfg.transport, cfg.bound,
                               cfg.topology, engine, source, sampling, get_reward_fn(cfg.data.task, cfg.reward),
                               lambda ids: tokenizer.decode(ids, skip_special_tokens=True), on_version=evaluator)
        resume_position(cfg, worker, worker_id, num_prompts)
        code = worker.run()
        log.info("rollout %d: exit %d after %d groups sent; last weights version loaded %d",
                 worker_id, code, worker.groups_sent, worker.weights_version)
    finally:
        if evaluator is not None:
            evaluator.close()
        engine.close()
    if code:
        raise RolloutAborted(code, worker.exit_reason)
    return ExitCode.OK
