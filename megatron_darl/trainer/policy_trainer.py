"""The Megatron policy trainer: log-prob pass, train step, snapshots, HF export.

``PolicyTrainer`` owns one rank's model chunks (Qwen3 ``GPTModel`` in Megatron DDP), the
distributed Adam optimizer and the LR schedule. The training loop talks to it through a small
contract and nothing else:

* ``compute_logprobs(batch)`` forward-only log-probs of the scored tokens, of the sampler's
  distribution ``softmax(logits / temperature)`` (``temperature`` given at construction);
* ``train_steps(minibatches, loss_fn)`` one optimizer step per mini-batch (PPO mini-batches),
  then one new weight version, whose norm the result carries (``weight_check``: the loop
  publishes and saves no version whose weights are not finite); ``train_step(batch, loss_fn)`` is the one-mini-batch case;
  ``loss_fn(logp, batch_slice)`` returns the
  *sum* of per-token losses of a micro-batch and a dict of float stats. The trainer divides by
  the number of scored tokens of the whole step (all micro-batches, all DP ranks), so the update
  is the token mean of docs/algorithm.md (5. Loss) whatever the DP size or micro-batch split. It knows nothing
  about PPO; the loop adapts the algorithm's loss, e.g.::

      def loss_fn(logp, b):                      # logp (n,): b's scored tokens, in order
          x = b.loss_inputs                      # the caller's dataclass, sliced alike: (n,) each
          loss, stats = policy_loss(logp, x.logp_base, x.weights, x.advantages, None,
                                    clip_low, clip_high, num_tokens=1.0)  # 1.0: a sum
          return loss, stats_as_floats(stats)
  With ``train_steps(..., entropy=True)`` the loss is called as ``loss_fn(logp, batch_slice,
  entropy)``, ``entropy`` (n,) the differentiable per-token entropy of the same distribution
  (for an entropy bonus; computed only then);
* ``snapshot(version)`` / ``compute_logprobs(batch, version=k)`` for exact backfill (and the
  reference policy of a KL term: one more snapshot, of version 0, kept by the caller);
* ``warm_up(lengths)`` compiles the fused kernels (``torch.compile``) of both passes on a synthetic
  batch, changing no weight, so the first real step does not pay for it;
* ``export_hf_stage()`` HF-named full tensors of this pipeline stage, for weight sync;
* ``require_finite(what)`` the collective NaN/Inf guard a checkpoint save runs first;
  ``megatron_darl.checkpoint`` saves and loads a trainer (``CheckpointManager``).

Every rank of a DP replica (its TP x PP ranks) must call these with the same batch; each DP
replica passes its own shard. Results are returned on every rank of the replica.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Iterator

import torch
import torch.distributed as dist

from megatron_darl import timeline
from megatron_darl.checkpoint.training import load_model_weights
from megatron_darl.models.qwen3.config import spec_from_hf
from megatron_darl.models.qwen3.fused_layer import fuse_layers
from megatron_darl.models.qwen3.mapping import megatron_to_hf_stage
from megatron_darl.models.qwen3.model import build_qwen3_model, have_transformer_engine
from megatron_darl.models.qwen3.norm import Qwen3RMSNorm
from megatron_darl.trainer.batch import MicroBatch, TrainBatch, split_microbatches
from megatron_darl.trainer.config import TrainerConfig
from megatron_darl.trainer.flops import mfu, train_flops
from megatron_darl.trainer.optim import build_lr_scheduler, build_optimizer, sync_hooks, wrap_ddp
from megatron_darl.trainer.phases import PhaseClock
from megatron_darl.trainer.schedule import run_schedule
from megatron_darl.trainer.snapshots import ParamSnapshots
from megatron_darl.trainer.weight_check import require_finite, weight_norm

log = logging.getLogger(__name__)

# (logp (n,) fp32 differentiable, batch_slice[, entropy (n,)]) -> (loss_sum scalar tensor, {stat: float})
LossFn = Callable[[torch.Tensor, TrainBatch], tuple[torch.Tensor, dict[str, float]]]


@dataclass
class StepResult:
    """What one ``train_step`` reports (identical on every rank)."""

    loss: float  # token-mean loss over the step (all mini-, micro-batches and DP ranks)
    grad_norm: float  # global gradient norm before clipping (mean over the optimizer steps)
    lr: float  # learning rate used by this step
    num_tokens: int  # all tokens of the step over DP (prompt + response)
    num_loss_tokens: int  # scored tokens of the step over DP
    seconds: float  # wall time of the step
    tokens_per_s: float  # num_tokens / seconds (all DP replicas together)
    mfu: float  # model FLOPs utilisation, full-attention convention (see flops.py)
    stats: dict[str, float] = field(default_factory=dict)  # loss_fn stats, token-weighted mean
    optimizer_steps: int = 1  # optimizer steps (mini-batches x epochs) behind this version
    weight_norm: float = 0.0  # L2 norm of the new weights (``weight_check``): NaN/Inf = never publish
    # this rank's device seconds by phase (``phases.py``): forward_backward, grad_reduce, optimizer
    phase_seconds: dict[str, float] = field(default_factory=dict)


def compile_norms(chunks: list, on: bool) -> int:
    """Set every ``Qwen3RMSNorm`` of ``chunks`` to its compiled (``on``) or eager kernel on GPU
    (``trainer.compiled_kernels``); returns how many norms there are."""
    norms = [m for chunk in chunks for m in chunk.modules() if isinstance(m, Qwen3RMSNorm)]
    for norm in norms:
        norm.compiled = on
    return len(norms)


def compiled_frames() -> int:
    """Frames ``torch.compile`` (dynamo) compiled in this process so far, recompiles included:
    a count that still grows after the first step means kernels recompiling every few steps."""
    try:
        from torch._dynamo.utils import counters
    except ImportError:  # pragma: no cover - a torch without dynamo
        return 0
    return int(counters["frames"]["total"])


class PolicyTrainer:
    """One rank's share of the policy: model, optimizer, schedule, step counter and version."""

    def __init__(self, cfg: TrainerConfig, parallel_state, hf_config: Any, model_chunks=None,
                 temperature: float = 1.0):
        """Build (or adopt) the model chunks, wrap them in DDP, build optimizer and scheduler.

        Args:
            cfg: trainer configuration.
            parallel_state: ``parallel.ParallelState`` of this rank.
            hf_config: the policy's HF config (``transformers`` config or dict).
            model_chunks: pre-built Megatron chunks (tests); default ``build_qwen3_model`` with
                random init, then ``cfg.init_checkpoint`` loaded when set.
            temperature: the rollout sampler's temperature; every log-prob (pass and train
                step) is of ``softmax(logits / temperature)``, the density the engine reports.
        """
        if not temperature > 0:
            raise ValueError(f"temperature must be > 0, got {temperature}")
        self.temperature = float(temperature)
        self.cfg = cfg
        self.ps = parallel_state
        self.hf_config = hf_config
        self.spec = spec_from_hf(hf_config)
        self.bf16 = bool(cfg.bf16 and not self.ps.on_cpu)
        self.phases = PhaseClock(self.ps.device)  # a train step's forward/backward, grad reduce, update
        chunks = model_chunks if model_chunks is not None else self._build_chunks()
        compile_norms(chunks, cfg.compiled_kernels)
        self.fused_layers = 0
        if cfg.fused_layers:
            self.fused_layers, why = fuse_layers(chunks, self.ps.tp_size, cfg.compiled_kernels)
            if why:
                log.info("trainer.fused_layers: Megatron's layer forward (%s)", why)
        timeline.mark("model_built")
        if cfg.init_checkpoint:
            load_model_weights(chunks, cfg.init_checkpoint, self.ps)
        timeline.mark("weights_loaded")
        self._configure(chunks[0].config)
        self.model = wrap_ddp(chunks, self.ps, cfg, self.bf16)
        sync_hooks(chunks[0].config, self.model, cfg.overlap_grad_reduce)
        self.optimizer = build_optimizer(self.model, cfg.optimizer, self.ps, self.bf16)
        self.scheduler = build_lr_scheduler(self.optimizer, cfg.optimizer)
        self.optimizer_steps = 0  # optimizer steps taken over the run (one per mini-batch)
        self.version = 0  # weight version published after the last step (docs/architecture.md)
        self.needs_attention_mask = bool(getattr(chunks[0], "needs_attention_mask", False))
        params = [p for chunk in self.model for p in chunk.module.parameters()]
        self.snapshots = ParamSnapshots(params, pin=self.ps.device.type == "cuda", placement=cfg.snapshots)

    # ------------------------------------------------------------------ construction
    def _build_chunks(self) -> list:
        overrides: dict[str, Any] = {"calculate_per_token_loss": True}
        if self.ps.tp_size > 1 and self.cfg.sequence_parallel and not self.ps.on_cpu:
            # Megatron's local (non-TE) norms cannot run sequence-parallel.
            overrides["sequence_parallel"] = have_transformer_engine()
        if self.cfg.activation_recompute:
            if self.ps.on_cpu:
                raise ValueError(
                    "trainer.activation_recompute=true needs a GPU (Megatron's activation "
                    "checkpointing saves the CUDA RNG state)"
                )
            overrides.update(
                recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1
            )
        if not self.cfg.compiled_kernels:  # Megatron's torch.compile'd SwiGLU and bias-dropout-add
            overrides.update(bias_activation_fusion=False, bias_dropout_fusion=False)
        dtype = torch.bfloat16 if self.bf16 else torch.float32
        torch.manual_seed(self.cfg.seed)
        return build_qwen3_model(self.hf_config, self.ps, dtype=dtype, **overrides)

    def _configure(self, config) -> None:
        """Model-config switches the trainer relies on (set before DDP reads them)."""
        from megatron.core.distributed import finalize_model_grads

        if config.sequence_parallel and self.cfg.micro_batch.pad_multiple % self.ps.tp_size:
            raise ValueError(
                f"micro_batch.pad_multiple={self.cfg.micro_batch.pad_multiple} must be a "
                f"multiple of tp={self.ps.tp_size} with sequence parallelism"
            )
        config.calculate_per_token_loss = True
        config.variable_seq_lengths = True

        def timed_finalize(*args, **kwargs):  # the gradients' reduce over DP, timed apart
            self.phases.mark("forward_backward")
            finalize_model_grads(*args, **kwargs)
            self.phases.mark("grad_reduce")

        config.finalize_model_grads_func = timed_finalize

    @property
    def model_chunks(self) -> list:
        """The unwrapped Megatron chunks (for the HF mapping and checkpoints)."""
        return [chunk.module for chunk in self.model]

    # ------------------------------------------------------------------ batches
    def _check(self, batch: TrainBatch) -> None:
        if batch.num_sequences == 0:
            raise ValueError(f"empty TrainBatch on dp_rank {self.ps.dp_rank}")
        max_len = self.cfg.micro_batch.max_seq_len
        too_long = torch.nonzero(batch.seq_lens > max_len).flatten().tolist()
        if too_long:
            i = too_long[0]
            raise ValueError(
                f"sequence {i} of the batch has {int(batch.seq_lens[i])} tokens, over "
                f"micro_batch.max_seq_len={max_len} ({len(too_long)} sequence(s) too long)"
            )
        vocab = self.spec.vocab_size
        if int(batch.input_ids.min()) < 0 or int(batch.input_ids.max()) >= vocab:
            raise ValueError(f"token ids must be in [0, {vocab}) (vocab_size of the model)")

    def _microbatches(self, batch: TrainBatch, forward_only: bool = False) -> list[MicroBatch]:
        mb = self.cfg.micro_batch
        budget = mb.logprob_token_budget if forward_only else mb.token_budget
        return split_microbatches(batch, budget, mb.pad_multiple, self.ps.device)

    def _run(self, microbatches: list[MicroBatch], on_logprobs, forward_only: bool,
             entropy: bool = False) -> None:
        try:
            run_schedule(
                self.model, microbatches, on_logprobs, forward_only=forward_only,
                tp_group=self.ps.tp_group, vocab_size=self.spec.vocab_size,
                chunk_tokens=self.cfg.micro_batch.logprob_chunk_tokens,
                needs_attention_mask=self.needs_attention_mask, temperature=self.temperature,
                entropy=entropy,
            )
        except (RuntimeError, dist.DistBackendError) as exc:  # a timeout or a dead peer
            ps = self.ps
            what = "log-prob pass" if forward_only else "train step"
            raise RuntimeError(
                f"{what} at optimizer step {self.optimizer_steps} failed on rank {ps.rank} (tp {ps.tp_rank}, "
                f"pp {ps.pp_rank}, dp {ps.dp_rank}): {exc}"
            ) from exc

    def _last_stage_rank(self) -> int:
        return dist.get_global_rank(self.ps.pp_group, self.ps.pp_size - 1)

    # ------------------------------------------------------------------ log-prob pass
    @torch.no_grad()
    def compute_logprobs(self, batch: TrainBatch, version: int | None = None) -> torch.Tensor:
        """Per-token log-probs of ``batch``'s scored tokens under the current weights.

        Args:
            batch: this DP replica's sequences (same on all its TP x PP ranks).
            version: a snapshotted weight version to score under instead of the current one.

        Returns:
            (n,) fp32 on CPU in the scored layout (the scored tokens of each sequence in turn):
            ``log p(token_t | tokens_<t)`` at every t where ``batch.loss_mask`` is True. Same on
            every rank of the replica.
        """
        self._check(batch)
        if version is not None and version != self.version:
            with self.snapshots.swapped_in(version):
                return self.compute_logprobs(batch)
        out = torch.zeros(batch.num_loss_tokens, dtype=torch.float32, device=self.ps.device)
        zero = torch.zeros((), device=self.ps.device)

        def on_logprobs(logp: torch.Tensor, mb: MicroBatch):
            out[mb.scored_index.to(out.device)] = logp.float()
            return zero, torch.tensor(logp.shape[0], dtype=torch.int, device=zero.device), {}

        for chunk in self.model:
            chunk.eval()
        self._run(self._microbatches(batch, forward_only=True), on_logprobs, forward_only=True)
        if self.ps.pp_size > 1:
            dist.broadcast(out, src=self._last_stage_rank(), group=self.ps.pp_group)
        return out.cpu()

    def warm_up(self, lengths: list[int], force: bool = False, entropy: bool = False) -> float:
        """Compile what the first steps would: a log-prob pass and a forward/backward over a
        synthetic batch that fills a log-prob micro-batch (``_full_budget``), then over sequences
        of ``lengths`` tokens (each scoring its second half), then
        the same at three quarters of the lengths with one sequence more, then one sequence alone:
        kernels dynamo specialises on their first sizes (Megatron's fused SwiGLU and
        bias-dropout-add: sequence length and micro-batch rows) compile their dynamic-shape graph
        here, and a one-row micro-batch (a size dynamo specialises) its own, not after the first
        step. The gradients are zeroed; no optimizer step, so
        weights, optimizer state, schedule and version are untouched. On GPU with
        ``compile_warmup`` only (elsewhere nothing compiles; ``force``: run it anyway, as the
        tests do on CPU); every rank of the trainer calls it (the passes are collectives).
        ``entropy``: the train steps will take the entropy too (its kernels compile here).
        Returns the seconds spent.
        """
        if not force and (self.ps.device.type != "cuda" or not self.cfg.compile_warmup):
            return 0.0
        start = time.perf_counter()
        cap = self.cfg.micro_batch.max_seq_len
        fitted = [max(2, min(int(n), cap)) for n in lengths]
        shorter = [max(2, n * 3 // 4) for n in fitted]
        for lens in (self._full_budget(max(fitted)), fitted, shorter + [min(shorter)], [max(fitted)]):
            self._warm_pass(torch.tensor(lens, dtype=torch.int64), entropy)
        if self.ps.device.type == "cuda":
            torch.cuda.synchronize()
        return time.perf_counter() - start

    def _full_budget(self, length: int) -> list[int]:
        """Sequences of ``length`` that fill one log-prob micro-batch (two train micro-batches): the
        fused layer's first compile at the run's common size, which inductor takes as the hint
        that steers its block sizes and autotuning (not a guard: ``norm.compile_dynamic``)."""
        mb = self.cfg.micro_batch
        padded = -(-length // mb.pad_multiple) * mb.pad_multiple
        return [length] * max(1, mb.logprob_token_budget // padded)

    def _warm_pass(self, lens: torch.Tensor, entropy: bool = False) -> None:
        """One log-prob pass and one forward/backward (zero loss) over sequences of ``lens``."""
        gen = torch.Generator().manual_seed(0)  # the same tokens on every rank of a replica
        ids = torch.randint(0, self.spec.vocab_size, (int(lens.sum()),), generator=gen)
        pos = torch.cat([torch.arange(int(n)) for n in lens])
        mask = pos >= torch.repeat_interleave(lens // 2, lens)  # (L,) each sequence's second half
        batch = TrainBatch(ids, lens, mask, None)
        self.compute_logprobs(batch)
        zero = lambda logp, mb, *ent: ((logp * 0.0).sum() + sum((e * 0.0).sum() for e in ent),  # noqa: E731
                                       torch.tensor(logp.shape[0], dtype=torch.int, device=logp.device), {})
        for chunk in self.model:
            chunk.train()
            chunk.zero_grad_buffer()
        self._run(self._microbatches(batch), zero, forward_only=False, entropy=entropy)
        for chunk in self.model:
            chunk.zero_grad_buffer()
        self.optimizer.zero_grad()

    # ------------------------------------------------------------------ train step
    def train_step(self, batch: TrainBatch, loss_fn: LossFn, entropy: bool = False) -> StepResult:
        """Forward/backward over ``batch`` with ``loss_fn``, one optimizer step, one new version."""
        return self.train_steps([batch], loss_fn, entropy)

    def train_steps(self, minibatches: list[TrainBatch], loss_fn: LossFn, entropy: bool = False) -> StepResult:
        """One optimizer step per mini-batch, in order, then one new weight version.

        PPO mini-batches (docs/algorithm.md): whatever ``loss_fn`` reads from the batches (proximal
        log-probs, weights, advantages) was fixed before the first one, so the ratio moves off 1
        from the second mini-batch on. Each step's loss is normalised by that mini-batch's scored
        tokens over all DP ranks; every DP rank must pass the same number of mini-batches.
        Increments ``optimizer_steps`` once per mini-batch and ``version`` once. ``entropy``: ``loss_fn`` also
        takes the per-token entropy (module docstring).
        """
        if not minibatches:
            raise ValueError("train_steps needs at least one mini-batch")
        for batch in minibatches:
            self._check(batch)
            if batch.num_loss_tokens == 0:
                raise ValueError(f"TrainBatch on dp_rank {self.ps.dp_rank} has no scored tokens")
        start = time.perf_counter()
        self.phases.start()
        records: list[tuple[int, torch.Tensor, dict[str, float]]] = []
        grad_norms, lr = [], 0.0
        for batch in minibatches:
            grad_norm, lr = self._optimizer_step(batch, loss_fn, records, entropy)
            grad_norms.append(grad_norm)
        self.version += 1
        weights = weight_norm(self.model_chunks, self.ps)  # one fused norm; its host sync ends the step
        seconds = time.perf_counter() - start
        norms = [g for g in grad_norms if g is not None]
        grad_norm = sum(float(g) for g in norms) / len(norms) if norms else None
        result = self._step_result(minibatches, records, grad_norm, lr, seconds)
        result.weight_norm = weights
        result.phase_seconds = self.phases.seconds()
        return result

    def _optimizer_step(self, batch: TrainBatch, loss_fn: LossFn, records: list,
                        entropy: bool = False) -> tuple[Any, float]:
        """Forward/backward over one mini-batch and one optimizer step; (grad_norm, lr)."""
        def on_logprobs(logp: torch.Tensor, mb: MicroBatch, *ent: torch.Tensor):
            loss_sum, stats = loss_fn(logp, mb.batch, *ent)
            if loss_sum.dim() != 0:
                raise ValueError(f"loss_fn must return a scalar loss sum, got {tuple(loss_sum.shape)}")
            records.append((int(logp.shape[0]), loss_sum.detach(), stats))
            n = torch.tensor(logp.shape[0], dtype=torch.int, device=logp.device)
            return loss_sum, n, {}

        for chunk in self.model:
            chunk.train()
            chunk.zero_grad_buffer()
        self.optimizer.zero_grad()
        self._run(self._microbatches(batch), on_logprobs, forward_only=False, entropy=entropy)
        self.scheduler.step(increment=1)  # LR of this step (see optim.build_lr_scheduler)
        lr = float(self.optimizer.param_groups[0]["lr"])
        out = self.optimizer.step()  # (update_successful, grad_norm, num_zeros_in_grad)
        self.phases.mark("optimizer")
        self.optimizer_steps += 1
        return (out[1] if isinstance(out, tuple) else None), lr

    def _step_result(self, minibatches, records, grad_norm, lr, seconds) -> StepResult:
        """Reduce loss and stats over DP (last stage) and share them over PP."""
        keys = sorted(records[0][2]) if records else []
        local = torch.zeros(4 + len(keys), dtype=torch.float64, device=self.ps.device)
        local[0] = sum(b.num_tokens for b in minibatches)
        local[1] = sum(train_flops(self.spec, b.seq_lens.tolist()) for b in minibatches)
        for n, loss_sum, stats in records:
            local[2] += n
            local[3] += float(loss_sum)
            for j, key in enumerate(keys):
                local[4 + j] += n * float(stats[key])
        if self.ps.dp_size > 1:
            dist.all_reduce(local, group=self.ps.dp_group)
        local = local.cpu()
        if self.ps.pp_size > 1:  # loss and stats live on the last stage
            shared = [keys, local[2:]]
            dist.broadcast_object_list(shared, src=self._last_stage_rank(), group=self.ps.pp_group)
            keys, local = shared[0], torch.cat([local[:2], shared[1]])
        tokens, flops, loss_tokens, loss_total = (float(x) for x in local[:4])
        return StepResult(
            loss=loss_total / max(loss_tokens, 1.0),
            grad_norm=float(grad_norm) if grad_norm is not None else float("nan"),
            lr=lr,
            num_tokens=int(tokens),
            num_loss_tokens=int(loss_tokens),
            seconds=seconds,
            optimizer_steps=len(minibatches),
            tokens_per_s=tokens / seconds,
            mfu=mfu(flops, seconds, self.ps.world_size, self.cfg.peak_tflops),
            stats={k: float(local[4 + j]) / max(loss_tokens, 1.0) for j, k in enumerate(keys)},
        )

    # ------------------------------------------------------------------ snapshots and export
    def snapshot(self, version: int | None = None, keep: Iterable[int] | None = None) -> None:
        """Keep a host copy of this rank's weights as ``version`` (default: the current one);
        with ``keep``, first drop every other snapshot whose version is not in it."""
        version = self.version if version is None else version
        if keep is not None:
            self.snapshots.retain(set(keep) | {version})
        self.snapshots.take(version)

    def require_finite(self, what: str) -> float:
        """Collective: the weight norm, or ``WeightsNotFinite`` on every rank naming ``what``."""
        return require_finite(self, what)

    def hf_stage_bytes(self) -> int:
        """About the bytes of this stage's full HF tensors (this rank's parameters x TP: norms,
        replicated, are counted TP times; an upper bound of ``export_hf_stage``'s payload)."""
        local = sum(p.numel() * p.element_size() for chunk in self.model_chunks for p in chunk.parameters())
        return local * self.ps.tp_size

    def export_hf_stage(self) -> Iterator[tuple[str, torch.Tensor]]:
        """``(hf_name, full_tensor)`` of this pipeline stage (collective over the TP group)."""
        return megatron_to_hf_stage(self.model_chunks, self.ps)
