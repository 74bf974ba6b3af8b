"""The D-ARL step: from a DP shard's new groups to the trainer's PPO mini-batches, and the update.

- ``planner``: ``ShardPlanner.step`` -> ``StepPlan``, the whole algorithm of one trainer step
  (arrival, scoring at t, selection, backfill, behavior weights, mini-batches) over the replay
  buffer and log-prob cache of ``megatron_darl.replay``;
- ``candidates``: which buffered groups a step scores (``replay.rescore``);
- ``runner``: ``StepRunner`` (plan with the trainer as the log-prob source, then train) and
  ``StepClock``; ``replica``: how the hub rank's passes reach its TP/PP peers;
- ``sequences``: samples -> the trainer's ``TrainBatch``, and the packed token layout;
- ``stats``: the step's typed ``StepStats`` and their DP reduction;
- ``config``: ``AlgorithmConfig``, ``MisConfig``, ``ReplayConfig``.

It imports the algorithms, the replay state, the samples and the trainer's batch types, and
nothing of the transport or the processes: ``megatron_darl.loop`` receives groups, calls the
step and publishes its weights (docs/architecture.md). Nothing heavy is imported here.
"""
