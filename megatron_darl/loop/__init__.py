"""The training loop: the processes around the D-ARL step (``megatron_darl.step``).

- ``trainer_loop`` + ``endpoints``: the trainer-side process loop over the transport (receive
  groups, run the step, publish weights, checkpoint through ``megatron_darl.checkpoint``);
- ``rollout_loop``: the rollout worker process;
- ``resume``: what a resumed trainer hands fresh rollout workers through the store;
- ``config`` + ``run_config``: the run's typed configs (``LoopConfig``, ``ModelConfig``, ``RunConfig``);
- ``metrics`` + ``plots``: per-step metrics, TensorBoard/W&B, progress bar, plot, summary;

Nothing heavy is imported here.
"""
