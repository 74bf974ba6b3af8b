"""Checkpoints: a trainer's save and load, the model checkpoint format, and a run's resume points.

One manager holds a run's checkpoints; the trainer loop uses it and nothing else here. Below it,
each module owns one part, which the launcher, eval, the converters and the trainer's initial
weights use directly. Nothing is imported here, so the launcher's cheap checks stay cheap:

  manager.CheckpointManager(loop_cfg, trainer, ps, with_snapshots, extra_state)
      .save(next_step) / .save_between(step) / .load() (verified) / .retain(newest)
      .complete() / .newest() / .due(step, start_step)
  manager.newest_checkpoint(run_dir)      the clause a failure message names for the resume
  resume_points.complete_checkpoints(run_dir), latest_checkpoint, partial_checkpoints
  training.save_checkpoint / load_checkpoint / load_model_weights   a trainer's full state
  model_io.save_model_checkpoint / load_model_checkpoint / read_metadata, CheckpointDamaged
  checksums.write_manifest(dir) / verify_checkpoint(dir)   SHA-256 of every file (collective)
  disk.check_room / CheckpointFailed      room on disk, agreed on by every rank before a write
  snapshots.save_snapshots / load_snapshots   the window's parameter snapshots, for exact backfill
  hf_dir.resolve_hf_dir(model, tmp, converter)   a Megatron checkpoint where an HF one is expected

It imports ``models`` (the Qwen3 spec and mapping) and nothing else of ours: the trainer object
it saves is passed in, so the trainer can load its initial weights through it.
"""

# one conversion (tools/convert_*.py, run as a process by hf_dir and by Slurm's CONVERT=1) may take
# this long; far past a healthy one: a conversion on a stalled filesystem would never end
CONVERT_TIMEOUT_S = 7200.0
