"""Throughput of the policy trainer: a full train step and the log-prob pass, vs HF + AdamW.

For each model (random init, bf16 on GPU) and layout (``tp1``, ``tp2``, ``dp2``, ``pp2``...), the
trainer runs ``PolicyTrainer.train_step`` (forward, backward, distributed Adam step) and
``compute_logprobs`` on a global batch of ``--seqs`` sequences of ``--seq`` tokens (the first
``--prompt`` tokens of each unscored), cut into micro-batches of ``--token-budget`` tokens. The
loss is a PPO-shaped token sum (the trainer's cost does not depend on it). On one GPU the same run
also times a plain Hugging Face step: ``Qwen3ForCausalLM`` (sdpa, bf16) with its own
cross-entropy loss, the same micro-batches and ``torch.optim.AdamW`` (fused on GPU).

FLOPs (``megatron_darl/trainer/flops.py``): per token of a train step ``6 * N + 12 * L * H * Q * s``
with N = matmul parameters including the LM head (PaLM / Megatron-LM convention, full s x s
attention; ``mfu_causal`` halves the attention term); the log-prob pass is a third of that.
MFU = FLOPs / seconds / (GPUs x 989 TFLOP/s dense bf16, H100/H200 SXM; ``--peak-tflops``).
Scaling efficiency of a 2-GPU layout = its tokens/s / (2 x the 1-GPU tokens/s of this run).

    python benchmarks/train_step.py                              # 1.7B and 4B, 1 GPU
    python benchmarks/train_step.py --layouts tp1 tp2 dp2        # on the 2-GPU machine
    python benchmarks/train_step.py --tiny                       # CPU smoke check, no JSON
    python benchmarks/train_step.py --models qwen3_1.7b --layouts tp1 dp2 tp2 --seqs 64 --seq 640 \
        --prompt 128 --minibatches 4 --token-budget 16384 --set grad_reduce_in_fp32=false
                                      # the loop's quick batch (8 x 8 x 512), one setting's A/B
    python benchmarks/train_step.py --models qwen3_1.7b --layouts dp2 ... --profile DIR
                                      # + rank 0's torch.profiler tables and host syncs by caller
Benchmark name ``train_step``; metrics ``mfu``, ``tokens_per_s``, ``logprob_tokens_per_s``,
``hf_tokens_per_s``, ``peak_gib`` (+ ``logprob_mfu``, ``mfu_causal``, ``scaling_efficiency``...).
"""

from __future__ import annotations

import argparse
import gc
import json
import sys
import tempfile
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from benchmarks.record import print_table, write_result  # noqa: E402

TINY = dict(architectures=["Qwen3ForCausalLM"], model_type="qwen3", vocab_size=512,
            hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, head_dim=16, rope_parameters={"rope_theta": 1e6},
            rms_norm_eps=1e-6, tie_word_embeddings=True, max_position_embeddings=4096)
LAYOUTS = {"tp1": (1, 1, 1), "tp2": (2, 1, 2), "dp2": (1, 1, 2), "pp2": (1, 2, 2),
           "tp2pp2": (2, 2, 4), "tp4": (4, 1, 4), "dp4": (1, 1, 4), "tp2dp2": (2, 1, 4),
           "dp8": (1, 1, 8), "tp2dp4": (2, 1, 8), "tp4dp2": (4, 1, 8), "tp2pp2dp2": (2, 2, 8)}
# (tp, pp, GPUs); DP = GPUs / (tp * pp)


def make_batches(args, vocab: int, dp_rank: int, dp_size: int) -> list:
    """This DP rank's share of the global batch (interleaved), with the loss's typed inputs, cut
    into ``--minibatches`` mini-batches (one optimizer step each, as the loop's PPO mini-batches)."""
    from megatron_darl.algorithms import PolicyLossInputs
    from megatron_darl.trainer.batch import TrainBatch

    g = torch.Generator().manual_seed(1234)
    tokens = [torch.randint(0, vocab, (args.seq,), generator=g) for _ in range(args.seqs)]
    mask = torch.arange(args.seq) >= args.prompt
    mine = list(range(dp_rank, args.seqs, dp_size))
    if len(mine) % args.minibatches:
        raise SystemExit(f"--seqs {args.seqs} over DP {dp_size} leaves {len(mine)} sequences a rank, "
                         f"not a multiple of --minibatches {args.minibatches}")
    scored = args.seq - args.prompt
    adv = torch.randn(len(mine), generator=g).repeat_interleave(scored)
    per = len(mine) // args.minibatches
    batches = []
    for k in range(args.minibatches):
        part = mine[k * per:(k + 1) * per]
        n = scored * len(part)
        inputs = PolicyLossInputs(logp_base=torch.full((n,), -12.0), weights=torch.ones(n),
                                  advantages=adv[k * per * scored:(k + 1) * per * scored])
        batches.append(TrainBatch.from_sequences([tokens[i] for i in part], [mask] * len(part), inputs))
    return batches


def ppo_like_loss(logp, batch_slice):
    x = batch_slice.loss_inputs
    ratio = torch.exp(logp - x.logp_base)
    clipped = torch.clamp(ratio, 0.8, 1.2)
    return -torch.minimum(ratio * x.advantages, clipped * x.advantages).sum(), {}


def _timed(fn, warmup: int, iters: int) -> float:
    for _ in range(warmup):
        fn()
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(iters):
        fn()
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    return (time.perf_counter() - start) / iters


def trainer_worker(rank, world_size, tp, pp, hf_config, args, out_path):
    """One rank: build the trainer, time steps and log-prob passes; rank 0 writes JSON."""
    import torch.distributed as dist

    from megatron_darl.trainer.config import MicroBatchConfig, OptimizerConfig, TrainerConfig
    from megatron_darl.trainer.config import ParallelConfig
    from megatron_darl.trainer.flops import forward_flops, train_flops
    from megatron_darl.trainer.parallel import init_parallel
    from megatron_darl.trainer.policy_trainer import PolicyTrainer, compiled_frames

    ps = init_parallel(ParallelConfig(tp=tp, pp=pp))
    cfg = TrainerConfig(
        optimizer=OptimizerConfig(lr=1e-6),
        micro_batch=MicroBatchConfig(token_budget=args.token_budget, max_seq_len=args.seq,
                                     logprob_token_budget=args.logprob_token_budget,
                                     pad_multiple=64 if args.seq % 64 == 0 else 1),
        peak_tflops=args.peak_tflops, activation_recompute=args.recompute,
        **trainer_settings(args.set),
    )
    trainer = PolicyTrainer(cfg, ps, hf_config)
    if args.megatron_fallbacks:  # the A/B of trainer/optim.py's use_foreach_fallbacks
        from megatron_darl.trainer.optim import fallback_swaps

        for module, name, theirs, ours in fallback_swaps():
            if getattr(module, name, None) is ours:
                setattr(module, name, theirs)
    batches = make_batches(args, hf_config["vocab_size"], ps.dp_rank, ps.dp_size)
    if torch.cuda.is_available():
        torch.cuda.reset_peak_memory_stats()
    phases: list[dict] = []  # each timed step's device seconds by phase (trainer/phases.py)
    step_s = _timed(lambda: phases.append(trainer.train_steps(batches, ppo_like_loss).phase_seconds),
                    args.warmup, args.iters)
    peak = torch.cuda.max_memory_allocated() / 2**30 if torch.cuda.is_available() else None
    logprob_s = _timed(lambda: [trainer.compute_logprobs(b) for b in batches], args.warmup, args.iters)
    tokens = args.seq * args.seqs
    lens = [args.seq] * args.seqs
    devices = world_size * args.peak_tflops * 1e12
    result = {
        "tokens_per_s": tokens / step_s, "logprob_tokens_per_s": tokens / logprob_s,
        "mfu": train_flops(trainer.spec, lens) / step_s / devices,
        "mfu_causal": train_flops(trainer.spec, lens, causal=True) / step_s / devices,
        "logprob_mfu": forward_flops(trainer.spec, lens) / logprob_s / devices,
        "step_s": step_s, "logprob_s": logprob_s, "peak_gib": peak,
        "microbatches_per_rank": sum(len(trainer._microbatches(b)) for b in batches),
        # rank 0's step by phase: forward_backward_s, grad_reduce_s (DP's reduce-scatter), optimizer_s
        **{f"{name}_s": sum(p.get(name, 0.0) for p in phases[args.warmup:]) / args.iters
           for name in ("forward_backward", "grad_reduce", "optimizer")},
        "dynamo_frames": compiled_frames(),  # compiles, warm-up included (a growing count: recompiles)
        "fused_layers": trainer.fused_layers,  # decoder layers run as one compiled call (fused_layer.py)
    }
    peaks = [None] * world_size
    dist.all_gather_object(peaks, peak)
    result["peak_gib"] = max(p for p in peaks if p is not None) if peak is not None else None
    if args.profile:
        stem = Path(args.profile) / f"train_step_profile_tp{tp}_pp{pp}_w{world_size}"
        profile_passes(trainer, batches, rank, stem)
    if rank == 0:
        Path(out_path).write_text(json.dumps(result))


def profile_passes(trainer, batches, rank: int, stem: Path) -> None:
    """One log-prob pass and one train step under ``torch.profiler`` (every rank runs them: they
    are collectives); rank 0 writes each one's operator table (self device time first), where a
    fixed cost per pass or per micro-batch shows up that the timings above only add up. Each file
    holds two tables: by self device time (by self CPU time on CPU), then by host time with
    children (where the host waits or launches); then the host syncs, and on a GPU the device's
    idle gaps by the host operator running meanwhile (``profile_gaps``)."""
    from torch.profiler import ProfilerActivity, profile

    from benchmarks.profile_gaps import trace_gaps

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.cuda.is_available() else [])
    sort = "self_cuda_time_total" if torch.cuda.is_available() else "self_cpu_time_total"
    passes = {"logprob": lambda: [trainer.compute_logprobs(b) for b in batches],
              "train": lambda: trainer.train_steps(batches, ppo_like_loss)}
    for name, fn in passes.items():
        with profile(activities=activities, with_stack=True) as prof:
            fn()
            if torch.cuda.is_available():
                torch.cuda.synchronize()
        warned = syncs_by_warning(fn)  # the same pass again, every rank (collectives)
        if rank == 0:
            stem.parent.mkdir(parents=True, exist_ok=True)
            averages = prof.key_averages()
            tables = [averages.table(sort_by=key, row_limit=30, max_name_column_width=70)
                      for key in dict.fromkeys((sort, "cpu_time_total"))]  # device work, then host
            tables += [host_syncs_by_caller(prof.events()), warned]
            if torch.cuda.is_available():  # where the device waited for the host
                trace = Path(f"{stem}_{name}_trace.json")
                tables.append(trace_gaps(prof, trace))
                trace.unlink()  # tens of MB at 1.7B: the table is what comes back
            Path(f"{stem}_{name}.txt").write_text("\n\n".join(tables))


SYNCS = ("aten::item", "aten::_local_scalar_dense", "cudaStreamSynchronize", "cudaDeviceSynchronize", "aten::nonzero")


def _outside_torch(frame: str) -> bool:
    """A frame of the code that asked for a value: not torch's, the CPU patches', the warnings
    module's or the sync counter's own."""
    return (not any(skip in frame for skip in ("torch/", "cpu_compat", "warnings.py"))
            and not frame.endswith(": syncs_by_warning"))


def syncs_by_warning(fn) -> str:
    """Run ``fn`` with CUDA's sync debug mode on (``torch.cuda.set_sync_debug_mode("warn")``): each
    op that makes the host wait for the device warns from inside the Python call that asked for
    it, and the two nearest frames outside torch are counted, most calls first. Unlike the
    profiler's stacks this names the line on the GPU machine's torch. Without CUDA nothing
    warns: only a warning ``fn`` itself raises about a synchronizing operation is counted."""
    import traceback
    import warnings
    from collections import Counter

    calls: Counter = Counter()

    def record(message, category, filename, lineno, file=None, line=None):
        if "synchroniz" not in str(message):
            return
        stack = [f"{f.filename.split('site-packages/')[-1]}({f.lineno}): {f.name}"
                 for f in reversed(traceback.extract_stack()[:-1])]  # innermost first, not this hook
        calls[" <- ".join([f for f in stack if _outside_torch(f)][:2]) or "?"] += 1

    cuda = torch.cuda.is_available()
    with warnings.catch_warnings():
        warnings.simplefilter("always")
        warnings.showwarning = record
        if cuda:
            torch.cuda.set_sync_debug_mode("warn")
        try:
            fn()
        finally:
            if cuda:
                torch.cuda.set_sync_debug_mode("default")
    lines = [f"{n:6d}  {where}" for where, n in calls.most_common(40)]
    return (f"host syncs by caller, from CUDA's sync debug mode ({sum(calls.values())} in all; "
            "calls, nearest frames outside torch)\n" + "\n".join(lines))


def host_syncs_by_caller(events) -> str:
    """Where the host waits for the device: each sync-like op counted by its two nearest Python
    frames outside torch (the line of ours or Megatron's that asked for a value, and its caller),
    most calls first. A torch build whose profiler records neither stacks nor Python events
    (torch 2.11 with CUDA on the GPU machine) gives "?" for the frames: the counts still hold."""
    from collections import Counter

    calls: Counter = Counter()
    for ev in events:
        if ev.name not in SYNCS:
            continue
        frames = [f for f in (ev.stack or []) if _outside_torch(f)][:2]
        parent = None if frames else ev.cpu_parent  # torch versions differ: a stack, or parent events
        while parent is not None and len(frames) < 2:  # with_stack: Python frames enclose the op
            if ".py(" in parent.name and _outside_torch(parent.name):
                frames.append(parent.name)
            parent = parent.cpu_parent
        calls[(ev.name, " <- ".join(frames) or "?")] += 1
    lines = [f"{n:6d}  {op:28s} {where}" for (op, where), n in calls.most_common(40)]
    return "host syncs by caller (calls, op, nearest frames outside torch)\n" + "\n".join(lines)


def trainer_settings(pairs: list[str]) -> dict:
    """``--set field=value`` as TrainerConfig keyword arguments, each value read as YAML (as a
    Hydra override is: ``false``, ``700.5``, ``host``): the A/B of one setting at one shape, e.g.
    ``grad_reduce_in_fp32=false``."""
    from dataclasses import fields

    import yaml

    from megatron_darl.trainer.config import TrainerConfig

    plain = [f.name for f in fields(TrainerConfig) if f.name not in ("optimizer", "micro_batch")]
    out: dict = {}
    for pair in pairs:
        name, sep, raw = pair.partition("=")
        if not sep or name not in plain:
            raise SystemExit(f"--set {pair!r}: use field=value with a plain TrainerConfig field ({', '.join(plain)})")
        out[name] = yaml.safe_load(raw)
    return out


def hf_tokens_per_s(hf_config: dict, args) -> float:
    """Plain HF step: micro-batches of the same size, CE loss, AdamW, one process."""
    import transformers

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    kwargs = {k: v for k, v in hf_config.items() if k not in ("architectures", "model_type")}
    with torch.device(device):
        model = transformers.Qwen3ForCausalLM._from_config(
            transformers.Qwen3Config(**kwargs), attn_implementation="sdpa", dtype=dtype
        ).train()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-6, fused=device.type == "cuda")
    rows = max(1, args.token_budget // args.seq)
    ids = torch.randint(0, hf_config["vocab_size"], (args.seqs, args.seq), device=device)
    labels = ids.clone()
    labels[:, : args.prompt] = -100

    def step():
        for start in range(0, args.seqs, rows):
            out = model(input_ids=ids[start : start + rows], labels=labels[start : start + rows])
            out.loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    seconds = _timed(step, args.warmup, args.iters)
    del model, opt
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    return args.seq * args.seqs / seconds


def bench(name: str, hf_config: dict, layout: str, args) -> dict:
    from megatron_darl.trainer.parallel import run_local_gloo

    tp, pp, world = LAYOUTS[layout]
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "result.json"
        run_local_gloo(trainer_worker, world, args=(tp, pp, hf_config, args, str(out)),
                       timeout_s=args.timeout)
        row = {"model": name, "layout": layout, "gpus": world, **json.loads(out.read_text())}
    return row


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="+", default=["qwen3_1.7b", "qwen3_4b"])
    parser.add_argument("--layouts", nargs="+", default=["tp1"], choices=sorted(LAYOUTS))
    parser.add_argument("--seq", type=int, default=4096, help="tokens per sequence")
    parser.add_argument("--prompt", type=int, default=512, help="unscored prefix per sequence")
    parser.add_argument("--seqs", type=int, default=16, help="sequences per global step")
    parser.add_argument("--minibatches", type=int, default=1,
                        help="optimizer steps per step, as the loop's algorithm.ppo_minibatches")
    parser.add_argument("--token-budget", type=int, default=8192, help="tokens per micro-batch")
    parser.add_argument("--logprob-token-budget", type=int, default=None,
                        help="tokens per forward-only micro-batch (default 2x --token-budget)")
    parser.add_argument("--recompute", action="store_true", help="full activation recompute")
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--iters", type=int, default=3)
    parser.add_argument("--peak-tflops", type=float, default=989.0)
    parser.add_argument("--skip-hf", action="store_true")
    parser.add_argument("--timeout", type=float, default=3600.0, help="per layout run, seconds")
    parser.add_argument("--set", action="append", default=[], metavar="FIELD=VALUE",
                        help="a TrainerConfig field for every layout (repeatable), e.g. grad_reduce_in_fp32=false")
    parser.add_argument("--megatron-fallbacks", action="store_true",
                        help="keep megatron-core's own no-TE/apex multi-tensor stand-ins (one host sync per tensor)")
    parser.add_argument("--profile", default=None, metavar="DIR",
                        help="also write rank 0's torch.profiler tables (one log-prob pass, one step) to DIR")
    parser.add_argument("--tiny", action="store_true", help="CPU smoke check at tiny shapes")
    parser.add_argument("--out-dir", default=None, help="results dir (default benchmarks/results)")
    return parser.parse_args(argv)


def main(argv=None) -> int:
    from megatron_darl.models.qwen3.config import load_preset

    args = parse_args(argv)
    trainer_settings(args.set)  # a bad --set stops here, before any process starts
    if args.tiny:
        args.models, args.seq, args.prompt, args.seqs = ["tiny"], 128, 16, 8
        args.token_budget, args.warmup, args.iters = 256, 1, 2
    rows = []
    for name in args.models:
        hf_config = dict(TINY) if name == "tiny" else load_preset(name)
        base = None
        for layout in args.layouts:
            row = bench(name, hf_config, layout, args)
            if row["gpus"] == 1 and base is None:
                base = row["tokens_per_s"]
                row["hf_tokens_per_s"] = None if args.skip_hf else hf_tokens_per_s(hf_config, args)
            row["scaling_efficiency"] = row["tokens_per_s"] / (row["gpus"] * base) if base else None
            rows.append(row)
            _record(name, layout, row, args)
    print_table(rows)
    return 0


def _record(name: str, layout: str, row: dict, args) -> None:
    if args.tiny and args.out_dir is None:
        return
    keys = ("seq", "prompt", "seqs", "minibatches", "token_budget", "logprob_token_budget", "recompute",
            "warmup", "iters", "set", "megatron_fallbacks")
    config = {k: getattr(args, k) for k in keys}
    config.update(model=name, layout=layout, gpus=row["gpus"], init="random",
                  flop_formula="6*N + 12*L*H*Q*s per token, N incl. LM head (PaLM, non-causal)")
    metrics = {k: v for k, v in row.items() if k not in ("model", "layout", "gpus")}
    print(f"wrote {write_result('train_step', config, metrics, Path(args.out_dir) if args.out_dir else None)}")


if __name__ == "__main__":
    sys.exit(main())
