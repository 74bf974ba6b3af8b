"""Small pieces the trainer relies on: layout validation, padded-vocab masking, causal masks."""

from __future__ import annotations

import pytest
import torch

from megatron_darl.models.qwen3 import causal_mask, mask_padded_vocab_
from megatron_darl.trainer.config import ParallelConfig
from megatron_darl.trainer.parallel import validate_layout


def test_parallel_config_rejects_bad_sizes_by_name():
    with pytest.raises(ValueError, match="ParallelConfig.tp must be a positive int, got 0"):
        ParallelConfig(tp=0)
    with pytest.raises(ValueError, match="ParallelConfig.backend"):
        ParallelConfig(backend="mpi")
    assert validate_layout(ParallelConfig(tp=2, pp=2), 8) == 2
    with pytest.raises(ValueError, match="world size 6 is not divisible by tp\\*pp = 2\\*2"):
        validate_layout(ParallelConfig(tp=2, pp=2), 6)


def test_padded_vocab_columns_are_masked_only_on_the_ranks_that_hold_them():
    # vocab 300 padded to 384 over TP 2: rank 0 holds [0, 192), rank 1 holds [192, 384)
    rank0 = mask_padded_vocab_(torch.zeros(2, 192), 300, tp_rank=0)
    rank1 = mask_padded_vocab_(torch.zeros(2, 192), 300, tp_rank=1)
    assert torch.isfinite(rank0).all()
    assert torch.isfinite(rank1[:, :108]).all() and torch.isinf(rank1[:, 108:]).all()
    full = torch.cat([rank0, rank1], dim=-1)
    assert torch.log_softmax(full, -1)[0, 0] == pytest.approx(-torch.log(torch.tensor(300.0)))


def test_causal_mask_uses_megatron_convention():
    mask = causal_mask(4)
    assert mask.shape == (1, 1, 4, 4) and mask.dtype == torch.bool
    assert not mask[0, 0, 2, :3].any() and mask[0, 0, 2, 3]  # True = masked (the future)
