"""Megatron policy trainer: parallel state, log-prob pass, train step, parameter snapshots.

It takes a loss function and knows nothing about PPO; it never imports ``rollout``. Nothing
heavy is imported here; the public API lives in the submodules:

  parallel.ParallelConfig, init_parallel(cfg) -> ParallelState, destroy_parallel()
  config.TrainerConfig (OptimizerConfig, MicroBatchConfig)
  batch.TrainBatch                    packed sequences + loss mask + the loss's typed inputs
                                      (a dataclass of (n,) tensors, one value per scored token)
  batch.broadcast_batch(batch|None, parallel_state, payload_type)  hub -> its replica's ranks
  policy_trainer.PolicyTrainer(cfg, parallel_state, hf_config, temperature=1.0)
      .compute_logprobs(batch, version=None) -> (n,) fp32 log-probs of the scored tokens, in
        order (of softmax(logits / temperature): the sampler's density)
      .train_steps(minibatches, loss_fn) -> StepResult: one optimizer step per mini-batch,
        one new version (PPO mini-batches); .train_step(batch, loss_fn) = one mini-batch
      .snapshot(version=None, keep=None)   host copies for exact backfill (keep: the window)
      .require_finite(what) -> weight norm, or WeightsNotFinite on every rank (before a save)
      .export_hf_stage() -> iterator of (hf_name, full tensor) for weight sync
      .optimizer_steps, .version
  snapshots.ParamSnapshots             the window's past weights, for exact backfill

Checkpoints of a trainer (save, load, resume) are ``megatron_darl.checkpoint``'s; the trainer
loads its initial weights (``init_checkpoint``) through it.
"""
