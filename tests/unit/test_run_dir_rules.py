"""The run-dir rules launcher, Slurm and loop share: which checkpoint is a resume point, which config
changes a resume takes (the table in docs/run_dirs.md is the code's), and the metrics history a
resume keeps."""

import json
import re
from pathlib import Path

import pytest

from launch.config import load_run_config
from launch.resume_changes import RULES, Rule, check_resume, leaves, rule_of
from launch.slurm import latest_step, trained_steps
from launch.slurm import main as slurm_main
from megatron_darl.checkpoint.resume_points import complete_checkpoints, latest_checkpoint, partial_checkpoints
from megatron_darl.loop.config import LoopConfig
from megatron_darl.loop.metrics import SUPERSEDED, MetricsLogger

REPO = Path(__file__).resolve().parents[2]


def test_only_final_names_with_their_marker_are_resume_points(tmp_path):
    root = tmp_path / "checkpoints"
    for name, marker in (("step_000002", True), ("step_000010", True), ("step_000004", False),
                         ("step_000012.tmp", True), ("damaged-step_000011", True)):
        (root / name).mkdir(parents=True)
        if marker:
            (root / name / "megatron_darl.json").write_text("{}")
    assert [p.name for p in complete_checkpoints(tmp_path)] == ["step_000002", "step_000010"]  # by step
    assert latest_checkpoint(tmp_path).name == "step_000010"
    assert latest_step(tmp_path) == 10 and latest_step(tmp_path / "nothing") == 0  # Slurm's answer too
    assert [p.name for p in partial_checkpoints(tmp_path)] == ["step_000004", "step_000012.tmp"]
    assert complete_checkpoints(tmp_path / "nothing") == [] and latest_checkpoint(tmp_path / "nothing") is None


def test_a_run_that_finished_past_its_newest_checkpoint_counts_its_summary_steps(tmp_path, capsys):
    """With ``loop.save_at_end=false`` the last steps have no checkpoint: the job is still done."""
    assert trained_steps(tmp_path) == 0
    (tmp_path / "summary.json").write_text(json.dumps({"steps": 40, "wall_seconds": 9.0}))
    assert trained_steps(tmp_path) == 40 and latest_step(tmp_path) == 0
    (tmp_path / "summary.json").write_text("[1, 2")
    with pytest.raises(ValueError, match="summary.json: not a run summary"):
        trained_steps(tmp_path)
    assert slurm_main(["trained-steps", "--run-dir", str(tmp_path)]) == 0  # what launch.sh reads: named, then 0
    out, err = capsys.readouterr()
    assert out == "0\n" and "summary.json: not a run summary" in err


def _table(doc: str) -> dict[str, str]:
    """pattern -> rule, from the markdown table of docs/run_dirs.md."""
    out = {}
    for line in doc.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) == 3 and cells[1] in {r.value for r in Rule}:
            for pattern in re.findall(r"`([^`]+)`", cells[0]):
                out[pattern] = cells[1]
    return out


def test_the_documented_table_is_the_code_s():
    table = _table((REPO / "docs" / "run_dirs.md").read_text())
    code = {p: rule.value for patterns, rule, _ in RULES for p in patterns}
    assert table == code


def test_every_config_key_has_a_rule_of_its_own():
    """A new config field must be placed in the table, not fall through to 'anything else'."""
    cfg = load_run_config(["experiment=smoke", "loop.run_dir=runs/x"])
    unplaced = [key for key, _ in leaves(cfg) if rule_of(key)[2] == len(RULES)]
    assert unplaced == []


def _saved(**changes) -> dict:
    cfg = load_run_config(["experiment=smoke", "loop.run_dir=runs/x"])
    tree: dict = {}
    for key, value in leaves(cfg):
        node = tree
        *parents, last = key.split(".")
        for part in parents:
            node = node.setdefault(part, {})
        node[last] = changes.get(key, value)
    return tree


def test_allowed_changes_pass_and_the_first_refused_primary_key_is_named():
    new = load_run_config(["experiment=smoke", "loop.run_dir=runs/x", "loop.steps=9", "engine.max_batch_size=4", "cluster.rollout_workers=2"])
    allowed = check_resume(_saved(), load_run_config(["experiment=smoke", "loop.run_dir=runs/x", "loop.steps=9", "engine.max_batch_size=4"]),
                           "old.yaml")
    assert sorted(str(c) for c in allowed) == ["engine.max_batch_size: 64 -> 4", "loop.steps: 4 -> 9"]
    with pytest.raises(ValueError) as err:
        check_resume(_saved(), new, "old.yaml")
    message = str(err.value)
    # the topology is stated once (cluster.rollout_workers): no transport key echoes it
    assert message.startswith("loop.resume=true: cluster.rollout_workers changed from 1 to 2 since the "
                              "checkpoint's run (old.yaml): refused")
    assert "also changed" not in message and "\n" not in message
    assert check_resume(_saved(**{"model.path": "/a"}), load_run_config(["experiment=smoke", "loop.run_dir=runs/x", "model.path=/b"]),
                        "old.yaml")[0].key == "model.path"  # checked at load, by the loader


def test_a_resumed_logger_keeps_the_records_it_runs_again(tmp_path):
    rows = [{"step": s, "reward_mean": 0.1 * s, "wall_seconds": float(s)} for s in range(4)]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    cfg = LoopConfig(run_dir=str(tmp_path), progress_bar=False, plot=False, tensorboard=False)
    logger = MetricsLogger(cfg, None, start_step=2)  # a resume from step 2 that fails before a step
    logger.close()
    assert [json.loads(x)["step"] for x in (tmp_path / "metrics.jsonl").read_text().splitlines()] == [0, 1, 2, 3]
    assert not (tmp_path / SUPERSEDED).exists() and (tmp_path / "summary.json").exists()
    logger = MetricsLogger(cfg, None, start_step=2)
    logger.log(2, {"reward_mean": 0.9})
    logger.close()
    assert [json.loads(x)["step"] for x in (tmp_path / "metrics.jsonl").read_text().splitlines()] == [0, 1, 2]
    again = [json.loads(x) for x in (tmp_path / SUPERSEDED).read_text().splitlines()]
    assert [(r["step"], r["reward_mean"], r["superseded_at_step"]) for r in again] == [(2, 0.2, 2), (3, 0.30000000000000004, 2)]
    assert json.loads((tmp_path / "summary.json").read_text())["steps"] == 3
