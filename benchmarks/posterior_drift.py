"""Benchmark ``posterior_drift``: does engine/trainer mismatch tip the mixture's posterior on a GPU?

The mixture weight's posterior over versions compares prefix log-densities that grow by one token's
log-prob at a time, so a small per-token bias between two sources adds up over a long response.
CPU runs cannot show it (their engine and trainer agree to ~1e-13); this measures it where it
happens: a bf16 engine (vLLM by default) against the bf16 Megatron trainer, on long responses.

One process, one GPU (``--model tiny --engine hf`` on CPU checks the harness):

1. a random-init Qwen3 of ``--model``'s shape (``loop_profile.build_policy``), its tied embedding
   and LM head scaled by each ``--logit-scale`` (a random model at scale 1 is nearly uniform over
   its 151k tokens, entropy ~11.5 nats; larger scales give peaked distributions like a trained
   model's, whose mismatch is larger);
2. the engine samples ``--prompts`` x ``--n`` responses of exactly ``--new-tokens`` tokens at
   temperature 1 (version 0; its rows mu_0, the true behavior density);
3. a fresh trainer loads the same weights, computes its rows of version 0 (pi_0) for those tokens,
   takes ``--updates`` optimizer steps of a PPO-shaped loss with random advantages at ``--lr``
   (version 1) and computes pi_1.

Two cases, each with alpha = (1/2, 1/2) over versions {0, 1} and the samples' own version 0:
``identical`` (version 1 := pi_0: the posterior must stay at 1/2, any drift is mismatch) and
``updated`` (version 1 the trained pi_1). Per case, the posterior of the own version by token
position (mean over samples, in position bins), read from one source (the trainer's rows for
both versions: DESIGN 4.6) and from two (mu_0 for the own version, pi_1 for the other: the
algorithm before the fix), and the effective sample size (ESS = (sum w)^2 / (n sum w^2) over the
response tokens) of the capped weight w = min(pi_t / q, c) with pi_t = version 1 under the forms
``prefix`` (one-source posterior; the own term mu_0), ``prefix_two_source``, ``token``
(sum_k alpha_k pi_k per token) and ``own`` (q = mu_0: decoupled PPO). ``mismatch_kl`` is the mean
of log mu_0 - log pi_0 over the sampled tokens (a KL estimate, positive when the sources differ).

    python benchmarks/posterior_drift.py --out-dir benchmarks/results          # GPU, vLLM
    python benchmarks/posterior_drift.py --model tiny --engine hf --new-tokens 64 --prompts 2 \
        --n 2 --logit-scale 1 --out-dir /tmp/pd                               # CPU harness check
"""

from __future__ import annotations

import argparse
import gc
import math
import sys
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from benchmarks.loop_profile import build_policy  # noqa: E402
from benchmarks.record import device_name, write_result  # noqa: E402
from megatron_darl.algorithms.importance import (  # noqa: E402
    behavior_weights, mixture_log_density, prefix_mixture_log_density, prefix_posterior,
)

BINS = (0, 256, 512, 1024, 2048, 4096, 8192, 16384)  # token-position bins of the posterior curve
CLIP = 2.0  # mis.clip's default


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="qwen3_1.7b", help="configs/model preset, or tiny (CPU check)")
    p.add_argument("--engine", default="vllm", choices=["vllm", "hf"])
    p.add_argument("--prompts", type=int, default=8)
    p.add_argument("--n", type=int, default=4, help="responses per prompt")
    p.add_argument("--prompt-tokens", type=int, default=32)
    p.add_argument("--new-tokens", type=int, default=4096, help="response length (at least 2k on GPU)")
    p.add_argument("--logit-scale", type=float, nargs="+", default=[1.0, 8.0])
    p.add_argument("--updates", type=int, default=1, help="optimizer steps from version 0 to 1")
    p.add_argument("--lr", type=float, default=1e-6)
    p.add_argument("--gpu-memory-utilization", type=float, default=0.25)
    p.add_argument("--work-dir", type=Path, default=Path("/tmp/darl_posterior_drift"))
    p.add_argument("--out-dir", type=Path, default=None, help="records (default benchmarks/results)")
    return p.parse_args(argv)


def scaled_policy(policy: Path, scale: float, out: Path) -> tuple[Path, dict[str, torch.Tensor]]:
    """``policy`` with the embedding (tied LM head) and any lm_head times ``scale``: written as an
    HF dir at ``out`` (the trainer's ``init_checkpoint``) and returned as tensors (the engine's)."""
    import shutil

    from safetensors.torch import load_file, save_file

    tensors: dict[str, torch.Tensor] = {}
    for f in sorted(policy.glob("*.safetensors")):
        tensors.update(load_file(str(f)))
    for name in ("model.embed_tokens.weight", "lm_head.weight"):
        if name in tensors:
            tensors[name] = (tensors[name].float() * scale).to(tensors[name].dtype)
    shutil.rmtree(out, ignore_errors=True)
    shutil.copytree(policy, out, ignore=shutil.ignore_patterns("*.safetensors", "*.safetensors.index.json"))
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    return out, tensors


def sample(engine, a: argparse.Namespace, vocab: int, seed: int):
    """``prompts`` x ``n`` responses of exactly ``new_tokens`` tokens: (token lists, engine rows)."""
    from megatron_darl.rollout.config import SamplingConfig

    gen = torch.Generator().manual_seed(seed)
    prompts = [torch.randint(0, vocab, (a.prompt_tokens,), generator=gen).tolist() for _ in range(a.prompts)]
    sampling = SamplingConfig(n=a.n, max_new_tokens=a.new_tokens, temperature=1.0, seed=seed, ignore_eos=True)
    out = engine.generate(prompts, sampling)
    seqs, rows = [], []
    for prompt, gens in zip(prompts, out):
        for g in gens:
            seqs.append((torch.tensor(prompt), g.token_ids.long().cpu()))
            rows.append(g.logprobs.float().cpu())
    return seqs, rows


def trainer_rows(a, ps, policy: Path, seqs) -> tuple[torch.Tensor, torch.Tensor]:
    """A fresh trainer's (pi_0, pi_1) rows over the responses (packed ``(n,)`` each), from the HF
    weights at ``policy``."""
    from benchmarks.train_step import ppo_like_loss
    from megatron_darl.algorithms import PolicyLossInputs
    from megatron_darl.models.qwen3.config import load_hf_config_dict
    from megatron_darl.trainer.batch import TrainBatch
    from megatron_darl.trainer.config import MicroBatchConfig, OptimizerConfig, TrainerConfig
    from megatron_darl.trainer.policy_trainer import PolicyTrainer

    longest = max(len(p) + len(r) for p, r in seqs)
    cfg = TrainerConfig(optimizer=OptimizerConfig(lr=a.lr),
                        micro_batch=MicroBatchConfig(max_seq_len=longest, token_budget=max(16384, longest)),
                        compile_warmup=False, init_checkpoint=str(policy))
    trainer = PolicyTrainer(cfg, ps, load_hf_config_dict(policy))
    tokens = [torch.cat([p, r]) for p, r in seqs]
    masks = [torch.arange(len(t)) >= len(p) for t, (p, _) in zip(tokens, seqs)]
    pi0 = trainer.compute_logprobs(TrainBatch.from_sequences(tokens, masks)).float()
    gen = torch.Generator().manual_seed(7)
    adv = torch.randn(len(seqs), generator=gen).repeat_interleave(torch.tensor([len(r) for _, r in seqs]))
    inputs = PolicyLossInputs(logp_base=pi0.clone(), weights=torch.ones_like(pi0), advantages=adv)
    batch = TrainBatch.from_sequences(tokens, masks, inputs)
    for _ in range(a.updates):
        trainer.train_step(batch, ppo_like_loss)
    pi1 = trainer.compute_logprobs(TrainBatch.from_sequences(tokens, masks)).float()
    del trainer, batch
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    return pi0, pi1


def ess(w: torch.Tensor) -> float:
    return float(w.sum() ** 2 / (w.numel() * (w * w).sum()))


def case_metrics(mu0: torch.Tensor, pi0: torch.Tensor, pi1: torch.Tensor, index: torch.Tensor,
                 position: torch.Tensor) -> dict[str, float]:
    """Posterior of the own version by position bin (one and two sources) and the forms' ESS."""
    alpha = torch.tensor([0.5, 0.5], dtype=torch.float64)
    one = torch.stack([pi0, pi1]).double()  # the trainer's rows of both versions
    terms = torch.stack([mu0, pi1]).double()  # the conditional: own term from the engine
    post_one = prefix_posterior(one, alpha, index)[0].exp()
    post_two = prefix_posterior(terms, alpha, index)[0].exp()
    out: dict[str, float] = {}
    for lo, hi in zip(BINS[:-1], BINS[1:]):
        sel = (position >= lo) & (position < hi)
        if bool(sel.any()):
            out[f"own_posterior_one_source_{lo}"] = float(post_one[sel].mean())
            out[f"own_posterior_two_source_{lo}"] = float(post_two[sel].mean())
    last = position == position.max()
    out["own_posterior_one_source_last"] = float(post_one[last].mean())
    out["own_posterior_two_source_last"] = float(post_two[last].mean())
    forms = {
        "prefix": prefix_mixture_log_density(terms, alpha, index, posterior_by_version=one),
        "prefix_two_source": prefix_mixture_log_density(terms, alpha, index),
        "token": mixture_log_density(terms, alpha),
        "own": mu0.double(),
    }
    for name, log_q in forms.items():
        w = behavior_weights(pi1, log_q.float(), CLIP)
        out[f"ess_{name}"] = ess(w)
        out[f"capped_{name}"] = float((w >= CLIP).float().mean())
    return out


def run_scale(a, engine, ps, policy: Path, scale: float, vocab: int) -> dict[str, float]:
    scaled, weights = scaled_policy(policy, scale, a.work_dir / "scaled")
    engine.load_weights(weights.items())
    seqs, rows = sample(engine, a, vocab, seed=int(scale * 1000))
    pi0, pi1 = trainer_rows(a, ps, scaled, seqs)
    mu0 = torch.cat(rows)
    lens = torch.tensor([len(r) for r in rows])
    index = torch.repeat_interleave(torch.arange(len(rows)), lens)
    position = torch.cat([torch.arange(int(n)) for n in lens])
    if mu0.shape != pi0.shape:
        raise RuntimeError(f"engine rows {tuple(mu0.shape)} and trainer rows {tuple(pi0.shape)} differ")
    out = {"mismatch_kl": float((mu0 - pi0).mean()), "entropy_nats": float(-mu0.mean()),
           "update_kl": float((pi0 - pi1).mean()), "tokens": int(mu0.numel())}
    for case, other in (("identical", pi0), ("updated", pi1)):
        out.update({f"{case}_{k}": v for k, v in case_metrics(mu0, pi0, other, index, position).items()})
    return out


def main(argv: list[str] | None = None) -> int:
    a = parse_args(argv)
    from megatron_darl.rollout.config import EngineConfig
    from megatron_darl.rollout.engines import build_engine

    start = time.perf_counter()
    a.work_dir.mkdir(parents=True, exist_ok=True)
    policy = build_policy(a.model, a.work_dir / f"policy_{a.model}")
    import json

    vocab = int(json.loads((policy / "config.json").read_text())["vocab_size"])
    engine = build_engine(EngineConfig(
        backend=a.engine, model_path=str(policy), dtype="bf16" if torch.cuda.is_available() else "fp32",
        max_batch_size=a.prompts * a.n, gpu_memory_utilization=a.gpu_memory_utilization,
        max_model_len=a.prompt_tokens + a.new_tokens + 16))
    from megatron_darl.trainer.parallel import init_single_process

    ps = init_single_process()  # after the engine: its processes start before this one's CUDA
    rows = []
    try:
        for scale in a.logit_scale:
            t = time.perf_counter()
            m = run_scale(a, engine, ps, policy, scale, vocab)
            m.update(logit_scale=scale, seconds=time.perf_counter() - t)
            rows.append(m)
            print(f"scale {scale:g}: mismatch KL {m['mismatch_kl']:.2e} nats/token, entropy "
                  f"{m['entropy_nats']:.2f}, update KL {m['update_kl']:.2e}", flush=True)
            for case in ("identical", "updated"):
                curve = " ".join(f"{lo}:{m.get(f'{case}_own_posterior_one_source_{lo}', math.nan):.3f}/"
                                 f"{m.get(f'{case}_own_posterior_two_source_{lo}', math.nan):.3f}"
                                 for lo in BINS[:-1] if f"{case}_own_posterior_one_source_{lo}" in m)
                print(f"  {case:9s} own posterior one/two source by position {curve}")
                print(f"  {case:9s} ESS prefix {m[f'{case}_ess_prefix']:.4f}  prefix(two source) "
                      f"{m[f'{case}_ess_prefix_two_source']:.4f}  token {m[f'{case}_ess_token']:.4f}  "
                      f"own {m[f'{case}_ess_own']:.4f}", flush=True)
    finally:
        engine.close()
    config = {"model": a.model, "engine": a.engine, "prompts": a.prompts, "n": a.n,
              "new_tokens": a.new_tokens, "updates": a.updates, "lr": a.lr, "clip": CLIP,
              "device": device_name()}
    metrics = {"by_scale": rows, "seconds": time.perf_counter() - start}
    path = write_result("posterior_drift", config, metrics, out_dir=a.out_dir)
    print(f"record: {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
