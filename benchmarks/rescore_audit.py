"""Benchmark ``rescore_audit``: what the opt-in ``replay.rescore`` rules would select on a real run.

``replay.rescore=selected`` and ``bounded`` skip re-scoring old groups by predicting their score
from the last one (``step/candidates.py``); the prediction is not a bound, so a rule can miss a
group whose score fell. This runs the real main job (``python -m launch.train``, the embedded
default exactly as the quick start runs it: warm-started tiny policy, built-in task, D-ARL) once
per rule with ``replay.rescore_audit=true``: every step scores every candidate, trains on that
exact selection (what the default ``all`` does) and logs what the rule would have selected from
the same scores. From the run's ``metrics.jsonl``, over the audited steps (those with candidates,
after warmup): ``agreement`` (share of the exact selection the rule keeps) mean and worst (min)
step; ``score_gap`` (mean exact score of the rule's selection minus the exact one's) mean and
worst (max) step, also relative to the exact selection's mean score; the groups the rule would
score per step against all candidates per step; the steps where the rule left groups unscored
and where it disagreed at all. One record per rule (``benchmarks/record.py``).

    python benchmarks/rescore_audit.py                      # 40 steps, selected then bounded
    python benchmarks/rescore_audit.py --steps 3 --rules bounded   # smoke check
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.record import print_table, write_result  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
AUDITED = ("rescore_agreement", "rescore_score_gap", "rescore_rule_scored", "candidate_groups")


def resolved(run_dir: Path) -> dict:
    """What the run resolved (its own ``run_config.yaml``): the replay section, batch, engine."""
    import yaml

    cfg = yaml.safe_load((run_dir / "run_config.yaml").read_text())
    algo = cfg["algorithm"]
    return {"replay": cfg["replay"], "variant": algo["variant"], "groups": algo["groups_per_step"],
            "group_size": algo["group_size"], "new_tokens": cfg["sampling"]["max_new_tokens"],
            "engine": cfg["engine"]["backend"]}


def run_rule(rule: str, a: argparse.Namespace, run_dir: Path) -> list[dict]:
    """The main job with ``replay.rescore=rule`` audited; its metrics rows."""
    shutil.rmtree(run_dir, ignore_errors=True)
    cmd = [sys.executable, "-m", "launch.train", f"algorithm={a.variant}", f"loop.steps={a.steps}",
           f"loop.run_dir={run_dir}", "loop.progress_bar=false", "loop.plot=false",
           "loop.tensorboard=false", "transport.control.port=0", "cluster.master_port=0",
           f"replay.rescore={rule}", "replay.rescore_audit=true", *a.overrides]
    env = {**os.environ, "PYTHONPATH": f"{REPO}:{os.environ.get('PYTHONPATH', '')}"}
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=a.timeout)
    if proc.returncode != 0:
        raise RuntimeError(f"{rule} failed ({proc.returncode}):\n{proc.stdout[-3000:]}{proc.stderr[-3000:]}")
    rows = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [r for r in rows if r.get("kind") != "heldout"]  # training steps only (eval.* points)


def audit_summary(rows: list[dict]) -> dict:
    """Mean and worst step of the audit metrics over the steps that logged them."""
    audited = [r for r in rows if all(k in r for k in AUDITED)]
    if not audited:
        raise ValueError("no step logged the audit (replay.rescore_audit off, or a score without pi_t)")
    col = lambda k: [float(r[k]) for r in audited]  # noqa: E731
    agree, gap, scored, cand = col("rescore_agreement"), col("rescore_score_gap"), \
        col("rescore_rule_scored"), col("candidate_groups")
    # the gap against the exact selection's own mean score (the audit trains on that selection)
    rel = [g / s if s > 0 else 0.0 for g, s in zip(gap, col("selected_score_mean"))]
    return {
        "steps_audited": len(audited),
        "agreement_mean": statistics.fmean(agree),
        "agreement_worst": min(agree),
        "steps_disagreeing": sum(x < 1.0 for x in agree),
        "steps_rule_skipped": sum(n < c for n, c in zip(scored, cand)),  # the rule left groups out
        "score_gap_mean": statistics.fmean(gap),
        "score_gap_worst": max(gap),
        "score_gap_relative_mean": statistics.fmean(rel),
        "score_gap_relative_worst": max(rel),
        "rule_scored_per_step": statistics.fmean(scored),
        "candidates_per_step": statistics.fmean(cand),
        "rule_scored_fraction": sum(scored) / max(sum(cand), 1e-9),
        "selected_score_mean": statistics.fmean(float(r["selected_score_mean"]) for r in audited),
        "agreement_per_step": agree,
        "score_gap_per_step": gap,
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rules", default="selected,bounded", help="comma list of replay.rescore rules")
    p.add_argument("--variant", default="darl", help="configs/algorithm/<name>.yaml (a ratio score)")
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--timeout", type=float, default=3600)
    p.add_argument("--work-dir", type=Path, default=Path("/tmp/darl_rescore_audit"))
    p.add_argument("--out-dir", type=Path, default=None, help="results dir (default benchmarks/results)")
    p.add_argument("overrides", nargs="*", help="extra Hydra overrides for every run")
    a = p.parse_args()
    table = []
    for rule in (r for r in a.rules.split(",") if r):  # one after the other: a shared machine
        run_dir = a.work_dir / rule
        metrics = audit_summary(run_rule(rule, a, run_dir))
        config = {"model": "default", "rule": rule, "steps": a.steps, **resolved(run_dir),
                  "overrides": list(a.overrides)}
        if config["replay"]["rescore"] != rule or not config["replay"]["rescore_audit"]:
            raise RuntimeError(f"{run_dir}: the run resolved replay={config['replay']}, not {rule} audited")
        print(write_result("rescore_audit", config, metrics, a.out_dir))
        table.append({"rule": rule, **{k: v for k, v in metrics.items() if not isinstance(v, list)}})
    print_table(table)


if __name__ == "__main__":
    main()
