"""The training loop: the one place that wires trainer, replay, algorithms and transport.

- ``config``: typed ``AlgorithmConfig`` / ``ReplayConfig`` / ``LoopConfig`` / ``ModelConfig``;
- ``planner``: one DP shard's step, ``ShardPlanner.step`` -> ``StepPlan`` (buffer, cache, pass,
  score, select, backfill, loss inputs, mini-batches); ``stats``: its typed ``StepStats``;
- ``step``: ``StepRunner`` (plan, then train with the trainer) and ``StepClock``;
- ``sequences``: samples -> the trainer's ``TrainBatch``, and the packed token layout;
- ``trainer_loop`` + ``endpoints`` + ``resume``: the trainer-side process loop over the transport;
- ``metrics`` + ``plots``: per-step metrics, TensorBoard/W&B, progress bar, plot, summary;
- ``warmstart``: the embedded default's supervised initial policy.

Nothing heavy is imported here.
"""
