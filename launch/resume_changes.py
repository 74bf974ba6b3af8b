"""Which config changes a resumed run accepts, and the one line that refuses the others.

A checkpoint holds more than weights: the optimizer and its schedule, each DP shard's replay
buffer and log-prob cache (groups of G samples, versions in the window K), the parameter
snapshots of the window, and each rollout worker's position in its shard of the prompts. A
resume with a config those were not made for would crash deep in a child (``replay.k`` or
``algorithm.variant``: "2 is not in list") or, worse, go on silently with a different
experiment (more workers, another G, another prompt seed). So ``launch.train`` and
``launch.slurm`` compare the new config with the checkpoint run's ``run_config.yaml`` before
any process starts (``check_resume``), and write the new one only once it is accepted.

The rules, first match wins (``RULES``; the full key lists: docs/run_dirs.md, checked against
``RULES`` by tests/unit/test_run_dir_rules.py):

=====================================================  ==============  =====================================
keys                                                   on resume       why
=====================================================  ==============  =====================================
loop.* (steps, intervals, logging, run_dir)            allowed         how long the run goes, what it writes
transport.control.{host,port,bind,secret,*timeout*,   allowed         plumbing of one launch
  poll}
transport.heartbeat.*, transport.weight_sync.*         allowed         plumbing of one launch
transport.channel.{max_unacked,send/connect/transfer   allowed         plumbing of one launch
  timeouts,transport,backend}
cluster.{master_*,devices,gpus,threads,grace,          allowed         where processes run, not what
  rollout_failure,rollout_restarts}, parallel.{backend,timeout_s}
engine.*, worker.*                                     allowed         how samples are generated; engines
                                                                       get the resumed weights first
eval.*                                                 allowed         held-out scoring touches no training state
trainer.micro_batch.*, trainer.{activation_recompute,  allowed         memory and speed only; the checkpoint
  sequence_parallel,grad_reduce_in_fp32,peak_tflops,                   replaces the initial weights and RNG
  overlap_grad_reduce,init_checkpoint,seed,snapshots,
  compile_warmup,compiled_kernels,fused_layers},
  parallel.seed
model.*, warmstart.*                                   checked at      the initial policy: the checkpoint
                                                       load            replaces it, and its loader refuses
                                                                       another model naming the fields
cluster.trainer_ranks, parallel.tp, parallel.pp        refused         optimizer format and per-DP-shard
                                                                       replay state hold this layout
cluster.rollout_workers                                refused         worker positions are per worker id,
                                                                       in shards of 1/workers of the prompts
replay.{rescore,rescore_audit}                         allowed         which groups a step re-scores
replay.{fill_batch,fill_max_degenerate}                allowed         which arrivals count toward B; the
                                                                       buffer holds no group either rule
                                                                       would select differently
algorithm.*, replay.*                                  refused         the buffer, cache, snapshots and
                                                                       selection state were made for them
sampling.*                                             refused         the sampler's density and the
                                                                       prompt order (seed) of the samples
data.*                                                 refused         the restored prompt positions index
                                                                       this dataset in this order
reward.fn_{timeout_s,max_inflight}, reward.math.       allowed         how long and where a verifier may
  {timeout_seconds,isolation,hard_timeout_seconds,                     run, not what it rewards
  pool_workers}, reward.code.{sandbox.*,stdio_total_seconds}
reward.*                                               refused         the buffered samples were scored
  (fn, fn_kwargs, answer extraction, stdio_scoring)                    with it: two rewards in one run
trainer.optimizer.*, trainer.bf16                      refused         restored from the checkpoint: a new
                                                                       value would be silently ignored
anything else                                          refused         not known to be safe
=====================================================  ==============  =====================================
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from enum import Enum
from typing import Any, Iterator, Mapping


class Rule(str, Enum):
    ALLOWED = "allowed"
    AT_LOAD = "checked at load"  # allowed here; the checkpoint loader compares it
    REFUSED = "refused"


_PLUMBING = "plumbing of one launch"
# (keys, rule, why): a key matches exactly, or by prefix when the pattern ends with "."
RULES: tuple[tuple[tuple[str, ...], Rule, str], ...] = (
    (("loop.",), Rule.ALLOWED, "how long the run goes and what it writes"),
    (("transport.control.host", "transport.control.port", "transport.control.secret",
      "transport.control.store_timeout_s", "transport.control.call_timeout_s",
      "transport.control.poll_interval_s", "transport.heartbeat.", "transport.weight_sync.",
      "transport.channel.max_unacked_per_hub", "transport.channel.send_timeout_s",
      "transport.channel.transport", "transport.channel.backend", "transport.channel.connect_timeout_s",
      "transport.channel.transfer_timeout_s", "transport.control.bind"), Rule.ALLOWED, _PLUMBING),
    (("cluster.master_addr", "cluster.master_port", "cluster.threads_per_process", "cluster.grace_s",
      "cluster.rollout_failure", "cluster.rollout_restarts", "cluster.trainer_devices", "cluster.rollout_devices",
      "cluster.trainer_gpus", "cluster.rollout_gpus", "cluster.split", "cluster.rates.", "parallel.backend",
      "parallel.timeout_s"),
     Rule.ALLOWED, "where the processes run, not what they compute"),
    (("engine.", "worker."), Rule.ALLOWED, "how samples are generated (engines get the resumed weights first)"),
    (("eval.",), Rule.ALLOWED, "which versions are scored on held-out prompts; scoring never touches training state"),
    (("trainer.micro_batch.", "trainer.activation_recompute", "trainer.sequence_parallel",
      "trainer.grad_reduce_in_fp32", "trainer.overlap_grad_reduce", "trainer.peak_tflops",
      "trainer.init_checkpoint", "trainer.seed", "trainer.snapshots", "trainer.compile_warmup",
      "trainer.compiled_kernels", "trainer.fused_layers", "parallel.seed"),
     Rule.ALLOWED, "memory and speed only; the checkpoint replaces the initial weights and RNG"),
    (("model.", "warmstart."), Rule.AT_LOAD, "the checkpoint's loader refuses another model naming the fields"),
    (("cluster.trainer_ranks", "parallel.tp", "parallel.pp"), Rule.REFUSED,
     "the checkpoint's optimizer format and per-DP-shard replay state hold the trainer layout"),
    (("cluster.rollout_workers",), Rule.REFUSED,
     "each worker's prompt position is restored by worker id, in shards of 1/workers of the prompts"),
    (("replay.rescore", "replay.rescore_audit", "replay.prefetch"), Rule.ALLOWED,
     "which buffered groups are re-scored at a step, and when rows are computed; the buffer keeps "
     "every group's last score"),
    (("replay.fill_batch", "replay.fill_max_degenerate"), Rule.ALLOWED,
     "which arrivals count toward a step's B: degenerate groups are never selected either way "
     "(replay.drop_degenerate, which fill_batch needs), and the restored counts hold trainable groups"),
    (("algorithm.", "replay."), Rule.REFUSED,
     "the replay buffer, log-prob cache, snapshots and selection state were made for it"),
    (("sampling.",), Rule.REFUSED, "the buffered samples were drawn with it (density, prompt order)"),
    (("data.",), Rule.REFUSED, "the restored prompt positions index this dataset in this order"),
    (("reward.fn_timeout_s", "reward.fn_max_inflight", "reward.math.timeout_seconds", "reward.math.isolation",
      "reward.math.hard_timeout_seconds", "reward.math.pool_workers", "reward.code.sandbox.",
      "reward.code.stdio_total_seconds"), Rule.ALLOWED,
     "how long and where a verifier may run, not what it rewards (a late one scores 0.0 and is counted)"),
    (("reward.",), Rule.REFUSED,
     "the buffered samples were scored with it: the run would mix two rewards (the code of reward.fn "
     "itself is not compared: keep it unchanged within a run)"),
    (("trainer.optimizer.", "trainer.bf16"), Rule.REFUSED,
     "restored from the checkpoint: a new value would be silently ignored"),
)
LAUNCH_KEYS = ("cluster.master_port", "transport.control.port", "transport.control.secret",
               "worker.initial_version")  # set anew by every launch: not a change of the run


@dataclass(frozen=True)
class Change:
    """One config value that differs from the checkpoint's run."""

    key: str  # dotted config key
    old: Any  # in the checkpoint run's run_config.yaml
    new: Any  # in this launch

    def __str__(self) -> str:
        return f"{self.key}: {self.old!r} -> {self.new!r}"


def rule_of(key: str) -> tuple[Rule, str, int]:
    """The rule for ``key``, why, and its place in ``RULES`` (keys no rule names: refused, last)."""
    for index, (patterns, rule, why) in enumerate(RULES):
        if any(key == p or (p.endswith(".") and key.startswith(p)) for p in patterns):
            return rule, why, index
    return Rule.REFUSED, "not known to be safe to change on resume", len(RULES)


def leaves(cfg: Any, prefix: str = "") -> Iterator[tuple[str, Any]]:
    """(dotted key, value) of a config dataclass's fields; dicts and lists are values."""
    for f in dataclasses.fields(cfg):
        value = getattr(cfg, f.name)
        if dataclasses.is_dataclass(value):
            yield from leaves(value, f"{prefix}{f.name}.")
        else:
            yield f"{prefix}{f.name}", value


def _lookup(tree: Mapping, key: str) -> tuple[bool, Any]:
    node: Any = tree
    for part in key.split("."):
        if not isinstance(node, Mapping) or part not in node:
            return False, None
        node = node[part]
    return True, node


def _plain(value: Any) -> Any:
    """A tuple as the list its YAML copy holds (YAML has no tuples)."""
    return list(value) if isinstance(value, tuple) else value


def config_changes(old: Mapping, new: Any) -> list[Change]:
    """Keys of ``new`` (a ``RunConfig``) whose value differs in ``old`` (a saved config as a
    plain dict); keys ``old`` lacks (a config field added since) are not compared."""
    out = []
    for key, value in leaves(new):
        found, before = _lookup(old, key)
        if found and _plain(before) != _plain(value):
            out.append(Change(key, before, value))
    return out


def check_resume(old: Mapping, new: Any, source: str) -> list[Change]:
    """The changes since the checkpoint's run (``source``: its ``run_config.yaml``), all allowed;
    else ``ValueError`` naming the first refused key, its old and new value and why."""
    changes = config_changes(old, new)
    refused = sorted(((rule_of(c.key)[2], i, c) for i, c in enumerate(changes)
                      if rule_of(c.key)[0] is Rule.REFUSED), key=lambda t: t[:2])  # primary keys first
    if refused:
        first, more = refused[0][2], [c.key for _, _, c in refused[1:]]
        why = rule_of(first.key)[1]
        also = f" (also changed: {', '.join(more)})" if more else ""
        raise ValueError(f"loop.resume=true: {first.key} changed from {first.old!r} to {first.new!r} since the "
                         f"checkpoint's run ({source}): refused, {why}; resume with {first.key}="
                         f"{first.old!r}, or start a new loop.run_dir{also}")
    return changes
