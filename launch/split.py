"""Choosing how many of a host's GPUs train and how many generate (``cluster.split=auto``).

Why a model and not a rule of thumb: the async loop overlaps the trainer's step with the engines'
generation, so a step takes about the longer of the two, and which one is longer depends on the
model, the engine, the batch and the variant (Qwen3-1.7B, hf, 8 x 8 samples of 512 tokens on 4
H200: 2.37 s a step at 1:3, 2.77 s at 2:2); the balance point moves with every one of those. So
we predict both sides per candidate split from measured rates and take the fastest.

The model, per step (B groups x G samples, each P prompt + M new tokens; T trainer and R rollout
GPUs, T + R = N):

    trainer seconds     = work x B G (P + M) x (c + d / T)
    generation seconds  = M x (a + b x B G / R)          (one engine; the R engines run at once)
    step seconds        = max(trainer, generation)       (async: they overlap)
                        = trainer + generation           (sync, max_staleness = 0: they take turns)

``c + d / T`` is the trainer's seconds per train-step token at T GPUs (``d`` the part that the
data-parallel ranks share, ``c`` what they don't: gradient all-reduce, optimizer; 1 / (c + d/T)
is the ``trainer_tokens_per_s`` of the records; with records at one T only, c = 0: linear), and
``work`` the trainer's busy time (a record's step less its receive wait) over its train step: the
log-prob pass over the candidates, the plan, the backfill and the publish on top
(``WORK_BY_VARIANT`` without a record of the variant). Generation is not 1/R: an engine's decode
step reads all the weights whatever its batch (``a``, memory-bound) and adds a little per sequence
(``b``); at small batches ``a`` dominates (Qwen3-1.7B on vLLM: one engine 5.65 s for a
64-sample step, each of two engines 5.35-5.77 s for half of it), while ``hf``'s fixed-size
generate calls make it nearly proportional.
Both sides assume responses run to M (a trained policy stops earlier on both sides alike).

Rates come from, in order: explicit ``cluster.rates`` (0 = unknown), the newest matching
``benchmarks/results/loop_profile_*.json`` records (same model and engine; the same GPU name
preferred; nearest batch shape; a fit over the records' layouts), else a FLOPs prior (``prior``
in the log line). A candidate needs a valid trainer layout (T a multiple of TP x PP, B at least
the DP size: 32 groups on 3 DP ranks train as 11, 11 and 10); within ``TIE`` of the fastest, the one with more rollout GPUs wins (fresher
samples, and generation is where the model is least sure: engines vary most with the batch).

What the model misses, and why measured steps win: the trainer's idle time when the engines'
fixed-size calls and the staleness gate deliver groups in bursts (a 2:2 step on H200 waited 0.6 s
although each engine generated only 1.8 of the trainer's 2.2 busy seconds), and darl's extra
scoring of the candidates that more engines deliver. So with rates from records, a candidate that a
record measured at the run's exact shape and variant takes that record's ``step_seconds``, and the
others their prediction times the mean measured / predicted ratio of those records (the
calibration; it leaves the order among predicted candidates as it was).
"""

from __future__ import annotations

import json
import math
import re
import subprocess
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Callable, Sequence

from megatron_darl.loop.run_config import SplitRatesConfig

RESULTS_DIR = Path(__file__).resolve().parents[1] / "benchmarks" / "results"
PROMPT_TOKENS = 64  # assumed mean prompt tokens when cluster.rates.prompt_tokens = 0
TIE = 0.01  # predicted step times within 1% of the fastest count as tied
# trainer busy seconds per train-step second, measured (loop_profile, Qwen3-1.7B, H200): darl 1.52
# at 1:1 (commit 95771ae: one log-prob pass over the scored groups + backfill), 2.0 at 2:2 and 2.5
# at 1:3 (2bdde42 + the candidate prefetch: more engines, more candidates scored); decoupled 1.17
# at 1:1. Others: one forward (a third of a train step by FLOPs) + the train step.
WORK_BY_VARIANT = {"darl": 2.0, "decoupled": 1.17}
WORK_DEFAULT = 4.0 / 3.0
ONE_SOURCE_FIXED_SHARE = 0.5  # engine records at one batch size only: half its time assumed fixed
# prior: dense bf16 peak (TFLOP/s) and HBM bandwidth (TB/s) by GPU name (longest key first)
PEAK_TFLOPS = {"H100 PCIe": 756.0, "H100": 989.0, "H200": 989.0, "H800": 989.0, "A100": 312.0, "B200": 2250.0}
HBM_TBPS = {"H100 PCIe": 2.0, "H100": 3.35, "H200": 4.8, "H800": 3.35, "A100": 2.0, "B200": 8.0}
PRIOR_MFU = 0.4  # trainer (records: 0.42 at 1 GPU, 0.30-0.32 per GPU at 2)
PRIOR_BW_EFF = 0.6  # share of HBM bandwidth a decode step reaches reading the weights
PRIOR_DECODE_MFU = 0.5  # per-sequence matmul work of a decode step
PRIOR_HF_LAYER_S = 0.25e-3  # hf's eager generate: Python/launch overhead per layer per decode step


@dataclass(frozen=True)
class SplitRequest:
    """What the chooser needs to know of the run (plain values, read from the config)."""

    n_gpus: int  # trainer + rollout GPUs to split
    groups: int  # B = algorithm.groups_per_step
    group_size: int  # G = algorithm.group_size
    new_tokens: int  # M = sampling.max_new_tokens
    variant: str  # algorithm.variant (record matching, default work factor)
    overlap: bool  # async (max_staleness > 0): trainer and engines overlap
    tp: int = 1  # parallel.tp
    pp: int = 1  # parallel.pp
    model: str = ""  # model.name (record matching)
    engine: str = "hf"  # engine.backend (record matching, prior)
    model_shape: tuple[tuple[str, int], ...] = ()  # HF config fields for the prior; () = unknown

    @property
    def samples(self) -> int:
        return self.groups * self.group_size


@dataclass(frozen=True)
class Rates:
    """The model's coefficients (module docstring) and where each came from."""

    trainer_fixed_s: float  # c: seconds per train-step token that T GPUs don't share
    trainer_shared_s: float  # d: seconds per train-step token on one GPU that T GPUs share
    work: float  # trainer busy seconds / train-step seconds
    decode_s: float  # a: one engine's seconds per decode step, whatever its batch
    decode_s_per_sample: float  # b: added per sequence in the batch
    trainer_source: str = ""
    work_source: str = ""
    engine_source: str = ""

    def trainer_tokens_per_s(self, t: int) -> float:
        return 1.0 / (self.trainer_fixed_s + self.trainer_shared_s / t)


@dataclass(frozen=True)
class Candidate:
    """One split and its predicted times."""

    trainer_gpus: int
    rollout_gpus: int
    trainer_s: float  # predicted trainer busy seconds per step
    generation_s: float  # predicted seconds per step of each engine
    step_s: float  # step seconds: measured, else predicted (x the calibration)
    measured: str = ""  # the record whose step_seconds this is; "" = predicted


@dataclass(frozen=True)
class SplitChoice:
    """The chosen split, every candidate and the reason (what ``launch.split`` logs)."""

    trainer_gpus: int
    rollout_gpus: int
    candidates: tuple[Candidate, ...]  # every valid split, fewest trainer GPUs first
    why: str  # one line: the choice, the predictions, the rates and their sources


# ---------------------------------------------------------------- the chooser (pure)

def valid_trainer_gpus(n_gpus: int, tp: int, pp: int, groups: int) -> list[int]:
    """Trainer GPU counts T (1 <= T < n_gpus, leaving >= 1 rollout GPU) with a valid layout."""
    mp = tp * pp
    return [t for t in range(1, n_gpus) if t % mp == 0 and groups >= t // mp]


def predict(req: SplitRequest, rates: Rates, t: int, prompt_tokens: int) -> Candidate:
    """Predicted trainer, generation and step seconds at ``t`` trainer GPUs (module docstring)."""
    r = req.n_gpus - t
    tokens = req.samples * (prompt_tokens + req.new_tokens)
    trainer = rates.work * tokens / rates.trainer_tokens_per_s(t)
    generation = req.new_tokens * (rates.decode_s + rates.decode_s_per_sample * req.samples / r)
    step = max(trainer, generation) if req.overlap else trainer + generation
    return Candidate(t, r, trainer, generation, step)


def choose_split(req: SplitRequest, rates: Rates, prompt_tokens: int = PROMPT_TOKENS,
                 measured: Sequence[ProfileRecord] = (), scale: float = 1.0) -> SplitChoice:
    """The fastest split of ``req.n_gpus``: a split in ``measured`` takes its record's step, the
    others their prediction x ``scale``; ties (``TIE``) go to more rollout GPUs."""
    ts = valid_trainer_gpus(req.n_gpus, req.tp, req.pp, req.groups)
    if not ts:
        raise ValueError(f"cluster.split=auto: no split of {req.n_gpus} GPUs leaves >= 1 rollout GPU and a "
                         f"trainer layout with T a multiple of parallel.tp x parallel.pp = {req.tp * req.pp} "
                         f"and algorithm.groups_per_step={req.groups} at least the DP size")
    steps = {(r.trainer_gpus, r.rollout_gpus): r for r in measured}
    cands = []
    for t in ts:
        c = predict(req, rates, t, prompt_tokens)
        rec = steps.get((t, req.n_gpus - t))
        cands.append(replace(c, step_s=rec.step_seconds, measured=rec.path) if rec
                     else replace(c, step_s=c.step_s * scale))
    cands = tuple(cands)
    fastest = min(c.step_s for c in cands)
    best = max((c for c in cands if c.step_s <= fastest * (1 + TIE)), key=lambda c: c.rollout_gpus)
    why = why_line(req, rates, best, cands, prompt_tokens, scale)
    return SplitChoice(best.trainer_gpus, best.rollout_gpus, cands, why)


def why_line(req: SplitRequest, rates: Rates, best: Candidate, cands: Sequence[Candidate], prompt: int,
             scale: float = 1.0) -> str:
    """One log line: the choice, every candidate's step, the rates and their sources."""
    preds = ", ".join(f"{c.trainer_gpus}:{c.rollout_gpus} {c.step_s:.2f} s "
                      + (f"measured [{c.measured}]" if c.measured else
                         f"(train {c.trainer_s:.2f}, gen {c.generation_s:.2f}"
                         + (f", x{scale:.2f} calibrated)" if scale != 1.0 else ")"))
                      for c in cands)
    tok = "/".join(_k(rates.trainer_tokens_per_s(c.trainer_gpus)) for c in cands)
    gpus = "/".join(str(c.trainer_gpus) for c in cands)
    return (f"cluster.split=auto on {req.n_gpus} GPUs -> {best.trainer_gpus}:{best.rollout_gpus} "
            f"({'max' if req.overlap else 'sum'} of trainer and generation per step; {preds}); "
            f"{req.groups}x{req.group_size} samples of {prompt}+{req.new_tokens} tokens; "
            f"trainer {tok} tokens/s at {gpus} GPUs [{rates.trainer_source}], work x{rates.work:.2f} "
            f"[{rates.work_source}]; engine {req.new_tokens} x ({rates.decode_s * 1e3:.3g} + "
            f"{rates.decode_s_per_sample * 1e3:.3g} x samples per engine) ms [{rates.engine_source}]")


def _k(x: float) -> str:
    return f"{x / 1e6:.1f}M" if x >= 1e6 else f"{x / 1e3:.1f}k"


def fit_nonnegative(points: Sequence[tuple[float, float]]) -> tuple[float, float]:
    """Least squares ``y = a + b x`` with a, b >= 0 (a negative one is refitted at 0)."""
    n = len(points)
    mx, my = sum(x for x, _ in points) / n, sum(y for _, y in points) / n
    sxx = sum((x - mx) ** 2 for x, _ in points)
    b = sum((x - mx) * (y - my) for x, y in points) / sxx if sxx > 0 else 0.0
    a = my - b * mx
    if b < 0:
        return my, 0.0
    if a < 0:
        return 0.0, sum(x * y for x, y in points) / sum(x * x for x, _ in points)
    return a, b


# ---------------------------------------------------------------- records

@dataclass(frozen=True)
class ProfileRecord:
    """The parts of one ``loop_profile`` record the chooser uses."""

    path: str
    device: str
    date: str
    variant: str
    samples: int  # groups x group_size per step
    new_tokens: int
    trainer_gpus: int
    rollout_gpus: int
    trainer_tokens_per_s: float  # all trainer GPUs together, train step
    generation_seconds: float  # per engine per step
    work: float  # trainer busy / train seconds; 0 = unknown
    step_seconds: float = 0.0  # measured step (0 = not recorded)

    @property
    def samples_per_engine(self) -> float:
        return self.samples / self.rollout_gpus


def _layout_counts(config: dict) -> tuple[int, int]:
    """(T, R) of a record: its counts, else its layout name; (0, 0) when trainer and engine share."""
    t, r = int(config.get("trainer_gpus") or 0), int(config.get("rollout_gpus") or 0)
    if t > 0 and r > 0:
        return t, r
    m = re.fullmatch(r"t(\d+)r(\d+)", str(config.get("layout", "")))
    if m:
        return int(m.group(1)), int(m.group(2))
    return (1, 1) if config.get("layout") == "gpu2" else (0, 0)  # gpu1: one GPU shared


def read_records(results_dir: Path, model: str, engine: str) -> list[ProfileRecord]:
    """``loop_profile_*.json`` records in ``results_dir`` of ``model`` on ``engine`` with separate
    trainer and rollout GPUs and both rates; others are skipped. Unreadable JSON: ValueError."""
    out = []
    for path in sorted(Path(results_dir).glob("loop_profile_*.json")):
        try:
            rec = json.loads(path.read_text())
        except (OSError, json.JSONDecodeError) as err:
            raise ValueError(f"{path}: not a readable benchmark record ({err}); move it out of "
                             f"cluster.rates.results_dir or set cluster.split=T:R") from None
        cfg, m = rec.get("config") or {}, rec.get("metrics") or {}
        t, r = _layout_counts(cfg)
        if cfg.get("model") != model or cfg.get("engine") != engine or t == 0:
            continue
        tok_s, gen_s = float(m.get("trainer_tokens_per_s") or 0), float(m.get("generation_seconds") or 0)
        if tok_s <= 0 or gen_s <= 0:
            continue
        train, step = float(m.get("train_seconds") or 0), float(m.get("step_seconds") or 0)
        busy = (step - float(m["receive_wait_seconds"]) if step > 0 and "receive_wait_seconds" in m else
                sum(float(m.get(f"{k}_seconds") or 0) for k in ("train", "logprob", "plan", "backfill", "publish")))
        out.append(ProfileRecord(
            path=path.name, device=str(rec.get("device", "")), date=str(rec.get("date", "")),
            variant=str(cfg.get("variant", "")), samples=int(cfg["groups"]) * int(cfg["group_size"]),
            new_tokens=int(cfg["new_tokens"]), trainer_gpus=t, rollout_gpus=r,
            trainer_tokens_per_s=tok_s, generation_seconds=gen_s, work=busy / train if train > 0 else 0.0,
            step_seconds=step))
    return out


def select_records(records: Sequence[ProfileRecord], req: SplitRequest, device: str | None) -> list[ProfileRecord]:
    """Those to fit: one device (``device`` if any record has it, else the newest record's), the
    batch shape nearest ``req``'s, and per (T, R) layout the newest, the run's variant first."""
    if not records:
        return []
    on = device if device and any(r.device == device for r in records) else max(records, key=lambda r: r.date).device
    recs = [r for r in records if r.device == on]

    def distance(r: ProfileRecord) -> float:
        return abs(math.log(r.samples / req.samples)) + abs(math.log(r.new_tokens / req.new_tokens))

    near = min(distance(r) for r in recs)
    newest: dict[tuple[int, int], ProfileRecord] = {}
    for r in sorted((r for r in recs if distance(r) <= near + 1e-9), key=lambda r: (r.variant == req.variant, r.date)):
        newest[(r.trainer_gpus, r.rollout_gpus)] = r  # later (same variant, newer) replaces earlier
    return sorted(newest.values(), key=lambda r: (r.trainer_gpus, r.rollout_gpus))


def _source(recs: Sequence[ProfileRecord]) -> str:
    """``records a.json, b.json (NVIDIA H200, 64 samples x 512 new tokens)``."""
    r = recs[0]
    return f"records {', '.join(x.path for x in recs)} ({r.device}, {r.samples} samples x {r.new_tokens} new tokens)"


# ---------------------------------------------------------------- rates: config, records, prior

def _gpu_key(table: dict[str, float], device: str | None, default: str) -> tuple[str, float]:
    for key in sorted(table, key=len, reverse=True):
        if device and key in device:
            return key, table[key]
    return default, table[default]


def matmul_params(shape: dict) -> int:
    """Weights a token's matmuls read (all layers and the LM head) from HF config fields."""
    h, layers = int(shape["hidden_size"]), int(shape["num_hidden_layers"])
    heads, kv = int(shape["num_attention_heads"]), int(shape.get("num_key_value_heads") or shape["num_attention_heads"])
    d = int(shape.get("head_dim") or h // heads)
    per_layer = h * d * (2 * heads + 2 * kv) + 3 * h * int(shape["intermediate_size"])
    return layers * per_layer + h * int(shape["vocab_size"])


def prior_rates(req: SplitRequest, device: str | None) -> Rates:
    """FLOPs/bandwidth prior: ``PRIOR_MFU`` of the GPU's peak for the train step (6 N per token,
    T GPUs T times one), weights read at ``PRIOR_BW_EFF`` of HBM per decode step (+ hf's per-layer
    overhead), 2 N per sequence per decode step at ``PRIOR_DECODE_MFU``; unknown GPU: H100's."""
    shape = dict(req.model_shape)
    if not shape:
        raise ValueError(f"cluster.split=auto: no rates for model {req.model!r} on engine {req.engine!r} "
                         f"(no cluster.rates.*, no matching loop_profile record, no model shape for the "
                         f"prior): set cluster.rates or cluster.split=T:R")
    n = matmul_params(shape)
    gpu, peak = _gpu_key(PEAK_TFLOPS, device, "H100")
    _, bw = _gpu_key(HBM_TBPS, device, gpu)
    tok_s = peak * 1e12 * PRIOR_MFU / (6.0 * n)
    decode = 2.0 * n / (bw * 1e12 * PRIOR_BW_EFF)
    if req.engine == "hf":
        decode += PRIOR_HF_LAYER_S * int(shape["num_hidden_layers"])
    per_sample = 2.0 * n / (peak * 1e12 * PRIOR_DECODE_MFU)
    src = f"prior: {n / 1e9:.2f}B matmul params on {gpu} ({peak:.0f} TFLOP/s, {bw} TB/s)"
    return Rates(0.0, 1.0 / tok_s, 0.0, decode, per_sample, src, "", src)


def record_rates(recs: Sequence[ProfileRecord], req: SplitRequest) -> Rates | None:
    """Fit the trainer (over T) and the engine (over samples per engine) to ``recs``; None: none."""
    if not recs:
        return None
    # trainer: seconds per token u(T) = c + d / T, from the run's variant's records when there are
    # any (the variants' train steps differ); one T only: linear scaling (c = 0)
    own = [r for r in recs if r.variant == req.variant] or list(recs)
    if len({r.trainer_gpus for r in own}) >= 2:
        c, d = fit_nonnegative([(1.0 / r.trainer_gpus, 1.0 / r.trainer_tokens_per_s) for r in own])
    else:
        c, d = 0.0, sum(r.trainer_gpus / r.trainer_tokens_per_s for r in own) / len(own)
    # engine: seconds per decode step y(s) = a + b s; one batch size only: half fixed (stated)
    pts = [(r.samples_per_engine, r.generation_seconds / r.new_tokens) for r in recs]
    if len({x for x, _ in pts}) >= 2:
        a, b = fit_nonnegative(pts)
        how = "fit a + b x samples"
    else:
        y = sum(y for _, y in pts) / len(pts)
        a, b = ONE_SOURCE_FIXED_SHARE * y, (1 - ONE_SOURCE_FIXED_SHARE) * y / pts[0][0]
        how = f"one batch size: {ONE_SOURCE_FIXED_SHARE:.0%} fixed assumed"
    same = [r for r in recs if r.variant == req.variant and r.work > 0]
    newest = max(same, key=lambda r: r.date) if same else None
    return Rates(c, d, newest.work if newest else 0.0, a, b, _source(own),
                 f"record {newest.path}" if newest else "", f"{_source(recs)}; {how}")


def resolve_rates(req: SplitRequest, explicit: SplitRatesConfig, records: Sequence[ProfileRecord],
                  device: str | None) -> Rates:
    """Each rate from ``explicit`` when > 0, else from ``records`` (already selected), else the
    prior; the work factor from ``explicit``, the newest record of the variant, else the table."""
    measured = record_rates(records, req)
    fallback = measured
    if fallback is None and not (explicit.trainer_tokens_per_s > 0 and
                                 (explicit.engine_decode_s > 0 or explicit.engine_decode_s_per_sample > 0)):
        fallback = prior_rates(req, device)
    if explicit.trainer_tokens_per_s > 0:
        c, d, t_src = 0.0, 1.0 / explicit.trainer_tokens_per_s, "config cluster.rates (x T GPUs)"
    else:
        c, d, t_src = fallback.trainer_fixed_s, fallback.trainer_shared_s, fallback.trainer_source
    if explicit.engine_decode_s > 0 or explicit.engine_decode_s_per_sample > 0:
        a, b, e_src = explicit.engine_decode_s, explicit.engine_decode_s_per_sample, "config cluster.rates"
    else:
        a, b, e_src = fallback.decode_s, fallback.decode_s_per_sample, fallback.engine_source
    if explicit.trainer_work > 0:
        work, w_src = explicit.trainer_work, "config cluster.rates"
    elif measured is not None and measured.work > 0:
        work, w_src = measured.work, measured.work_source
    else:
        family = next((k for k in WORK_BY_VARIANT if req.variant.startswith(k)), "")
        work = WORK_BY_VARIANT.get(family, WORK_DEFAULT)
        w_src = f"default for {family or req.variant}"
    return Rates(c, d, work, a, b, t_src, w_src, e_src)


def calibration(req: SplitRequest, rates: Rates, records: Sequence[ProfileRecord],
                prompt_tokens: int) -> tuple[list[ProfileRecord], float]:
    """Records that measured a step at ``req``'s exact shape and variant, and the mean of their
    measured / predicted step (1.0 without any)."""
    same = [r for r in records if r.step_seconds > 0 and r.variant == req.variant
            and r.samples == req.samples and r.new_tokens == req.new_tokens]
    if not same:
        return [], 1.0
    ratios = [r.step_seconds / predict(replace(req, n_gpus=r.trainer_gpus + r.rollout_gpus), rates,
                                       r.trainer_gpus, prompt_tokens).step_s for r in same]
    return same, sum(ratios) / len(ratios)


def decide(req: SplitRequest, explicit: SplitRatesConfig, device: str | None = None,
           results_dir: Path | None = None) -> SplitChoice:
    """Rates (config, records, prior) and the choice for ``req``; measured steps and the
    calibration only when every rate came from the records (module docstring)."""
    directory = Path(explicit.results_dir) if explicit.results_dir else (results_dir or RESULTS_DIR)
    given = (explicit.trainer_tokens_per_s > 0, explicit.trainer_work > 0,
             explicit.engine_decode_s > 0 or explicit.engine_decode_s_per_sample > 0)
    records = select_records(read_records(directory, req.model, req.engine), req, device) if not all(given) else []
    rates = resolve_rates(req, explicit, records, device)
    prompt = explicit.prompt_tokens or PROMPT_TOKENS
    measured, scale = calibration(req, rates, records, prompt) if records and not any(given) else ([], 1.0)
    return choose_split(req, rates, prompt, measured, scale)


# ---------------------------------------------------------------- "T:R" and this machine

def parse_split(text: str) -> tuple[int, int]:
    """``"T:R"`` -> (T, R), each >= 1; anything else a ValueError naming ``cluster.split``."""
    parts = text.split(":")
    if len(parts) != 2 or not all(p.strip().isdigit() and int(p) >= 1 for p in parts):
        raise ValueError(f"cluster.split={text!r}: use 'T:R' with T, R >= 1 (e.g. '2:2'), 'auto' or ''")
    return int(parts[0]), int(parts[1])


def visible_gpus() -> int:
    """CUDA devices this process sees (0 without CUDA)."""
    import torch

    return torch.cuda.device_count()


def gpu_name(run: Callable[..., subprocess.CompletedProcess] = subprocess.run) -> str | None:
    """GPU 0's name as ``nvidia-smi`` (and the records) give it, e.g. ``NVIDIA H200``; None: none."""
    try:
        out = run(["nvidia-smi", "--query-gpu=name", "--format=csv,noheader", "-i", "0"],
                  capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.SubprocessError):
        return None
    name = out.stdout.strip().splitlines()[0].strip() if out.returncode == 0 and out.stdout.strip() else ""
    return name or None
