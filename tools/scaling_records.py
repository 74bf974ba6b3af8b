"""The loop's scaling by trainer:rollout split, from ``benchmarks/loop_profile.py`` records.

``python tools/scaling_report.py --records benchmarks/results --out docs/img`` (this module does the
work). One table and one picture, ``loop_profile.png`` (``tools/benchmarks_table.py`` shows it
under the loop_profile table of docs/benchmarks.md), of samples/s by split and batch shape, for
each variant (darl, decoupled) of each engine and update mode on each device. Each row has its
samples/s over the 1:1 split's of the same device, engine, update mode, variant and batch
(``vs 1:1``: what the extra GPUs bought) and, on darl's rows, darl's step seconds over
decoupled's at the same split (``darl/decoupled step``: what D-ARL's candidate pass and backfill
cost). ``hf`` is not the production engine: its records are a regression guard, in the table's
second part and drawn in grey.

Per (device, engine, update mode, variant, batch, split) the newest record is shown; what it is
compared with (the 1:1 split, decoupled) is the newest such record of the same commit, i.e. of the
same call, and only without one the newest of any commit (its ratio then carries a ``*``: a
different commit's run, which may differ by more than the split). A record
names the engine and update mode its run resolved; older ones guessed the engine from an
``engine.backend=`` override and called a ``rollout@_global_=vllm`` run ``hf``, so for them both
are read from the overrides again (the update mode: ``finish``, both presets' default, unless
``worker.update_mode=`` was given). Records of the shared-GPU layout ``gpu1`` (trainer
and rollout on one GPU: no split), those without GPU counts, and A/B runs of any other knob are
left out. The batch is the one
asked for (``groups_requested``: older records of a 3:1 split ran 32 groups as 33, its DP size's
multiple).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Optional

GUARD_ENGINE = "hf"  # the reference engine: a regression guard, not the production path
VARIANT_STYLE = {"darl": ("-", "o"), "decoupled": ("--", "s")}  # line, marker; others dash-dot
ENGINE_OVERRIDES = ("rollout=", "rollout@_global_=", "engine.backend=")
UPDATE_MODE_OVERRIDES = ("worker.update_mode=",)
# what the harness itself passes (and no end checkpoint): any other knob makes a record an A/B run
HARNESS_OVERRIDES = ("loop.save_at_end=", *ENGINE_OVERRIDES, *UPDATE_MODE_OVERRIDES)


def _from_overrides(config: dict[str, Any], prefixes: tuple[str, ...], default: str) -> str:
    value = default
    for override in config.get("overrides") or []:
        for prefix in prefixes:
            if override.startswith(prefix):
                value = override[len(prefix):]  # the last one wins, as in Hydra
    return value


def record_engine(config: dict[str, Any]) -> str:
    """The engine a record's run used (see the module docstring for older records)."""
    if config.get("update_mode") and config.get("engine"):  # read from the run's own config
        return config["engine"]
    return _from_overrides(config, ENGINE_OVERRIDES, config.get("engine") or GUARD_ENGINE)


def record_update_mode(config: dict[str, Any]) -> str:
    """The run's ``worker.update_mode``; for older records its override, else both presets' ``finish``."""
    return config.get("update_mode") or _from_overrides(config, UPDATE_MODE_OVERRIDES, "finish")


def batch_label(config: dict[str, Any]) -> str:
    """``groups x group size x new tokens`` as asked for."""
    groups = config.get("groups_requested") or config.get("groups")
    return f"{groups}x{config.get('group_size')}x{config.get('new_tokens')}"


def _key(r: dict[str, Any]) -> tuple:
    c = r["config"]
    return (r["device"], record_engine(c), record_update_mode(c), c.get("variant"), batch_label(c),
            c["trainer_gpus"], c["rollout_gpus"])


def is_ab_run(record: dict[str, Any]) -> bool:
    """Whether the record's run changed a knob beyond the harness's (``trainer.overlap_grad_reduce=true``)."""
    return any(not o.startswith(HARNESS_OVERRIDES) for o in record["config"].get("overrides") or [])


def with_split(records: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The records that name a trainer:rollout split and ran the defaults (not: before GPU counts,
    CPU, trainer and rollout sharing one GPU, or an A/B run of another knob)."""
    return [r for r in records if r["config"].get("trainer_gpus") and r["config"].get("rollout_gpus")
            and r["config"].get("layout") != "gpu1" and not is_ab_run(r)]


def load(results: Path) -> list[dict[str, Any]]:
    """Every loop_profile record of ``results`` that names a trainer:rollout split."""
    return with_split([json.loads(p.read_text()) for p in sorted(results.glob("loop_profile_*.json"))])


def _pick(records: list[dict[str, Any]], key: tuple, commit: Optional[str] = None) -> Optional[dict]:
    """The newest record of ``key``, of ``commit`` where there is one."""
    found = [r for r in records if _key(r) == key]
    same = [r for r in found if r["commit"] == commit]
    return max(same or found, key=lambda r: r["date"], default=None)


def _ratio(num: Optional[float], den: Optional[float]) -> Optional[float]:
    return num / den if num is not None and den else None


def rate(record: dict[str, Any]) -> float:
    """Sustained samples/s of a record: B x G per step (the loop makes one step per B groups on
    average); ``samples_per_s`` (received in the measured steps) where the batch is unknown.
    A short run's received count includes the backlog the engines built ahead: 1:1 darl at
    32 x 8 x 1024 received 307 samples a step over 5 steps for B x G = 256."""
    m, c = record["metrics"], record["config"]
    if m.get("sustained_samples_per_s"):
        return float(m["sustained_samples_per_s"])
    if c.get("groups") and c.get("group_size") and m.get("step_seconds"):
        return c["groups"] * c["group_size"] / m["step_seconds"]
    return float(m["samples_per_s"])


def rows(records: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """One row per newest record with its ratio to the 1:1 split and (darl) its step over decoupled's."""
    out = []
    for key in dict.fromkeys(_key(r) for r in records):
        r = _pick(records, key)
        m = r["metrics"]
        device, engine, update, variant, batch, t, n = key
        one = _pick(records, (device, engine, update, variant, batch, 1, 1), r["commit"])
        dec = _pick(records, (device, engine, update, "decoupled", batch, t, n), r["commit"]) \
            if variant == "darl" else None
        out.append({
            "device": device, "engine": engine, "update_mode": update, "variant": variant,
            "batch": batch, "split": f"{t}:{n}", "trainer_gpus": t, "gpus": t + n,
            "samples_per_s": rate(r), "received_per_s": m["samples_per_s"], "step_seconds": m["step_seconds"],
            "vs_1to1": _ratio(rate(r), rate(one) if one else None),
            "darl_to_decoupled": _ratio(m["step_seconds"], dec["metrics"]["step_seconds"] if dec else None),
            "other_commit": [name for name, ref in (("vs_1to1", one), ("darl_to_decoupled", dec))
                             if ref is not None and ref["commit"] != r["commit"]],
            "receive_wait_seconds": m.get("receive_wait_seconds") or 0.0,
            "generation_seconds": m.get("generation_seconds") or 0.0,
            "trainer_seconds": sum(m.get(k) or 0.0 for k in ("logprob_seconds", "plan_seconds",
                                                             "backfill_seconds", "train_seconds")),
            "date": r["date"][:10], "commit": str(r["commit"])[:8], "note": r.get("note", "")})
    out.sort(key=lambda d: (d["engine"] == GUARD_ENGINE, d["device"], d["engine"], d["update_mode"],
                            d["batch"], d["variant"], d["gpus"], d["trainer_gpus"]))
    return out


def _fmt(d: dict[str, Any], name: str, spec: str, suffix: str = "") -> str:
    """A ratio cell; ``*``: its reference is another commit's record."""
    value = d[name]
    star = "*" if name in d["other_commit"] else ""
    return "-" if value is None else f"{value:{spec}}{suffix}{star}"


def table(data: list[dict[str, Any]]) -> str:
    """The markdown table: production engines first, then the hf regression guard; a ``*`` marks
    a ratio whose reference record is of another commit, ``[i]`` a record's note (below it)."""
    head = ["device", "engine", "update", "variant", "batch (groups x G x tokens)", "split (trainer:rollout)",
            "samples/s", "vs 1:1", "step s", "darl/decoupled step", "trainer idle s", "generation s/worker",
            "trainer work s", "date", "commit"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    guard, notes = False, []
    for d in data:
        if d["engine"] == GUARD_ENGINE and not guard:
            guard = True
            lines.append("| **hf: regression guard** |" + " |" * (len(head) - 1))
        if d.get("note"):
            notes.append(d["note"])
        mark = f" [{len(notes)}]" if d.get("note") else ""
        lines.append(f"| {d['device']} | {d['engine']} | {d['update_mode']} | {d['variant']}{mark} | {d['batch']} | "
                     f"{d['split']} | {d['samples_per_s']:.1f} | {_fmt(d, 'vs_1to1', '.2f', 'x')} | "
                     f"{d['step_seconds']:.2f} | {_fmt(d, 'darl_to_decoupled', '.2f')} | "
                     f"{d['receive_wait_seconds']:.2f} | {d['generation_seconds']:.2f} | "
                     f"{d['trainer_seconds']:.2f} | {d['date']} | {d['commit']} |")
    for i, note in enumerate(notes, 1):  # each record's own note: what its numbers do not say
        lines += ["", f"[{i}] {note}"]
    return "\n".join(lines)


def plot(data: list[dict[str, Any]], path: Path) -> Path:
    """Samples/s by split: a line per device, engine, update mode, variant and batch (the newest
    records), each point labelled with its ratio to the 1:1 split (``*``: another commit's); hf
    lines in grey."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    splits = sorted({(d["gpus"], d["trainer_gpus"], d["split"]) for d in data})
    x_of = {s[2]: i for i, s in enumerate(splits)}
    series: dict[tuple, list[dict]] = {}
    for d in data:
        series.setdefault((d["engine"], d["device"], d["update_mode"], d["batch"], d["variant"]), []).append(d)
    colors = iter(plt.get_cmap("tab10").colors)
    color_of: dict[tuple, Any] = {}
    fig, ax = plt.subplots(figsize=(9, 4.5))
    for (engine, device, update, batch, variant), points in series.items():
        points.sort(key=lambda d: x_of[d["split"]])
        guard = engine == GUARD_ENGINE
        shade = (engine, device, update, batch)
        if shade not in color_of:
            color_of[shade] = "0.55" if guard else next(colors, "black")
        style, marker = VARIANT_STYLE.get(variant, ("-.", "^"))
        xs, ys = [x_of[d["split"]] for d in points], [d["samples_per_s"] for d in points]
        ax.plot(xs, ys, linestyle=style, marker=marker, color=color_of[shade], alpha=0.6 if guard else 1.0,
                label=f"{variant}, {batch}, {engine}/{update}, {device}" + (" (guard)" if guard else ""))
        for x, y, d in zip(xs, ys, points):
            if d["vs_1to1"] is not None and d["split"] != "1:1":
                ax.annotate(_fmt(d, "vs_1to1", ".2f", "x"), (x, y), textcoords="offset points", xytext=(4, 4),
                            fontsize="x-small", color=color_of[shade])
    ax.set_xticks(range(len(splits)), [f"{s[2]}\n({s[0]} GPUs)" for s in splits])
    ax.set_xlim(-0.3, len(splits) - 0.5)  # room for the last point's ratio
    ax.set(title="loop throughput by split (ratio: vs the 1:1 split)", ylabel="samples / s",
           xlabel="trainer:rollout GPUs")
    ax.set_ylim(bottom=0)
    ax.grid(alpha=0.3)
    ax.legend(fontsize="x-small", loc="upper left", bbox_to_anchor=(1.01, 1.0))
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def report(results: Path, out: Path) -> str:
    """Write ``out/loop_profile.png``; return the markdown table."""
    data = rows(load(results))
    if not data:
        raise ValueError(f"{results}: no loop_profile record names its trainer:rollout split")
    out.mkdir(parents=True, exist_ok=True)
    plot(data, out / "loop_profile.png")
    return table(data)
