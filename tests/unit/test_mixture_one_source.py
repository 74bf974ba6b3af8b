"""The mixture's posterior over versions reads one source of densities, so the engine/trainer
mismatch cannot tip it.

Two identical versions (pi_0 = pi_1) and an engine whose sampled-token log-probs differ from the
trainer's by a per-token mismatch of ~1e-3 nats with a positive mean on the sampled tokens (it
is KL(mu || pi), the order measured between vLLM and a bf16 trainer). The posterior of a
response's own version must stay at its prior alpha over 8k tokens: it does when every version's
prefix reads the trainer's rows, and it runs to ~1 when the own version's prefix reads the
engine's rows and the others the trainer's (the mismatch adds up along the prefix). Checked on
the pure functions, then through ``ShardPlanner.step`` (cache slots, the own-version rows from the
arrival pass and from a parameter snapshot, the weights it hands the loss).
"""

from __future__ import annotations

import pytest
import torch

from megatron_darl.algorithms import batch_behavior_weights, prefix_mixture_log_density, prefix_posterior
from megatron_darl.replay import RowSource
from megatron_darl.samples import Sample, SampleGroup
from megatron_darl.step.config import AlgorithmConfig, ReplayConfig
from megatron_darl.step.planner import ShardPlanner
from megatron_darl.trainer.batch import TrainBatch

LENGTH, VOCAB, NOISE = 8192, 64, 0.045  # NOISE: engine logit noise, KL(mu || pi) ~ 1e-3 nats a token


def mismatched(seed: int, length: int = LENGTH) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A response sampled by the engine: (token ids, engine row log mu(y_j), trainer row log pi(y_j)).

    The trainer's next-token distribution at each position is a random softmax; the engine's is
    the same logits plus Gaussian noise, and the tokens are drawn from the engine."""
    g = torch.Generator().manual_seed(seed)
    logits = 2.0 * torch.randn(length, VOCAB, generator=g, dtype=torch.float64)
    log_pi = torch.log_softmax(logits, -1)
    log_mu = torch.log_softmax(logits + NOISE * torch.randn(length, VOCAB, generator=g, dtype=torch.float64), -1)
    ids = torch.multinomial(log_mu.exp(), 1, generator=g)[:, 0]
    pick = lambda lp: lp.gather(-1, ids[:, None])[:, 0]  # noqa: E731
    return ids, pick(log_mu), pick(log_pi)


def test_the_injected_mismatch_is_a_kl_of_about_1e3_nats_a_token():
    d = torch.cat([e - t for _, e, t in (mismatched(s) for s in range(4))])
    assert 5e-4 < float(d.mean()) < 2e-3  # positive on sampled tokens: it is KL(mu || pi)


def test_one_source_keeps_the_posterior_at_the_prior_over_8k_tokens_two_sources_tip_it():
    rows = [mismatched(s) for s in range(4)]
    own = torch.tensor([0, 0, 1, 1])  # two responses of each (identical) version
    alpha = torch.tensor([0.5, 0.5], dtype=torch.float64)
    engine = torch.stack([e for _, e, _ in rows])  # (N, T)
    trainer = torch.stack([t for _, _, t in rows])
    is_own = own[None, :, None] == torch.arange(2)[:, None, None]  # (K, N, 1)
    conditional = torch.where(is_own, engine[None], trainer[None])  # (K, N, T): engine at k = v_i
    posterior = trainer[None].expand(2, -1, -1)  # (K, N, T): the trainer's for every k

    beta_own = prefix_posterior(posterior, alpha).exp().gather(0, own.view(1, -1, 1).expand(1, -1, LENGTH))[0]
    assert float((beta_own - 0.5).abs().max()) < 0.01  # (N, T): every position up to 8192
    old = prefix_posterior(conditional, alpha).exp().gather(0, own.view(1, -1, 1).expand(1, -1, LENGTH))[0]
    assert float((old[:, -1] - 0.5).abs().min()) > 0.01  # the two-source posterior fails it ...
    assert float(old[:, -1].mean()) > 0.9  # ... leaning on the own version, towards decoupled PPO

    # the conditional keeps the engine's own term: q = 1/2 mu + 1/2 pi at every token
    log_q = prefix_mixture_log_density(conditional, alpha, posterior_by_version=posterior)
    want = torch.logaddexp(engine, trainer) + torch.log(torch.tensor(0.5, dtype=torch.float64))
    assert torch.allclose(log_q, want, atol=1e-12)


# ---- through the planner ------------------------------------------------------------------------
RESPONSES: dict[tuple, tuple[torch.Tensor, int]] = {}  # prompt ++ response ids -> (trainer row, id)


def group(group_id: int, version: int) -> SampleGroup:
    samples = []
    for i, reward in enumerate((1.0, 0.0)):
        sid = 10 * group_id + i
        ids, engine, trainer = mismatched(sid)
        prompt = torch.tensor([group_id, i, 7])
        s = Sample(sample_id=sid, prompt_ids=prompt, response_ids=ids, behavior_logprobs=engine.float(),
                   token_versions=torch.full((LENGTH,), version), reward=reward)
        RESPONSES[tuple(torch.cat([prompt, ids]).tolist())] = (trainer.float(), sid)
        samples.append(s)
    return SampleGroup(group_id=group_id, prompt_id=group_id, samples=samples, worker_id=0)


class IdenticalVersions:
    """The trainer of two identical versions: the same rows under every version; records each
    (sample, version) row it computes."""

    def __init__(self) -> None:
        self.rows: list[tuple[int, int]] = []

    def __call__(self, batch: TrainBatch, version: int) -> torch.Tensor:
        out = []
        for ids in torch.split(batch.input_ids, batch.seq_lens.tolist()):
            row, sid = RESPONSES[tuple(ids.tolist())]
            self.rows.append((sid, version))
            out.append(row)
        return torch.cat(out)


def implied_own_posterior(w: torch.Tensor, engine: torch.Tensor, trainer: torch.Tensor) -> float:
    """The own version's posterior a weight implies, fitted over the tokens given: with identical
    versions and pi_t = pi, 1/w_j - 1 = beta (mu_j / pi_j - 1)."""
    x = (engine.double() - trainer.double()).expm1()
    y = 1.0 / w.double() - 1.0
    return float((x * y).sum() / (x * x).sum())


def test_the_planner_reads_trainer_rows_for_the_posterior_and_the_engine_row_for_the_own_term():
    trainer = IdenticalVersions()
    algo = AlgorithmConfig(variant="darl", groups_per_step=4)
    p = ShardPlanner(algo, ReplayConfig(k=4))
    a = group(1, 0)  # arrives while the trainer is at its version: the pass computes its own row
    plan = p.step([a], 0, 0, trainer)
    p.evict(1, plan.stats)
    b, c = group(2, 1), group(3, 0)  # c arrives a version late: its own row from the snapshot
    plan = p.step([b, c], 1, 1, trainer, exact_versions=[0])
    assert {e.group_id for e in plan.selection.entries} == {1, 2, 3}
    st = plan.stats
    assert st.rows_duplicate == 0 and len(trainer.rows) == len(set(trainer.rows))
    assert st.backfill_own == len(c.samples) and st.backfill_nearest == 0
    for s in a.samples:  # stored by the pass at version 0, not recomputed
        assert p.cache.source(s.sample_id, 0, trainer=True) is RowSource.TRAINER
        assert p.cache.source(s.sample_id, 0) is RowSource.ENGINE
    assert all(p.cache.source(s.sample_id, 0, trainer=True) is RowSource.SNAPSHOT for s in c.samples)
    at_0 = [sid for sid, v in trainer.rows if v == 0]  # a's by the pass at 0; b's and c's by the snapshot
    assert sorted(at_0) == sorted(s.sample_id for s in a.samples + b.samples + c.samples)

    alpha = {0: 2 / 3, 1: 1 / 3}  # version 0: groups a and c; version 1: group b
    w = torch.split(plan.loss_inputs.weights, [s.num_tokens for s in plan.samples])
    old = _two_source_weights(plan, p)
    tail = slice(LENGTH - 1024, LENGTH)  # the last 1k tokens of 8k
    lean = []
    for s, ws, wo in zip(plan.samples, w, old):
        row = RESPONSES[tuple(torch.cat([s.prompt_ids, s.response_ids]).tolist())][0]
        beta = implied_own_posterior(ws[tail], s.behavior_logprobs[tail], row[tail])
        assert beta == pytest.approx(alpha[s.behavior_version], abs=0.01)
        lean.append(implied_own_posterior(wo[tail], s.behavior_logprobs[tail], row[tail]) - alpha[s.behavior_version])
    # the two-source weights lean on v_i: the summed mismatch is ~8 +- 4 nats at 8k tokens, so
    # most responses' posterior is near 1 (one whose sum came out near 0 stays near its prior)
    assert sum(x > 0.01 for x in lean) >= len(lean) - 1 and sum(lean) / len(lean) > 0.3, lean


def _two_source_weights(plan, p: ShardPlanner) -> list[torch.Tensor]:
    """The weights of the same step with the posterior reading the conditional's rows (the
    engine's for the own version), split by sample."""
    samples = plan.samples
    ids = [s.sample_id for s in samples]
    lengths = torch.tensor([s.num_tokens for s in samples])
    versions = plan.selection.versions
    by_version = p.cache.gather(ids, versions)
    logp_t = p.cache.gather(ids, [1], trainer=True)[0]
    bv = torch.repeat_interleave(torch.tensor([s.behavior_version for s in samples]), lengths)
    bw = batch_behavior_weights("darl", logp_t, by_version, torch.tensor(versions), bv,
                                torch.ones(bv.shape[0], dtype=torch.bool),
                                sample_index=torch.repeat_interleave(torch.arange(len(samples)), lengths))
    return list(torch.split(bw.weights, lengths.tolist()))
