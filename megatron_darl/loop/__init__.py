"""The training loop: the processes around the D-ARL step (``megatron_darl.step``).

- ``trainer_loop`` + ``endpoints`` + ``resume``: the trainer-side process loop over the
  transport (receive groups, run the step, publish weights, checkpoint);
- ``checkpoint_policy`` + ``checkpoints``: the trainer's checkpoints (``RunCheckpoints``: when,
  save, resume, retention) and which of a run dir's are resume points (launcher and loop);
- ``rollout_loop``: the rollout worker process;
- ``config`` + ``run_config``: the run's typed configs (``LoopConfig``, ``ModelConfig``, ``RunConfig``);
- ``metrics`` + ``plots``: per-step metrics, TensorBoard/W&B, progress bar, plot, summary;
- ``warmstart``: the embedded default's supervised initial policy.

Nothing heavy is imported here.
"""
