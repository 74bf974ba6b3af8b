"""Benchmark ``step_batches``: host-side work of the planner's step, trainer calls left out.

A D-ARL step builds several batches from buffered groups on the hub's host: the log-prob pass over
the candidates, each snapshot backfill pass, the mini-batches, and the per-token rows (behavior,
proximal, cache) of the score and the loss inputs. This runs ``ShardPlanner.step`` (darl, chi2,
mixture weights, exact backfill from every window version) on synthetic one-step-off arrivals with
a stand-in trainer, and reports per step:

- ``host_seconds``: the step's wall seconds minus the stand-in trainer's (mean over the measured
  steps, best of ``--repeats`` runs; one thread);
- ``*_copy_mb``: bytes written by copying ops (cat, index, copy_, clone, ...), by dtype: int64
  token ids, bool masks, float32 rows (counted with a dispatch mode, in a separate run);
- ``id_copies`` / ``row_copies``: those int64 / float32 bytes over the selected samples' token-id
  bytes / scored-token row bytes: the copies per trained sample per step;
- ``digest``: a hash of every mini-batch (tokens, lengths, mask, loss inputs) and the selection,
  so two commits can be checked to plan bitwise the same step.

    python benchmarks/step_batches.py                     # the default config's shapes
    python benchmarks/step_batches.py --case large        # 64 groups x 8, responses up to 4096
"""

from __future__ import annotations

import argparse
import hashlib
import os
import sys
import time
import traceback
from collections import defaultdict
from pathlib import Path

import torch
from torch.utils._python_dispatch import TorchDispatchMode, _disable_current_modes

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.record import print_table, write_result  # noqa: E402
from megatron_darl.samples import Sample, SampleGroup  # noqa: E402
from megatron_darl.step.config import AlgorithmConfig, ReplayConfig  # noqa: E402
from megatron_darl.step.planner import ShardPlanner  # noqa: E402

# groups per step, group size, prompt tokens, response limit: configs/config.yaml's defaults
# (B = G = 8, max_new_tokens 48), and a production-like shape
CASES = {"default": (8, 8, 32, 48), "large": (64, 8, 256, 4096)}
_COPIES = {"cat", "index", "index_select", "copy_", "clone", "_to_copy", "index_put_",
           "slice_scatter", "gather", "masked_select", "stack", "split_with_sizes_copy"}
_MATH = f"megatron_darl{os.sep}algorithms{os.sep}"


class CopyCounter(TorchDispatchMode):
    """Bytes of sample data copied outside the algorithms' math, by dtype.

    Sample data is what arrived (token ids, engine log-probs: ``taint``) and what the trainer
    returned, and every copy of either (cat, index, copy_, clone, ... whose input is such data);
    views share the storage, so slicing copies nothing. A copy inside ``megatron_darl/algorithms``
    (e.g. its float64 math) is followed but not counted: that math is the same whatever the layout.
    """

    def __init__(self) -> None:
        super().__init__()
        self.bytes: dict[str, int] = defaultdict(int)
        self.counting = False  # follow the data always, count only the measured steps
        self._data: dict[int, torch.Tensor] = {}  # storage pointer -> a tensor keeping it alive

    def taint(self, *tensors: torch.Tensor) -> None:
        for t in tensors:
            self._data[t.untyped_storage().data_ptr()] = t

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func.overloadpacket.__name__ not in _COPIES:
            return out
        flat = [*args, *(kwargs or {}).values()]
        flat = [t for a in flat for t in (a if isinstance(a, (list, tuple)) else [a])]
        inputs = [t for t in flat if torch.is_tensor(t) and t.untyped_storage().data_ptr() in self._data]
        if func.overloadpacket.__name__ == "copy_":
            inputs = inputs if torch.is_tensor(args[1]) and args[1].untyped_storage().data_ptr() in self._data else []
        if not inputs:
            return out
        outs = [t for t in (out if isinstance(out, (list, tuple)) else [out]) if torch.is_tensor(t)]
        self.taint(*outs)
        frames = [f.filename for f in traceback.extract_stack() if "megatron_darl" in f.filename]
        if self.counting and frames and _MATH not in frames[-1]:
            for t in outs:
                self.bytes[str(t.dtype).replace("torch.", "")] += t.numel() * t.element_size()
        return out


def stand_in_logp(ids: torch.Tensor, version: int) -> torch.Tensor:
    """The stand-in trainer's log pi_version of tokens ``ids``: cheap and deterministic."""
    return -(ids % 97).float() * 0.03 - 0.002 * version - 0.05


def arrivals(step: int, groups: int, size: int, prompt: int, max_len: int) -> list[SampleGroup]:
    """``groups`` groups of version ``step - 1`` (one-step-off), log-normal response lengths.

    Engine log-probs are the stand-in's plus noise of a per-group scale, so groups differ in score
    and some are replayed (selected again at later versions, which needs backfill)."""
    g = torch.Generator().manual_seed(step)
    version = max(step - 1, 0)
    out = []
    for j in range(groups):
        gid = step * 10_000 + j
        lens = torch.exp(torch.randn(size, generator=g) * 0.9 + torch.log(torch.tensor(max_len / 8)))
        noise = float(torch.rand(1, generator=g)) + 0.01
        samples = []
        for i, n in enumerate(lens.clamp(4, max_len).long().tolist()):
            response = torch.randint(0, 1000, (n,), generator=g)
            mu = stand_in_logp(response, version) + noise * torch.randn(n, generator=g)
            samples.append(Sample(sample_id=gid * 64 + i, prompt_ids=torch.randint(0, 1000, (prompt,), generator=g),
                                  response_ids=response, behavior_logprobs=mu.clamp(max=0.0),
                                  token_versions=torch.full((n,), version), reward=float(i % 3 == 0)))
        out.append(SampleGroup(group_id=gid, prompt_id=gid, samples=samples, worker_id=0))
    return out


class StandIn:
    """The trainer's ``compute_logprobs``: a cheap deterministic function of tokens and version,
    timed (and hidden from the copy counter) so the step's own host work can be told apart."""

    def __init__(self, counter: CopyCounter | None) -> None:
        self.seconds, self.counter = 0.0, counter

    def __call__(self, batch, version: int) -> torch.Tensor:
        start = time.perf_counter()
        with _disable_current_modes():
            logp = stand_in_logp(batch.input_ids[batch.loss_mask], version)
        if self.counter is not None:
            self.counter.taint(logp)
        self.seconds += time.perf_counter() - start
        return logp


def digest(plans) -> str:
    h = hashlib.sha256()
    for plan in plans:
        h.update(str([e.group_id for e in plan.selection.entries]).encode())
        for b in plan.minibatches:
            x = b.loss_inputs
            for t in (b.input_ids, b.seq_lens, b.loss_mask, x.logp_base, x.weights, x.advantages):
                h.update(t.contiguous().numpy().tobytes())
    return h.hexdigest()[:16]


def run(a, count: bool) -> dict:
    """``a.steps`` steps; per measured step (after ``a.skip``): host seconds and copied bytes."""
    groups, size, prompt, max_len = CASES[a.case]
    algorithm = AlgorithmConfig(variant="darl", groups_per_step=groups, group_size=size,
                                ppo_minibatches=a.minibatches)
    planner = ShardPlanner(algorithm, ReplayConfig(k=4))
    counter = CopyCounter() if count else None
    trainer, host, plans, ids, rows = StandIn(counter), 0.0, [], 0, 0
    for step in range(a.steps):
        new = arrivals(step, groups, size, prompt, max_len)
        trainer.seconds, measured = 0.0, step >= a.skip
        start = time.perf_counter()
        if counter is not None:
            counter.taint(*(t for g in new for s in g.samples
                            for t in (s.prompt_ids, s.response_ids, s.behavior_logprobs)))
            counter.counting = measured
            with counter:
                plan = planner.step(new, step, step, trainer, exact_versions=range(step + 1))
        else:
            plan = planner.step(new, step, step, trainer, exact_versions=range(step + 1))
        if measured:
            host += time.perf_counter() - start - trainer.seconds
            ids += sum(s.prompt_ids.numel() + s.num_tokens for s in plan.samples) * 8
            rows += sum(s.num_tokens for s in plan.samples) * 4
            plans.append(plan)
        planner.evict(step + 1, plan.stats)  # the version the step trains
    n = a.steps - a.skip
    out = {"host_seconds": host / n, "digest": digest(plans)}
    if counter is not None:
        b = counter.bytes
        out.update({f"{k}_copy_mb": v / n / 1e6 for k, v in sorted(b.items()) if k in ("int64", "bool", "float32")})
        out.update(id_copies=b["int64"] / ids, row_copies=b["float32"] / rows)
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--case", choices=sorted(CASES), default="default")
    p.add_argument("--steps", type=int, default=10, help="steps run (the buffer fills over K = 4)")
    p.add_argument("--skip", type=int, default=4, help="first steps not measured (filling the window)")
    p.add_argument("--minibatches", type=int, default=4, help="algorithm.ppo_minibatches (M)")
    p.add_argument("--repeats", type=int, default=3, help="timed runs; the fastest is kept")
    a = p.parse_args()
    torch.set_num_threads(1)
    timed = min((run(a, count=False) for _ in range(a.repeats)), key=lambda r: r["host_seconds"])
    counted = run(a, count=True)
    assert counted["digest"] == timed["digest"], "the counted run planned a different step"
    groups, size, prompt, max_len = CASES[a.case]
    config = {"case": a.case, "groups": groups, "group_size": size, "prompt_tokens": prompt,
              "max_len": max_len, "k": 4, "minibatches": a.minibatches, "steps": a.steps,
              "skip": a.skip, "threads": 1, "load_avg_1min": round(os.getloadavg()[0], 2)}
    metrics = {**counted, "host_seconds": timed["host_seconds"]}
    print_table([{"case": a.case, **metrics}])
    print(f"wrote {write_result('step_batches', config, metrics)}")


if __name__ == "__main__":
    main()
