"""The trainer's input contract (``TrainBatch``) and its cut into padded micro-batches.

A ``TrainBatch`` is a DP shard's sequences packed end to end (prompt + response token ids) with a
loss mask and *named* float fields that the loss function needs (per token, e.g. proximal
log-probs and behavior weights; per sequence, e.g. advantages). The trainer never reads the
fields: it only slices them alongside the tokens, so the algorithm can change without touching
the trainer.

Micro-batching is **length-bucketed padding**, not THD packing: Megatron's packed-sequence path
(``packed_seq_params`` with cu_seqlens) needs Transformer Engine or flash-attn varlen kernels,
and the local/SDPA attention we must also run (CPU, GPU without TE) has none. Sequences are
sorted by length (longest first) and filled greedily into micro-batches whose padded size
``rows x round_up(longest, pad_multiple)`` stays within the token budget, so neighbours have
similar lengths and padding waste stays small. Each micro-batch keeps its own padded length;
the pipeline schedule runs with Megatron's ``variable_seq_lengths`` (shapes are exchanged
before each p2p send), so one schedule call takes all micro-batches of a step and the pipeline
is flushed once per step, not once per length bucket. Right padding is safe with a causal mask:
no real token attends to a later (pad) position.

Log-prob alignment: position t of a sequence is *scored* when ``loss_mask[t]``; its log-prob is
``log p(token_t | tokens_<t)``, read from the logits at position t - 1, so the first token of a
sequence can never be scored.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass
class TrainBatch:
    """One DP shard's sequences, packed end to end, with the fields the loss needs."""

    input_ids: torch.Tensor  # (T,) int64 token ids of all sequences concatenated
    seq_lens: torch.Tensor  # (N,) int64 length of each sequence (prompt + response); sums to T
    loss_mask: torch.Tensor  # (T,) bool True where the token is scored (never a sequence's first)
    token_fields: dict[str, torch.Tensor] = field(default_factory=dict)  # name -> (T,) float
    seq_fields: dict[str, torch.Tensor] = field(default_factory=dict)  # name -> (N,) float

    def __post_init__(self) -> None:
        total = int(self.input_ids.shape[0])
        if self.input_ids.dim() != 1 or self.seq_lens.dim() != 1:
            raise ValueError("TrainBatch.input_ids and seq_lens must be 1-D")
        if int(self.seq_lens.sum()) != total:
            raise ValueError(
                f"TrainBatch.seq_lens sums to {int(self.seq_lens.sum())}, input_ids has {total}"
            )
        if (self.seq_lens <= 0).any():
            raise ValueError(f"TrainBatch.seq_lens must be positive, got {self.seq_lens.tolist()}")
        if self.loss_mask.shape != (total,):
            raise ValueError(f"TrainBatch.loss_mask must be ({total},), got {tuple(self.loss_mask.shape)}")
        if self.loss_mask.dtype != torch.bool:
            self.loss_mask = self.loss_mask.bool()
        if self.loss_mask[self.offsets[:-1]].any():
            raise ValueError("TrainBatch.loss_mask marks the first token of a sequence (it has no context)")
        for name, value in self.token_fields.items():
            if value.shape != (total,):
                raise ValueError(f"TrainBatch.token_fields[{name!r}] must be ({total},), got {tuple(value.shape)}")
        n = self.num_sequences
        for name, value in self.seq_fields.items():
            if value.shape != (n,):
                raise ValueError(f"TrainBatch.seq_fields[{name!r}] must be ({n},), got {tuple(value.shape)}")

    @classmethod
    def from_sequences(
        cls,
        tokens: list[torch.Tensor],
        loss_masks: list[torch.Tensor],
        token_fields: dict[str, list[torch.Tensor]] | None = None,
        seq_fields: dict[str, torch.Tensor] | None = None,
    ) -> "TrainBatch":
        """Pack per-sequence ``(L_i,)`` tensors into one batch."""
        if len(tokens) != len(loss_masks) or not tokens:
            raise ValueError(f"need the same non-zero number of tokens and loss_masks, got {len(tokens)}/{len(loss_masks)}")
        return cls(
            input_ids=torch.cat([t.long() for t in tokens]),
            seq_lens=torch.tensor([int(t.shape[0]) for t in tokens], dtype=torch.int64),
            loss_mask=torch.cat([m.bool() for m in loss_masks]),
            token_fields={k: torch.cat(v) for k, v in (token_fields or {}).items()},
            seq_fields=dict(seq_fields or {}),
        )

    @property
    def num_sequences(self) -> int:
        return int(self.seq_lens.shape[0])

    @property
    def num_tokens(self) -> int:
        """All tokens T, prompt and response."""
        return int(self.input_ids.shape[0])

    @property
    def num_loss_tokens(self) -> int:
        """Scored tokens (the loss's token count)."""
        return int(self.loss_mask.sum())

    @property
    def offsets(self) -> torch.Tensor:
        """(N + 1,) int64 start of each sequence in the packed tensors, then T."""
        out = torch.zeros(self.num_sequences + 1, dtype=torch.int64, device=self.seq_lens.device)
        torch.cumsum(self.seq_lens, 0, out=out[1:])
        return out

    def select(self, seq_indices: list[int]) -> "TrainBatch":
        """The sub-batch of the given sequences, in the given order."""
        offs = self.offsets
        token_idx = torch.cat([torch.arange(int(offs[i]), int(offs[i + 1])) for i in seq_indices])
        seq_idx = torch.tensor(seq_indices, dtype=torch.int64)
        return TrainBatch(
            input_ids=self.input_ids[token_idx],
            seq_lens=self.seq_lens[seq_idx],
            loss_mask=self.loss_mask[token_idx],
            token_fields={k: v[token_idx] for k, v in self.token_fields.items()},
            seq_fields={k: v[seq_idx] for k, v in self.seq_fields.items()},
        )

    def to(self, device: torch.device | str) -> "TrainBatch":
        """The same batch with every tensor on ``device`` (loss functions see it there)."""
        return TrainBatch(
            input_ids=self.input_ids.to(device),
            seq_lens=self.seq_lens.to(device),
            loss_mask=self.loss_mask.to(device),
            token_fields={k: v.to(device) for k, v in self.token_fields.items()},
            seq_fields={k: v.to(device) for k, v in self.seq_fields.items()},
        )

    def masked(self, name: str) -> torch.Tensor:
        """``token_fields[name]`` at the scored tokens: (n,), aligned with the loss's ``logp``."""
        return self.token_fields[name][self.loss_mask]

    def per_token(self, name: str) -> torch.Tensor:
        """``seq_fields[name]`` repeated over each sequence's scored tokens: (n,)."""
        seq_of_token = torch.repeat_interleave(
            torch.arange(self.num_sequences, device=self.seq_lens.device), self.seq_lens
        )
        return self.seq_fields[name][seq_of_token[self.loss_mask]]

    def scored_to_padded(self, values: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Lay (n,) scored-token values out as (N, T_max) rows, one per sequence.

        For losses written over ``(N, T)`` tensors (``algorithms.policy_loss``). Differentiable
        in ``values``. Returns ``(padded, mask)``: zeros and ``False`` where no token is scored.
        """
        counts = torch.stack([m.sum() for m in torch.split(self.loss_mask, self.seq_lens.tolist())])
        width = max(int(counts.max()), 1)
        rows = torch.repeat_interleave(torch.arange(self.num_sequences), counts)
        starts = torch.cumsum(counts, 0) - counts
        cols = torch.arange(int(counts.sum())) - torch.repeat_interleave(starts, counts)
        rows, cols = rows.to(values.device), cols.to(values.device)
        padded = values.new_zeros(self.num_sequences, width).index_put((rows, cols), values)
        mask = torch.zeros(self.num_sequences, width, dtype=torch.bool, device=values.device)
        mask[rows, cols] = True
        return padded, mask

    def split_by_sequence(self, flat: torch.Tensor) -> list[torch.Tensor]:
        """Cut a (T,) tensor aligned with ``input_ids`` into per-sequence (L_i,) views."""
        return list(torch.split(flat, self.seq_lens.tolist()))


def broadcast_batch(batch: TrainBatch | None, parallel_state) -> TrainBatch:
    """Give every rank of a DP replica the batch its hub rank (TP 0, first PP stage) holds.

    Samples arrive at the hub (DESIGN 3); the trainer needs the same ``TrainBatch`` on all
    TP x PP ranks of the replica. Collective over the replica's model-parallel group; other
    ranks pass ``None``.
    """
    import torch.distributed as dist

    ps = parallel_state
    hub = ps.tp_rank == 0 and ps.pp_rank == 0
    if hub and batch is None:
        raise ValueError(f"broadcast_batch: the hub rank {ps.rank} has no batch")
    if ps.tp_size * ps.pp_size == 1:
        return batch
    group = ps.model_parallel_group
    src = dist.get_global_rank(group, 0)
    assert hub == (ps.rank == src), "model-parallel group rank 0 must be TP 0 / PP 0"
    box = [batch if hub else None]
    dist.broadcast_object_list(box, src=src, group=group)
    return box[0]


def round_up(value: int, multiple: int) -> int:
    return -(-value // multiple) * multiple


def plan_microbatches(seq_lens: list[int], token_budget: int, pad_multiple: int) -> list[list[int]]:
    """Group sequence indices into micro-batches of padded size ``<= token_budget``.

    Longest first, greedy: a micro-batch's padded length is fixed by its first (longest)
    sequence; a sequence is added while ``(rows + 1) * padded_len <= token_budget``. A single
    sequence longer than the budget still gets its own micro-batch (the caller bounds lengths).
    """
    order = sorted(range(len(seq_lens)), key=lambda i: (-seq_lens[i], i))
    plan: list[list[int]] = []
    padded = 0
    for i in order:
        if plan and (len(plan[-1]) + 1) * padded <= token_budget:
            plan[-1].append(i)
        else:
            plan.append([i])
            padded = round_up(seq_lens[i], pad_multiple)
    return plan


@dataclass
class MicroBatch:
    """One padded micro-batch, ready for the model, plus what maps logits back to tokens."""

    batch: TrainBatch  # the micro-batch's sequences (what ``loss_fn`` sees as ``batch_slice``)
    input_ids: torch.Tensor  # (B, S) int64 right-padded with 0
    position_ids: torch.Tensor  # (B, S) int64 0..S-1 per row
    pred_rows: torch.Tensor  # (n,) int64 flat index b * S + t - 1 of the logits scoring each token
    targets: torch.Tensor  # (n,) int64 the scored token ids
    source_index: torch.Tensor  # (n,) int64 position of each scored token in the parent batch

    @property
    def shape(self) -> tuple[int, int]:
        return int(self.input_ids.shape[0]), int(self.input_ids.shape[1])


def make_microbatch(
    parent: TrainBatch,
    seq_indices: list[int],
    score_mask: torch.Tensor,
    pad_multiple: int,
    device: torch.device,
) -> MicroBatch:
    """Pad ``parent``'s sequences ``seq_indices`` to one length; score where ``score_mask`` (T,).

    Scored tokens are listed sequence by sequence, positions ascending: with
    ``score_mask = parent.loss_mask`` that is the order of ``batch.masked(name)``.
    """
    offs = parent.offsets.tolist()
    lens = [int(parent.seq_lens[i]) for i in seq_indices]
    rows, seq_len = len(lens), round_up(max(lens), pad_multiple)
    input_ids = torch.zeros(rows, seq_len, dtype=torch.int64)
    pred_rows, source = [], []
    for b, (i, length) in enumerate(zip(seq_indices, lens)):
        input_ids[b, :length] = parent.input_ids[offs[i] : offs[i] + length]
        scored = torch.nonzero(score_mask[offs[i] : offs[i] + length]).flatten()
        pred_rows.append(b * seq_len + scored - 1)
        source.append(offs[i] + scored)
    source_index = torch.cat(source)
    position_ids = torch.arange(seq_len, dtype=torch.int64).unsqueeze(0).expand(rows, -1)
    return MicroBatch(
        batch=parent.select(seq_indices).to(device),
        input_ids=input_ids.to(device),
        position_ids=position_ids.contiguous().to(device),
        pred_rows=torch.cat(pred_rows).to(device),
        targets=parent.input_ids[source_index].to(device),
        source_index=source_index,
    )


def split_microbatches(
    batch: TrainBatch, score_mask: torch.Tensor, token_budget: int, pad_multiple: int,
    device: torch.device,
) -> list[MicroBatch]:
    """The step's micro-batches (``plan_microbatches``), padded and on ``device``."""
    plan = plan_microbatches(batch.seq_lens.tolist(), token_budget, pad_multiple)
    return [make_microbatch(batch, idx, score_mask, pad_multiple, device) for idx in plan]
