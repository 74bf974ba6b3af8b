"""The optional loss terms in a step: the entropy bonus and the KL penalty to the initial policy.

Off by default (``algorithm.entropy_coef = algorithm.kl_coef = 0``), and then nothing here runs:
the step's loss, batches and passes are exactly those of the plain policy loss. When a term is on:

* the loss is ``algorithms.regularizer_loss`` added to ``policy_loss`` (same token mean), its
  inputs ``RegularizedLossInputs``: the policy loss's plus a token mask (0 on the zero-weight
  stand-ins that keep DP shards in step, which must not be regularised either) and the
  reference log-probs;
* ``entropy_coef > 0``: the train step's last stage also returns the per-token entropy
  (``trainer.logprobs``, one more all-reduced sum per row); the metric ``entropy`` is its token
  mean over the step's trained tokens (``term_stats``; left out of a step that trained none);
* ``kl_coef > 0``: the reference is the initial policy, version 0, kept by the trainer as one more
  parameter snapshot for the whole run (``ensure_reference``; it goes into checkpoints with the
  window's snapshots, so a resumed run has it). Each step scores the selected samples that lack a
  reference row under it, in one pass with the same machinery as backfill (``ref_rows`` counts
  them); a replayed sample reuses its row, which is dropped once the sample left the buffer. The
  metric ``kl_ref`` is the token mean of the estimator, over the trained tokens too.
"""

from __future__ import annotations

import dataclasses
import logging
from typing import Callable

import torch

from megatron_darl.algorithms import (
    PolicyLossInputs, RegularizedLossInputs, policy_loss, regularizer_loss,
)
from megatron_darl.step.config import AlgorithmConfig
from megatron_darl.step.prefetch import entry_pieces, take
from megatron_darl.step.sequences import packed_batch
from megatron_darl.step.stats import StepStats
from megatron_darl.trainer.batch import TrainBatch

log = logging.getLogger(__name__)

REFERENCE_VERSION = 0  # the initial policy
LOSS_STATS = ("clip_frac_low", "clip_frac_high", "mean_ratio", "mean_weight")  # policy_loss stats logged
TRAINED_SHARE = "trained_token_share"  # a micro-batch's tokens of trained samples over all its tokens


def terms_on(algorithm: AlgorithmConfig) -> bool:
    """Whether any optional term is in the loss."""
    return algorithm.entropy_coef > 0 or algorithm.kl_coef > 0


def regularized_loss_fn(algorithm: AlgorithmConfig):
    """The trainer's ``loss_fn(logp, batch_slice[, entropy])``: ``policy_loss`` plus the terms, a
    micro-batch *sum* (``num_tokens=1``) like ``runner.loss_fn_for``'s; stats add ``entropy``
    (when computed) and ``kl_ref`` (when on), token means over the micro-batch's trained tokens."""
    a = algorithm
    kl_on = a.kl_coef > 0

    def loss_fn(logp: torch.Tensor, batch_slice: TrainBatch,
                entropy: torch.Tensor | None = None) -> tuple[torch.Tensor, dict[str, float]]:
        x: RegularizedLossInputs = batch_slice.loss_inputs
        loss, stats = policy_loss(logp, x.logp_base, x.weights, x.advantages, None, a.eps_low, a.eps_high,
                                  num_tokens=1.0)
        extra, reg = regularizer_loss(logp, entropy, x.logp_ref if kl_on else None, x.token_mask,
                                      a.entropy_coef, a.kl_coef, a.kl_estimator, num_tokens=1.0)
        out = {k: float(getattr(stats, k)) for k in LOSS_STATS}
        # the trainer weights a stat by the micro-batch's tokens, stand-ins included: the terms'
        # means go out scaled by their trained share, which ``term_stats`` divides out again
        share = float(x.token_mask.sum()) / max(int(logp.shape[0]), 1)
        if entropy is not None or kl_on:
            out[TRAINED_SHARE] = share
        if entropy is not None:
            out["entropy"] = float(reg.entropy) * share
        if kl_on:
            out["kl_ref"] = float(reg.kl) * share
        return loss + extra, out

    return loss_fn


def term_stats(stats: dict[str, float]) -> dict[str, float]:
    """The step's stats with the terms' means over its trained tokens: ``regularized_loss_fn``'s
    share-scaled means divided by the step's trained share (their token-weighted means, as the
    trainer reduces every stat). A step that trained no token has no entropy or KL to report,
    so both are left out rather than logged as 0."""
    out = dict(stats)
    share = out.pop(TRAINED_SHARE, None)
    if share is None:
        return out
    for key in ("entropy", "kl_ref"):
        if key in out:
            if share > 0:
                out[key] /= share
            else:
                del out[key]
    return out


def ensure_reference(trainer, only: bool) -> None:
    """Keep the initial weights as the snapshot of version 0 (taken now at version 0; a resumed
    run must have it from its checkpoint) and log what it costs. ``only``: the variant keeps no
    other snapshot (no exact backfill), so any other one (a resume loads the current version's)
    is dropped."""
    snaps = trainer.snapshots
    if REFERENCE_VERSION not in snaps.versions:
        if trainer.version != REFERENCE_VERSION:
            raise ValueError(
                f"algorithm.kl_coef > 0 needs the initial policy (version {REFERENCE_VERSION}) as the KL "
                f"reference, but the checkpoint resumed at version {trainer.version} carries no snapshot of "
                "it (its run had no KL term): start a new loop.run_dir, or resume with algorithm.kl_coef=0")
        snaps.take(REFERENCE_VERSION)
    if only:
        snaps.retain([REFERENCE_VERSION])
    on_device = REFERENCE_VERSION in snaps.resident_versions()
    log.info("KL reference: the initial weights kept as snapshot v%d, %.2f GiB on this rank (%s)",
             REFERENCE_VERSION, snaps.bytes() / max(len(snaps.versions), 1) / 2**30,
             "on the device" if on_device else "in host memory")


def keep_versions(window_versions: list[int], algorithm: AlgorithmConfig) -> list[int]:
    """The snapshots to keep after a step: the window's, plus the reference under a KL term."""
    return [*window_versions, REFERENCE_VERSION] if algorithm.kl_coef > 0 else list(window_versions)


class ReferenceRows:
    """log pi_ref rows of this shard's buffered samples, by sample id; and the step's inputs."""

    def __init__(self, algorithm: AlgorithmConfig) -> None:
        self.kl_on = algorithm.kl_coef > 0
        self.epochs = algorithm.ppo_epochs
        self._rows: dict[int, torch.Tensor] = {}  # sample_id -> (T_i,) float32

    def bytes(self) -> int:
        return sum(r.numel() * r.element_size() for r in self._rows.values())

    def attach(self, plan, planner, logprobs: Callable[[TrainBatch, int], torch.Tensor]):
        """``plan`` with ``RegularizedLossInputs`` on every mini-batch (the reference rows of its
        selected samples computed first, those lacking one, in one pass)."""
        stats: StepStats = plan.stats
        ref = None
        if self.kl_on:
            live = {s.sample_id for e in planner.buffer.entries(planner.shard) for s in e.group.samples}
            self._rows = {sid: row for sid, row in self._rows.items() if sid in live}
            entries = plan.selection.entries if plan.selection is not None and not plan.filler else []
            work = take(entry_pieces(entries, lambda s: s.sample_id not in self._rows), float("inf"),
                        REFERENCE_VERSION)
            if work is not None:
                logp = logprobs(packed_batch(work.packed), REFERENCE_VERSION)
                rows = logp.to(torch.float32).split([s.num_tokens for s in work.samples])
                self._rows.update({s.sample_id: r.clone() for s, r in zip(work.samples, rows, strict=True)})
                stats.ref_rows += len(work.samples)
            if entries:
                ref = torch.cat([self._rows[s.sample_id] for s in plan.samples if s.num_tokens])
        return with_terms_inputs(plan, ref, self.epochs)


def with_terms_inputs(plan, logp_ref: torch.Tensor | None, epochs: int):
    """``plan`` whose mini-batches carry ``RegularizedLossInputs``: the trained samples' tokens
    (the first ``n`` of the plan's packed inputs, in order) get mask 1 and their ``logp_ref`` rows
    (zeros when None), the stand-ins after them mask 0. The plan's mini-batches are its M parts
    ``epochs`` times over."""
    n = 0 if plan.filler or plan.loss_inputs is None else int(plan.loss_inputs.weights.numel())
    ref = logp_ref if logp_ref is not None else torch.zeros(n, dtype=torch.float32)
    assert ref.numel() == n, (ref.numel(), n)
    parts = plan.minibatches[: len(plan.minibatches) // epochs]
    out, start = [], 0
    for part in parts:
        k = part.num_loss_tokens
        real = start < n
        assert not real or start + k <= n, "a mini-batch straddles the trained tokens and a stand-in"
        mask = torch.full((k,), 1.0 if real else 0.0)
        logp_ref_k = ref[start:start + k] if real else torch.zeros(k)
        x: PolicyLossInputs = part.loss_inputs
        inputs = RegularizedLossInputs(x.logp_base, x.weights, x.advantages, mask, logp_ref_k)
        out.append(dataclasses.replace(part, loss_inputs=inputs))
        start += k if real else 0
    return dataclasses.replace(plan, minibatches=out * epochs)
