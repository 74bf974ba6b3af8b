"""The trainer's input contract (``TrainBatch``) and its cut into padded micro-batches.

A ``TrainBatch`` is a DP shard's sequences packed end to end (prompt + response token ids) with a
loss mask and the loss function's inputs, ``loss_inputs``: a dataclass of the caller's whose
tensor fields hold one value per *scored* token, in the scored-token layout (the scored tokens
of sequence 0, then of sequence 1, ..., positions ascending: exactly the order of the ``logp``
the loss function and ``compute_logprobs`` see). The trainer never reads the fields: it only
slices them alongside the tokens and moves them to the device, so the algorithm can change
without touching the trainer, and the loss gets typed inputs, not a dict of names.

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

import dataclasses
from dataclasses import dataclass
from typing import Any

import torch


def scored_fields(payload: Any) -> list[tuple[str, torch.Tensor]]:
    """``(name, tensor)`` of each field of a loss-inputs dataclass, in declaration order."""
    if payload is None:
        return []
    if not dataclasses.is_dataclass(payload):
        raise TypeError(f"loss_inputs must be a dataclass of (n,) tensors, got {type(payload).__name__}")
    out = [(f.name, getattr(payload, f.name)) for f in dataclasses.fields(payload)]
    for name, value in out:
        if not torch.is_tensor(value):
            raise TypeError(f"loss_inputs.{name} is a {type(value).__name__}, not a tensor")
    return out


def take_scored(payload: Any, index: torch.Tensor) -> Any:
    """The same loss inputs at the scored tokens ``index`` (``(m,)`` int64), in that order."""
    if payload is None:
        return None
    return dataclasses.replace(payload, **{k: v[index.to(v.device)] for k, v in scored_fields(payload)})


def move_scored(payload: Any, device: torch.device | str) -> Any:
    """The same loss inputs with every tensor on ``device``."""
    if payload is None:
        return None
    return dataclasses.replace(payload, **{k: v.to(device) for k, v in scored_fields(payload)})


@dataclass
class TrainBatch:
    """One DP shard's sequences, packed end to end, with the loss's inputs per scored token."""

    input_ids: torch.Tensor  # (T,) int64 token ids of all sequences concatenated
    seq_lens: torch.Tensor  # (N,) int64 length of each sequence (prompt + response); sums to T
    loss_mask: torch.Tensor  # (T,) bool True where the token is scored (never a sequence's first)
    loss_inputs: Any = None  # dataclass of (n,) tensors, n = scored tokens (scored layout), or None

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
        n = self.num_loss_tokens
        for name, value in scored_fields(self.loss_inputs):
            if value.shape != (n,):
                raise ValueError(f"TrainBatch.loss_inputs.{name} must be ({n},) (one per scored token), "
                                 f"got {tuple(value.shape)}")

    @classmethod
    def from_sequences(
        cls, tokens: list[torch.Tensor], loss_masks: list[torch.Tensor], loss_inputs: Any = None,
    ) -> "TrainBatch":
        """Pack per-sequence ``(L_i,)`` tensors into one batch."""
        if len(tokens) != len(loss_masks) or not tokens:
            raise ValueError(f"need the same non-zero number of tokens and loss_masks, got {len(tokens)}/{len(loss_masks)}")
        return cls(
            input_ids=torch.cat([t.long() for t in tokens]),
            seq_lens=torch.tensor([int(t.shape[0]) for t in tokens], dtype=torch.int64),
            loss_mask=torch.cat([m.bool() for m in loss_masks]),
            loss_inputs=loss_inputs,
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
        """Scored tokens n (the loss's token count, the length of the scored layout)."""
        return int(self.loss_mask.sum())

    @property
    def offsets(self) -> torch.Tensor:
        """(N + 1,) int64 start of each sequence in the packed tensors, then T."""
        out = torch.zeros(self.num_sequences + 1, dtype=torch.int64, device=self.seq_lens.device)
        torch.cumsum(self.seq_lens, 0, out=out[1:])
        return out

    def scored_index(self) -> torch.Tensor:
        """(T,) int64 position of each token in the scored layout (-1 where not scored)."""
        rank = torch.cumsum(self.loss_mask.long(), 0) - 1
        return torch.where(self.loss_mask, rank, torch.full_like(rank, -1))

    def select(self, seq_indices: list[int], scored_index: torch.Tensor | None = None) -> "TrainBatch":
        """The sub-batch of the given sequences, in the given order (loss inputs alongside).

        ``scored_index`` is this batch's ``scored_index()`` when the caller has it (one O(T) pass
        per batch, not per sub-batch)."""
        offs = self.offsets
        token_idx = torch.cat([torch.arange(int(offs[i]), int(offs[i + 1])) for i in seq_indices])
        seq_idx = torch.tensor(seq_indices, dtype=torch.int64)
        scored = (self.scored_index() if scored_index is None else scored_index)[token_idx]
        return TrainBatch(
            input_ids=self.input_ids[token_idx],
            seq_lens=self.seq_lens[seq_idx],
            loss_mask=self.loss_mask[token_idx],
            loss_inputs=take_scored(self.loss_inputs, scored[scored >= 0]),
        )

    def to(self, device: torch.device | str) -> "TrainBatch":
        """The same batch with every tensor on ``device`` (loss functions see it there)."""
        return TrainBatch(
            input_ids=self.input_ids.to(device),
            seq_lens=self.seq_lens.to(device),
            loss_mask=self.loss_mask.to(device),
            loss_inputs=move_scored(self.loss_inputs, device),
        )


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
    scored_index: torch.Tensor  # (n,) int64 position of each scored token in the parent's scored layout

    @property
    def shape(self) -> tuple[int, int]:
        return int(self.input_ids.shape[0]), int(self.input_ids.shape[1])


def make_microbatch(
    parent: TrainBatch, seq_indices: list[int], pad_multiple: int, device: torch.device,
    scored_index: torch.Tensor | None = None,
) -> MicroBatch:
    """Pad ``parent``'s sequences ``seq_indices`` to one length, scored where its loss mask is.

    Scored tokens are listed sequence by sequence, positions ascending: the scored layout of
    ``batch`` (``parent.select(seq_indices)``), which is what ``loss_fn`` receives.
    ``scored_index`` is ``parent.scored_index()`` when the caller has it (``split_microbatches``
    computes it once for all the micro-batches).
    """
    if scored_index is None:
        scored_index = parent.scored_index()
    offs = parent.offsets.tolist()
    lens = [int(parent.seq_lens[i]) for i in seq_indices]
    rows, seq_len = len(lens), round_up(max(lens), pad_multiple)
    input_ids = torch.zeros(rows, seq_len, dtype=torch.int64)
    pred_rows, source = [], []
    for b, (i, length) in enumerate(zip(seq_indices, lens)):
        input_ids[b, :length] = parent.input_ids[offs[i] : offs[i] + length]
        scored = torch.nonzero(parent.loss_mask[offs[i] : offs[i] + length]).flatten()
        pred_rows.append(b * seq_len + scored - 1)
        source.append(offs[i] + scored)
    source_index = torch.cat(source)
    position_ids = torch.arange(seq_len, dtype=torch.int64).unsqueeze(0).expand(rows, -1)
    return MicroBatch(
        batch=parent.select(seq_indices, scored_index).to(device),
        input_ids=input_ids.to(device),
        position_ids=position_ids.contiguous().to(device),
        pred_rows=torch.cat(pred_rows).to(device),
        targets=parent.input_ids[source_index].to(device),
        scored_index=scored_index[source_index],
    )


def split_microbatches(
    batch: TrainBatch, token_budget: int, pad_multiple: int, device: torch.device,
) -> list[MicroBatch]:
    """The step's micro-batches (``plan_microbatches``), padded and on ``device``."""
    plan = plan_microbatches(batch.seq_lens.tolist(), token_budget, pad_multiple)
    scored_index = batch.scored_index()  # (T,) once, not once per micro-batch
    return [make_microbatch(batch, idx, pad_multiple, device, scored_index) for idx in plan]


_DTYPES = (torch.float32, torch.float64, torch.int64, torch.bool, torch.bfloat16)


def broadcast_batch(batch: TrainBatch | None, parallel_state, payload_type: type | None = None) -> TrainBatch:
    """Give every rank of a DP replica the batch its hub rank (TP 0, first PP stage) holds.

    Samples and the replay state live on the hub (docs/architecture.md, The path of one sample); the
    trainer needs the same ``TrainBatch`` on all TP x PP ranks of the replica. Tensors only, no
    pickles: a small int64 header (sizes, dtypes) and then each tensor, broadcast inside the
    replica's model-parallel group on the trainer's device (NCCL on GPU, gloo on CPU). The other
    ranks pass ``None`` and ``payload_type``, the dataclass of ``loss_inputs`` (fields in
    declaration order), or ``None`` for a batch without loss inputs. Returns the batch in host
    memory, as the trainer's calls take it (they move each micro-batch to the device themselves).
    """
    import torch.distributed as dist

    ps = parallel_state
    hub = ps.tp_rank == 0 and ps.pp_rank == 0
    if hub and batch is None:
        raise ValueError(f"broadcast_batch: the hub rank {ps.rank} has no batch")
    if ps.tp_size * ps.pp_size == 1:
        return batch
    group, device = ps.model_parallel_group, ps.device
    src = dist.get_global_rank(group, 0)
    assert hub == (ps.rank == src), "model-parallel group rank 0 must be TP 0 / PP 0"
    fields = scored_fields(batch.loss_inputs) if hub else []
    head = torch.zeros(4 + 8, dtype=torch.int64, device=device)  # T, N, n, fields, dtype codes
    if hub:
        assert len(fields) <= 8, "broadcast_batch carries at most 8 loss-input fields"
        codes = [_DTYPES.index(v.dtype) for _, v in fields]
        head[:4 + len(codes)] = torch.tensor([batch.num_tokens, batch.num_sequences,
                                              batch.num_loss_tokens, len(fields), *codes])
    dist.broadcast(head, src=src, group=group)
    t, n_seq, n, f = (int(x) for x in head[:4].tolist())
    shapes = [((t,), torch.int64), ((n_seq,), torch.int64), ((t,), torch.bool)]
    shapes += [((n,), _DTYPES[int(c)]) for c in head[4:4 + f].tolist()]
    mine = [batch.input_ids, batch.seq_lens, batch.loss_mask, *(v for _, v in fields)] if hub else []
    out = []
    for i, (shape, dtype) in enumerate(shapes):
        buf = mine[i].to(device).contiguous() if hub else torch.empty(shape, dtype=dtype, device=device)
        dist.broadcast(buf, src=src, group=group)
        out.append(buf)
    if hub:
        return batch
    if f and payload_type is None:
        raise ValueError("broadcast_batch: the hub's batch has loss inputs; pass their payload_type")
    out = [t.cpu() for t in out]
    return TrainBatch(out[0], out[1], out[2], payload_type(*out[3:]) if f else None)
