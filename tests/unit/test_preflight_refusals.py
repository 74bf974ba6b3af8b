"""``python -m launch.train`` refuses, before anything starts, a run that could only fail later:
exit code 2, one line naming the key, and the run dir left untouched."""

import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]

# override -> what the one line must name
CASES = {
    "model=qwen3_0.6b": ("model.path is empty", "model=qwen3_0.6b"),  # a shape, no weights
    "cluster=gpu2": ("cluster.trainer_devices=[0]", "not present"),  # GPUs that are not there
    "parallel.tp=2": ("parallel.tp=2 x parallel.pp=1", "cluster.trainer_ranks=1"),  # TP x PP vs ranks
}


def test_each_refusal_is_exit_2_and_one_line_naming_the_key(tmp_path):
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": ""}  # no GPU, whatever this machine has
    procs = {o: subprocess.Popen([sys.executable, "-m", "launch.train", o, f"loop.run_dir={tmp_path / str(i)}"],
                                 cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for i, o in enumerate(CASES)}  # started together: each one is a fresh Python
    for i, (override, proc) in enumerate(procs.items()):
        out, err = proc.communicate(timeout=120)
        lines = [ln for ln in (out + err).splitlines() if ln.strip()]
        assert proc.returncode == 2, (override, out, err)
        assert len(lines) == 1 and lines[0].startswith("launch.train: "), (override, lines)
        assert all(needle in lines[0] for needle in CASES[override]), (override, lines[0])
        assert not (tmp_path / str(i)).exists()  # refused before the run dir was touched


def test_worker_without_model_path_no_longer_sends_the_user_back_to_launch_train():
    from launch.config import load_run_config
    from megatron_darl.loop.rollout_loop import engine_config

    cfg = load_run_config(["model=qwen3_0.6b"])
    try:
        engine_config(cfg)
    except ValueError as exc:
        assert "model.path=" in str(exc) and "start workers through launch.train" not in str(exc)
    else:
        raise AssertionError("engine_config accepted an empty model.path")


def test_trainer_value_errors_keep_the_trainer_prefix():
    import pytest

    from launch.config import load_run_config

    with pytest.raises(ValueError, match=r"^trainer\.optimizer\.lr must be > 0"):
        load_run_config(["trainer.optimizer.lr=0"])
    with pytest.raises(ValueError, match=r"^trainer\.micro_batch\.token_budget"):
        load_run_config(["trainer.micro_batch.token_budget=0"])


def test_a_missing_benchmark_file_names_the_command_that_fetches_it():
    import pytest

    from launch.config import load_run_config
    from launch.preflight import check_paths
    from megatron_darl.data.locations import LOCAL_BENCHMARKS

    missing = LOCAL_BENCHMARKS / "math500" / "not_prepared.jsonl"
    with pytest.raises(ValueError, match=r"^data\.path=.*no such file.*python tools/prepare_data\.py math500$"):
        check_paths(load_run_config(["data=math", f"data.path={missing}"]))
