"""One DP replica's model-parallel ranks in a step: the hub leads, its TP/PP peers follow.

The replay buffer and the log-prob cache live on the replica's hub rank only (TP 0, first PP stage:
docs/architecture.md, The path of one sample), so memory does not grow with TP x PP. Its peers hold
no sample data. Every trainer call is a collective over the replica, so each one the hub's planner
makes is announced to the peers first, with the batch it runs on, by broadcast inside the
model-parallel group (tensors only: ``trainer.batch.broadcast_batch``):

    hub                                         peers
    wait:  LOGPROBS(v) + batch, then the pass    receive, then the same pass (the rows a step
           (none or more, ``prefetch.py``), then  will need, computed while the groups come),
           WAITED(flags)                          until WAITED: did the step go on
    plan:  LOGPROBS(v) + batch, then the pass    receive, then the same pass (result unused)
           ... (the candidates' pass, each snapshot backfill pass)
    train: TRAIN + the M mini-batches, then      receive, rebuild M x epochs, then the same
           M x epochs optimizer steps            optimizer steps

The peers know M and epochs from the config, so a step's mini-batches cross once whatever the
epochs. With TP = PP = 1 there are no peers and nothing is sent.
"""

from __future__ import annotations

import enum

import torch
import torch.distributed as dist

from megatron_darl.algorithms import PolicyLossInputs
from megatron_darl.trainer.batch import TrainBatch, broadcast_batch


class Op(enum.IntEnum):
    """What the hub asks its peers to do next."""

    LOGPROBS = 1  # a log-prob pass at the version in the header
    TRAIN = 2  # the step's mini-batches follow; train on them (the step's last call)
    WAITED = 3  # the wait for the step's groups is over; the header's argument holds its flags


class ReplicaLink:
    """The hub's and its peers' ends of the model-parallel group of one DP replica."""

    def __init__(self, ps, payload_type: type = PolicyLossInputs) -> None:
        self.ps = ps
        self.payload_type = payload_type  # the dataclass of the batches' loss inputs
        self.is_hub = ps.is_hub
        self.has_peers = ps.tp_size * ps.pp_size > 1
        self._src = dist.get_global_rank(ps.model_parallel_group, 0) if self.has_peers else ps.rank

    def _header(self, op: int = 0, arg: int = 0) -> tuple[int, int]:
        head = torch.tensor([op, arg], dtype=torch.int64, device=self.ps.device)
        dist.broadcast(head, src=self._src, group=self.ps.model_parallel_group)
        return int(head[0]), int(head[1])

    def share(self, value: int) -> int:
        """The hub's ``value`` on every rank of the replica (e.g. the step a resume starts at)."""
        if not self.has_peers:
            return value
        return self._header(0, value if self.is_hub else 0)[1]

    def announce(self, op: Op, arg: int, batches: list[TrainBatch]) -> None:
        """Hub: tell the peers ``op`` with ``arg`` and hand them ``batches``."""
        assert self.is_hub, "only the hub announces"
        if not self.has_peers:
            return
        self._header(int(op), arg)
        for batch in batches:
            broadcast_batch(batch, self.ps, self.payload_type)

    def receive(self) -> tuple[Op, int]:
        """Peer: the hub's next op and its argument."""
        op, arg = self._header()
        return Op(op), arg

    def batch(self) -> TrainBatch:
        """Peer: the next batch the hub hands over."""
        return broadcast_batch(None, self.ps, self.payload_type)
