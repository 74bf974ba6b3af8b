"""The training loop: the one place that wires trainer, replay, algorithms and transport.

- ``config``: typed ``AlgorithmConfig`` / ``ReplayConfig`` / ``LoopConfig`` / ``ModelConfig``;
- ``planner``: one DP shard's per-step algorithm (buffer, cache, score, select, weights, loss);
- ``sequences``: samples <-> the trainer's packed ``TrainBatch`` (token alignment);
- ``trainer_loop`` + ``endpoints`` + ``resume``: the trainer-side process loop over the transport;
- ``metrics`` + ``plots``: per-step metrics, TensorBoard/W&B, progress bar, plot, summary;
- ``warmstart``: the embedded default's supervised initial policy.

Nothing heavy is imported here.
"""
